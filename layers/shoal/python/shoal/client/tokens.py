"""Where a client's token comes from, and when it is read again: the same for every transport.

A token is a JWT with an expiry (``shoal token`` mints one for an hour by default). A process
that should outlive it takes its token from a *source* it can ask again:

- ``StaticToken``: the string given (``--token``, ``$SHOAL_TOKEN``); it cannot be renewed, so
  once the server refuses it the refusal is final;
- ``FileToken``: a file's content (``--token-file``), read again when the token is due;
  whatever rotates the file (a sidecar, a cron job, ``shoal token > file``) renews it;
- ``CommandToken``: the last line a command prints (``$SHOAL_TOKEN_COMMAND``), run again when
  the token is due (as the AWS CLI's ``credential_process`` or kubectl's exec plugins).

``TokenKeeper`` holds the token in use for a transport. Before a request (an HTTP call, a
WebSocket handshake) the transport asks ``token()``: a token that expires within
``RENEW_BEFORE_S`` (its ``exp`` claim, read without verifying: the server verifies) is
renewed first. When the server refuses a token (HTTP 401; a WebSocket ``$connect`` refused as
unauthorized) the transport calls ``refused(token)``: True when a different token could be had
(send again with it), False when not (the refusal is final: exit). Nothing here knows HTTP.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from shoal.client.errors import ClientError

#: a token that expires within this is renewed before it is sent
RENEW_BEFORE_S = 30
#: how long a token command may take
COMMAND_TIMEOUT_S = 30


class TokenUnavailable(ClientError):
    """A token source could not give a token (a file that cannot be read, a command that
    failed)."""


class TokenSource(Protocol):
    #: what a person reads in a message: "the token file x", "$SHOAL_TOKEN_COMMAND"
    description: str

    def read(self) -> str:
        """The token as the source has it now (raises TokenUnavailable)."""
        ...

    @property
    def renewable(self) -> bool:
        """Whether reading again can give another token."""
        ...


class StaticToken:
    description = "the token given"
    renewable = False

    def __init__(self, token: str) -> None:
        self.token = token

    def read(self) -> str:
        return self.token


class FileToken:
    renewable = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"the token file {path}"

    def read(self) -> str:
        try:
            token = self.path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TokenUnavailable(
                f"{self.description} cannot be read ({exc.strerror or type(exc).__name__})"
            ) from exc
        if not token:
            raise TokenUnavailable(f"{self.description} is empty")
        return token.splitlines()[-1].strip()


class CommandToken:
    renewable = True

    def __init__(self, command: str) -> None:
        self.argv = shlex.split(command)
        self.description = "$SHOAL_TOKEN_COMMAND"

    def read(self) -> str:
        if not self.argv:
            raise TokenUnavailable(f"{self.description} is empty")
        try:
            done = subprocess.run(
                self.argv, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TokenUnavailable(f"{self.description} did not run ({exc})") from exc
        lines = [line.strip() for line in done.stdout.decode(errors="replace").splitlines()]
        lines = [line for line in lines if line]
        if done.returncode != 0 or not lines:
            raise TokenUnavailable(
                f"{self.description} failed (exit status {done.returncode}, "
                f"{'no output' if not lines else 'output ignored'})"
            )
        return lines[-1]


def expires_at(token: str) -> float | None:
    """The ``exp`` claim of a JWT (seconds since the epoch), read without verifying it."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims.get("exp") if isinstance(claims, dict) else None
        return float(exp) if isinstance(exp, (int, float)) else None
    except (IndexError, ValueError):
        return None


class TokenKeeper:
    """The token a transport sends, renewed from its source when due or refused."""

    def __init__(self, source: TokenSource, now_s: Callable[[], float] = time.time) -> None:
        self.source = source
        self.now_s = now_s
        self._lock = threading.Lock()
        self._token = source.read()

    @property
    def renewable(self) -> bool:
        return self.source.renewable

    def token(self) -> str:
        """The token to send now: renewed first when it expires within RENEW_BEFORE_S (kept
        if the source has no newer one or cannot be read: the server then says)."""
        with self._lock:
            exp = expires_at(self._token)
            if self.source.renewable and exp is not None and exp - self.now_s() < RENEW_BEFORE_S:
                # kept if the source cannot be read now: the server then says
                with contextlib.suppress(TokenUnavailable):
                    self._token = self.source.read()
            return self._token

    def refused(self, token: str) -> bool:
        """The server refused ``token``: True if another one is now at hand to send instead."""
        with self._lock:
            if self._token != token:
                return True  # renewed meanwhile (another thread)
            if not self.source.renewable:
                return False
            fresh = self.source.read()
            if fresh == token:
                return False
            self._token = fresh
            return True
