"""The push queue's messages (``shoal.edge.pushwork``) and Lambda's SQS mapping as ``shoal dev``
emulates it (``shoal.local.esm.queues``): pure parts, no account."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shoal.core.clock import ManualClock
from shoal.core.errors import ServerBusy
from shoal.delivery.inbox import Given, pack
from shoal.delivery.model import ArchiveLine, InboxMessage
from shoal.edge.connections import Connection
from shoal.edge.push import _carried
from shoal.edge.pushwork import MAX_BODY_BYTES, PushQueue, PushWork, group_id, lane_of, qos0_id
from shoal.local.esm.queues import QueueMapping, done_messages, sqs_event


def _message(position: str, *, qos: int = 1, payload: bytes = b"x") -> InboxMessage:
    return InboxMessage(
        position=position,
        message_id=f"m-{position}",
        topic="a/b",
        payload=payload,
        qos=qos,
        subscription="a/#",
        sid="s1",
        published_at_ms=1,
        line=ArchiveLine("messages/k", 10, 20),
    )


def test_a_work_message_reads_back_as_it_was_written() -> None:
    line = ArchiveLine("messages/k", 10, 20)
    [item] = pack("s1", "src", [_message("0001-00")], "0001-00", 99)
    work = PushWork(
        {"s1": "c1", "s2": None},
        "src",
        {line: {"payload": "eA=="}},
        {"s2": [{"id": qos0_id("s2", "m9"), "message_id": "m9", "subscription": "a/#", "x": 1}]},
        {"s1": Given("src", "0000-00", (item,))},
        stream="shoal-orders-1",
    )
    back = PushWork.parse(work.body())
    assert back.sessions == {"s1": "c1", "s2": None}
    assert back.source == "src"
    assert back.stream == "shoal-orders-1"
    assert PushWork({"s1": None}).body() == PushWork.parse(PushWork({"s1": None}).body()).body()
    assert PushWork.parse(PushWork({"s1": None}).body()).stream is None
    assert back.lines == {line: {"payload": "eA=="}}
    assert back.direct == work.direct
    [given] = back.given.values()
    assert (given.source, given.after) == ("src", "0000-00")
    assert [i.key for i in given.items] == [item.key]
    assert given.items[0].messages[0].position == "0001-00"


def _connection(connection_id: str, session_id: str = "s1") -> Connection:
    return Connection(connection_id, "alice", "sub-1", "ch-1", session_id, 7, 123)


class _Unread:
    """A delivery service whose batch read finds nothing (each get would read its own)."""

    groups = None

    def read_sessions(self, pairs: Any) -> dict[str, Any]:
        return {}


def _carried_batch(sessions: list[str]) -> PushWork:
    """A push work naming ``sessions``, each with its connection carried (none read)."""
    return PushWork(
        dict.fromkeys(sessions, "alice"),
        connections={s: _connection(f"k-{s}", s) for s in sessions},
    )


def test_a_work_message_carries_the_connections_read_for_its_sessions() -> None:
    work = PushWork({"s1": "alice", "s2": None}, connections={"s1": _connection("k1")})
    back = PushWork.parse(work.body())
    assert back.connections == {"s1": _connection("k1")}
    assert back.sessions == {"s1": "alice", "s2": None}


def test_a_connection_carried_by_every_record_of_a_session_is_not_read_again() -> None:
    # Given a batch whose two records name s1, each with the connection the router read
    works: list[PushWork | None] = [
        PushWork({"s1": "alice"}, connections={"s1": _connection("k1")}),
        None,  # a record that could not be read
        PushWork({"s1": "alice", "s2": None}, connections={"s1": _connection("k2")}),
    ]
    # Then the pusher takes the latest for s1 and reads s2's, which came without one
    assert _carried(works, {"s1", "s2"}) == {"s1": _connection("k2")}


def test_a_session_named_once_without_a_connection_has_its_connection_read() -> None:
    # Given a record carrying s1's connection as the router read it, and a later one naming
    # s1 without (a reconnect's own push: it may follow a newer connection)
    works: list[PushWork | None] = [
        PushWork({"s1": "alice"}, connections={"s1": _connection("k1")}),
        PushWork({"s1": None}),
    ]
    # Then the pusher reads s1's connection
    assert _carried(works, {"s1"}) == {}


@pytest.mark.parametrize("body", ['{"v": 2, "s": []}', "[]", "not json"])
def test_a_body_of_another_version_is_refused(body: str) -> None:
    with pytest.raises(ValueError):
        PushWork.parse(body)


def test_a_sessions_lane_is_stable_and_spreads() -> None:
    lanes = {lane_of(f"session-{n}", 64) for n in range(2000)}
    assert lanes == set(range(64))
    # the same lane in any process: not Python's salted hash
    assert lane_of("session-1", 64) == 46  # crc32 % 64, whatever the process
    assert group_id(7) == "lane-7"


class _Sqs:
    """SendMessageBatch as SQS answers it, refusing the entries ``fail`` names once."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.fail = set(fail or ())

    def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> Any:
        self.calls.append(Entries)
        failed = [{"Id": e["Id"]} for e in Entries if e["Id"] in self.fail]
        self.fail -= {f["Id"] for f in failed}
        return {"Failed": failed} if failed else {}


