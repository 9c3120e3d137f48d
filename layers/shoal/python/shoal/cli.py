"""The ``shoal`` command: ``shoal dev`` runs Shoal on this machine, ``shoal token`` mints a JWT.

    shoal dev [--host 127.0.0.1] [--port 8080] [--state-dir DIR] [--default-partitions N]
    shoal token --sub NAME [--admin] [--clients PATTERN ...] [--publish FILTER ...]
                [--subscribe FILTER ...] [--state-dir DIR] [--ttl-s N]

``shoal token`` signs with the key of the ``shoal dev`` that uses the same state directory
(default ``.shoal``, the one ``make run`` uses) and prints the token alone on its last line.

    shoal publish --url URL --token TOKEN --topic T (--text S | --file F) [--qos N] [--retain]
                  [--publisher-id ID] [--state FILE]
    shoal subscribe --url URL --token TOKEN --client-id C --filter F [--filter ...] [--qos N]
                    [--count N] [--state FILE]

    shoal pipeline {sync,audit,replay,stats} ...   (see docs/pipeline.md; each takes --help)

``publish`` and ``subscribe`` speak to any Shoal (``shoal dev`` or a deployed stack) through
``shoal.client``; ``--url`` and ``--token`` default to ``$SHOAL_URL`` and ``$SHOAL_TOKEN``. Their
state file keeps the publisher sequence and the processed message ids, so a command killed and
run again neither publishes twice nor prints a message twice.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

DEFAULT_STATE_DIR = Path(".shoal")
CLIENT_DIR = DEFAULT_STATE_DIR / "client"
ADMIN_TOKEN_TTL_S = 12 * 3600


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal", description="Shoal: durable pub/sub with MQTT semantics."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser("dev", help="run Shoal locally over an embedded AWS emulator")
    dev.add_argument("--host", default="127.0.0.1", help="interface to serve on (loopback)")
    dev.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    dev.add_argument("--aws-host", default="127.0.0.1", help="interface of the AWS emulator")
    dev.add_argument("--aws-port", type=int, default=0, help="default: a free port")
    dev.add_argument(
        "--state-dir",
        type=Path,
        help="keep state here across restarts (default: a temporary folder, gone on exit)",
    )
    dev.add_argument("--default-partitions", type=int, default=1, metavar="N")
    dev.add_argument("--issuer", help="JWT issuer (default: this server's URL)")
    dev.add_argument("--audience", default="shoal", help="JWT audience (default: shoal)")
    dev.add_argument(
        "--no-triggers",
        action="store_true",
        help="do not run event source mappings and schedules",
    )
    dev.add_argument(
        "--schedule",
        action="append",
        default=[],
        type=_schedule,
        metavar="FUNCTION=SECONDS",
        help="run a scheduled function this often instead of its deployed period",
    )
    dev.add_argument("--log-level", default="INFO")

    token = commands.add_parser("token", help="print a JWT signed with the local key")
    token.add_argument("--sub", required=True)
    token.add_argument("--admin", action="store_true", help="grant shoal:admin")
    token.add_argument("--clients", nargs="+", metavar="PATTERN", help="default: exactly --sub")
    token.add_argument("--publish", nargs="+", default=[], metavar="FILTER")
    token.add_argument("--subscribe", nargs="+", default=[], metavar="FILTER")
    token.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    token.add_argument("--ttl-s", type=int, default=3600)
    token.add_argument("--issuer", help="default: the issuer of shoal dev on --state-dir")
    token.add_argument("--audience", help="default: the audience of shoal dev on --state-dir")

    publish = commands.add_parser("publish", help="publish one message, exactly once")
    _client_arguments(publish)
    publish.add_argument("--topic", required=True)
    payload = publish.add_mutually_exclusive_group(required=True)
    payload.add_argument("--text", help="the payload as UTF-8 text")
    payload.add_argument("--file", type=Path, help="the payload's bytes ('-': standard input)")
    publish.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    publish.add_argument("--retain", action="store_true")
    publish.add_argument("--publisher-id", help="default: one made once per state file")

    subscribe = commands.add_parser(
        "subscribe", help="subscribe and print one JSON line per message"
    )
    _client_arguments(subscribe)
    subscribe.add_argument("--client-id", required=True)
    subscribe.add_argument("--filter", action="append", required=True, dest="filters")
    subscribe.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    subscribe.add_argument(
        "--count", type=int, metavar="N", help="stop after N messages (0: subscribe and exit)"
    )
    subscribe.add_argument("--clean-start", action="store_true", help="discard the session")
    subscribe.add_argument("--session-expiry-s", type=int, default=3600)
    subscribe.add_argument("--wait-ms", type=int, default=20_000, help="long-poll per request")

    # the jobs parse their own flags (the same ones EMR passes them): `shoal pipeline audit -h`
    pipeline = commands.add_parser(
        "pipeline", help="data pipeline over the archive: sync, audit, replay, stats"
    )
    pipeline.add_argument("job", choices=("sync", "audit", "replay", "stats"))
    pipeline.add_argument("rest", nargs=argparse.REMAINDER, help="the job's flags")
    return parser


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    url, token = os.environ.get("SHOAL_URL"), os.environ.get("SHOAL_TOKEN")
    parser.add_argument("--url", default=url, required=url is None, help="default: $SHOAL_URL")
    parser.add_argument(
        "--token", default=token, required=token is None, help="default: $SHOAL_TOKEN"
    )
    parser.add_argument("--state", type=Path, metavar="FILE", help=f"default: under {CLIENT_DIR}")


def _schedule(text: str) -> tuple[str, int]:
    name, _, seconds = text.partition("=")
    if not name or not seconds.isdigit() or int(seconds) < 1:
        raise argparse.ArgumentTypeError("expected FUNCTION=SECONDS, e.g. reaper=2")
    return name, int(seconds)


def _configure_logging(level: str) -> None:
    """The runtime's own lines (loggers "shoal-dev.*") as text on stderr.

    They get a handler of their own: Powertools filters every record whose logger name holds
    its service name ("shoal") out of the root logger's handlers. Everything else (moto,
    botocore) reaches stderr through the root logger from WARNING up.
    """
    line = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    formatter = logging.Formatter(line)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    runtime_log = logging.getLogger("shoal-dev")
    runtime_log.addHandler(handler)
    runtime_log.setLevel(level)
    runtime_log.propagate = False
    logging.basicConfig(level=logging.WARNING, format=line, stream=sys.stderr)


def _dev(args: argparse.Namespace) -> int:
    from shoal.local.runtime import DevOptions, LocalRuntime, StateDirInUse

    _configure_logging(args.log_level.upper())
    options = DevOptions(
        host=args.host,
        port=args.port,
        aws_host=args.aws_host,
        aws_port=args.aws_port,
        state_dir=args.state_dir.resolve() if args.state_dir else None,
        default_partitions=args.default_partitions,
        issuer=args.issuer,
        audience=args.audience,
        triggers=not args.no_triggers,
        schedule_every_s=tuple(args.schedule),
    )
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    runtime = LocalRuntime(options)
    try:
        runtime.start()
    except (StateDirInUse, OSError, ValueError) as exc:
        print(f"shoal dev: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        assert runtime.aws is not None
        replay = runtime.aws.replay_stats
        state = str(options.state_dir) if options.state_dir else "(temporary, gone on exit)"
        token = runtime.mint_token("admin", admin=True, ttl_s=ADMIN_TOKEN_TTL_S)
        lines = [
            f"Shoal dev is serving {runtime.url}",
            f"  AWS emulator:  {runtime.aws_url}  (AWS_ENDPOINT_URL for boto3 and the AWS CLI)",
            f"  state:         {state}",
        ]
        if replay.records:
            failed = f" ({replay.failures} FAILED, see the log)" if replay.failures else ""
            lines.append(
                f"  journal:       {replay.records} requests replayed in {replay.seconds:.2f} s"
                + failed
            )
        lines += [
            f"  JWT issuer:    {runtime.issuer}  audience: {options.audience}",
            f"  JWKS:          {runtime.url}/.well-known/jwks.json",
            f"Admin token (valid {ADMIN_TOKEN_TTL_S // 3600} h; more with `shoal token`):",
            token,
        ]
        print("\n".join(lines), flush=True)
        stopping.wait()
        # a second Ctrl-C while stopping ends the process the ordinary way
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    finally:
        logging.getLogger("shoal-dev.runtime").info("stopping")
        runtime.stop()
    # Everything is stopped, fsynced and closed. Tearing down the interpreter's copy of every
    # emulated service would take seconds more, so the process ends here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _token(args: argparse.Namespace) -> int:
    from shoal.local.authorizer import IssuerSettings, SigningKey, mint_token

    state: Path = args.state_dir
    settings = IssuerSettings.load(state)
    issuer = args.issuer or (settings.issuer if settings else None)
    if issuer is None:
        print(
            f"shoal token: no shoal dev has used {state} yet; start `shoal dev --state-dir "
            f"{state}` first, or name the issuer with --issuer",
            file=sys.stderr,
        )
        return 2
    audience = args.audience or (settings.audience if settings else "shoal")
    key = SigningKey.load_or_create(state)
    token = mint_token(
        key,
        issuer=issuer,
        audience=audience,
        sub=args.sub,
        admin=args.admin,
        clients=args.clients,
        publish=args.publish,
        subscribe=args.subscribe,
        ttl_s=args.ttl_s,
    )
    print(token)
    return 0


def _publish(args: argparse.Namespace) -> int:
    from shoal.client import ClientError, ShoalClient

    if args.file is None:
        text, payload = args.text, None
    else:
        text = None
        payload = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
    try:
        with ShoalClient(
            args.url,
            args.token,
            publisher_id=args.publisher_id,
            state=args.state or CLIENT_DIR / "publish.json",
        ) as client:
            result = client.publish(
                args.topic, text=text, payload=payload, qos=args.qos, retain=args.retain
            )
    except ClientError as exc:
        print(f"shoal publish: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict()))
    return 0


def _subscribe(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from shoal.client import ClientError, ShoalClient

    state = args.state or CLIENT_DIR / f"subscribe-{quote(args.client_id, safe='')}.json"
    try:
        with ShoalClient(args.url, args.token, client_id=args.client_id, state=state) as client:
            client.connect(clean_start=args.clean_start, session_expiry_s=args.session_expiry_s)
            granted = client.subscribe(args.filters, qos=args.qos)
            for topic_filter, answer in zip(args.filters, granted, strict=False):
                print(f"shoal subscribe: {topic_filter}: {answer}", file=sys.stderr)
            if any(not isinstance(answer, int) for answer in granted):
                return 1
            try:
                for message in client.messages(count=args.count, wait_ms=args.wait_ms):
                    print(message.as_json_line(), flush=True)
            except KeyboardInterrupt:
                pass
            client.close(disconnect=True)
    except ClientError as exc:
        print(f"shoal subscribe: {exc}", file=sys.stderr)
        return 1
    return 0


def _pipeline(args: argparse.Namespace) -> int:
    from shoal.local.runtime import ensure_functions_importable

    try:
        # pipeline/ sits beside functions/ in the project root
        ensure_functions_importable()
    except RuntimeError:
        print("shoal pipeline: run it from the project root (the folder with pipeline/)")
        return 2
    from pipeline.entry import main as pipeline_main

    return pipeline_main([args.job, *args.rest])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "pipeline":
        return _pipeline(args)
    if args.command == "dev":
        return _dev(args)
    if args.command == "publish":
        return _publish(args)
    if args.command == "subscribe":
        return _subscribe(args)
    return _token(args)


if __name__ == "__main__":
    sys.exit(main())
