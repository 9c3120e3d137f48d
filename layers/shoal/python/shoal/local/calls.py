"""Which function made which AWS call: a record of each, for the check of calls against roles.

Deployed, every function calls AWS with its own role, and a call its role does not allow is an
``AccessDeniedException``. The emulator checks no role, so ``shoal dev`` and the test suites
record instead, when ``SHOAL_DEV_CALL_LOG`` names a folder: each process appends one JSON line
per distinct call (function, service, operation and the parameters that name the resource) to
``calls-<pid>.jsonl`` there. ``tests/iam`` reads those lines and holds each call against the
statements of that function's role in the synthesized template (docs/design.md, "IAM").

The function is the one whose handler is on the calling thread's stack (``functions.<name>``
modules), the nearest to the call: that holds for the local runtime's invocations and for
handlers that tests call directly alike. A test's code met first (``tests.`` modules) makes the
call the test's: a test's hook that runs inside a handler (a fault switch that lists the
archive, a clock whose sleep routes a batch as the mappings would) acts for the test, not for
the function whose frames are further up. (So a test's wrapper that hands a handler's call on
to the real client is not recorded either: fewer calls seen, never a call taken for another's.)
Work a handler hands to a thread pool keeps its function: the pool's tasks run with the
function of whoever submitted them. Calls no handler made (provisioning, the event
source mappings' pollers, the tests' own reads) are not a function's, and are not recorded.

A line is written when its call is first seen, and flushed: a process killed with -9 (the
end-to-end restarts) has lost nothing it recorded. Object keys are cut to their first folder
(``messages/<key>``): the grants name buckets and prefixes, and a line per object would make the
record as large as the archive.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from botocore import handlers

#: a folder: every process that records appends its lines to a file of its own there
CALL_LOG_ENV = "SHOAL_DEV_CALL_LOG"
FUNCTION_MODULE_PREFIX = "functions."
#: a test's code: nearer to a call than any handler, the call is the test's own
TEST_MODULE_PREFIX = "tests."
#: how far up a calling stack to look for a handler's frame (a call through botocore, moto's
#: in-process transport and Shoal's layers is some 60 frames deep)
MAX_DEPTH = 400
#: the parameters that name what a call acts on (the rest are data)
NAMING = (
    "QueueUrl",
    "TableName",
    "IndexName",
    "StreamName",
    "StreamARN",
    "ConsumerARN",
    "Bucket",
    "Key",
    "Prefix",
    "FunctionName",
    "UUID",
    "StackName",
    "ConnectionId",
)
#: shard iterators remembered at most (each poll makes a new one; a reader uses the latest)
MAX_ITERATORS = 100_000
#: names what was running when a call was first seen (pytest sets it for each test)
SEEN_IN_ENV = "PYTEST_CURRENT_TEST"
#: what ``shoal.local.calls`` writes in the place of an object key's name
KEY_ELIDED = "<key>"

#: the function a thread pool task runs for (the submitter's), when no handler is on its stack
_submitted_by: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "shoal_calls_function", default=None
)


def calling_function() -> str | None:
    """The declared function whose handler is on this thread's stack, or whose task this is;
    None for a call a test's code made, even inside a handler."""
    frame: FrameType | None = sys._getframe(1)
    depth = 0
    while frame is not None and depth < MAX_DEPTH:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(FUNCTION_MODULE_PREFIX) and name.count(".") >= 2:
            return str(name.split(".", 2)[1])
        if name.startswith(TEST_MODULE_PREFIX):
            return None
        frame = frame.f_back
        depth += 1
    return _submitted_by.get()


