"""The ``shoal`` command. ``shoal --help`` and ``shoal COMMAND --help`` say everything; in short:

    shoal dev        run Shoal on this machine over an embedded AWS emulator
    shoal token      print a JWT signed with the local key of ``shoal dev``
    shoal publish    publish messages exactly once (flags of mosquitto_pub)
    shoal subscribe  print the messages of a session's subscriptions (flags of mosquitto_sub)
    shoal topics     create, list, describe and grow composite topics (admin)
    shoal push       push subscriptions: create, describe, update, delete, seek, dlq (admin)
    shoal sessions   show a session
    shoal pipeline   jobs over the archive: sync, audit, replay, stats, compact

``publish``, ``subscribe``, ``topics``, ``push`` and ``sessions`` speak to any Shoal (``shoal dev``
or a deployed stack) through ``shoal.client``; ``--url`` and ``--token`` default to
``$SHOAL_URL`` and ``$SHOAL_TOKEN``. Every error is one line on stderr (``shoal: error: ...``)
and a non-zero exit status: 2 for a command line that cannot be run, 1 for a refusal or a
failure, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from shoal.cli import admin, pubsub
from shoal.cli.common import Help, UsageError
from shoal.cli.dev import DEFAULT_STATE_DIR, run_dev, run_token
from shoal.client.errors import ClientError

DEFAULT_URL = "http://127.0.0.1:8080"

#: ``shoal pipeline``'s jobs, in the words of someone who runs them
PIPELINE_JOBS = {
    "sync": "copy shoal dev's archive (messages and delivery events) into a local folder",
    "audit": "check every archived message reached each subscriber exactly once, in order",
    "replay": "deliver archived messages of a topic filter and time range to a session again",
    "stats": "messages per topic and hour, each subscriber's backlog and lag, retry rates",
    "compact": "turn the archive's JSON lines into Parquet, hour by hour (the jobs read both)",
}


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (``shoal: error: ...``), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"shoal: error: {message} (see: {self.prog} --help)\n")


def _parser() -> Parser:
    parser = Parser(
        prog="shoal",
        description="Shoal: durable publish/subscribe with MQTT semantics, over HTTP.",
        formatter_class=Help,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_: str, epilog: str | None = None) -> Parser:
        sub: Parser = commands.add_parser(
            name,
            help=help_,
            description=help_[0].upper() + help_[1:] + ".",
            epilog=epilog,
            formatter_class=Help,
        )
        return sub

    _dev_arguments(command("dev", "run Shoal locally over an embedded AWS emulator"))
    _token_arguments(command("token", "print a JWT signed with the local key of shoal dev"))
    pubsub.publish_arguments(
        command("publish", "publish messages exactly once (the flags of mosquitto_pub)"),
        _client_arguments,
    )
    pubsub.subscribe_arguments(
        command("subscribe", "print the messages of a session (the flags of mosquitto_sub)"),
        _client_arguments,
    )
    admin.topics_arguments(
        command("topics", "composite topics: create, list, describe, grow (admin)"),
        _client_arguments,
    )
    admin.push_arguments(
        command("push", "push subscriptions: create, describe, update, seek, dlq (admin)"),
        _client_arguments,
    )
    admin.sessions_arguments(command("sessions", "look at a session"), _client_arguments)

    jobs = "\n".join(f"  {name:<8}{text}" for name, text in PIPELINE_JOBS.items())
    pipeline = command(
        "pipeline",
        "jobs over the archive: sync, audit, replay, stats, compact",
        epilog=f"jobs:\n{jobs}\n\n`shoal pipeline JOB --help` gives each job's flags.",
    )
    pipeline.add_argument("job", choices=tuple(PIPELINE_JOBS), help="the job to run")
    # the jobs parse their own flags (the same ones EMR passes them)
    pipeline.add_argument("rest", nargs=argparse.REMAINDER, help="the job's flags")
    return parser


def _dev_arguments(dev: Parser) -> None:
    dev.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    dev.add_argument("--port", type=int, default=8080, help="port to serve on (0: a free one)")
    dev.add_argument(
        "--ws-port",
        type=int,
        help="port of the WebSocket API (default: --port + 1, or a free one with --port 0; "
        "0: a free one)",
    )
    dev.add_argument("--aws-host", default="127.0.0.1", help="interface of the AWS emulator")
    dev.add_argument(
        "--aws-port",
        type=int,
        help="port of the AWS emulator (default: the one of the last run on --state-dir, "
        "else a free one; 0: a free one)",
    )
    dev.add_argument(
        "--state-dir",
        type=Path,
        help="keep state here across restarts (default: a temporary folder, gone on exit)",
    )
    dev.add_argument(
        "--default-partitions",
        type=int,
        default=1,
        metavar="N",
        help="partitions (Kinesis shards) of the catch-all composite topic, made at first start",
    )
    dev.add_argument("--issuer", help="JWT issuer (default: this server's URL)")
    dev.add_argument("--audience", default="shoal", help="JWT audience")
    dev.add_argument(
        "--no-triggers",
        action="store_true",
        help="do not run event source mappings and schedules (only HTTP reaches the functions)",
    )
    dev.add_argument(
        "--schedule",
        action="append",
        default=[],
        type=_schedule,
        metavar="FUNCTION=SECONDS",
        help="run a scheduled function this often instead of its deployed period "
        "(e.g. reaper=2; repeatable)",
    )
    dev.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="least level of the runtime's JSON log lines on stderr",
    )


def _token_arguments(token: Parser) -> None:
    token.add_argument("--sub", required=True, help="the principal (the token's subject)")
    token.add_argument("--admin", action="store_true", help="grant shoal:admin")
    token.add_argument(
        "--clients", nargs="+", metavar="PATTERN", help="client ids it may use (default: --sub)"
    )
    token.add_argument(
        "--publish", nargs="+", default=[], metavar="FILTER", help="topic filters it may publish to"
    )
    token.add_argument(
        "--subscribe",
        nargs="+",
        default=[],
        metavar="FILTER",
        help="topic filters it may subscribe with",
    )
    token.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="the state directory of the shoal dev whose key signs",
    )
    token.add_argument(
        "--ttl-s",
        type=int,
        default=3600,
        help="seconds the token is valid (an hour; e.g. 86400 for a day)",
    )
    token.add_argument("--issuer", help="default: the issuer of shoal dev on --state-dir")
    token.add_argument("--audience", help="default: the audience of shoal dev on --state-dir")


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("SHOAL_URL") or DEFAULT_URL,
        help=f"the Shoal API (default: $SHOAL_URL or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token",
        help="a JWT (default: --token-file, else $SHOAL_TOKEN_COMMAND, else $SHOAL_TOKEN); "
        "`shoal token` mints one for shoal dev, valid an hour unless --ttl-s says more",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="read the JWT from this file, and again whenever it is about to expire or is "
        "refused (whatever rotates the file renews it); $SHOAL_TOKEN_COMMAND instead names a "
        "command whose last line of output is the JWT, run again likewise",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=5,
        metavar="N",
        help="retries of a request that times out or is told to come back later, with backoff",
    )


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
    except RuntimeError as exc:
        raise UsageError("run it from the project root (the folder with pipeline/)") from exc
    # imported here: pipeline/ is importable only once the project root is on the path
    from pipeline.entry import main as pipeline_main

    return pipeline_main([args.job, *args.rest])


COMMANDS = {
    "dev": run_dev,
    "token": run_token,
    "publish": pubsub.run_publish,
    "subscribe": pubsub.run_subscribe,
    "topics": admin.run_topics,
    "push": admin.run_push,
    "sessions": admin.run_sessions,
    "pipeline": _pipeline,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): nothing to say to it; stdout is closed for good so
        # the interpreter's own flush at exit stays quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UsageError as exc:
        _say(str(exc))
        return 2
    except ClientError as exc:
        _say(str(exc))
        return 1
    except OSError as exc:
        # a file that is missing or unreadable, a closed pipe: what and where, in one line
        _say(f"{exc.strerror or type(exc).__name__}: {exc.filename or ''}".rstrip(": "))
        return 1
    except Exception as exc:  # a command line never ends in a traceback
        _say(f"unexpected {type(exc).__name__}: {exc}")
        return 1


def _say(message: str) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"shoal: error: {first}", file=sys.stderr)
