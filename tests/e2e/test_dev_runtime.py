"""``shoal dev`` as a user runs it: health, the authorizer, durability across kill -9, shutdown."""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import jwt
import pytest
from botocore.exceptions import BotoCoreError, ClientError
from shoal import __version__
from shoal.declarations import DEPLOYMENT
from shoal.local.provision import LocalNames
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.e2e.conftest import ROOT, DevServer, shoal_command

pytestmark = pytest.mark.e2e

NAMES = LocalNames.for_deployment()
AUTHORIZED_ROUTES = [r for r, _ in DEPLOYMENT.routes() if r.authorized]


def concrete_path(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "e2e", template)


def test_health_answers_with_the_version(shared_dev: DevServer) -> None:
    assert shared_dev.request("GET", "/v1/health") == (
        200,
        {"status": "ok", "version": __version__},
    )


@pytest.mark.skipif(not AUTHORIZED_ROUTES, reason="no authorized route is declared yet")
def test_authorized_routes_refuse_a_request_without_token(shared_dev: DevServer) -> None:
    # Given every declared route that needs a token
    answers = {}
    for route in AUTHORIZED_ROUTES:
        method = "GET" if route.method == "ANY" else route.method
        # When it is called without one
        status, body = shared_dev.request(method, concrete_path(route.path), json={})
        answers[route.key] = (status, body)
    # Then each answers API Gateway's own 401, as a deployed stack does
    unauthorized = (401, {"message": "Unauthorized"})
    assert answers == {route.key: unauthorized for route in AUTHORIZED_ROUTES}


def test_unknown_route_is_a_coded_404(shared_dev: DevServer) -> None:
    status, body = shared_dev.request("GET", "/v1/no-such-route")
    assert status == 404
    assert body["error"]["code"] == "route_not_found"


def test_minted_token_verifies_against_the_served_jwks(shared_dev: DevServer) -> None:
    # Given a token from `shoal token` and the keys the server publishes
    token = shared_dev.token("alice", publish=["orders/#"])
    _, discovery = shared_dev.request("GET", "/.well-known/openid-configuration")
    _, jwks = shared_dev.request("GET", "/.well-known/jwks.json")
    # When it is verified as any JWT library would
    key = jwt.PyJWKSet.from_dict(jwks)[jwt.get_unverified_header(token)["kid"]]
    claims = jwt.decode(
        token, key.key, algorithms=["RS256"], audience="shoal", issuer=discovery["issuer"]
    )
    # Then it carries the issuer of this server and the requested permissions
    assert (claims["sub"], claims["shoal:publish"]) == ("alice", ["orders/#"])
    assert discovery["issuer"] == shared_dev.issuer == shared_dev.url


def test_admin_token_is_printed_alone_on_a_line(shared_dev: DevServer) -> None:
    tokens = [
        line
        for line in shared_dev.log().splitlines()
        if re.fullmatch(r"[\w-]+\.[\w-]+\.[\w-]+", line)
    ]
    assert len(tokens) == 1
    assert jwt.decode(tokens[0], options={"verify_signature": False})["shoal:admin"] is True


def write_everything(dev: DevServer) -> dict[str, Any]:
    session = dev.aws()
    session.client("dynamodb").put_item(
        TableName=NAMES.tables["topics"], Item={"name": {"S": "durable"}, "version": {"N": "7"}}
    )
    session.client("s3").put_object(
        Bucket=NAMES.buckets["archive"], Key="e2e/object.json", Body=b'{"kept": true}'
    )
    kinesis = session.client("kinesis")
    kinesis.create_stream(StreamName="e2e-durability", ShardCount=1)
    put = kinesis.put_record(StreamName="e2e-durability", Data=b"record-1", PartitionKey="k")
    return {"sequence_number": put["SequenceNumber"], "shard_id": put["ShardId"]}


