"""``shoal publish`` and ``shoal subscribe``: any Shoal, through ``shoal.client``, with the flags
of mosquitto_pub and mosquitto_sub (``-t -m -f -l -s -n -q -r -i`` and ``-t -i -q -C -v -k -x``).

State. Each command keeps a state file under ``.shoal/client/`` named after the server URL and
the principal (the token's subject), and everything in a state file is keyed by both too: a
publish left in flight by a run against one server is sent again only to that server, under
that principal. When a run finds publishes an earlier run left in flight, it says so on stderr
before it sends them (``--discard-pending`` forgets them instead).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shoal.cli.common import UsageError, note, policy_of, token_of
from shoal.cli.dev import DEFAULT_STATE_DIR
from shoal.client.batch import PublisherClosed
from shoal.client.errors import ApiError, ClientError, Unavailable
from shoal.client.http import ShoalClient
from shoal.client.support import MAX_BATCH, BatchSettings, PublishResult, principal_of

CLIENT_DIR = DEFAULT_STATE_DIR / "client"
#: MQTT 5 §3.8.3.1 Retain Handling, as `shoal subscribe --help` words it
RETAIN_HANDLING = {
    0: "send retained messages at every subscribe",
    1: "send them only when the subscription is new",
    2: "never send them",
}

#: exit status of `shoal subscribe -C N -W SECONDS` when fewer than N came in time (mosquitto_sub)
TIMED_OUT = 27

Arguments = Callable[[argparse.ArgumentParser], None]


def state_file(kind: str, url: str, principal: str, client_id: str | None = None) -> Path:
    """The default state file of a command: one per (URL, principal) and client id, named so
    a person can tell them apart (with a digest, as names are cut and characters replaced)."""
    digest = hashlib.sha256(f"{url}\n{principal}\n{client_id or ''}".encode()).hexdigest()[:10]
    parts = [kind, urlsplit(url).netloc or url, principal, client_id or ""]
    readable = "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p)[:32] for p in parts if p)
    return CLIENT_DIR / f"{readable}-{digest}.json"


# -- shoal publish ------------------------------------------------------------------------------


def publish_arguments(parser: argparse.ArgumentParser, client_arguments: Arguments) -> None:
    client_arguments(parser)
    parser.add_argument("-t", "--topic", required=True, help="the topic to publish to")
    payload = parser.add_mutually_exclusive_group()
    payload.add_argument(
        "-m", "--message", "--text", dest="text", help="the payload: this text (UTF-8)"
    )
    payload.add_argument(
        "-f", "--file", type=Path, help="the payload: the bytes of this file ('-': stdin)"
    )
    payload.add_argument(
        "-l",
        "--stdin-line",
        action="store_true",
        help="one message per line of stdin, until it ends (blank lines are not sent); "
        "lines go out in batches (--batch-size, --batch-delay-ms)",
    )
    payload.add_argument(
        "-s", "--stdin-file", action="store_true", help="the payload: all of stdin"
    )
    payload.add_argument(
        "-n",
        "--null-message",
        action="store_true",
        help="an empty payload (with -r: clears the topic's retained message)",
    )
    parser.add_argument(
        "-q",
        "--qos",
        type=int,
        choices=(0, 1, 2),
        default=1,
        help="quality of service: 0 at most once, 1 and 2 exactly once to each subscriber "
        "(the delivery is capped by the subscription's QoS)",
    )
    parser.add_argument(
        "-r",
        "--retain",
        action="store_true",
        help="keep it as the topic's retained message, which new subscriptions get",
    )
    parser.add_argument(
        "-i",
        "--id",
        "--publisher-id",
        dest="publisher_id",
        help="publisher id: the server drops a repeated (id, sequence number) as a duplicate; "
        "a subscriber's --no-local skips messages whose publisher id is its client id "
        "(default: one made for this server and principal, kept in the state file)",
    )
    parser.add_argument(
        "--ordering-key",
        help="messages of one key reach each subscriber in publish order (default: the topic)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="FILE",
        help=f"the state file: sequences and publishes in flight "
        f"(default: one per server and principal under {CLIENT_DIR})",
    )
    parser.add_argument(
        "--discard-pending",
        action="store_true",
        help="forget the publishes an earlier run left in flight instead of sending them "
        "first (on its own: forget them and exit)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=100,
        metavar="N",
        help=f"with -l: messages per request at most (1 to {MAX_BATCH})",
    )
    parser.add_argument(
        "--batch-delay-ms",
        type=int,
        default=10,
        metavar="MS",
        help="with -l: how long a line waits for its batch to fill",
    )
    parser.add_argument(
        "-d",
        "--debug",
        action="store_true",
        help="say on stderr how many messages went in how many requests",
    )


def _payload(args: argparse.Namespace) -> dict[str, Any]:
    """The single message's text or payload (read once, before anything is sent)."""
    if args.text is not None:
        return {"text": args.text}
    if args.null_message:
        return {"payload": b""}
    if args.stdin_file or str(args.file) == "-":
        return {"payload": sys.stdin.buffer.read()}
    try:
        return {"payload": args.file.read_bytes()}
    except OSError as exc:
        raise UsageError(f"cannot read --file {args.file}: {exc.strerror or exc}") from exc


