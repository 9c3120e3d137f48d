"""``shoal publish`` and ``shoal subscribe``: any Shoal, through ``shoal.client``."""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

from shoal.cli.dev import DEFAULT_STATE_DIR
from shoal.client.errors import ClientError
from shoal.client.http import ShoalClient

CLIENT_DIR = DEFAULT_STATE_DIR / "client"


def run_publish(args: argparse.Namespace) -> int:
    """``shoal publish``: one message, exactly once (the state file keeps the sequence)."""
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


def run_subscribe(args: argparse.Namespace) -> int:
    """``shoal subscribe``: print one JSON line per message, each once."""
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
