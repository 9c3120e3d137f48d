"""``shoal dev`` and ``shoal token``: Shoal on this machine, over an embedded AWS emulator.

Both are development tools: the AWS emulator (moto) and the local issuer's JWT library (PyJWT)
come with the ``dev`` extra, not with the library.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType

DEFAULT_STATE_DIR = Path(".shoal")
#: in the state directory: the AWS emulator's port of the last run, used again by the next
AWS_PORT_FILE = "aws-port"
ADMIN_TOKEN_TTL_S = 12 * 3600
#: what the embedded AWS emulator imports (``moto[server]``: moto and its Flask server)
EMULATOR_MODULES = ("moto", "flask")
#: what the local issuer signs and checks tokens with (``PyJWT[crypto]``)
SIGNING_MODULES = ("jwt", "cryptography")
INSTALL_DEV = "pip install 'shoal[dev]' (in a checkout: pip install -e '.[dev]')"


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` that are not installed (none when the dev extra is)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def _without_dev_extra(command: str, missing: list[str]) -> int:
    print(
        f"shoal {command}: needs the dev extra (missing: {', '.join(missing)}); {INSTALL_DEV}",
        file=sys.stderr,
    )
    return 2


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as the emulator's server binds: a port in TIME_WAIT counts as free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _emulator_port(args: argparse.Namespace) -> int | None:
    """The port for the AWS emulator, or None when it cannot be had (said on stderr).

    ``--aws-port`` is a promise: taken, ``shoal dev`` will not start. Without it, a state
    directory keeps the port of its last run, so an ``AWS_ENDPOINT_URL`` a developer exported
    keeps working across restarts; if another program took that port since, a free one is used
    and the line saying so names it (the banner prints the new URL).
    """
    if args.aws_port is not None:
        if args.aws_port and not port_free(args.aws_host, args.aws_port):
            print(f"shoal dev: cannot start: --aws-port {args.aws_port} is in use", file=sys.stderr)
            return None
        return int(args.aws_port)
    if args.state_dir is None:
        return 0
    try:
        saved = int((args.state_dir / AWS_PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0
    if port_free(args.aws_host, saved):
        return saved
    print(
        f"shoal dev: the emulator's port of the last run, {saved}, is in use; "
        "taking a free one (AWS_ENDPOINT_URL changes: see below)",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _remember_emulator_port(state_dir: Path | None, aws_url: str) -> None:
    if state_dir is None:
        return
    port = aws_url.rsplit(":", 1)[1].rstrip("/")
    tmp = state_dir / f"{AWS_PORT_FILE}.tmp"
    tmp.write_text(port + "\n")
    tmp.replace(state_dir / AWS_PORT_FILE)


def run_dev(args: argparse.Namespace) -> int:
    """``shoal dev``: run Shoal on this machine until SIGTERM or Ctrl-C."""
    missing = missing_modules(EMULATOR_MODULES + SIGNING_MODULES)
    if missing:
        return _without_dev_extra("dev", missing)
    # Starting creates a few hundred thousand objects that live until the process ends (the
    # emulator's modules and service models, the provisioned account): the collector's full
    # passes over them, repeated while loading and then while serving, are skipped (below).
    gc.disable()
    # imported here: only `shoal dev` needs the local runtime, the other commands start faster
    from shoal.local.logs import configure
    from shoal.local.runtime import DevOptions, LocalRuntime, StateDirInUse
    from shoal.local.websocket import lifetimes_from_environment

    configure(args.log_level.upper())
    aws_port = _emulator_port(args)
    if aws_port is None:
        return 1
    try:
        # SHOAL_WS_IDLE_TIMEOUT_S / SHOAL_WS_MAX_CONNECTION_S: shorter lifetimes, for tests
        lifetimes = lifetimes_from_environment()
    except ValueError as exc:
        print(f"shoal dev: cannot start: {exc}", file=sys.stderr)
        return 2
    options = DevOptions(
        host=args.host,
        port=args.port,
        aws_host=args.aws_host,
        aws_port=aws_port,
        state_dir=args.state_dir.resolve() if args.state_dir else None,
        default_partitions=args.default_partitions,
        issuer=args.issuer,
        audience=args.audience,
        triggers=not args.no_triggers,
        schedule_every_s=tuple(args.schedule),
        ws_port=args.ws_port,
        ws_idle_timeout_s=lifetimes["idle_timeout_s"],
        ws_max_connection_s=lifetimes["max_connection_s"],
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
    finally:
        # as a pre-forking server does once loaded: what exists now is out of the collector's
        # passes, which then walk only what serving creates
        gc.freeze()
        gc.enable()
    # the collector's full passes walk all the account holds: in quiet moments, not in bursts
    from shoal.local.collector import Collector

    collector = Collector()
    collector.start()
    try:
        assert runtime.aws is not None
        _remember_emulator_port(options.state_dir, runtime.aws_url)
        replay = runtime.aws.replay_stats
        state = str(options.state_dir) if options.state_dir else "(temporary, gone on exit)"
        token = runtime.mint_token("admin", admin=True, ttl_s=ADMIN_TOKEN_TTL_S)
        lines = [
            f"Shoal dev is serving {runtime.url}",
            f"  WebSocket API: {runtime.ws_url}",
            f"  Console:       {runtime.console_url}  (in a browser on this machine)",
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
        collector.stop()
    # Everything is stopped, fsynced and closed. Tearing down the interpreter's copy of every
    # emulated service would take seconds more, so the process ends here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_token(args: argparse.Namespace) -> int:
    """``shoal token``: print a JWT signed with the key of the state directory's shoal dev."""
    missing = missing_modules(SIGNING_MODULES)
    if missing:
        return _without_dev_extra("token", missing)
    # imported here: only `shoal token` signs (the JWT and crypto libraries take time to load)
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