def run_publish(args: argparse.Namespace) -> int:
    """``shoal publish``: one message (``-m -f -s -n``) or one per line of stdin (``-l``), each
    exactly once; one JSON line per message on stdout."""
    token = token_of(args)
    chosen = args.text is not None or args.file or args.stdin_line or args.stdin_file
    if not (chosen or args.null_message or args.discard_pending):
        raise UsageError("give the payload: one of -m TEXT, -f FILE, -l, -s, -n")
    settings = _batch_settings(args)
    message = None if args.stdin_line or not (chosen or args.null_message) else _payload(args)
    state = args.state or state_file("publish", args.url.rstrip("/"), principal_of(token))

    def on_resend(bodies: list[dict[str, Any]]) -> None:
        seqs = [int(b["publisher_seq"]) for b in bodies]
        note(
            f"sending again {len(bodies)} message(s) an earlier run left in flight to "
            f"{args.url} (sequence {min(seqs)}..{max(seqs)}); --discard-pending forgets them"
        )

    with ShoalClient(
        args.url,
        token,
        publisher_id=args.publisher_id,
        state=state,
        policy=policy_of(args),
        on_resend=on_resend,
    ) as client:
        if args.discard_pending:
            dropped = client.discard_pending()
            note(f"forgot {dropped} message(s) left in flight" if dropped else "nothing in flight")
        try:
            if args.stdin_line:
                status = _publish_lines(client, args, settings)
            elif message is not None:
                result = client.publish(
                    args.topic,
                    qos=args.qos,
                    retain=args.retain,
                    ordering_key=args.ordering_key,
                    **message,
                )
                print(json.dumps(result.as_dict()), flush=True)
                status = 0
            else:
                status = 0
        except Unavailable as exc:
            left = len(client.pending_publishes)
            unread = "; the lines after them were not sent" if args.stdin_line else ""
            raise ClientError(
                f"{args.url} did not answer ({exc.message}); {left} message(s) stay in flight "
                f"for the next shoal publish to {args.url} (--discard-pending forgets them)"
                + unread
            ) from exc
        if args.debug:
            note(f"{client.requests_sent} request(s) sent")
    return status


def _batch_settings(args: argparse.Namespace) -> BatchSettings:
    try:
        return BatchSettings(
            max_messages=args.batch_size, max_latency_s=max(0, args.batch_delay_ms) / 1000
        )
    except ValueError as exc:
        raise UsageError(f"--batch-size: {exc}") from exc


def _lines() -> Iterator[dict[str, Any]]:
    """stdin's lines without their line ends; blank lines are not sent (as mosquitto_pub -l)."""
    for raw in sys.stdin.buffer:
        line = raw.rstrip(b"\n").rstrip(b"\r")
        if not line:
            continue
        try:
            yield {"text": line.decode("utf-8")}
        except UnicodeDecodeError:
            yield {"payload": line}


def _publish_lines(client: ShoalClient, args: argparse.Namespace, settings: BatchSettings) -> int:
    """Lines of stdin as messages, batched by count and delay; results printed in order."""
    status = 0
    futures: list[Future[PublishResult]] = []

    def settle(done: list[Future[PublishResult]]) -> None:
        nonlocal status
        for future in done:
            try:
                print(json.dumps(future.result().as_dict()))
            except Unavailable:
                raise  # nothing more gets through: the rest stays in flight for the next run
            except ApiError as exc:
                note(f"error: a line was refused: {exc}")
                status = 1
        sys.stdout.flush()

    with client.batch_publisher(settings) as publisher:
        try:
            for message in _lines():
                futures.append(
                    publisher.publish(
                        args.topic,
                        qos=args.qos,
                        retain=args.retain,
                        ordering_key=args.ordering_key,
                        **message,
                    )
                )
                # print what is settled as it settles, in order, so a long stream shows progress
                while futures and futures[0].done():
                    settle([futures.pop(0)])
        except PublisherClosed as exc:
            # a batch could not be sent: its error, not the closed publisher's
            raise publisher.failure or exc from None
    settle(futures)
    if args.debug:
        note(f"{publisher.messages} message(s) in {publisher.requests} request(s)")
    return status


# -- shoal subscribe ----------------------------------------------------------------------------