def naming(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of a call that name its resources, the rest left out."""
    named: dict[str, Any] = {k: params[k] for k in NAMING if k in params}
    if isinstance(named.get("Key"), str):
        folder, _, rest = named["Key"].partition("/")
        named["Key"] = f"{folder}/{KEY_ELIDED}" if rest else KEY_ELIDED
    if isinstance(params.get("RequestItems"), Mapping):  # BatchGetItem, BatchWriteItem
        named["RequestItems"] = sorted(params["RequestItems"])
    if isinstance(params.get("TransactItems"), list):  # TransactWriteItems, TransactGetItems
        named["TransactItems"] = sorted(
            {
                (kind, str(item[kind].get("TableName", "")))
                for item in params["TransactItems"]
                for kind in item
            }
        )
    return named


class CallLog:
    """The distinct calls of this process's functions, appended to one file as first seen."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"calls-{os.getpid()}.jsonl"
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        #: shard iterator -> the stream parameters it was made for: GetRecords names no stream
        #: (IAM checks it against the iterator's stream)
        self._iterators: dict[str, dict[str, Any]] = {}
        #: called with every call's line, seen before or not (a test's own record)
        self.listeners: list[Callable[[Mapping[str, Any]], None]] = []

    def record(self, line: Mapping[str, Any]) -> None:
        # where the call was seen, to tell a function's own call from a test's that the
        # recorder took for one: pytest's current test in a test process, and in a `shoal dev`
        # the test that started it (its environment is inherited). Not part of what makes a
        # call distinct: a call is written once, with where it was first seen.
        seen_in = os.environ.get(SEEN_IN_ENV, "")
        written = {**line, "seen_in": seen_in} if seen_in else line
        for listener in list(self.listeners):
            listener(written)
        text = json.dumps(line, sort_keys=True, default=list)
        if text in self._seen:
            return
        with self._lock:
            if text in self._seen:
                return
            self._seen.add(text)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(written, sort_keys=True, default=list) + "\n")

    # -- botocore's events --

    def before_parameter_build(
        self, params: Mapping[str, Any], model: Any, context: Any = None, **_: Any
    ) -> None:
        if not isinstance(context, dict):
            return
        # the caller's parameters, kept for the request's ``before-call`` (which has the URL)
        named = naming(params)
        iterator = params.get("ShardIterator")
        if isinstance(iterator, str):
            named.update(self._iterators.get(iterator, {}))
        context["shoal_calls_params"] = named

    def after_call(
        self, parsed: Any = None, model: Any = None, context: Any = None, **_: Any
    ) -> None:
        if model is None or not isinstance(parsed, Mapping):
            return
        if model.name not in ("GetShardIterator", "GetRecords") or not isinstance(context, dict):
            return
        stream = {
            k: v
            for k, v in (context.get("shoal_calls_params") or {}).items()
            if k in ("StreamName", "StreamARN")
        }
        following = parsed.get("ShardIterator") or parsed.get("NextShardIterator")
        if stream and isinstance(following, str):
            with self._lock:
                if len(self._iterators) > MAX_ITERATORS:
                    self._iterators.clear()
                self._iterators[following] = stream

    def before_call(self, model: Any, params: Mapping[str, Any], **_: Any) -> None:
        function = calling_function()
        if function is None:
            return
        context = params.get("context") or {}
        service = model.service_model
        line: dict[str, Any] = {
            "function": function,
            # the IAM prefix of a service's actions is its signing name (apigatewaymanagementapi
            # signs as execute-api, dynamodb as dynamodb)
            "service": service.signing_name or service.endpoint_prefix,
            "operation": model.name,
            "region": context.get("client_region") or "",
            "params": context.get("shoal_calls_params") or {},
        }
        if line["service"] == "execute-api":
            # the API and stage are in the endpoint, not in the parameters
            line["endpoint"] = urlsplit(str(params.get("url", ""))).netloc
            line["path"] = urlsplit(str(params.get("url", ""))).path
            line["method"] = str(params.get("method", ""))
        self.record(line)


_installed: list[CallLog] = []
_install_lock = threading.Lock()


def install(folder: Path) -> CallLog:
    """Record the calls of every botocore session made from now on in this process (botocore
    registers its built-in handlers on each new session), once per process."""
    with _install_lock:
        if _installed:
            return _installed[0]
        log = CallLog(folder)
        handlers.BUILTIN_HANDLERS.append(("before-parameter-build", log.before_parameter_build))
        handlers.BUILTIN_HANDLERS.append(("before-call", log.before_call))
        handlers.BUILTIN_HANDLERS.append(("after-call", log.after_call))
        _carry_function_into_pools()
        _installed.append(log)
        return log


def installed() -> CallLog | None:
    """This process's recorder, if it records."""
    return _installed[0] if _installed else None


def install_from_environment(environ: Mapping[str, str] = os.environ) -> CallLog | None:
    folder = environ.get(CALL_LOG_ENV)
    return install(Path(folder)) if folder else None


def _carry_function_into_pools() -> None:
    """A pool task runs with the function of the thread that submitted it: the router's writer
    pool and push's delivery pool call AWS for the invocation that handed them the work."""
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit_for_function(
        self: concurrent.futures.ThreadPoolExecutor,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> concurrent.futures.Future[Any]:
        function = calling_function()
        if function is None:
            return submit(self, fn, *args, **kwargs)

        def run() -> Any:
            token = _submitted_by.set(function)
            try:
                return fn(*args, **kwargs)
            finally:
                _submitted_by.reset(token)

        return submit(self, run)

    concurrent.futures.ThreadPoolExecutor.submit = submit_for_function  # type: ignore[method-assign,assignment]