def test_state_written_before_kill_9_is_read_back_after_restart(dev: DevServer) -> None:
    # Given an item, an object and a stream record, each acknowledged
    told = write_everything(dev)
    # When the server is killed with SIGKILL and started again on the same state directory
    dev.restart(kill=True)
    # Then all three are there
    session = dev.aws()
    item = session.client("dynamodb").get_item(
        TableName=NAMES.tables["topics"], Key={"name": {"S": "durable"}}, ConsistentRead=True
    )
    assert item["Item"]["version"] == {"N": "7"}
    body = session.client("s3").get_object(Bucket=NAMES.buckets["archive"], Key="e2e/object.json")
    assert body["Body"].read() == b'{"kept": true}'
    kinesis = session.client("kinesis")
    iterator = kinesis.get_shard_iterator(
        StreamName="e2e-durability", ShardId=told["shard_id"], ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records = kinesis.get_records(ShardIterator=iterator)["Records"]
    assert [(r["SequenceNumber"], r["Data"]) for r in records] == [
        (told["sequence_number"], b"record-1")
    ]
    # And the server still serves
    assert dev.request("GET", "/v1/health")[0] == 200


def test_every_acknowledged_write_survives_a_kill_mid_stream(dev: DevServer) -> None:
    # Given a writer that keeps putting items and records which ones were acknowledged
    table = dev.aws().client("dynamodb")
    acknowledged: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            try:
                table.put_item(TableName=NAMES.tables["topics"], Item={"name": {"S": f"w-{n}"}})
            except (BotoCoreError, ClientError):
                return  # the server died under this request: it was never acknowledged
            acknowledged.append(n)
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    while len(acknowledged) < 50 and thread.is_alive():
        threading.Event().wait(0.01)
    # When the server is killed in the middle of the stream of writes
    dev.kill()
    stop.set()
    thread.join()
    dev.start()
    # Then every write the client was told succeeded is there
    table = dev.aws().client("dynamodb")
    missing = [
        n
        for n in acknowledged
        if "Item"
        not in table.get_item(
            TableName=NAMES.tables["topics"], Key={"name": {"S": f"w-{n}"}}, ConsistentRead=True
        )
    ]
    assert len(acknowledged) >= 50
    assert missing == []


def test_sigterm_stops_it_cleanly(dev: DevServer) -> None:
    # When the server gets SIGTERM
    status = dev.terminate()
    # Then it exits 0 and leaves no runtime file behind
    assert status == 0
    assert not (dev.state_dir / "runtime.json").exists()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port`` (Linux /proc)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, port_hex = address.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(host)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_it_listens_on_loopback_only(shared_dev: DevServer) -> None:
    loopback = "0100007F"  # 127.0.0.1, as /proc/net/tcp writes it
    assert _listening_addresses(shared_dev.port) == {loopback}
    assert _listening_addresses(shared_dev.aws_port) == {loopback}


def test_a_second_server_on_the_same_state_dir_is_refused(shared_dev: DevServer) -> None:
    done = subprocess.run(
        [*shoal_command(), "dev", "--port", "0", "--state-dir", str(shared_dev.state_dir)],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert b"another shoal dev" in done.stderr
    assert shared_dev.request("GET", "/v1/health")[0] == 200


def test_minted_tokens_pass_the_authorizer_with_their_claims(shared_dev: DevServer) -> None:
    # Given an admin token and a plain one from `shoal token`
    admin, plain = shared_dev.token("ops", admin=True), shared_dev.token("bob")
    # When both list the topics (an admin route)
    status, body = shared_dev.request("GET", "/v1/topics", token=admin)
    refused = shared_dev.request("GET", "/v1/topics", token=plain)
    # Then the admin claim reached the function: the admin sees the `default` topic that
    # the start hook created, the plain principal is forbidden
    assert status == 200
    assert "default" in [t["name"] for t in body["topics"]]
    assert (refused[0], refused[1]["error"]["code"]) == (403, "forbidden")


def test_a_topic_created_over_http_survives_kill_9(dev: DevServer) -> None:
    # Given a topic whose creation was acknowledged, and a token minted before the crash
    admin = dev.token("ops", admin=True)
    status, created = dev.request(
        "POST", "/v1/topics", token=admin, json={"name": "durable", "partitions": 2}
    )
    assert status == 201
    # When the server is killed with SIGKILL and restarted on the same state directory
    dev.restart(kill=True)
    # Then the topic reads back as it was created, with the same token (same key and issuer)
    assert dev.request("GET", "/v1/topics/durable", token=admin) == (200, created)


def test_the_websocket_api_is_served_beside_the_http_api(shared_dev: DevServer) -> None:
    # the banner and runtime.json name it, on loopback
    assert shared_dev.ws_url.startswith("ws://127.0.0.1:")
    assert f"WebSocket API: {shared_dev.ws_url}" in shared_dev.log()

    # a handshake without a token is refused by the $connect authorizer, as deployed
    async def handshake() -> int:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(shared_dev.ws_url, open_timeout=30):
                pass
        return refused.value.response.status_code

    assert asyncio.run(handshake()) == 401
    # the management API the functions' SDK clients reach: an unknown connection is gone
    status, body = shared_dev.request("GET", "/@connections/L0SM9cOFvHcCIhw%3D")
    assert (status, body) == (410, {"message": None})
