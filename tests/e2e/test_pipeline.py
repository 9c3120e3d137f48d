"""The pipeline end to end over ``shoal dev``: sync the archive out, audit it.

One test, because each audit starts a Spark job (tens of seconds on two cores): traffic through
``shoal dev`` to a session and a shared group while the router's fault switch
(``SHOAL_FAULTS``) fails a quarter of its invocations at random steps; then sync and audit the
archive and the delivery events the router, get and ack record (docs/pipeline.md, "What the
services record").
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from shoal.client.http import ShoalClient

from tests.e2e.conftest import ROOT, DevFactory, DevServer, shoal_command

pytestmark = [pytest.mark.e2e, pytest.mark.pipeline]

PUBLISHED = 60


def pipeline(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*shoal_command(), "pipeline", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def publish(dev: DevServer, topic: str, count: int) -> list[str]:
    """``count`` messages in one batch request; their ids in publish order."""
    token = dev.token("pub", publish=["#"])
    # unkeyed: a session gets them in topic order, a shared group over its lanes in any order
    # (the audit judges a group's order per explicit key only)
    batch = [{"topic": topic, "text": f"n{n}"} for n in range(count)]
    status, body = dev.request("POST", "/v1/messages:batch", token=token, json={"messages": batch})
    assert status == 200 and all("error" not in r for r in body["results"]), body
    return [r["message_id"] for r in body["results"]]


def archived_ids(folder: Path) -> set[str]:
    return {
        json.loads(line)["message_id"]
        for path in (folder / "messages").rglob("*.jsonl")
        for line in path.read_text().splitlines()
    }


def wait_archived(dev: DevServer, folder: Path, wanted: set[str]) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = pipeline(
            "sync", "--endpoint", dev.url, "--to", str(folder), "--state-dir", str(dev.state_dir)
        )
        assert done.returncode == 0, done.stderr
        if wanted <= archived_ids(folder):
            return
        time.sleep(0.5)
    raise AssertionError(f"{len(wanted - archived_ids(folder))} messages never archived")


def audited(dev: DevServer, tmp_path: Path, ids: list[str]) -> dict[str, Any]:
    """Sync the archive out (once every message is archived) and audit it; the report."""
    archive = tmp_path / "archive"
    wait_archived(dev, archive, set(ids))
    # horizon 1 ms: "lost" means never acked
    done = pipeline(
        "audit", "--input", str(archive), "--output", str(tmp_path / "report"),
        "--horizon-s", "0.001",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads((tmp_path / "report" / "report.json").read_text())
    return doc


def test_traffic_under_router_faults_audits_to_zero_lost_and_zero_duplicated(
    dev_factory: DevFactory, tmp_path: Path
) -> None:
    # Given shoal dev whose router fails a quarter of its invocations at a random step (the
    # seed makes the first one fail, after its inbox writes and event flush)
    dev = dev_factory(env={"SHOAL_FAULTS": "router=0.25,seed=3"})
    token = dev.token(
        "reader", clients=["reader", "member"], subscribe=["faults/#", "$share/audit/faults/#"]
    )
    reader = ShoalClient(dev.url, token, client_id="reader", state=tmp_path / "reader.json")
    member = ShoalClient(dev.url, token, client_id="member", state=tmp_path / "member.json")
    # and a session and a shared group's only member subscribed
    reader.connect()
    member.connect()
    assert reader.subscribe(["faults/#"], qos=1) == [1]
    assert member.subscribe(["$share/audit/faults/#"], qos=1) == [1]
    # When messages are published and both get and ack every one
    ids = publish(dev, "faults/a", PUBLISHED)
    got = list(reader.messages(count=PUBLISHED, wait_ms=5000))
    shared = list(member.messages(count=PUBLISHED, wait_ms=5000))
    reader.close()
    member.close()
    assert [m.raw["message_id"] for m in got] == ids
    assert sorted(m.raw["message_id"] for m in shared) == sorted(ids)
    # And the archive is synced out and audited
    doc = audited(dev, tmp_path, ids)
    consumers = {c["consumer_kind"]: c for c in doc["consumers"]}
    # Then the session and the group matched every message, none lost, duplicated or reordered
    assert sorted(consumers) == ["group", "session"]
    for consumer in consumers.values():
        assert consumer["matched"] == PUBLISHED
        assert (consumer["lost"], consumer["duplicated"], consumer["reordered"]) == (0, 0, 0)
        assert consumer["acked"] + consumer["late"] == PUBLISHED
    # And the group is named by its share name (its consumer id is a digest)
    assert consumers["group"]["label"] == "audit"
    # And the router did fail on purpose (else this proves nothing about retries)
    assert "InjectedFault" in dev.log_path.read_text()
    # And the report saw every message once, with its charts and page
    assert doc["totals"]["messages"] == PUBLISHED
    assert (tmp_path / "report" / "report.html").stat().st_size > 0
    # And a second sync fetches nothing it already has
    again = pipeline(
        "sync", "--endpoint", dev.url, "--to", str(tmp_path / "archive"),
        "--state-dir", str(dev.state_dir),
    )  # fmt: skip
    assert "fetched 0 " in again.stderr
