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
import os
from collections.abc import Sequence
from pathlib import Path

from shoal.cli.dev import DEFAULT_STATE_DIR, run_dev, run_token
from shoal.cli.pubsub import CLIENT_DIR, run_publish, run_subscribe


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


def _pipeline(args: argparse.Namespace) -> int:
    # imported here: of the commands, only `shoal dev` and this one load the local runtime
    from shoal.local.runtime import ensure_functions_importable

    try:
        # pipeline/ sits beside functions/ in the project root
        ensure_functions_importable()
    except RuntimeError:
        print("shoal pipeline: run it from the project root (the folder with pipeline/)")
        return 2
    # imported here: pipeline/ is importable only once the project root is on the path
    from pipeline.entry import main as pipeline_main

    return pipeline_main([args.job, *args.rest])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "pipeline":
        return _pipeline(args)
    if args.command == "dev":
        return run_dev(args)
    if args.command == "publish":
        return run_publish(args)
    if args.command == "subscribe":
        return run_subscribe(args)
    return run_token(args)
