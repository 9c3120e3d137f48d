"""What the client commands share: their error for a command line that cannot run, the token,
the retry policy, and how a document is printed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from shoal.client.support import CallRetry, check_url
from shoal.client.tokens import (
    CommandToken,
    FileToken,
    StaticToken,
    TokenKeeper,
    TokenSource,
    TokenUnavailable,
)

#: a command whose last line of output is a token, run again when the token is due
TOKEN_COMMAND_ENV = "SHOAL_TOKEN_COMMAND"  # noqa: S105 - the variable's name, no secret


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


def token_of(args: argparse.Namespace) -> TokenKeeper:
    """The token: ``--token``, else ``--token-file`` (read again when due), else
    ``$SHOAL_TOKEN_COMMAND`` (run again when due), else ``$SHOAL_TOKEN``."""
    source: TokenSource
    if args.token:
        source = StaticToken(str(args.token))
    elif getattr(args, "token_file", None) is not None:
        source = FileToken(args.token_file)
    elif os.environ.get(TOKEN_COMMAND_ENV):
        source = CommandToken(os.environ[TOKEN_COMMAND_ENV])
    elif os.environ.get("SHOAL_TOKEN"):
        source = StaticToken(os.environ["SHOAL_TOKEN"])
    else:
        raise UsageError(
            "no token: give --token or --token-file, or set SHOAL_TOKEN or SHOAL_TOKEN_COMMAND "
            "(`shoal token` mints one)"
        )
    try:
        return TokenKeeper(source)
    except TokenUnavailable as exc:
        raise UsageError(str(exc)) from exc


def url_of(args: argparse.Namespace) -> str:
    """``--url``, refused before anything is sent or kept when it cannot be an API's URL."""
    try:
        return check_url(str(args.url))
    except ValueError as exc:
        raise UsageError(f"--url {exc}") from exc


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
