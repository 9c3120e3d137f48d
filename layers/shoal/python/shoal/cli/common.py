"""What the client commands share: their error for a command line that cannot run, the token,
the retry policy, and how a document is printed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shoal.client.support import CallRetry


class Help(argparse.RawDescriptionHelpFormatter):
    """A flag's default after its help text, unless the text already says it or there is none
    to say (a switch, an unset option); descriptions and epilogs keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(default, list)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: {default})"


class UsageError(Exception):
    """A command line that parses but cannot be run (no token, a file not found): exit 2."""


def token_of(args: argparse.Namespace) -> str:
    if not args.token:
        raise UsageError("no token: give --token or set SHOAL_TOKEN (`shoal token` mints one)")
    return str(args.token)


def policy_of(args: argparse.Namespace) -> CallRetry:
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    return CallRetry(attempts=args.retries + 1)


def print_document(document: Any) -> None:
    """An answer of the API as indented JSON on stdout (``jq`` reads it)."""
    print(json.dumps(document, indent=2, ensure_ascii=False))


def note(message: str) -> None:
    """A line for the person at the terminal (stderr: stdout stays the data)."""
    print(f"shoal: {message}", file=sys.stderr, flush=True)
