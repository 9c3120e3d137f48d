"""``shoal publish`` and ``shoal subscribe``: any Shoal, through ``shoal.client``, with the flags
of mosquitto_pub and mosquitto_sub (``-t -m -f -l -s -n -q -r -i`` and ``-t -i -q -C -v -k -x``).

State. Each command keeps a state file under ``.shoal/client/`` named after the server URL and
the principal (the token's subject), and everything in a state file is keyed by both too: a
publish left in flight by a run against one server is sent again only to that server, under
that principal. When a run finds publishes an earlier run left in flight, it says so on stderr
before it sends them (``--discard-pending`` forgets them instead).

Transports. ``shoal subscribe`` holds its session over the WebSocket API by default
(``shoal.client.ws``: messages pushed, no request while idle); ``--transport poll`` long-polls
the HTTP API (``shoal.client.http``). Both keep the processed ids under the HTTP API's URL in
the same state file, so either prints each message once, whichever printed the ones before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shoal.cli.common import UsageError, note, policy_of, token_of, url_of
from shoal.cli.dev import DEFAULT_STATE_DIR
from shoal.client.acks import DEFAULT_ACK_DELAY_S, MAX_ACK_DELAY_S
from shoal.client.batch import PublisherClosed
from shoal.client.errors import ApiError, ClientError, Unavailable
from shoal.client.http import ShoalClient
from shoal.client.support import (
    MAX_BATCH,
    BatchSettings,
    FlowControl,
    PublishResult,
    ReceivedMessage,
    principal_of,
)
from shoal.client.tokens import TokenKeeper
from shoal.client.ws import ShoalWsClient
from shoal.client.wslink import check_ws_url

CLIENT_DIR = DEFAULT_STATE_DIR / "client"
#: MQTT 5 §3.8.3.1 Retain Handling, as `shoal subscribe --help` words it
RETAIN_HANDLING = {
    0: "send retained messages at every subscribe",
    1: "send them only when the subscription is new",
    2: "never send them",
}

#: where `shoal subscribe` finds the WebSocket API when --ws-url is not given
WS_URL_ENV = "SHOAL_WS_URL"
#: `shoal dev` and `make run` keep their runtime file here (`shoal token`'s default --state-dir)
RUNTIME_FILE = DEFAULT_STATE_DIR / "runtime.json"
#: messages pushed to `shoal subscribe` unacked at most (its receive maximum)
SUBSCRIBE_WINDOW = 100

#: exit status of `shoal subscribe -C N -W SECONDS` when fewer than N came in time (mosquitto_sub)
TIMED_OUT = 27
#: exit status after Ctrl-C, as a shell reports a command ended by SIGINT (128 + 2)
INTERRUPTED = 130

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
        help="messages of one key reach each subscriber in publish order, and one member of "
        "a shared group at a time. Without it a message routes by its topic, in order for "
        "plain subscribers, but a shared group treats it as unkeyed: spread over the members, "
        "in no order (give a key to keep order in a group)",
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
    url = url_of(args)
    token = token_of(args)
    chosen = args.text is not None or args.file or args.stdin_line or args.stdin_file
    if not (chosen or args.null_message or args.discard_pending):
        raise UsageError("give the payload: one of -m TEXT, -f FILE, -l, -s, -n")
    settings = _batch_settings(args)
    message = None if args.stdin_line or not (chosen or args.null_message) else _payload(args)
    state = args.state or state_file("publish", url, principal_of(token.token()))

    def on_resend(bodies: list[dict[str, Any]]) -> None:
        seqs = [int(b["publisher_seq"]) for b in bodies]
        note(
            f"sending again {len(bodies)} message(s) an earlier run left in flight to "
            f"{url} (sequence {min(seqs)}..{max(seqs)}); --discard-pending forgets them"
        )

    with ShoalClient(
        url,
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
                f"{url} did not answer ({exc.message}); {left} message(s) stay in flight "
                f"for the next shoal publish to {url} (--discard-pending forgets them)" + unread
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
        help="with --transport poll: the session's keepalive: silent for 1.5 times this, it is "
        "disconnected (and its will published). Over ws the connection is the liveness: its "
        "close ends the channel at once",
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
        "--transport",
        choices=("ws", "poll"),
        default="ws",
        help="ws: hold the session over the WebSocket API, messages pushed; poll: long-poll "
        "the HTTP API (GET .../messages)",
    )
    parser.add_argument(
        "--ws-url",
        metavar="URL",
        help=f"the WebSocket API (ws:// or wss://; a stack's WebSocketUrl output). Default: "
        f"${WS_URL_ENV}; else, for a shoal dev on this machine, the ws_url of "
        f"{RUNTIME_FILE} when it serves --url, else --url's port + 1 (shoal dev's default)",
    )
    parser.add_argument(
        "--wait-ms",
        type=int,
        default=20_000,
        metavar="MS",
        help="with --transport poll: how long one request waits for messages",
    )
    parser.add_argument(
        "--ack-delay-ms",
        type=int,
        default=round(DEFAULT_ACK_DELAY_S * 1000),
        metavar="MS",
        help=f"over ws: how long the acks of printed messages are held to go in one frame "
        f"(0 to {MAX_ACK_DELAY_S * 1000:.0f}; 0: one ack per message). Longer: fewer billed "
        f"frames and ack invocations, and after a crash more messages sent again (acked, not "
        f"printed again)",
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


def ws_url_of(url: str, given: str | None) -> tuple[str, bool]:
    """The WebSocket API's URL for the HTTP API at ``url``, and whether it is known (given, or
    read from shoal dev's runtime file) rather than guessed (shoal dev's port + 1).

    ``--ws-url``, else ``$SHOAL_WS_URL``; else, for a loopback ``url`` (a ``shoal dev`` on this
    machine), the ``ws_url`` of ``.shoal/runtime.json`` when that file describes the server at
    ``url`` (``make run``), else ``url``'s port + 1 (``shoal dev``'s default ``--ws-port``). A
    deployed stack's WebSocket API has a URL of its own, not derivable from the HTTP API's:
    without one given, a usage error says where to find it.
    """
    named = given or os.environ.get(WS_URL_ENV)
    if named:
        try:
            return check_ws_url(named), True
        except ValueError as exc:
            flag = "--ws-url" if given else f"${WS_URL_ENV}"
            raise UsageError(f"{flag} {exc}") from exc
    parts = urlsplit(url)
    if _loopback(parts.hostname or ""):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            info = json.loads(RUNTIME_FILE.read_text())
            if str(info.get("url", "")).rstrip("/") == url.rstrip("/") and info.get("ws_url"):
                return check_ws_url(str(info["ws_url"])), True
        port = parts.port or (443 if parts.scheme == "https" else 80)
        scheme = "wss" if parts.scheme == "https" else "ws"
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return f"{scheme}://{host}:{port + 1}", False
    raise UsageError(
        f"which WebSocket API serves {url}? give --ws-url (a stack's WebSocketUrl output, "
        f"wss://...) or set {WS_URL_ENV}; or --transport poll to long-poll the HTTP API"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _subscriptions(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        # MQTT 5 §3.8.3.1: the Retain Handling and No Local subscription options
        {"filter": f, "qos": args.qos, "retain_handling": args.retain_handling}
        | ({"no_local": True} if args.no_local else {})
        for f in args.filters
    ]


def _check_granted(args: argparse.Namespace, granted: list[Any]) -> None:
    refused = [
        f"{f}: {answer}"
        for f, answer in zip(args.filters, granted, strict=False)
        if not isinstance(answer, int)
    ]
    if refused:
        raise ClientError(f"subscription refused ({', '.join(refused)})")


def _printer(args: argparse.Namespace) -> Callable[[ReceivedMessage], None]:
    out = sys.stdout.buffer

    def show(message: ReceivedMessage) -> None:
        if args.json:
            out.write(message.as_json_line().encode() + b"\n")
        elif args.verbose:
            out.write(message.topic.encode() + b" " + message.payload + b"\n")
        else:
            out.write(message.payload + b"\n")
        out.flush()

    return show


def run_subscribe(args: argparse.Namespace) -> int:
    """``shoal subscribe``: each message of the session printed once, then acked."""
    if not 0 <= args.ack_delay_ms <= MAX_ACK_DELAY_S * 1000:
        raise UsageError(f"--ack-delay-ms must be 0 to {MAX_ACK_DELAY_S * 1000:.0f}")
    url = url_of(args)
    token = token_of(args)
    principal = principal_of(token.token())
    client_id = args.client_id or principal
    state = args.state or state_file("subscribe", url, principal, client_id)
    will = _will(args)
    if args.transport == "ws":
        ws_url, known = ws_url_of(url, args.ws_url)
        printed = _subscribe_ws(
            args,
            url=url,
            ws_url=ws_url,
            known=known,
            token=token,
            client_id=client_id,
            state=state,
            will=will,
        )
    else:
        printed = _subscribe_poll(
            args, url=url, token=token, client_id=client_id, state=state, will=will
        )
    if printed is None:
        return INTERRUPTED
    # as mosquitto_sub -W: the time ran out before -C N messages came
    timed_out = args.timeout is not None and args.count is not None and printed < args.count
    return TIMED_OUT if timed_out else 0


def _subscribe_ws(
    args: argparse.Namespace,
    *,
    url: str,
    ws_url: str,
    known: bool,
    token: TokenKeeper,
    client_id: str,
    state: Path,
    will: dict[str, Any] | None,
) -> int | None:
    """Over the WebSocket API; the messages printed, None after Ctrl-C. A guessed URL (shoal
    dev's port + 1) that does not answer as Shoal's WebSocket API falls back to the long poll."""
    policy = policy_of(args)
    client = ShoalWsClient(
        ws_url,
        token,
        client_id=client_id,
        state=state,
        # the processed ids are kept under the HTTP API's URL, as the long poll keeps them:
        # a run over either transport never prints what a run over the other printed
        state_scope=url,
        flow=FlowControl(max_messages=SUBSCRIBE_WINDOW),
        ack_delay_s=args.ack_delay_ms / 1000,
        policy=dataclasses.replace(policy, attempts=1) if not known else policy,
    )
    with client:
        try:
            client.connect(
                clean_start=args.clean_start, session_expiry_s=args.session_expiry_s, will=will
            )
        except (Unavailable, ApiError) as exc:
            if known:
                if isinstance(exc, Unavailable):
                    raise ClientError(
                        f"{ws_url} did not answer ({exc.message}); nothing was subscribed (is "
                        f"the server up, and is --ws-url right?)"
                    ) from exc
                raise
            note(
                f"no Shoal WebSocket API at {ws_url} (shoal dev's port + 1): long-polling "
                f"{url} instead (--ws-url names the WebSocket API; --transport poll says so)"
            )
            client.close()
            return _subscribe_poll(
                args, url=url, token=token, client_id=client_id, state=state, will=will
            )
        client.policy = policy
        _check_granted(args, client.subscribe(_subscriptions(args)))
        until_ms = None
        if args.timeout is not None:
            until_ms = client.clock.now_ms() + int(args.timeout * 1000)
        show = _printer(args)
        printed = 0
        try:
            # a lost connection is ridden out for ever (a line on stderr as it goes and comes
            # back); only a refusal (403, a token refused with no renewal) or a takeover ends it
            for message in client.messages(count=args.count, until_ms=until_ms, on_outage=note):
                show(message)
                printed += 1
        except KeyboardInterrupt:
            # Ctrl-C: a clean DISCONNECT, so the server publishes no will (MQTT 5 §3.14.4)
            client.close(disconnect=True)
            return None
        client.close(disconnect=True)
    return printed


def _subscribe_poll(
    args: argparse.Namespace,
    *,
    url: str,
    token: TokenKeeper,
    client_id: str,
    state: Path,
    will: dict[str, Any] | None,
) -> int | None:
    """Over the HTTP API's long poll; the messages printed, None after Ctrl-C."""
    with ShoalClient(
        url, token, client_id=client_id, state=state, policy=policy_of(args)
    ) as client:
        try:
            client.connect(
                clean_start=args.clean_start,
                session_expiry_s=args.session_expiry_s,
                keepalive_s=args.keepalive,
                will=will,
            )
        except Unavailable as exc:
            # never connected: a wrong --url or a server not started, said as publish says it
            raise ClientError(
                f"{url} did not answer ({exc.message}); nothing was subscribed (is the server "
                f"up, and is --url right?)"
            ) from exc
        _check_granted(args, client.subscribe(_subscriptions(args)))
        until_ms = None
        if args.timeout is not None:
            until_ms = client.clock.now_ms() + int(args.timeout * 1000)
        show = _printer(args)
        printed = 0
        interrupted = False
        try:
            # a lost server is waited out for ever (a line on stderr as it goes and comes
            # back); only a refusal (403, a token refused with no renewal) ends the loop
            for message in client.messages(
                count=args.count, wait_ms=args.wait_ms, until_ms=until_ms, on_outage=note
            ):
                show(message)
                printed += 1
        except KeyboardInterrupt:
            # Ctrl-C ends the session's connection normally: a clean DISCONNECT, so the server
            # publishes no will (MQTT 5 §3.14.4); exit status 130 as any interrupted command
            interrupted = True
        client.close(disconnect=True)
    return None if interrupted else printed