def test_a_hand_off_is_a_message_a_lane_ten_a_call_and_deduplicated_by_its_key() -> None:
    sqs = _Sqs()
    queue = PushQueue(sqs, "url", 64, ManualClock(0))
    sessions = [f"session-{n}" for n in range(1000)]
    assert queue.hand_off(sessions, source="src", key="batch-1") == 64
    sent = [e for call in sqs.calls for e in call]
    assert len(sqs.calls) == 7 and all(len(call) <= 10 for call in sqs.calls)
    assert {e["MessageGroupId"] for e in sent} == {group_id(n) for n in range(64)}
    # a lane's chunk names exactly that lane's sessions
    for entry in sent:
        lane = int(entry["MessageGroupId"].split("-")[1])
        named = PushWork.parse(entry["MessageBody"]).sessions
        assert {lane_of(s, 64) for s in named} == {lane}
    # the same hand-off again (a retried router batch): the same deduplication ids
    again = _Sqs()
    PushQueue(again, "url", 64, ManualClock(0)).hand_off(sessions, source="src", key="batch-1")
    ids = [e["MessageDeduplicationId"] for call in again.calls for e in call]
    assert ids == [e["MessageDeduplicationId"] for e in sent]


def test_a_refused_entry_is_sent_again_and_a_queue_that_keeps_refusing_fails_the_hand_off() -> None:
    sqs = _Sqs(fail={"0"})
    PushQueue(sqs, "url", 4, ManualClock(0)).hand_off(["a"])
    assert [len(c) for c in sqs.calls] == [1, 1]

    class Refusing(_Sqs):
        def send_message_batch(self, QueueUrl: str, Entries: Any) -> Any:
            return {"Failed": [{"Id": e["Id"]} for e in Entries]}

    with pytest.raises(ServerBusy):
        PushQueue(Refusing(), "url", 4, ManualClock(0)).hand_off(["a"])


def test_a_lane_too_large_for_a_message_is_split_in_order() -> None:
    sqs = _Sqs()
    queue = PushQueue(sqs, "url", 1, ManualClock(0))
    sessions = {f"session-{n:06d}-" + "x" * 100: f"client-{n}" for n in range(4000)}
    assert queue.hand_off(sessions) > 1
    bodies = [e["MessageBody"] for call in sqs.calls for e in call]
    assert all(len(b) <= MAX_BODY_BYTES for b in bodies)
    # every session once, in the order the parts were sent (one group: SQS keeps it)
    named = [s for b in bodies for s in PushWork.parse(b).sessions]
    assert named == sorted(sessions)


def _mapping(report: bool = True) -> QueueMapping:
    return QueueMapping(
        "u", "arn:aws:lambda:r:1:function:f", "arn:aws:sqs:r:1:q", 10, 2, report, True
    )


