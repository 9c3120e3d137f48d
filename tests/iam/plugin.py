"""The suite records every AWS call its functions make, and fails a call their roles forbid.

Every process of the run records (``shoal.local.calls``) into one folder named by
``SHOAL_DEV_CALL_LOG``: this process, pytest-xdist's workers, and each ``shoal dev`` the
end-to-end tests start (they inherit the environment). At the end the main process reads
the folder and holds each call against the synthesized roles (``tests.iam.roles``): a call a
role does not allow fails the run, naming the function, the action and the resource.

When the run took in every module of tests/integration and tests/e2e, the unused grants are
held against ``tests.iam.allowlist`` too (once ``allowlist.ENFORCED``): each must be there with
its reason, and nothing may be there that is used or granted no more. The report of unused
grants is printed after such a run, and after any run with ``SHOAL_IAM_REPORT=1``.

Set ``SHOAL_DEV_CALL_LOG`` yourself to keep the records (runs then add to the same folder).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from shoal.local import calls as recorder

ROOT = Path(__file__).resolve().parents[2]
#: the suites whose calls decide whether a grant is unused
COVERING = ("tests/integration", "tests/e2e")
REPORT_ENV = "SHOAL_IAM_REPORT"
#: the check runs unless ``SHOAL_IAM_CHECK=off``. The first whole run with it on (2026-11-29)
#: named 1,093 calls: 1,077 a stage mismatch of the check's own (tests/iam/requests.py), one a
#: missing grant (sessions' PutRecords), and 15 that were four more missing grants and two
#: tests' calls taken for a function's (docs/decisions/0010-calls-held-against-the-roles.md)
SWITCH_ENV = "SHOAL_IAM_CHECK"

#: a test's figure for the run's closing lines (tests/infra/test_package_limits.py)
SUMMARY_PROPERTY = "suite_summary"

_state: dict[str, object] = {"seen_modules": set()}
_summaries: list[str] = []


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _off() -> bool:
    return os.environ.get(SWITCH_ENV, "on").lower() in ("off", "0", "false")


def pytest_configure(config: pytest.Config) -> None:
    if _off():
        return
    if not _is_worker(config) and not os.environ.get(recorder.CALL_LOG_ENV):
        folder = tempfile.mkdtemp(prefix="shoal-calls-")
        os.environ[recorder.CALL_LOG_ENV] = folder
        _state["owned"] = folder
    recorder.install_from_environment()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    seen = _state["seen_modules"]
    assert isinstance(seen, set)
    seen.add(report.nodeid.split("::", 1)[0])
    # figures a test reports for the run's summary (record_property("suite_summary", ...)):
    # properties travel from xdist's workers with the report, where prints do not
    for key, value in report.user_properties:
        if key == SUMMARY_PROPERTY and report.when == "call":
            _summaries.append(str(value))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _summaries:
        terminalreporter.write_line(line)


#: a module with a test of its own (``test_*_support.py`` and ``test_*_harness.py`` modules hold
#: only fixtures and helpers: no test of theirs is ever reported)
_A_TEST = re.compile(r"^\s*(async\s+)?def test_", re.MULTILINE)


def covering_modules(root: Path = ROOT) -> set[str]:
    """The modules of tests/integration and tests/e2e that hold tests, as their nodeids
    begin."""
    return {
        str(path.relative_to(root))
        for suite in COVERING
        for path in (root / suite).glob("test_*.py")
        if _A_TEST.search(path.read_text(encoding="utf-8"))
    }


def _covering_run() -> bool:
    seen = _state["seen_modules"]
    assert isinstance(seen, set)
    return covering_modules() <= seen


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_worker(session.config) or _off():
        return
    folder = Path(os.environ.get(recorder.CALL_LOG_ENV, ""))
    try:
        _check(session, folder)
    finally:
        owned = _state.get("owned")
        if isinstance(owned, str):
            shutil.rmtree(owned, ignore_errors=True)


def _check(session: pytest.Session, folder: Path) -> None:
    from tests.iam.allowlist import ENFORCED
    from tests.iam.check import (
        denied,
        load_calls,
        report,
        stale_entries,
        unlisted_unused,
        unused_grants,
    )
    from tests.iam.roles import deployed_roles

    calls = load_calls(folder) if folder.is_dir() else []
    if not calls:
        return
    roles = deployed_roles()
    problems = [f"not allowed by its role: {d}" for d in denied(calls, roles)]
    covering = _covering_run()
    if covering and ENFORCED:
        unused = unused_grants(calls, roles)
        problems += [
            f"granted, never used, not on tests/iam/allowlist.py: {f}: {a}"
            for f, a in unlisted_unused(unused)
        ]
        problems += [
            f"on tests/iam/allowlist.py but used, or granted no more: {f}: {a}"
            for f, a in stale_entries(unused, roles)
        ]
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(text: str) -> None:
        if terminal is not None:
            terminal.write_line(text)

    if covering or os.environ.get(REPORT_ENV):
        say(report(calls, roles))
    functions = len({c.function for c in calls})
    if problems:
        say(f"IAM check: {len(problems)} problem(s) in {len(calls)} calls of {functions} functions")
        for problem in problems:
            say(f"  {problem}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        say(
            f"IAM check: {len(calls)} distinct calls of {functions} functions, each allowed by "
            f"its role{' (unused grants all on the allowlist)' if covering and ENFORCED else ''}"
        )
