"""``shoal topics``, ``shoal push`` and ``shoal sessions``: the admin routes of the API, in the
shape of ``gcloud pubsub topics|subscriptions ...``. Each prints the API's answer as indented
JSON on stdout; a refusal is one line on stderr and exit status 1.

    shoal topics create orders --partitions 4
    shoal topics list | describe orders | grow orders --partitions 8 | switch-produce orders
    shoal push create billing --filter 'orders/#' --endpoint https://example.com/hook
    shoal push list [--limit 50] [--page-token T] [--all]
    shoal push describe billing | update billing --parallelism 4 | delete billing
    shoal push seek billing --to-time 2026-01-01T00:00:00Z   (or --to earliest|latest)
    shoal push dlq list billing | dlq redrive billing --ordering-key k1
    shoal sessions show sensor-1
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from shoal.cli.common import Help, note, policy_of, print_document, token_of, url_of
from shoal.client.http import ShoalClient

Arguments = Callable[[argparse.ArgumentParser], None]


def _client(args: argparse.Namespace, **options: Any) -> ShoalClient:
    return ShoalClient(url_of(args), token_of(args), policy=policy_of(args), **options)


def _name(value: str) -> str:
    return quote(value, safe="")


def _actions(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction:
    return parser.add_subparsers(dest=dest, required=True, metavar="ACTION")


def _action(
    actions: argparse._SubParsersAction,
    name: str,
    help_: str,
    client_arguments: Arguments,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name,
        help=help_,
        description=help_[0].upper() + help_[1:] + ".",
        formatter_class=Help,
    )
    client_arguments(parser)
    return parser


# -- shoal topics -------------------------------------------------------------------------------


def topics_arguments(parser: argparse.ArgumentParser, client_arguments: Arguments) -> None:
    actions = _actions(parser, "action")
    create = _action(actions, "create", "create a composite topic", client_arguments)
    create.add_argument("name", help="1 to 64 of A-Z a-z 0-9 _ - (MQTT topics under NAME/...)")
    create.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="partitions (Kinesis shards): 1, 2, 3, or a multiple of 4 or 6",
    )
    _action(actions, "list", "list the composite topics", client_arguments)
    describe = _action(actions, "describe", "show a composite topic", client_arguments)
    describe.add_argument("name", help="the composite topic")
    grow = _action(
        actions,
        "grow",
        "add a storage topic with more partitions (then switch-produce)",
        client_arguments,
    )
    grow.add_argument("name", help="the composite topic")
    grow.add_argument("--partitions", type=int, required=True, help="partitions of the new one")
    switch = _action(
        actions,
        "switch-produce",
        "publish into the newest storage topic from now on",
        client_arguments,
    )
    switch.add_argument("name", help="the composite topic")


def run_topics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "create":
            body = {"name": args.name, "partitions": args.partitions}
            answer = client.call("POST", "/v1/topics", body=body)
        elif args.action == "list":
            answer = client.call("GET", "/v1/topics")
        elif args.action == "describe":
            answer = client.call("GET", f"/v1/topics/{_name(args.name)}")
        elif args.action == "grow":
            path = f"/v1/topics/{_name(args.name)}/storage-topics"
            answer = client.call("POST", path, body={"partitions": args.partitions})
        else:
            answer = client.call("POST", f"/v1/topics/{_name(args.name)}/switch-produce")
    print_document(answer)
    return 0


# -- shoal push ---------------------------------------------------------------------------------


def push_arguments(parser: argparse.ArgumentParser, client_arguments: Arguments) -> None:
    actions = _actions(parser, "action")
    create = _action(actions, "create", "create a push subscription", client_arguments)
    create.add_argument("name", help="1 to 64 of A-Z a-z 0-9 _ -")
    create.add_argument("--filter", required=True, help="the topic filter it delivers")
    create.add_argument(
        "--endpoint",
        required=True,
        help="the URL each message is POSTed to (https; http only to loopback under shoal dev)",
    )
    create.add_argument(
        "--unordered",
        action="store_true",
        help="deliver messages of one ordering key in parallel (default: in publish order)",
    )
    create.add_argument(
        "--parallelism", type=int, help="ordering keys delivered at once, 1 to 10 (default: 1)"
    )
    create.add_argument(
        "--topic",
        help="the composite topic to read (default: the filter's first level, else `default`)",
    )
    create.add_argument(
        "--max-attempts", type=int, help="deliveries before a message is dead-lettered (5)"
    )
    create.add_argument("--initial-backoff-s", type=float, help="first retry after (1 s)")
    create.add_argument("--max-backoff-s", type=float, help="longest wait between retries (60 s)")
    create.add_argument("--multiplier", type=float, help="backoff growth per retry (2)")
    create.add_argument(
        "--retry-on",
        nargs="+",
        metavar="STATUS",
        help="answers that retry: codes, classes (4xx, 5xx) and `timeout` (429 5xx timeout)",
    )
    listing = _action(
        actions,
        "list",
        "list the push subscriptions, a page at a time (no blocked keys or depths: describe)",
        client_arguments,
    )
    listing.add_argument("--limit", type=int, default=50, help="subscriptions per page, 1 to 100")
    listing.add_argument("--page-token", help="the `next_page_token` of the previous page")
    listing.add_argument(
        "--all", action="store_true", help="follow the pages to the end; print them as one"
    )
    describe = _action(
        actions, "describe", "show a push subscription and its queues", client_arguments
    )
    describe.add_argument("name", help="the push subscription")
    update = _action(actions, "update", "change a push subscription", client_arguments)
    update.add_argument("name", help="the push subscription")
    update.add_argument(
        "--parallelism", type=int, required=True, help="ordering keys delivered at once, 1 to 10"
    )
    delete = _action(
        actions, "delete", "delete a push subscription with its queues", client_arguments
    )
    delete.add_argument("name", help="the push subscription")
    seek = _action(actions, "seek", "deliver again from a time, or skip to one", client_arguments)
    seek.add_argument("name", help="the push subscription")
    where = seek.add_mutually_exclusive_group(required=True)
    where.add_argument("--to-time", help="epoch milliseconds or ISO 8601 (2026-01-01T00:00:00Z)")
    where.add_argument("--to", choices=("earliest", "latest"), help="either end of the stream")

    dlq = _action(actions, "dlq", "the dead-letter queue: list, redrive", lambda p: None)
    dlq_actions = _actions(dlq, "dlq_action")
    letters = _action(dlq_actions, "list", "list dead-lettered messages", client_arguments)
    letters.add_argument("name", help="the push subscription")
    letters.add_argument("--limit", type=int, default=20, help="messages per page, 1 to 100")
    letters.add_argument("--after", help="the `next` of the previous page")
    redrive = _action(
        dlq_actions,
        "redrive",
        "deliver dead-lettered messages again, per ordering key in order",
        client_arguments,
    )
    redrive.add_argument("name", help="the push subscription")
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("--ordering-key", nargs="+", dest="ordering_keys", help="these keys")
    which.add_argument("--message-id", nargs="+", dest="message_ids", help="these messages")
    which.add_argument("--failed-after", help="what failed after this time (epoch ms or ISO 8601)")


def _int_or_text(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def _list_push(client: ShoalClient, args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": args.limit}
    if args.page_token:
        params["page_token"] = args.page_token
    answer: dict[str, Any] = client.call("GET", "/v1/subscriptions", params=params)
    if not args.all:
        return answer
    listed = list(answer["subscriptions"])
    while answer["next_page_token"]:
        params["page_token"] = answer["next_page_token"]
        answer = client.call("GET", "/v1/subscriptions", params=params)
        listed += answer["subscriptions"]
    return {"subscriptions": listed, "next_page_token": None}


def run_push(args: argparse.Namespace) -> int:
    if args.action == "list":
        with _client(args) as client:
            print_document(_list_push(client, args))
        return 0
    base = f"/v1/subscriptions/{_name(args.name)}"
    with _client(args) as client:
        if args.action == "create":
            answer = client.call("POST", "/v1/subscriptions", body=_create_body(args))
        elif args.action == "describe":
            answer = client.call("GET", base)
        elif args.action == "update":
            answer = client.call("PATCH", base, body={"parallelism": args.parallelism})
        elif args.action == "delete":
            client.call("DELETE", base)
            note(f"deleted push subscription {args.name}")
            return 0
        elif args.action == "seek":
            body: dict[str, Any] = (
                {"to": args.to} if args.to else {"to_time": _int_or_text(args.to_time)}
            )
            answer = client.call("POST", f"{base}/seek", body=body)
        elif args.dlq_action == "list":
            params = {"limit": args.limit} | ({"after": args.after} if args.after else {})
            answer = client.call("GET", f"{base}/dlq", params=params)
        else:
            if args.ordering_keys:
                body = {"ordering_keys": args.ordering_keys}
            elif args.message_ids:
                body = {"message_ids": args.message_ids}
            else:
                body = {"failed_after": _int_or_text(args.failed_after)}
            answer = client.call("POST", f"{base}/dlq/redrive", body=body)
    print_document(answer)
    return 0


def _create_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"name": args.name, "filter": args.filter, "endpoint": args.endpoint}
    if args.unordered:
        body["ordered"] = False
    if args.parallelism is not None:
        body["parallelism"] = args.parallelism
    if args.topic is not None:
        body["topic"] = args.topic
    retry = {
        key: value
        for key, value in (
            ("max_attempts", args.max_attempts),
            ("initial_backoff_s", args.initial_backoff_s),
            ("max_backoff_s", args.max_backoff_s),
            ("multiplier", args.multiplier),
        )
        if value is not None
    }
    if args.retry_on:
        retry["retry_on"] = [int(s) if s.isdigit() else s for s in args.retry_on]
    if retry:
        body["retry"] = retry
    return body


# -- shoal sessions -----------------------------------------------------------------------------


def sessions_arguments(parser: argparse.ArgumentParser, client_arguments: Arguments) -> None:
    actions = _actions(parser, "action")
    show = _action(
        actions,
        "show",
        "show a session: subscriptions, shared groups, expiry, messages in flight",
        client_arguments,
    )
    show.add_argument("client_id", help="the session's client id")


def run_sessions(args: argparse.Namespace) -> int:
    """``GET /v1/sessions/{id}`` without ``Shoal-Channel``: the session read-only, for the
    session's principal or an admin. It never connects, so a subscriber running under that
    client id keeps its channel and its deliveries."""
    with _client(args) as client:
        answer = client.call("GET", f"/v1/sessions/{_name(args.client_id)}")
    print_document(answer)
    return 0