@pytest.mark.parametrize(
    ("response", "done"),
    [
        (None, {"a", "b"}),
        ({}, {"a", "b"}),
        ({"batchItemFailures": []}, {"a", "b"}),
        ({"batchItemFailures": [{"itemIdentifier": "b"}]}, {"a"}),
        # a message not of the batch, or no list: the whole batch failed
        ({"batchItemFailures": [{"itemIdentifier": "z"}]}, set()),
        ({"batchItemFailures": "b"}, set()),
        ("not an object", set()),
    ],
)
def test_lambdas_partial_batch_answer(response: Any, done: set[str]) -> None:
    assert done_messages(response, ["a", "b"], report_item_failures=True) == done


def test_without_partial_answers_any_answer_finishes_the_batch() -> None:
    assert done_messages({"batchItemFailures": [{"itemIdentifier": "a"}]}, ["a"], False) == {"a"}


def test_a_mapping_of_a_queue_reads_as_lambda_lists_it() -> None:
    raw = {
        "UUID": "u1",
        "FunctionArn": "arn:aws:lambda:us-east-1:1:function:shoal-pusher",
        "EventSourceArn": "arn:aws:sqs:us-east-1:123456789012:shoal-push.fifo",
        "BatchSize": 10,
        "FunctionResponseTypes": ["ReportBatchItemFailures"],
        "ScalingConfig": {"MaximumConcurrency": 5},
        "State": "Enabled",
    }
    mapping = QueueMapping.from_api(raw, default_concurrency=8)
    assert mapping is not None
    assert mapping.queue_url == "https://sqs.us-east-1.amazonaws.com/123456789012/shoal-push.fifo"
    assert (mapping.function_name, mapping.concurrency) == ("shoal-pusher", 5)
    assert mapping.report_item_failures and mapping.enabled
    # a stream's mapping is not a queue's
    stream = {**raw, "EventSourceArn": "arn:aws:kinesis:us-east-1:1:stream/s"}
    assert QueueMapping.from_api(stream, 8) is None
    event = sqs_event(mapping, [{"MessageId": "m", "ReceiptHandle": "r", "Body": "{}"}])
    [record] = event["Records"]
    assert (record["eventSource"], record["body"], record["messageId"]) == ("aws:sqs", "{}", "m")
    assert json.loads(record["body"]) == {}


def test_the_push_parallelism_is_read_from_the_environment() -> None:
    from pydantic import ValidationError
    from shoal.core.config import DEFAULT_PUSH_PARALLELISM, Config

    assert Config.from_env({}).push.parallelism == DEFAULT_PUSH_PARALLELISM == 16
    settings = Config.from_env({"SHOAL_PUSH_PARALLELISM": "1", "SHOAL_PUSH_LANES": "8"}).push
    assert (settings.parallelism, settings.lanes) == (1, 8)
    with pytest.raises(ValidationError):
        Config.from_env({"SHOAL_PUSH_PARALLELISM": "0"})


@pytest.mark.parametrize("parallelism", [1, 4])
def test_a_batchs_pushes_run_on_at_most_parallelism_threads(parallelism: int) -> None:
    """``PushWorker._each``: at parallelism 1 (``shoal dev``'s) one thread takes the batch's
    pushes in order; otherwise up to that many side by side. Every push's step runs even when
    another's raised, and a failure is raised after them all."""
    import threading

    from shoal.edge.push import PushWorker

    placeholder: Any = None
    worker = PushWorker(placeholder, placeholder, placeholder, parallelism=parallelism)
    ran: list[tuple[int, str]] = []
    lock = threading.Lock()

    def step(push: Any) -> None:
        with lock:
            ran.append((push, threading.current_thread().name))
        if push in (2, 5):
            raise RuntimeError(f"push {push}")

    pushes: Any = list(range(8))
    with pytest.raises(RuntimeError, match="push 2"):
        worker._each(step, pushes)
    assert sorted(n for n, _ in ran) == list(range(8))
    threads = {name for _, name in ran}
    assert all(name.startswith("shoal-push") for name in threads)
    assert len(threads) <= parallelism
    if parallelism == 1:
        assert [n for n, _ in ran] == list(range(8))


