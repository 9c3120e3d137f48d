"""shoal.client's batching (publish_many, BatchPublisher), its state per (URL, principal) and
its subscriber flow control, against the fake Shoal of test_client_support."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from shoal.client.errors import ApiError, Unavailable
from shoal.client.http import ShoalClient
from shoal.client.support import BatchSettings, FlowControl, principal_of
from shoal.core.clock import ManualClock

from tests.unit.test_client import POLICY, Clients
from tests.unit.test_client_support import FakeShoal, transport


@pytest.fixture
def fake() -> FakeShoal:
    return FakeShoal()


@pytest.fixture
def state_path(tmp_path: Path) -> Path:
    return tmp_path / "client.json"


@pytest.fixture
def clients(fake: FakeShoal, state_path: Path) -> Iterator[Clients]:
    made = Clients(fake, state_path)
    yield made
    for client in made.made:
        client.state.close()


def bodies(*texts: str) -> list[dict[str, object]]:
    return [ShoalClient.message_body("a/b", text=t) for t in texts]


def test_publish_many_sends_batches_of_the_settings_count_with_consecutive_seqs(
    clients: Clients,
) -> None:
    client = clients.new(client_id=None)
    results = client.publish_many(bodies(*"abcdefg"), BatchSettings(max_messages=3))
    # Then 7 messages went in 3 requests (the last one alone, on the plain route), numbered
    # 1..7, and the server has each once
    assert clients.fake.requests == ["POST /v1/messages:batch"] * 2 + ["POST /v1/messages"]
    assert [r.publisher_seq for r in results] == list(range(1, 8))  # type: ignore[union-attr]
    assert clients.fake.texts() == list("abcdefg")
    assert client.pending_publishes == []


def test_a_batch_is_cut_by_bytes(clients: Clients) -> None:
    client = clients.new(client_id=None)
    big = "x" * 1000
    client.publish_many(bodies(big, big, big), BatchSettings(max_messages=100, max_bytes=2200))
    # two fit the bytes, the third goes alone (one message: the plain publish route)
    sizes = [len(b["messages"]) for b in clients.fake.bodies_of("POST /v1/messages:batch")]
    assert sizes == [2]
    assert clients.fake.requests == ["POST /v1/messages:batch", "POST /v1/messages"]
    assert len(clients.fake.published) == 3


def test_a_refused_message_mid_batch_fails_alone_and_the_rest_is_renumbered(
    clients: Clients,
) -> None:
    client = clients.new(client_id=None)
    messages = [*bodies("one"), ShoalClient.message_body("bad/+", text="no"), *bodies("3", "4")]
    results = client.publish_many(messages)
    # Then the invalid one has its error, and the server told of the gap renumbers the rest
    assert isinstance(results[1], ApiError) and results[1].code == "invalid_topic"
    assert [getattr(r, "publisher_seq", None) for r in results] == [1, None, 2, 3]
    assert clients.fake.texts() == ["one", "3", "4"]
    assert client.next_seq == 4


def test_a_lost_batch_answer_is_sent_again_with_the_same_seqs(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages:batch", "lose")
    client = clients.new(client_id=None)
    results = client.publish_many(bodies("a", "b"))
    sent = [
        [m["publisher_seq"] for m in b["messages"]]
        for b in clients.fake.bodies_of("POST /v1/messages:batch")
    ]
    assert sent == [[1, 2], [1, 2]]
    assert [r.duplicate for r in results] == [True, True]  # type: ignore[union-attr]
    assert clients.fake.texts() == ["a", "b"]


def test_an_unanswered_batch_stays_in_flight_for_the_next_run(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages:batch", 503, times=POLICY.attempts)
    with pytest.raises(Unavailable):
        clients.new(client_id=None).publish_many(bodies("a", "b"))
    resent: list[list[dict[str, object]]] = []
    restarted = clients.new(client_id=None, on_resend=resent.append)
    assert [b["text"] for b in restarted.pending_publishes] == ["a", "b"]
    assert restarted.publish("a/b", text="c").publisher_seq == 3
    # the earlier run's messages were announced once, with their seqs, then sent first
    assert [[m["publisher_seq"] for m in r] for r in resent] == [[1, 2]]
    assert clients.fake.texts() == ["a", "b", "c"]


def test_discarding_pending_publishes_starts_a_new_sequence(clients: Clients) -> None:
    clients.fake.fail("POST /v1/messages", 503, times=POLICY.attempts)
    first = clients.new(client_id=None)
    with pytest.raises(Unavailable):
        first.publish("a/b", text="stale")
    old_id = first.publisher_id
    client = clients.new(client_id=None)
    assert client.discard_pending() == 1
    result = client.publish("a/b", text="fresh")
    assert (result.publisher_seq, clients.fake.texts()) == (1, ["fresh"])
    assert result.publisher_id != old_id


def test_state_is_kept_apart_per_url_and_principal(fake: FakeShoal, state_path: Path) -> None:
    def token(sub: str) -> str:
        claims = base64.urlsafe_b64encode(json.dumps({"sub": sub}).encode()).decode()
        return f"h.{claims.rstrip('=')}.s"

    def client(url: str, sub: str) -> ShoalClient:
        http, _ = transport(fake)
        clock = ManualClock()
        return ShoalClient(url, token(sub), state=state_path, http=http, policy=POLICY, clock=clock)

    # Given a publish in flight for one server
    fake.fail("POST /v1/messages", 503, times=POLICY.attempts)
    with client("http://one.test", "alice") as one, pytest.raises(Unavailable):
        one.publish("a/b", text="for one")
    # Then the same file seen for another server, or another principal, holds nothing of it
    for url, sub in (("http://two.test", "alice"), ("http://one.test", "bob")):
        with client(url, sub) as other:
            assert other.pending_publishes == []
            assert other.publish("a/b", text=f"{url} {sub}").publisher_seq == 1
    with client("http://one.test", "alice") as one:
        assert [b["text"] for b in one.pending_publishes] == ["for one"]
    assert principal_of(token("alice")) == "alice"
    assert principal_of("not-a-jwt").startswith("token-")


def test_the_batch_publisher_batches_by_count_and_keeps_order(clients: Clients) -> None:
    client = clients.new(client_id=None)
    settings = BatchSettings(max_messages=4, max_latency_s=60)
    with client.batch_publisher(settings) as publisher:
        futures = [publisher.publish("a/b", text=str(n)) for n in range(10)]
        # four are a full batch: it goes without waiting for the minute-long delay
        assert futures[3].result(timeout=10).publisher_seq == 4
    # closing sends the rest: 4 + 4 + 2, in order
    assert [f.result().publisher_seq for f in futures] == list(range(1, 11))
    sizes = [len(b["messages"]) for b in clients.fake.bodies_of("POST /v1/messages:batch")]
    assert sizes == [4, 4, 2]
    assert clients.fake.texts() == [str(n) for n in range(10)]
    assert (publisher.messages, publisher.requests) == (10, 3)


def test_the_batch_publisher_sends_a_partial_batch_after_the_delay(clients: Clients) -> None:
    client = clients.new(client_id=None)
    with client.batch_publisher(BatchSettings(max_messages=100, max_latency_s=0.01)) as pub:
        assert pub.publish("a/b", text="alone").result(timeout=10).publisher_seq == 1


def test_flow_control_stops_fetching_while_the_outstanding_messages_fill_it(
    clients: Clients,
) -> None:
    consumer = clients.new()
    consumer.subscribe("a/#")
    publisher = clients.new(client_id=None)
    publisher.publish_many(bodies("1", "2", "3"))
    consumer = clients.new()
    stream = consumer.messages(wait_ms=0, auto_ack=False, flow=FlowControl(max_messages=2))
    first, second = next(stream), next(stream)
    # Then the fetch asked for two at most: the third is still on the server
    assert clients.fake.requests.count("GET /v1/sessions/c1/messages") == 1
    assert [m["id"] for m in clients.fake.sessions["c1"].inbox] == ["m3"]
    # and it is fetched once one of the two is processed (here by another thread)
    timer = threading.Timer(0.05, consumer.mark_processed, args=(first,))
    timer.start()
    third = next(stream)
    timer.join()
    assert [m.text for m in (first, second, third)] == ["1", "2", "3"]
    assert clients.fake.bodies_of("POST /v1/sessions/c1/acks") == [{"ids": ["m1"]}]
