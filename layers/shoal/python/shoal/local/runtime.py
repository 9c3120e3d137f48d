"""``shoal dev`` wired together: emulated account, functions, gateway, triggers.

Start order: the embedded AWS (journal replayed), the process environment exactly as a deployed
function sees it, provisioning from the declarations (idempotent, so a restart keeps what is
there), the store bound, the start hooks, the triggers (event source mappings and schedules)
and last the WebSocket API and the gateway, so nothing reaches a handler before the account is
ready.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config, get_config
from shoal.core.observability import SERVICE_ENV, service_scope, set_emf_writer
from shoal.declarations import DEPLOYMENT, Deployment, FunctionDef, function_environment
from shoal.local.authorizer import (
    DEFAULT_AUDIENCE,
    IssuerSettings,
    JwtAuthorizer,
    SigningKey,
    mint_token,
)
from shoal.local.aws import EmbeddedAws
from shoal.local.calls import install_from_environment
from shoal.local.checkpoints import FileCheckpoints
from shoal.local.console import DevConsole
from shoal.local.context import REGION, LambdaContext, NotInvoked
from shoal.local.esm.mappings import EventSourceMappings
from shoal.local.esm.queues import QueueMappings
from shoal.local.gateway import (
    JWKS_PATH,
    Gateway,
    GatewayServer,
    RouteTable,
    in_process_connections,
)
from shoal.local.metrics import LocalMetrics
from shoal.local.provision import LocalNames, provision, provision_mappings
from shoal.local.scheduler import Scheduler, schedules_for
from shoal.local.throttle import Throttles
from shoal.local.transport import InProcessEndpoint
from shoal.local.websocket import WebSocketServer, WsLimits
from shoal.local.wsledger import LEDGER_FILE, ConnectionLedger

log = logging.getLogger("shoal-dev.runtime")

RUNTIME_FILE = "runtime.json"
LOCK_FILE = "lock"
CHECKPOINTS_DIR = "checkpoints"

#: What every function's process sees besides the declared environment: fake credentials (the
#: emulator checks none, and no real account can be reached with them), one region, few SDK
#: retries (nothing throttles locally; a retry only hides a bug), no X-Ray daemon, and metrics
#: kept out of the console: one EMF line per invocation would bury the request log (the
#: runtime puts them into its CloudWatch, ``shoal.local.metrics``, and they go to the function
#: log at DEBUG: --log-level is the runtime's own; POWERTOOLS_LOG_LEVEL=DEBUG shows them).
BASE_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_MAX_ATTEMPTS": "2",
    "AWS_RETRY_MODE": "standard",
    "AWS_ACCOUNT_ID_ENDPOINT_MODE": "disabled",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "POWERTOOLS_TRACE_DISABLED": "1",
    "POWERTOOLS_METRICS_NAMESPACE": "Shoal",
    "POWERTOOLS_METRICS_DISABLED": "true",
}

StartHook = Callable[[Config], object]

#: sessions a pusher invocation pushes at once under ``shoal dev`` (``PushSettings.parallelism``,
#: 16 deployed, where a worker's threads overlap their calls' round trips on a CPU of its own).
#: Here every call is CPU of this one process, and a function's share of the core the GIL
#: gives grows with its threads: 8 pushers of 16 threads left a fan-out's ack invocations so
#: little that 10,000 subscribers' acks came after their 30 s timeout (sent again with
#: ``dup``); 1 thread left the pushes too little beside a hundred long polls. 4 serves both
#: (docs/design.md has the runs). A value in the environment wins.
LOCAL_PUSH_PARALLELISM = 4

#: the declared mappings' batching window under ``shoal dev`` (the archiver's is 60 s deployed):
#: events reach the archive a second or two after a call, so that ``shoal pipeline sync``
#: right after traffic finds them (it waits for the archiver all the same)
LOCAL_BATCHING_WINDOW_S = 1


def _ensure_default_topic(config: Config) -> None:
    # imported once the runtime has set the functions' environment (the services' modules
    # read it when they are first imported, as in a Lambda sandbox)
    from shoal.composite.service import ensure_default_topic
    from shoal.wiring import topic_service

    ensure_default_topic(topic_service(config, stream_wait_s=240.0))


#: Called in order after provisioning, with the process configuration bound, before any
#: request is served. Each runs at every start (after the journal replay), so each must be
#: idempotent. Add a hook here; import inside it, to keep the runtime's own imports light.
START_HOOKS: list[StartHook] = [
    # the `default` composite topic every MQTT topic without a topic of its own belongs to
    _ensure_default_topic,
]


# --- in-process Lambda -----------------------------------------------------------------------


Handler = Callable[[dict[str, Any], Any], Any]


_IMPORT_LOCK = threading.RLock()
#: Invocations of one function running at once; more wait for a sandbox (Lambda would scale
#: out). Every sandbox shares the process's GIL and the emulator's one lock: 128 clients on
#: 32 sandboxes per function spent their time switching threads, so that the thread holding
#: the emulator's lock ran slowly and calls behind it timed out (8: 128 clients served in
#: about half the time, without a 5xx, on 2 cores).
MAX_CONCURRENCY = 8
#: a long poll sleeps in its sandbox for up to 20 s, costing no CPU: room for many pollers.
#: The edge function keeps 8 (tried 16 on 2026-11-30: ``python -m bench wspush`` at 100
#: sessions was no better, and the 1,000-session end-to-end test took 276 s instead of 220 s)
CONCURRENCY = {"messages": 64}


class _Sandboxes:
    """One function's execution environments: each runs one invocation at a time.

    Lambda never runs two invocations in one environment at once, and handlers rely on that
    (Powertools' resolver keeps the current event on a module-level object). So concurrent
    invocations get separate copies of the handler module, made on demand like cold starts.
    """

    def __init__(self, fn: FunctionDef, limit: int) -> None:
        self.fn = fn
        self.limit = limit
        self.created = 0
        self._idle: list[Handler] = []
        self._available = threading.Condition()

    def _load(self) -> Handler:
        # one import at a time in the process: two functions' first imports racing each other
        # see each other's half-initialized modules (ImportError, KeyError in sys.modules)
        with _IMPORT_LOCK:
            return self._load_unlocked()

    def _load_unlocked(self) -> Handler:
        if self.created == 0:
            module = importlib.import_module(self.fn.module)
        else:
            spec = importlib.util.find_spec(self.fn.module)
            if spec is None or spec.loader is None:
                raise ImportError(self.fn.module)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        handler: Handler = getattr(module, self.fn.attribute)
        return handler

    def acquire(self, deadline: float | None = None) -> Handler:
        """A free sandbox, made if the function has fewer than its limit; waited for until
        ``deadline`` (``time.monotonic``) at most: ``NotInvoked`` past it."""
        with self._available:
            while not self._idle and self.created >= self.limit:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise NotInvoked(f"no sandbox of {self.fn.name} free in time")
                self._available.wait(left)
            if self._idle:
                return self._idle.pop()
            handler = self._load()
            self.created += 1
            return handler

    def release(self, handler: Handler) -> None:
        with self._available:
            self._idle.append(handler)
            self._available.notify()


class Functions:
    """The declared functions, invoked in-process with the event Lambda would pass."""

    def __init__(
        self,
        deployment: Deployment,
        names: LocalNames,
        *,
        max_concurrency: int = MAX_CONCURRENCY,
        concurrency: Mapping[str, int] = CONCURRENCY,
    ) -> None:
        self.names = names
        self._by_name = {names.functions[fn.name]: fn for fn in deployment.functions}
        self._sandboxes = {
            fn.name: _Sandboxes(fn, concurrency.get(fn.name, max_concurrency))
            for fn in deployment.functions
        }
        #: invocations so far, by declared function name (``warm`` counts none): what shows
        #: that an idle WebSocket connection runs no function
        self.invocations: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        #: told the deployed name of each function whose invocation raised (Lambda's
        #: ``Errors``: ``shoal.local.metrics``)
        self.on_error: Callable[[str], None] | None = None

    def concurrency(self, name: str) -> int:
        """How many invocations of the declared function run at once (its sandboxes)."""
        sandboxes = self._sandboxes.get(name)
        return sandboxes.limit if sandboxes is not None else MAX_CONCURRENCY

    def invocation_counts(self) -> dict[str, int]:
        """A copy of ``invocations`` (read from the gateway's threads)."""
        with self._count_lock:
            return dict(self.invocations)

    def warm(self) -> None:
        """Import every function once, before anything is served: the first requests after a
        start then make only copies of loaded modules, one at a time, not racing imports."""
        for sandboxes in self._sandboxes.values():
            sandboxes.release(sandboxes.acquire())

    def invoke(self, function_name: str, event: dict[str, Any]) -> Any:
        """Invoke by deployed name (e.g. "shoal-health"), as triggers name their target."""
        fn = self._by_name.get(function_name)
        if fn is None:
            raise KeyError(f"no declared function is deployed as {function_name!r}")
        return self.invoke_def(fn, event)

    def invoke_def(
        self,
        fn: FunctionDef,
        event: dict[str, Any],
        *,
        deadline: float | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> Any:
        """One invocation in a free sandbox. ``deadline`` and ``abandoned``: an API's request
        (``shoal.local.gateway``) waits for a sandbox no longer than API Gateway waits for
        its integration, and does not run once its client has gone. Deployed, Lambda scales
        out and runs it at once; here the sandboxes are few, and a request that ran minutes
        after its client gave up spent them for no one while the client's retry queued behind
        it (the 2-hour soak at 200 clients: no publish answered from minute 22 on)."""
        sandboxes = self._sandboxes[fn.name]
        handler = sandboxes.acquire(deadline)
        if abandoned is not None and abandoned():
            sandboxes.release(handler)
            raise NotInvoked(f"the caller of {fn.name} had gone")
        with self._count_lock:
            self.invocations[fn.name] += 1
        # the function's own environment (its service name) for this invocation only: every
        # function shares the process's environment here
        service = function_environment(fn)[SERVICE_ENV]
        try:
            with service_scope(service):
                return handler(
                    event,
                    LambdaContext(
                        self.names.functions[fn.name],
                        memory_mb=fn.memory_mb,
                        timeout_s=fn.timeout_s,
                    ),
                )
        except Exception:
            if self.on_error is not None:
                self.on_error(self.names.functions[fn.name])
            raise
        finally:
            sandboxes.release(handler)


def ensure_functions_importable(root: Path | None = None) -> Path:
    """Put the project root (the folder holding ``functions/``) on ``sys.path``."""
    candidates = [root] if root else [Path.cwd(), Path(__file__).resolve().parents[5]]
    for candidate in candidates:
        if candidate is not None and (candidate / "functions").is_dir():
            if str(candidate) not in sys.path:
                sys.path.insert(0, str(candidate))
            return candidate
    raise RuntimeError("cannot find the functions/ folder; run shoal dev from the project root")


# --- the runtime -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DevOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    aws_host: str = "127.0.0.1"
    aws_port: int = 0
    state_dir: Path | None = None
    default_partitions: int = 1
    #: default: the gateway's own URL
    issuer: str | None = None
    audience: str = DEFAULT_AUDIENCE
    prefix: str = "shoal"
    #: run event source mappings and schedules (off: only HTTP reaches the functions)
    triggers: bool = True
    project_root: Path | None = None
    #: declared function name -> run every this many seconds instead of its declared period
    schedule_every_s: tuple[tuple[str, int], ...] = ()
    #: the WebSocket API's port (None: ``port`` + 1, or a free one when ``port`` is 0)
    ws_port: int | None = None
    #: shorter idle and whole-connection lifetimes than API Gateway's (tests; None: its own)
    ws_idle_timeout_s: float | None = None
    ws_max_connection_s: float | None = None

    @property
    def websocket_port(self) -> int:
        if self.ws_port is not None:
            return self.ws_port
        return self.port + 1 if self.port else 0


class StateDirInUse(RuntimeError):
    pass


class LocalRuntime:
    def __init__(
        self,
        options: DevOptions,
        *,
        clock: Clock | None = None,
        deployment: Deployment = DEPLOYMENT,
    ) -> None:
        self.options = options
        self.clock = clock or SystemClock()
        self.deployment = deployment
        self.names = LocalNames.for_deployment(
            deployment, prefix=options.prefix, default_partitions=options.default_partitions
        )
        self.aws: EmbeddedAws | None = None
        self.gateway: GatewayServer | None = None
        self.websocket: WebSocketServer | None = None
        #: the functions' ``@connections`` calls, answered by the gateway in this process
        self._connections: InProcessEndpoint | None = None
        self.functions = Functions(deployment, self.names)
        self.key: SigningKey | None = None
        self.issuer = ""
        self._state_dir: Path | None = None
        self._temp_dir: Path | None = None
        self._lock_fd: int | None = None
        self._triggers: list[Any] = []
        #: the functions' metrics, put into the emulated CloudWatch (``shoal.local.metrics``)
        self.metrics: LocalMetrics | None = None

    # -- lifecycle --

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        options = self.options
        # SHOAL_DEV_CALL_LOG: each function's AWS calls recorded for the check against its
        # role (shoal.local.calls); before any session exists, so every one records
        install_from_environment()
        ensure_functions_importable(options.project_root)
        state = self._open_state_dir()
        # bound first, so a port in use fails at once; it serves nothing before start(). The
        # default issuer is its URL, port 0 included.
        server = GatewayServer(options.host, options.port)
        self.gateway = server
        websocket = WebSocketServer(
            self.deployment,
            self.functions.invoke_def,
            host=options.host,
            port=options.websocket_port,
            limits=WsLimits.of(
                self.deployment.websocket,
                idle_timeout_s=options.ws_idle_timeout_s,
                max_connection_s=options.ws_max_connection_s,
            ),
            ledger=ConnectionLedger(state / LEDGER_FILE),
        )
        self.websocket = websocket
        public = server.url
        if options.host in ("0.0.0.0", "::"):  # noqa: S104 - naming it, not binding it
            public = f"http://127.0.0.1:{server.port}"
        self.issuer = options.issuer or public
        # SHOAL_DEV_THROTTLE: a share of posts and DynamoDB calls refused as AWS throttles
        throttles = Throttles.from_environment()
        self.aws = EmbeddedAws(
            options.aws_host, options.aws_port, options.state_dir, throttles=throttles
        )
        self.aws.start()
        self._set_environment(self.aws.url, public)
        session = self.aws.session()
        # before any function runs: their EMF documents and failures become CloudWatch's data
        self.metrics = LocalMetrics(session.client("cloudwatch"))
        set_emf_writer(self.metrics.take)
        self.functions.on_error = self.metrics.failed
        self.metrics.start()
        provision(session, self.names, self.deployment)
        # the mappings the stack declares (the archiver's on the event log); the router's and
        # push's are made at run time, by the start hooks and the admin API
        provision_mappings(
            session, self.names, self.deployment, batching_window_s=LOCAL_BATCHING_WINDOW_S
        )

        get_config.cache_clear()
        config = get_config()
        for hook in START_HOOKS:
            hook(config)

        self.key = SigningKey.load_or_create(state)
        server.gateway = Gateway(
            RouteTable(self.deployment.routes()),
            JwtAuthorizer(
                issuer=self.issuer,
                audiences=(options.audience,),
                jwks=self.key.jwks(),
                clock=self.clock,
            ),
            self.functions.invoke_def,
            jwks=self.key.jwks(),
            public_url=public,
            connections=websocket,
            invocations=self.functions.invocation_counts,
            console=DevConsole(
                ws_url=self.ws_url,
                mint=self.mint_token,
                max_connection_s=websocket.limits.max_connection_s,
            ),
            throttles=throttles,
        )
        IssuerSettings(self.issuer, options.audience).save(state)
        # before any function runs: every push of this process skips the socket
        self._connections = in_process_connections(public, server.gateway)
        self._connections.install()

        self.functions.warm()
        if options.triggers:
            self._start_triggers(state)
        websocket.start()
        server.start()
        self._write_runtime_file(state, public)

    def _start_triggers(self, state: Path) -> None:
        """Event source mappings (read from the Lambda API) and schedules, invoking in-process."""
        assert self.aws is not None
        # checkpoints are keyed by mapping UUID, which the journal replays identically
        mappings = EventSourceMappings(
            self.aws.session(),
            self.functions.invoke,
            self.clock,
            FileCheckpoints(state / CHECKPOINTS_DIR),
            endpoint_url=self.aws.url,
        )
        mappings.start()
        self._triggers.append(mappings)
        # the queues' mappings (the push queue's pusher), batches side by side as Lambda runs them
        queues = QueueMappings(
            self.aws.session(),
            self.functions.invoke,
            endpoint_url=self.aws.url,
            default_concurrency=self.functions.concurrency("pusher"),
        )
        queues.start()
        self._triggers.append(queues)
        scheduler = Scheduler(
            schedules_for(self.deployment, self.names, dict(self.options.schedule_every_s)),
            self.functions.invoke,
            self.clock,
        )
        scheduler.start()
        self._triggers.append(scheduler)

    def stop(self) -> None:
        """Stop serving, then the triggers, then the emulator; safe to call more than once."""
        started = time.monotonic()
        if self._connections is not None:
            self._connections.uninstall()
            self._connections = None
        if self.websocket is not None:
            # first: closing its connections runs $disconnect, which needs the account
            self.websocket.stop()
            self.websocket = None
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        while self._triggers:
            trigger = self._triggers.pop()
            try:
                trigger.stop()
            except Exception as exc:
                log.error("stopping %s failed: %s", type(trigger).__name__, type(exc).__name__)
            log.debug("%s stopped after %.2f s", type(trigger).__name__, time.monotonic() - started)
        if self.metrics is not None:
            # after the functions: what they counted last is put before the emulator stops
            set_emf_writer(None)
            self.functions.on_error = None
            self.metrics.stop()
            self.metrics = None
        if self.aws is not None:
            self.aws.stop()
            self.aws = None
        log.debug("stopped in %.2f s", time.monotonic() - started)
        if self._state_dir is not None:
            (self._state_dir / RUNTIME_FILE).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    # -- pieces --

    def _open_state_dir(self) -> Path:
        if self.options.state_dir is None:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="shoal-dev-"))
            self._state_dir = self._temp_dir
            return self._temp_dir
        state = self.options.state_dir
        state.mkdir(parents=True, exist_ok=True)
        os.chmod(state, 0o700)
        fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise StateDirInUse(f"another shoal dev is running on {state}") from exc
        self._lock_fd = fd
        self._state_dir = state
        return state

    def _set_environment(self, aws_url: str, public_url: str) -> None:
        for key in list(os.environ):
            # a developer's own AWS settings must not leak into the emulated account
            if key.startswith("AWS_ENDPOINT_URL_") or key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
                del os.environ[key]
        os.environ.update(BASE_ENVIRONMENT)
        os.environ["AWS_ENDPOINT_URL"] = aws_url
        os.environ.update(self.names.environment())
        # what the stack gives the WebSocket API's functions: the management API their boto3
        # client pushes frames through (this gateway serves /@connections), and the JWT rules
        # of the HTTP API's authorizer for the $connect authorizer (the local issuer's)
        os.environ["SHOAL_CONNECTIONS_ENDPOINT"] = public_url
        os.environ["SHOAL_JWT_ISSUER"] = self.issuer
        os.environ["SHOAL_JWT_AUDIENCE"] = self.options.audience
        os.environ["SHOAL_JWKS_URL"] = f"{public_url}{JWKS_PATH}"
        os.environ.setdefault("SHOAL_PUSH_PARALLELISM", str(LOCAL_PUSH_PARALLELISM))

    def _write_runtime_file(self, state: Path, public_url: str) -> None:
        assert self.aws is not None
        info = {
            "pid": os.getpid(),
            "url": public_url,
            "ws_url": self.ws_url,
            "aws_url": self.aws.url,
            "issuer": self.issuer,
            "audience": self.options.audience,
        }
        tmp = state / f"{RUNTIME_FILE}.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(state / RUNTIME_FILE)

    # -- for the CLI and tests --

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    @property
    def ws_url(self) -> str:
        """The WebSocket API's URL, as clients on this machine reach it."""
        assert self.websocket is not None
        if self.options.host in ("0.0.0.0", "::"):  # noqa: S104 - naming it, not binding it
            return f"ws://127.0.0.1:{self.websocket.port}"
        return self.websocket.url

    @property
    def console_url(self) -> str:
        """The console's page, on the gateway's port (one origin with the HTTP API)."""
        assert self.gateway is not None
        if self.options.host in ("0.0.0.0", "::"):  # noqa: S104 - naming it, not binding it
            return f"http://127.0.0.1:{self.gateway.port}/console/"
        return f"{self.gateway.url}/console/"

    @property
    def aws_url(self) -> str:
        assert self.aws is not None
        return self.aws.url

    @property
    def state_dir(self) -> Path | None:
        return self._state_dir

    def mint_token(self, sub: str, **kwargs: Any) -> str:
        assert self.key is not None
        return mint_token(
            self.key, issuer=self.issuer, audience=self.options.audience, sub=sub, **kwargs
        )