def test_shoal_dev_pushes_four_sessions_at_a_time_unless_told_otherwise(tmp_path: Any) -> None:
    """The local runtime's pushers run 4 threads an invocation (``LOCAL_PUSH_PARALLELISM``: in
    one process more threads claim more of the GIL, not more CPU); a value in the environment
    wins."""
    import os

    from shoal.local.runtime import LOCAL_PUSH_PARALLELISM, DevOptions, LocalRuntime

    runtime = LocalRuntime(DevOptions(port=0, state_dir=tmp_path))
    saved = dict(os.environ)
    try:
        os.environ.pop("SHOAL_PUSH_PARALLELISM", None)
        runtime._set_environment("http://127.0.0.1:1", "http://127.0.0.1:2")
        assert os.environ["SHOAL_PUSH_PARALLELISM"] == str(LOCAL_PUSH_PARALLELISM) == "4"
        os.environ["SHOAL_PUSH_PARALLELISM"] = "3"
        runtime._set_environment("http://127.0.0.1:1", "http://127.0.0.1:2")
        assert os.environ["SHOAL_PUSH_PARALLELISM"] == "3"
    finally:
        # the runtime sets the whole process's environment (endpoints among it): all of it back
        os.environ.clear()
        os.environ.update(saved)


def test_the_members_a_batchs_gets_hand_streams_to_are_handed_off_from_any_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HandOffs`` keeps the invocation's notes, not a thread's: a batch of several sessions
    runs its gets on the pusher's threads (``shoal.core.pools``), and the members those gets
    hand shared-group streams to reach the push queue at the batch's end. A thread's local
    hid them from the flush, and the lanes waited for the group's next message."""
    from shoal.edge.push import PushWorker

    handed: list[set[str]] = []

    class Queue:
        def hand_off(self, sessions: Any, **_: Any) -> int:
            handed.append(set(sessions))
            return 1

    placeholder: Any = None
    worker = PushWorker(placeholder, placeholder, _Unread(), Queue(), parallelism=4)  # type: ignore[arg-type]

    def push(pushes: list[Any]) -> None:
        # each get hands a stream of its group to another member, on whichever thread it ran
        worker._each(lambda p: worker.hand_offs.note({f"member-of-{p.session_id}"}), pushes)

    monkeypatch.setattr(worker, "_push", push)
    sessions = [f"s{n}" for n in range(8)]
    assert worker.work([_carried_batch(sessions)]) == set()
    assert handed == [{f"member-of-{s}" for s in sessions}]
    # and a second batch on this thread hands off only its own
    assert worker.work([PushWork({"s1": "alice"}, connections={"s1": _connection("k")})]) == set()
    assert handed[1:] == [{"member-of-s1"}]


def test_the_last_report_is_the_whole_one_of_the_batch_that_finished_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PushWorker.last``: ``shoal dev`` runs pusher batches side by side on one worker, so a
    batch that began and ended while another ran must not leave its report there after the
    other finished (it was set when a batch began, and the longer batch's figures went to a
    report nobody read)."""
    import threading

    from shoal.edge.push import PushWorker

    placeholder: Any = None
    worker = PushWorker(placeholder, placeholder, _Unread(), None, parallelism=2)  # type: ignore[arg-type]
    inner = PushWork({"s9": "alice"}, connections={"s9": _connection("k-s9", "s9")})

    def push(pushes: list[Any]) -> None:
        if len(pushes) > 1:
            # another invocation's batch, begun and done while this one pushes
            side = threading.Thread(target=worker.work, args=([inner],))
            side.start()
            side.join()
            assert worker.last.sessions == 1

    monkeypatch.setattr(worker, "_push", push)
    assert worker.work([_carried_batch([f"s{n}" for n in range(3)])]) == set()
    assert worker.last.sessions == 3
    assert worker.last.skipped == 0