def subscribe_arguments(parser: argparse.ArgumentParser, client_arguments: Arguments) -> None:
    client_arguments(parser)
    parser.add_argument(
        "-t",
        "--topic",
        "--filter",
        action="append",
        required=True,
        dest="filters",
        metavar="FILTER",
        help="a topic filter (wildcards + and #; $share/NAME/FILTER joins a shared group); "
        "repeatable",
    )
    parser.add_argument(
        "-i",
        "--id",
        "--client-id",
        dest="client_id",
        help="the session's client id (default: the token's subject)",
    )
    parser.add_argument(
        "-q",
        "--qos",
        type=int,
        choices=(0, 1, 2),
        default=1,
        help="the subscription's QoS: 0 at most once, 1 and 2 each message once, acked",
    )
    parser.add_argument(
        "-C",
        "--count",
        type=int,
        metavar="N",
        help="stop after N messages (0: subscribe and exit; default: run until Ctrl-C)",
    )
    parser.add_argument(
        "-W",
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop after this long; exit status 27 when -C N messages did not all come in it",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "-v", "--verbose", action="store_true", help="print `topic payload` (default: payload)"
    )
    output.add_argument(
        "--json",
        action="store_true",
        help="print each message as one JSON line: the API's message, plus `text` when UTF-8",
    )
    parser.add_argument(
        "-k",
        "--keepalive",
        type=int,
        default=60,
        metavar="SECONDS",
        help="the session's keepalive: silent for 1.5 times this, it is disconnected (and its "
        "will published)",
    )
    parser.add_argument(
        "-x",
        "--session-expiry-s",
        type=int,
        default=3600,
        metavar="SECONDS",
        help="how long the session (its subscriptions and unacked messages) outlives a "
        "disconnect; 0: it ends with it",
    )
    parser.add_argument(
        "--clean-start",
        action="store_true",
        help="start a new session, discarding the one kept under this client id",
    )
    parser.add_argument(
        "--retain-handling",
        type=int,
        choices=(0, 1, 2),
        default=1,
        help="retained messages at subscribe (MQTT 5): "
        + "; ".join(f"{k} {v}" for k, v in RETAIN_HANDLING.items())
        + ". 1 prints a retained message once per session, not on every run",
    )
    parser.add_argument(
        "--no-local",
        action="store_true",
        help="skip messages this client id published (shoal publish -i with the same id)",
    )
    parser.add_argument("--will-topic", help="a will: published if the session dies unannounced")
    parser.add_argument(
        "--will-message", "--will-payload", dest="will_text", help="the will's payload (text)"
    )
    parser.add_argument("--will-qos", type=int, choices=(0, 1, 2), default=1, help="the will's QoS")
    parser.add_argument("--will-retain", action="store_true", help="retain the will")
    parser.add_argument(
        "--will-delay-s",
        type=int,
        default=0,
        metavar="SECONDS",
        help="publish the will this long after the session died (not if it reconnects first)",
    )
    parser.add_argument(
        "--wait-ms",
        type=int,
        default=20_000,
        metavar="MS",
        help="how long one request waits for messages (long poll)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        metavar="FILE",
        help=f"the state file: ids of processed messages (default: one per server, principal "
        f"and client id under {CLIENT_DIR})",
    )


def _will(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.will_topic is None:
        if args.will_text is not None or args.will_retain:
            raise UsageError("--will-message and --will-retain need --will-topic")
        return None
    return {
        "topic": args.will_topic,
        "text": args.will_text or "",
        "qos": args.will_qos,
        "retain": args.will_retain,
        "delay_s": args.will_delay_s,
    }


def run_subscribe(args: argparse.Namespace) -> int:
    """``shoal subscribe``: each message of the session printed once, then acked."""
    token = token_of(args)
    principal = principal_of(token)
    client_id = args.client_id or principal
    url = args.url.rstrip("/")
    state = args.state or state_file("subscribe", url, principal, client_id)
    will = _will(args)
    out = sys.stdout.buffer
    with ShoalClient(
        url, token, client_id=client_id, state=state, policy=policy_of(args)
    ) as client:
        client.connect(
            clean_start=args.clean_start,
            session_expiry_s=args.session_expiry_s,
            keepalive_s=args.keepalive,
            will=will,
        )
        subscriptions = [
            # MQTT 5 §3.8.3.1: the Retain Handling and No Local subscription options
            {"filter": f, "qos": args.qos, "retain_handling": args.retain_handling}
            | ({"no_local": True} if args.no_local else {})
            for f in args.filters
        ]
        granted = client.subscribe(subscriptions)
        refused = [
            f"{f}: {answer}"
            for f, answer in zip(args.filters, granted, strict=False)
            if not isinstance(answer, int)
        ]
        if refused:
            raise ClientError(f"subscription refused ({', '.join(refused)})")
        until_ms = None
        if args.timeout is not None:
            until_ms = client.clock.now_ms() + int(args.timeout * 1000)
        printed = 0
        try:
            for message in client.messages(
                count=args.count, wait_ms=args.wait_ms, until_ms=until_ms
            ):
                printed += 1
                if args.json:
                    out.write(message.as_json_line().encode() + b"\n")
                elif args.verbose:
                    out.write(message.topic.encode() + b" " + message.payload + b"\n")
                else:
                    out.write(message.payload + b"\n")
                out.flush()
        except KeyboardInterrupt:
            pass
        client.close(disconnect=True)
    # as mosquitto_sub -W: the time ran out before -C N messages came
    timed_out = args.timeout is not None and args.count is not None and printed < args.count
    return TIMED_OUT if timed_out else 0
