"""Fidelity with the deployed engine: the jobs are tested on the Spark of the EMR release the
stack pins, and run on that release's Python (3.9), as EMR Serverless runs them: the staged
code (``infra.pipeline.stage_code``, what the stack uploads) and nothing else of this venv but
pyspark and py4j."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pyspark
import pytest

from infra.pipeline import RELEASE_LABEL, RELEASES, stage_code
from pipeline.common import JVM_OPTIONS
from tests.pipeline.data import delivered_and_acked, message

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.pipeline


def release_python(version: str) -> str | None:
    """An interpreter of the release's Python version on this machine (pyenv or PATH)."""
    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")))
    return found[-1] if found else shutil.which(f"python{version}")


def test_the_local_pyspark_is_the_spark_of_the_pinned_emr_release() -> None:
    spark_version, _ = RELEASES[RELEASE_LABEL]
    assert pyspark.__version__ == spark_version


def test_local_sessions_collect_garbage_as_the_deployed_jobs(spark: SparkSession) -> None:
    # the stack gives EMR's driver and executors JVM_OPTIONS (tests/infra/test_pipeline.py):
    # the local JVM runs the same collector, the throughput one
    management = spark.sparkContext._jvm.java.lang.management.ManagementFactory
    collectors = {bean.getName() for bean in management.getGarbageCollectorMXBeans()}
    assert collectors == {"PS Scavenge", "PS MarkSweep"}


def test_local_sessions_run_every_jvm_option_of_the_deployed_jobs(spark: SparkSession) -> None:
    # Given the options the stack gives EMR's JVMs, as -XX:+Flag / -XX:-Flag / -XX:Flag=value
    expected = {}
    for option in JVM_OPTIONS.split():
        name = option.removeprefix("-XX:")
        if name[0] in "+-":
            expected[name[1:]] = "true" if name[0] == "+" else "false"
        else:
            key, value = name.split("=", 1)
            expected[key] = value
    assert "FreqInlineSize" in expected
    # Then the local JVM runs with each of them
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hotspot = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    running = {key: hotspot.getVMOption(key).getValue() for key in expected}
    assert running == expected


def test_the_jobs_run_end_to_end_on_the_release_python(tmp_path: Path) -> None:
    _, python_version = RELEASES[RELEASE_LABEL]
    interpreter = release_python(python_version)
    if interpreter is None:
        pytest.skip(f"no Python {python_version} here (CI's machines have it under pyenv)")
    # Given the staged job code, only pyspark and py4j beside it, and a tiny archive
    staged = stage_code()
    libs = tmp_path / "libs"
    libs.mkdir()
    for package in ("pyspark", "py4j"):
        (libs / package).symlink_to(Path(str(__import__(package).__file__)).parent)
    root = tmp_path / "archive"
    hour = "date=2023-11-14/hour=22"
    (root / "messages" / "topic=default" / hour).mkdir(parents=True)
    (root / "events" / hour).mkdir(parents=True)
    (root / "messages" / "topic=default" / hour / "a.jsonl").write_text(
        "".join(json.dumps(message(n)) + "\n" for n in range(3))
    )
    events = [e for n in range(3) for e in delivered_and_acked("s1", n)]
    (root / "events" / hour / "e.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    subscriptions = tmp_path / "subscriptions.jsonl"
    subscriptions.write_text(
        json.dumps({"consumer_kind": "session", "consumer": "s1", "filter": "orders/+", "qos": 1})
        + "\n"
    )
    out = tmp_path / "report"
    script = (
        "import sys; from pipeline.entry import main; "
        f"assert sys.version_info[:2] == {tuple(map(int, python_version.split('.')))}; "
        f"assert main(['compact', '--input', {str(root)!r}, '--quiet']) == 0; "
        f"sys.exit(main(['audit', '--input', {str(root)!r}, '--output', {str(out)!r}, "
        f"'--subscriptions', {str(subscriptions)!r}, '--fail-on-findings']))"
    )
    # When compact and audit run on that interpreter (driver and workers)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYSPARK"))},
        "PYTHONPATH": f"{staged}:{libs}",
        "PYSPARK_PYTHON": interpreter,
        "PYTHONNOUSERSITE": "1",
    }
    done = subprocess.run(
        [interpreter, "-c", script],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    # Then both succeed: the hour is compacted and the audit of it is clean
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["totals"]["messages"], report["totals"]["acked"], report["clean"]) == (
        3,
        3,
        True,
    )
    assert (root / "parquet" / "events" / hour / "_manifest.json").is_file()
    # and the consumer is named from the names compact wrote beside the hour's events
    assert [c["consumer"] for c in report["consumers"]] == ["s1"]
    assert list((root / "parquet" / "names" / hour).glob("*.parquet"))
