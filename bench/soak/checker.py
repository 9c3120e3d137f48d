"""The soak's checker: each promise of the contract stated as a property of a whole history.

``python -m bench.soak.checker HISTORY`` (a folder of ``bench.soak.history`` files, or one file)
prints the report and exits 1 when any property is violated. Nothing here runs during the
soak: the history is read afterwards, as Jepsen's checkers read theirs, and every verdict names
the records that show it.

Time. Every record's ``t`` is the one machine's wall clock. An operation is a pair of records,
invoked and answered; two operations are ordered only when one was answered before the other
was invoked (real-time order), anything else is concurrent and either outcome is allowed. An
operation never answered may or may not have happened. A property is judged only where the
history decides it; the rest is counted as undecided, never as a pass or a failure.

The properties (``/work/shared/API.md`` is the contract; docs/design.md says how):

- ``lost``: a publish answered success (201, or 200 ``duplicate``), of QoS 1 or 2, whose topic
  matches a subscription that was answered before the publish was first invoked and that was
  held to the end of the run (never unsubscribed, the session never lost), is delivered to that
  session at least once (DESIGN.md property 1). For a shared group: to one of its members, if
  the group had a member throughout; a QoS 2 message whose member left the group before acking
  it is *dropped*, as [MQTT-4.8.2-5] and Shoal's design say, and counted, not lost; so is one
  the service archived as ``dropped`` (reason ``session_ended``) for that group when no member
  recorded it (the driver's ``server_drops`` record: the answer that carried it was lost).
- ``duplicate_after_ack``: an ack the server answered as counting every id it named is never
  followed by a delivery of one of those ids (or of their messages) to that session (API.md:
  "an acked id is never delivered again to that session"), nor, for a shared group, to another
  member. "Followed": a long poll sent after the ack's answer; a WebSocket connection opened
  after it; or a push received more than ``ack_race_s`` after it on the same connection (a
  push decided before the ack committed can still be on its way: counted apart as a race).
  A retained copy a new subscribe asks for is a new delivery, not a duplicate.
- ``dup_flag``: a delivery id delivered again carries ``dup`` ([MQTT-3.3.1-1]); so does a group
  message handed to another member (its hand-off, docs/design.md "Hand-off").
- ``qos0_twice``: a QoS 0 delivery comes at most once (API.md; [MQTT-4.3.1]).
- ``order``: per ordering key (within its composite topic), the first deliveries of messages to
  one subscription of one session follow publish order (DESIGN.md property 3); for a shared
  subscription that is per member, the holder of the key's lane. Publish order: a publish
  answered before another was invoked, and one publisher's accepted sequence numbers. A
  message first seen with ``dup`` was handed out before, unseen (a long poll's answer lost, a
  push to a connection that dropped): where it stood is unknown, so it is left out.
- ``qos2_member``: a QoS 2 message of a shared group goes to one member only
  ([MQTT-4.8.2-4/5]; API.md "it never goes to another member").
- ``subscription_start``: a message whose publish was answered before a subscription was made
  never reaches it, except as the retained copy a non-shared subscribe asks for (API.md "A
  subscription starts where it was made"); a group's start is its first member's subscribe.
- ``retained_current``: the retained copy a subscribe gets is the topic's newest: not one that
  another retained publish had replaced before the subscribe was invoked ([MQTT-3.3.1-5]).
- ``session_kept``: a connect that resumes (``clean_start`` false) a session that cannot have
  expired answers ``session_present`` true ([MQTT-3.2.2-3]).
- ``will``: a connection's will message is published exactly when MQTT 5 says. Published at
  most once ([MQTT-3.1.2-10]); never after a normal DISCONNECT the server answered
  ([MQTT-3.1.2-8], [MQTT-3.1.2-10]); never when a new connection of the client id was opened
  before the will delay ran out from the connection's close ([MQTT-3.1.3-9], §3.1.3.2.2);
  never before its delay ran out from the earliest moment the server could call the
  connection closed (§3.1.3.2.2); and published when the connection was lost without a
  DISCONNECT (§3.1.2.5: dropped, a client killed, keep-alive expiry [MQTT-3.1.2-24]) and no new
  connection came within the delay ([MQTT-3.1.2-8]), or at once when a new connection took the
  session over from a live connection with no delay ([MQTT-3.1.4-3], §3.1.3.2.2). The delay is
  the smaller of the will delay and the session expiry (§3.1.3.2.2). A connection that a kill
  of the server cut is judged only on at-most-once: MQTT lets a failed server publish its
  wills after it restarts (§3.1.2.5). When the server calls an HTTP channel closed: after
  1.5 keep-alives without a call of the channel ([MQTT-3.1.2-24]); Shoal refreshes a channel's
  last call only once half a keep-alive has passed (docs/design.md "Sessions"), so the earliest
  close counted is one keep-alive after the last call. An HTTP connect answered more than
  1.5 keep-alives after it was sent was tried more than once, and an earlier try may have
  registered a channel whose answer was lost: silent from its start, it is lost after its
  keep-alive with the same will. A will of such a connect published no sooner than a
  keep-alive (plus the delay) after the connect was sent is that channel's, allowed
  (``_unseen_channel``; counted ``wills_of_unseen_channels``).
- ``push``: for a push subscription, the messages delivered to its endpoint (a 2xx answer)
  and those in its dead-letter queue at the end are the messages published to its filter since
  it was made: none missing, none in both, none that were never published; a message the
  endpoint always refuses is dead-lettered, one it takes in the end is delivered unless an
  earlier message of its ordering key was dead-lettered (an ordered subscription keeps the key
  behind it); and per ordering key the first 2xx deliveries follow publish order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.groups.records import group_key

from bench.soak.history import Record, read_history

PROPERTIES = (
    "lost",
    "duplicate_after_ack",
    "dup_flag",
    "qos0_twice",
    "order",
    "qos2_member",
    "subscription_start",
    "retained_current",
    "session_kept",
    "will",
    "push",
)
#: a push decided before an ack committed may reach the client this long after the ack's
#: answer on the same connection (a frame queued, a post retried after a 429)
ACK_RACE_S = 5.0
#: how long after its earliest due time a will may take to be seen (the reaper's period comes
#: from the history's start record; this is on top: the publish, routing, the delivery)
WILL_GRACE_S = 20.0
#: how long a WebSocket close takes to reach the server (its ``$disconnect``)
CLOSE_SLACK_S = 5.0
#: the server's ``published_at`` is whole milliseconds
CLOCK_TOLERANCE_S = 0.05
#: records shown per violation, and violations listed per property
SHOWN_RECORDS = 8
SHOWN_VIOLATIONS = 20


@dataclass
class Violation:
    property: str
    summary: str
    records: list[Record] = field(default_factory=list)


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_property(self) -> dict[str, list[Violation]]:
        found: dict[str, list[Violation]] = {name: [] for name in PROPERTIES}
        for violation in self.violations:
            found.setdefault(violation.property, []).append(violation)
        return found

    def add(self, prop: str, summary: str, *records: Record | None) -> None:
        shown = [r for r in records if r is not None][:SHOWN_RECORDS]
        self.violations.append(Violation(prop, summary, shown))

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def render(self) -> str:
        lines = [f"verdict: {'PASS' if self.ok else 'FAIL'}", ""]
        grouped = self.by_property()
        for name in PROPERTIES:
            found = grouped.get(name, [])
            lines.append(f"- {name}: {len(found)} violation(s)")
        lines.append("")
        lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())))
        for note in self.notes:
            lines.append(f"note: {note}")
        for name, found in grouped.items():
            if not found:
                continue
            lines += ["", f"## {name} ({len(found)})"]
            for violation in found[:SHOWN_VIOLATIONS]:
                lines.append(f"* {violation.summary}")
                lines += [f"    {_brief(r)}" for r in violation.records]
            if len(found) > SHOWN_VIOLATIONS:
                lines.append(f"* ... and {len(found) - SHOWN_VIOLATIONS} more")
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        grouped = self.by_property()
        return {
            "ok": self.ok,
            "violations": {name: len(found) for name, found in grouped.items()},
            "counts": dict(sorted(self.counts.items())),
            "notes": list(self.notes),
            "examples": {
                name: [{"summary": v.summary, "records": v.records} for v in found[:3]]
                for name, found in grouped.items()
                if found
            },
        }


def _brief(record: Record) -> str:
    return json.dumps(record, separators=(",", ":"), sort_keys=False, default=str)


# -- topics -----------------------------------------------------------------------------------


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching (§4.7), written here rather than taken from the library under test;
    a ``$share/{name}/`` prefix is stripped, and wildcards at the first level never match a
    ``$``-topic ([MQTT-4.7.2-1])."""
    if topic_filter.startswith("$share/"):
        topic_filter = topic_filter.split("/", 2)[2]
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("#", "+"):
        return False
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(t_levels):
            return False
        if level != "+" and level != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def _shared(subscription: str | None) -> bool:
    return bool(subscription) and str(subscription).startswith("$share/")


# -- the history's model ----------------------------------------------------------------------


@dataclass
class Publish:
    mk: str
    topic: str = ""
    qos: int = 1
    retain: bool = False
    key: str = ""
    explicit_key: bool = False
    pub: str | None = None
    seq: int | None = None
    invokes: list[Record] = field(default_factory=list)
    oks: list[Record] = field(default_factory=list)
    fails: list[Record] = field(default_factory=list)

    @property
    def first_invoke(self) -> float:
        return float(self.invokes[0]["t"]) if self.invokes else float("inf")

    @property
    def first_ok(self) -> float | None:
        return float(self.oks[0]["t"]) if self.oks else None

    @property
    def acked(self) -> bool:
        return bool(self.oks)


@dataclass
class Interval:
    """One client's subscription to one filter, from its subscribe to its end."""

    client: str
    filter: str
    qos: int
    invoke: Record
    ok: Record | None = None
    #: when it stopped being owed anything: an unsubscribe invoked, a session lost
    end: float | None = None
    end_record: Record | None = None
    #: when it was certainly gone: its unsubscribe answered
    gone: float | None = None


@dataclass
class Delivery:
    record: Record
    client: str

    @property
    def t(self) -> float:
        return float(self.record["t"])

    @property
    def mk(self) -> str | None:
        value = self.record.get("mk")
        return str(value) if value is not None else None

    @property
    def sub(self) -> str:
        return str(self.record.get("sub") or "")


@dataclass
class Ack:
    invoke: Record
    answer: Record | None = None

    @property
    def confirmed(self) -> bool:
        """Answered as counting every id it named (an ack of a lease the member lost counts
        nothing; which of several ids counted is not said, so a partial count confirms none)."""
        if self.answer is None or self.answer.get("phase") != "ok":
            return False
        ids = set(self.invoke.get("ids") or [])
        return bool(ids) and int(self.answer.get("acked", -1)) >= len(ids)


@dataclass
class Connection:
    client: str
    conn: str
    transport: str
    invoke: Record
    ok: Record | None = None
    fail: Record | None = None
    records: list[Record] = field(default_factory=list)


class Model:
    """The history read into publishes, subscriptions, deliveries, acks and connections."""

    def __init__(self, records: Sequence[Record]) -> None:
        self.records = list(records)
        self.start: Record | None = None
        self.traffic_end: float | None = None
        #: when the driver stopped waiting for deliveries (the ``drained`` phase): a publish
        #: first answered after it could reach no subscriber any more (its clients stop)
        self.drained: float | None = None
        self.end: float = max((float(r["t"]) for r in records), default=0.0)
        self.composites: set[str] = set()
        self.publishes: dict[str, Publish] = {}
        self.intervals: dict[tuple[str, str], list[Interval]] = defaultdict(list)
        #: every subscribe invoked, per (client, filter): each asks for the retained messages
        #: again (retain handling 0), a subscribe again while subscribed too
        self.subscribes: dict[tuple[str, str], list[Record]] = defaultdict(list)
        self.deliveries: dict[str, list[Delivery]] = defaultdict(list)
        self.acks: dict[str, list[Ack]] = defaultdict(list)
        self.connections: dict[str, Connection] = {}
        self.client_connections: dict[str, list[Connection]] = defaultdict(list)
        self.faults: list[Record] = []
        #: every connection's (WebSocket connection's or HTTP channel's) first frame or call
        self.conn_opened: dict[str, float] = {}
        #: each client's answered calls and deliveries: when it last heard from its session
        self.heard: dict[str, list[float]] = defaultdict(list)
        self.lost: dict[str, Record] = {}
        self.disconnects: dict[str, list[Record]] = defaultdict(list)
        self.heartbeats: dict[str, list[Record]] = defaultdict(list)
        self.push_subs: dict[str, list[Record]] = defaultdict(list)
        self.push_hits: list[Record] = []
        self.push_final: dict[str, Record] = {}
        #: (group key, message id) of each QoS 2 delivery the service archived as dropped
        #: because its member's session ended or left ([MQTT-4.8.2-5])
        self.server_dropped: set[tuple[str, str]] = set()
        self._read()

    def setting(self, name: str, default: float) -> float:
        if self.start is not None and self.start.get(name) is not None:
            return float(self.start[name])
        return default

    def composite_of(self, topic: str) -> str:
        first = topic.split("/", 1)[0]
        return first if first in self.composites else "default"

    def _read(self) -> None:
        acks_by_rq: dict[tuple[str, str], Ack] = {}
        for record in self.records:
            op = record["op"]
            client = str(record.get("client", ""))
            if client and (op == "deliver" or record.get("phase") == "ok"):
                self.heard[client].append(float(record["t"]))
            if op == "phase":
                if record.get("name") == "start" and self.start is None:
                    self.start = record
                elif record.get("name") == "traffic_end":
                    self.traffic_end = float(record["t"])
                elif record.get("name") == "drained":
                    self.drained = float(record["t"])
            elif op == "topic" and record.get("action") == "create":
                self.composites.add(str(record["name"]))
            elif op == "publish":
                self._publish(record)
            elif op in ("subscribe", "unsubscribe"):
                self._subscription(record)
            elif op == "deliver":
                self.deliveries[client].append(Delivery(record, client))
            elif op == "ack":
                key = (client, str(record.get("rq")))
                if record.get("phase") == "invoke":
                    ack = Ack(record)
                    acks_by_rq[key] = ack
                    self.acks[client].append(ack)
                elif key in acks_by_rq and acks_by_rq[key].answer is None:
                    acks_by_rq[key].answer = record
            elif op in ("connect", "renew"):
                self._connection(record)
            elif op == "disconnect":
                self.disconnects[str(record.get("conn"))].append(record)
            elif op == "heartbeat":
                self.heartbeats[str(record.get("conn"))].append(record)
            elif op == "lost":
                self.lost.setdefault(str(record.get("conn")), record)
            elif op == "fault":
                self.faults.append(record)
            elif op == "push_sub":
                self.push_subs[str(record.get("name"))].append(record)
            elif op == "push_hit":
                self.push_hits.append(record)
            elif op == "push_final":
                self.push_final[str(record.get("name"))] = record
            elif op == "server_drops":
                self.server_dropped |= {
                    (str(e.get("consumer")), str(e.get("message_id")))
                    for e in record.get("events") or []
                    if e.get("reason") == "session_ended"
                }
        for deliveries in self.deliveries.values():
            deliveries.sort(key=lambda d: (d.record["w"], d.record["life"], d.record["n"]))

    def _publish(self, record: Record) -> None:
        mk = record.get("mk")
        if mk is None:
            return
        publish = self.publishes.setdefault(str(mk), Publish(str(mk)))
        phase = record.get("phase")
        if phase == "invoke":
            if not publish.invokes:
                publish.topic = str(record["topic"])
                publish.qos = int(record.get("qos", 1))
                publish.retain = bool(record.get("retain", False))
                given = record.get("key")
                publish.explicit_key = given is not None
                publish.key = str(given) if given is not None else publish.topic
                publish.pub = record.get("pub")
            publish.invokes.append(record)
        elif phase == "ok":
            if not publish.oks:
                publish.seq = record.get("seq")
            publish.oks.append(record)
        elif phase == "fail":
            publish.fails.append(record)

    def _subscription(self, record: Record) -> None:
        client = str(record.get("client"))
        phase = record.get("phase")
        if record["op"] == "subscribe":
            items = record.get("filters") or []
            if phase == "invoke":
                for item in items:
                    name, qos = str(item["filter"]), int(item.get("qos", 1))
                    self.subscribes[(client, name)].append(record)
                    held = self._open(client, name)
                    if held is None:
                        self.intervals[(client, name)].append(Interval(client, name, qos, record))
            elif phase == "ok":
                granted = list(record.get("granted") or [])
                for i, item in enumerate(items):
                    name = str(item["filter"])
                    held = self._open(client, name)
                    if held is None:
                        continue
                    outcome = granted[i] if i < len(granted) else None
                    if isinstance(outcome, int) and not isinstance(outcome, bool):
                        if held.ok is None:
                            held.ok = record
                            held.qos = min(held.qos, outcome)
                    elif held.ok is None:
                        # refused: never made
                        self.intervals[(client, name)].remove(held)
        elif phase == "invoke":
            for name in record.get("filters") or []:
                held = self._open(client, str(name))
                if held is not None:
                    held.end, held.end_record = float(record["t"]), record
        elif phase == "ok":
            for name in record.get("filters") or []:
                intervals = self.intervals.get((client, str(name)))
                if intervals and intervals[-1].end is not None and intervals[-1].gone is None:
                    intervals[-1].gone = float(record["t"])

    def _open(self, client: str, name: str) -> Interval | None:
        intervals = self.intervals.get((client, name))
        if intervals and intervals[-1].end is None:
            return intervals[-1]
        return None

    def _connection(self, record: Record) -> None:
        conn = str(record.get("conn"))
        phase = record.get("phase")
        if phase == "invoke":
            self.conn_opened.setdefault(conn, float(record["t"]))
            if record["op"] == "renew":
                return
            connection = Connection(
                str(record.get("client")), conn, str(record.get("transport", "")), record
            )
            self.connections[conn] = connection
            self.client_connections[connection.client].append(connection)
        elif conn in self.connections:
            connection = self.connections[conn]
            if phase == "ok" and connection.ok is None and record["op"] == "connect":
                connection.ok = record
                if not record.get("session_present"):
                    # a session that is new or was lost holds no subscriptions: whatever the
                    # client subscribed before is owed nothing from here on
                    began = float(connection.invoke["t"])
                    for (client, _), intervals in self.intervals.items():
                        held = intervals[-1]
                        if (
                            client == connection.client
                            and held.end is None
                            and float(held.invoke["t"]) < began
                        ):
                            held.end, held.end_record = began, record
            elif phase == "fail" and connection.ok is None:
                connection.fail = record

    # -- derived --

    def server_down(self) -> list[tuple[float, float]]:
        """(killed, up again) of every kill of the server."""
        spans: list[tuple[float, float]] = []
        killed: float | None = None
        for fault in self.faults:
            if fault.get("kind") == "server_kill":
                killed = float(fault["t"])
            elif fault.get("kind") == "server_up" and killed is not None:
                spans.append((killed, float(fault["t"])))
                killed = None
        if killed is not None:
            spans.append((killed, self.end))
        return spans

    def kills_of(self, client: str) -> list[Record]:
        return [
            f
            for f in self.faults
            if f.get("kind") == "client_kill" and client in (f.get("clients") or [])
        ]


# -- the checker ------------------------------------------------------------------------------


def check(
    records: Iterable[Record],
    *,
    ack_race_s: float = ACK_RACE_S,
    will_grace_s: float = WILL_GRACE_S,
    torn: int = 0,
) -> Report:
    """Judge a history (records in any order: they are sorted by time here)."""
    ordered = sorted(records, key=lambda r: (float(r["t"]), r.get("w", ""), r.get("n", 0)))
    model = Model(ordered)
    report = Report()
    if torn:
        report.notes.append(f"{torn} torn line(s) skipped (a writer killed mid-line)")
    _counts(model, report)
    _lost(model, report)
    _duplicates_after_ack(model, report, ack_race_s)
    _dup_flags(model, report)
    _order(model, report)
    _qos2_member(model, report)
    _subscription_start(model, report)
    _retained_current(model, report)
    _session_kept(model, report)
    _wills(model, report, will_grace_s)
    _push(model, report)
    return report


def _counts(model: Model, report: Report) -> None:
    report.counts["published"] = len(model.publishes)
    report.counts["publishes_acked"] = sum(1 for p in model.publishes.values() if p.acked)
    report.counts["deliveries"] = sum(len(d) for d in model.deliveries.values())
    report.counts["acks"] = sum(len(a) for a in model.acks.values())
    report.counts["connections"] = len(model.connections)
    for fault in model.faults:
        report.count(f"fault_{fault.get('kind')}")


def _acked_by_topic(model: Model, report: Report | None = None) -> dict[str, list[Publish]]:
    """Publishes answered success, of QoS 1 or 2, by topic (a filter is matched once a topic).
    Not one first answered after the drain: the run no longer waited for its deliveries (a
    publisher's retry that got through while the clients were being stopped), so it is owed
    to no one; counted ``acked_after_drain``."""
    by_topic: dict[str, list[Publish]] = defaultdict(list)
    for publish in model.publishes.values():
        if not publish.acked or publish.qos < 1:
            continue
        if (
            model.drained is not None
            and publish.first_ok is not None
            and publish.first_ok > model.drained
        ):
            if report is not None:
                report.count("acked_after_drain")
            continue
        by_topic[publish.topic].append(publish)
    return by_topic


def _owed(by_topic: dict[str, list[Publish]], name: str, since: float) -> Iterable[Publish]:
    for topic, publishes in by_topic.items():
        if matches(name, topic):
            yield from (p for p in publishes if p.first_invoke > since)


def _ack_sent(model: Model, clients: Iterable[str]) -> set[str]:
    """The delivery ids some ack of these clients named (sent, answered or not)."""
    return {i for c in clients for a in model.acks.get(c, []) for i in a.invoke.get("ids") or []}


def _lost(model: Model, report: Report) -> None:
    by_topic = _acked_by_topic(model, report)
    for (client, name), intervals in model.intervals.items():
        if name.startswith("$share/"):
            continue
        got: dict[str, list[Delivery]] = defaultdict(list)
        for delivery in model.deliveries.get(client, []):
            if delivery.mk is not None and delivery.sub == name:
                got[delivery.mk].append(delivery)
        acked_ids = _ack_sent(model, [client])
        for interval in intervals:
            if interval.ok is None or interval.end is not None or interval.qos < 1:
                continue
            for publish in _owed(by_topic, name, float(interval.ok["t"])):
                report.count("owed_session")
                _judge_owed(
                    report,
                    publish=publish,
                    deliveries=got.get(publish.mk, []),
                    acked_ids=acked_ids,
                    who=client,
                    name=name,
                )
    _lost_in_groups(model, report, by_topic)


def _judge_owed(
    report: Report,
    *,
    publish: Publish,
    deliveries: list[Delivery],
    acked_ids: set[str],
    who: str,
    name: str,
) -> None:
    """An owed message: delivered, and then named by an ack (one never acked is still in
    flight at the server, so it must come again until one is: a message delivered once to a
    client killed before its ack, and never again, is lost)."""
    if not deliveries:
        report.add(
            "lost",
            f"{publish.mk} ({publish.topic}, QoS {publish.qos}) never reached {who} under {name}",
            publish.invokes[0],
            publish.oks[0],
        )
    elif not any(str(d.record.get("id")) in acked_ids for d in deliveries):
        report.add(
            "lost",
            f"{publish.mk} ({publish.topic}) reached {who} under {name} but never again after "
            "it went unacked",
            publish.oks[0],
            *[d.record for d in deliveries],
        )


def _groups(model: Model) -> dict[str, list[Interval]]:
    groups: dict[str, list[Interval]] = defaultdict(list)
    for (_, name), intervals in model.intervals.items():
        if name.startswith("$share/"):
            groups[name] += intervals
    return groups


def _covered_from(intervals: list[Interval], end: float) -> float | None:
    """The earliest time from which some member (answered) held the group without a gap up to
    ``end``, or None if no member held it at the end."""
    spans = sorted(
        (float(i.ok["t"]), i.end if i.end is not None else float("inf"))
        for i in intervals
        if i.ok is not None
    )
    start: float | None = None
    reach = float("-inf")
    for begin, finish in spans:
        if begin > reach:
            start = begin  # a gap before this span: the cover starts again here
        reach = max(reach, finish)
    return start if reach >= end else None


def _group_deliveries(model: Model, name: str, members: Iterable[str]) -> list[Delivery]:
    return [d for m in members for d in model.deliveries.get(m, []) if d.sub == name and d.mk]


def _lost_in_groups(model: Model, report: Report, by_topic: dict[str, list[Publish]]) -> None:
    for name, intervals in _groups(model).items():
        since = _covered_from(intervals, model.end)
        if since is None:
            report.notes.append(f"{name} had no member at the end: its losses not judged")
            continue
        members = {i.client for i in intervals}
        got: dict[str, list[Delivery]] = defaultdict(list)
        for delivery in _group_deliveries(model, name, members):
            got[str(delivery.mk)].append(delivery)
        acked_ids = _ack_sent(model, members)
        least_qos = min(i.qos for i in intervals if i.ok is not None)
        if least_qos < 1:
            continue
        for publish in _owed(by_topic, name, since):
            report.count("owed_group")
            deliveries = got.get(publish.mk, [])
            if publish.qos == 2 and deliveries and _left_holding(intervals, deliveries[0]):
                # a QoS 2 message stays with its member, and goes when that member leaves
                # ([MQTT-4.8.2-5]; docs/design.md, "QoS 2 stays with its member")
                report.count("qos2_dropped_on_leave")
                continue
            if publish.qos == 2 and not deliveries and _dropped_by_service(model, name, publish):
                # the same, with the delivery its member's client never recorded (its answer
                # lost to a kill): the service's archived ``dropped`` event says so
                report.count("qos2_dropped_unseen")
                continue
            _judge_owed(
                report,
                publish=publish,
                deliveries=deliveries,
                acked_ids=acked_ids,
                who="any member",
                name=name,
            )


def _dropped_by_service(model: Model, name: str, publish: Publish) -> bool:
    if not model.server_dropped:
        return False
    share, _, topic_filter = name.removeprefix("$share/").partition("/")
    key = group_key(share, topic_filter)
    return any((key, str(ok.get("message_id"))) in model.server_dropped for ok in publish.oks)


def _left_holding(intervals: list[Interval], first: Delivery) -> bool:
    return any(
        i.client == first.client and i.end is not None and i.end >= first.t for i in intervals
    )


def _confirmed_acks(model: Model, client: str) -> list[tuple[Ack, float, set[str]]]:
    """(ack, when answered, the ids it counted) of every confirmed ack of ``client``."""
    out = []
    for ack in model.acks.get(client, []):
        if ack.confirmed:
            assert ack.answer is not None
            out.append((ack, float(ack.answer["t"]), set(ack.invoke.get("ids") or [])))
    return out


def _after_ack(delivery: Delivery, acked_at: float, model: Model, ack_race_s: float) -> str:
    """Whether ``delivery`` came after an ack answered at ``acked_at``: 'after', 'race' (a push
    on a connection open before, within ``ack_race_s``) or '' (concurrent or before)."""
    record = delivery.record
    if record.get("transport") == "http":
        sent = record.get("ti")
        return "after" if float(sent if sent is not None else record["t"]) > acked_at else ""
    if delivery.t <= acked_at:
        return ""
    opened = model.conn_opened.get(str(record.get("conn")))
    if opened is not None and opened > acked_at:
        return "after"
    return "after" if delivery.t > acked_at + ack_race_s else "race"


def _duplicates_after_ack(model: Model, report: Report, ack_race_s: float) -> None:
    races = 0
    # each group's deliveries by message, over its members
    in_group: dict[tuple[str, str], list[Delivery]] = defaultdict(list)
    for name, intervals in _groups(model).items():
        for delivery in _group_deliveries(model, name, {i.client for i in intervals}):
            in_group[(name, str(delivery.mk))].append(delivery)
    for client, deliveries in model.deliveries.items():
        by_id: dict[str, list[Delivery]] = defaultdict(list)
        by_message: dict[tuple[str, str], list[Delivery]] = defaultdict(list)
        for delivery in deliveries:
            by_id[str(delivery.record.get("id"))].append(delivery)
            if delivery.mk is not None and not delivery.record.get("retain"):
                by_message[(delivery.sub, delivery.mk)].append(delivery)
        for ack, acked_at, ids in _confirmed_acks(model, client):
            named = [d for i in ids for d in by_id.get(i, [])[:1]]
            suspects = {id(d): d for i in ids for d in by_id.get(i, [])}
            for d in named:
                if d.mk is not None:
                    suspects.update({id(x): x for x in by_message.get((d.sub, d.mk), [])})
            for delivery in suspects.values():
                when = _after_ack(delivery, acked_at, model, ack_race_s)
                if when == "race":
                    races += 1
                elif when == "after":
                    report.add(
                        "duplicate_after_ack",
                        f"{client} got {delivery.mk} ({delivery.record.get('id')}) again after "
                        "its ack was answered",
                        ack.invoke,
                        ack.answer,
                        delivery.record,
                    )
            # a group's message acked by one member reaches no other member afterwards
            for d in named:
                if not _shared(d.sub) or d.mk is None:
                    continue
                for delivery in in_group.get((d.sub, d.mk), []):
                    if delivery.client == client:
                        continue
                    when = _after_ack(delivery, acked_at, model, ack_race_s)
                    if when == "race":
                        races += 1
                    elif when == "after":
                        report.add(
                            "duplicate_after_ack",
                            f"{delivery.client} got {delivery.mk} of {d.sub} after {client}'s "
                            "ack of it was answered",
                            ack.invoke,
                            ack.answer,
                            delivery.record,
                        )
    report.counts["ack_races"] = races


def _dup_flags(model: Model, report: Report) -> None:
    for client, deliveries in model.deliveries.items():
        seen: dict[str, Delivery] = {}
        seen_qos0: dict[str, Delivery] = {}
        for delivery in deliveries:
            record = delivery.record
            delivery_id = str(record.get("id"))
            if int(record.get("qos", 1)) == 0:
                key = delivery.mk if delivery.mk and not record.get("retain") else delivery_id
                if key in seen_qos0:
                    report.add(
                        "qos0_twice",
                        f"{client} got QoS 0 {delivery.mk} twice",
                        seen_qos0[key].record,
                        record,
                    )
                seen_qos0[key] = delivery
                continue
            if delivery_id in seen and not record.get("dup"):
                report.add(
                    "dup_flag",
                    f"{client} got delivery {delivery_id} again without dup",
                    seen[delivery_id].record,
                    record,
                )
            seen.setdefault(delivery_id, delivery)
    # a group's message handed to another member is a redelivery: one member at most gets it
    # without dup (the first it was handed to). Not judged by when the members got it: a
    # first hand-out's frame can reach its member after another member's redelivery (its push
    # posted late, under load), so the first received need not be the first handed out
    for name, intervals in _groups(model).items():
        group = sorted(
            _group_deliveries(model, name, {i.client for i in intervals}), key=lambda d: d.t
        )
        fresh: dict[str, Delivery] = {}
        for delivery in group:
            if delivery.record.get("dup") or int(delivery.record.get("qos", 1)) == 0:
                continue
            held = fresh.setdefault(str(delivery.mk), delivery)
            if held.client != delivery.client:
                report.add(
                    "dup_flag",
                    f"{delivery.client} got {delivery.mk} of {name} without dup, as "
                    f"{held.client} had",
                    held.record,
                    delivery.record,
                )


def _scope(model: Model, publish: Publish) -> tuple[str, str]:
    return (model.composite_of(publish.topic), publish.key)


def _order_violations(
    model: Model, sequence: Iterable[tuple[Publish, Record]]
) -> list[tuple[Publish, Record, Publish, Record]]:
    """In a sequence of first deliveries, every (earlier, its record, later, its record) where
    the later one's publish preceded the earlier one's. Linear: per scope, the latest invoke
    and each publisher's highest seq seen so far stand for everything delivered before."""
    latest_invoke: dict[tuple[str, str], tuple[Publish, Record]] = {}
    top_seq: dict[tuple[tuple[str, str], str], tuple[Publish, Record]] = {}
    found = []
    for publish, record in sequence:
        scope = _scope(model, publish)
        held = latest_invoke.get(scope)
        if (
            held is not None
            and publish.first_ok is not None
            and publish.first_ok < held[0].first_invoke
        ):
            found.append((held[0], held[1], publish, record))
        elif publish.pub is not None and publish.seq is not None:
            top = top_seq.get((scope, publish.pub))
            if top is not None and top[0].seq is not None and int(publish.seq) < int(top[0].seq):
                found.append((top[0], top[1], publish, record))
        if held is None or publish.first_invoke > held[0].first_invoke:
            latest_invoke[scope] = (publish, record)
        if publish.pub is not None and publish.seq is not None:
            top = top_seq.get((scope, publish.pub))
            if top is None or (top[0].seq is not None and int(publish.seq) > int(top[0].seq)):
                top_seq[(scope, publish.pub)] = (publish, record)
    return found


def _order(model: Model, report: Report) -> None:
    for client, deliveries in model.deliveries.items():
        by_sub: dict[str, list[tuple[Publish, Record]]] = defaultdict(list)
        seen: set[tuple[str, str]] = set()
        for delivery in deliveries:
            mk = delivery.mk
            if mk is None or mk not in model.publishes or delivery.record.get("retain"):
                continue
            if (delivery.sub, mk) in seen:
                continue
            seen.add((delivery.sub, mk))
            if delivery.record.get("dup"):
                # first seen as a redelivery: it was handed out before, at a moment the client
                # never saw (a lost answer, a push to a dropped connection)
                continue
            by_sub[delivery.sub].append((model.publishes[mk], delivery.record))
        for sub, sequence in by_sub.items():
            for earlier, earlier_record, later, later_record in _order_violations(model, sequence):
                report.add(
                    "order",
                    f"{client} under {sub} got {earlier.mk} before {later.mk}, published "
                    f"before it (key {later.key})",
                    later.oks[0] if later.oks else later.invokes[0],
                    earlier.invokes[0],
                    earlier_record,
                    later_record,
                )


def _qos2_member(model: Model, report: Report) -> None:
    for name, intervals in _groups(model).items():
        holders: dict[str, dict[str, Delivery]] = defaultdict(dict)
        for client in {i.client for i in intervals}:
            for delivery in model.deliveries.get(client, []):
                if delivery.sub == name and delivery.mk and int(delivery.record["qos"]) == 2:
                    holders[delivery.mk].setdefault(client, delivery)
        for mk, by_member in holders.items():
            if len(by_member) > 1:
                report.add(
                    "qos2_member",
                    f"QoS 2 {mk} of {name} went to {len(by_member)} members: "
                    f"{', '.join(sorted(by_member))}",
                    *[d.record for d in by_member.values()],
                )


def _subscription_start(model: Model, report: Report) -> None:
    groups = _groups(model)
    group_start = {
        name: min(float(i.invoke["t"]) for i in intervals) for name, intervals in groups.items()
    }
    for client, deliveries in model.deliveries.items():
        for delivery in deliveries:
            mk = delivery.mk
            if mk is None or mk not in model.publishes:
                continue
            publish = model.publishes[mk]
            answered = publish.first_ok
            if answered is None:
                continue
            sub = delivery.sub
            if _shared(sub):
                start = group_start.get(sub)
                if start is not None and answered < start:
                    report.add(
                        "subscription_start",
                        f"{client} got {mk} under {sub}, published before the group was made",
                        publish.oks[0],
                        delivery.record,
                    )
                continue
            if delivery.record.get("retain") and publish.retain:
                continue  # the retained copy a subscribe asks for
            intervals = model.intervals.get((client, sub), [])
            if not intervals:
                continue
            if answered < float(intervals[0].invoke["t"]) or _in_gap(intervals, publish):
                report.add(
                    "subscription_start",
                    f"{client} got {mk} under {sub}, published while it was not subscribed",
                    publish.invokes[0],
                    publish.oks[0],
                    delivery.record,
                )


def _in_gap(intervals: list[Interval], publish: Publish) -> bool:
    """Whether the publish was invoked after one interval's unsubscribe was answered and
    answered before the next subscribe was invoked."""
    answered = publish.first_ok
    assert answered is not None
    for before, after in itertools.pairwise(intervals):
        if before.gone is None:
            continue
        if publish.first_invoke > before.gone and answered < float(after.invoke["t"]):
            return True
    return False


def _retained_current(model: Model, report: Report) -> None:
    retained_by_topic: dict[str, list[Publish]] = defaultdict(list)
    for publish in model.publishes.values():
        if publish.retain and publish.acked:
            retained_by_topic[publish.topic].append(publish)
    for client, deliveries in model.deliveries.items():
        #: the subscribe each (filter, topic)'s last retained copy is laid to (its invoke time)
        last_source: dict[tuple[str, str], float] = {}
        #: the retained copies' delivery ids seen: one seen again is that copy sent again
        #: (unacked when a kill or a drop came: [MQTT-4.4.0-1], also after an unsubscribe,
        #: [MQTT-3.10.4-3]), judged when it first came, not a later subscribe's copy
        handed: set[str] = set()
        for delivery in sorted(deliveries, key=lambda d: d.t):
            mk = delivery.mk
            if (
                not delivery.record.get("retain")
                or mk not in model.publishes
                or _shared(delivery.sub)
            ):
                continue
            delivery_id = str(delivery.record.get("id"))
            if delivery.record.get("dup") and delivery_id in handed:
                continue
            handed.add(delivery_id)
            if delivery.record.get("dup"):
                # first seen sent again: handed out before, at a moment the client never saw
                # (a long poll's answer lost), so which subscribe it is of is unknown; it may
                # precede copies already laid to a later one (the 40-minute run at 200 clients,
                # seed 12: a prober's copies of one subscribe, handed out unseen, came with dup
                # after the next subscribe's). Left out, as ``order`` leaves such deliveries
                continue
            copy = model.publishes[mk]
            source = last_source.get((delivery.sub, copy.topic))
            # the subscribes whose retained copies may be the one delivered: those made before
            # it came and after the subscribe the topic's last copy is laid to, the earliest of
            # them the first that can have sent it. Not "made since the last copy came": a
            # subscribe's copies wait in the session's inbox behind what is there already, so
            # an earlier subscribe's copy can come after a later subscribe was made (under
            # lag; after an unsubscribe and a subscribe again too, MQTT 5 §3.10.4)
            candidates = [
                r
                for r in model.subscribes.get((client, delivery.sub), [])
                if float(r["t"]) <= delivery.t and (source is None or float(r["t"]) > source)
            ]
            if not candidates or copy.first_ok is None:
                continue
            subscribed = float(candidates[0]["t"])
            last_source[(delivery.sub, copy.topic)] = subscribed
            for newer in retained_by_topic.get(copy.topic, []):
                if (
                    newer.first_ok is not None
                    and copy.first_ok < newer.first_invoke
                    and newer.first_ok < subscribed
                ):
                    report.add(
                        "retained_current",
                        f"{client} subscribed to {delivery.sub} after {newer.mk} replaced "
                        f"{mk} on {copy.topic}, and got {mk}",
                        newer.oks[0],
                        candidates[0],
                        delivery.record,
                    )
                    break


def _session_kept(model: Model, report: Report) -> None:
    for client, connections in model.client_connections.items():
        expiry: float | None = None
        heard = model.heard.get(client, [])
        for connection in connections:
            invoke, ok = connection.invoke, connection.ok
            began = float(invoke["t"])
            if ok is None:
                continue
            if not invoke.get("clean_start") and not ok.get("session_present") and expiry:
                # the session lives at least the expiry past the last answer it gave
                last = max((t for t in heard if t < began), default=None)
                if last is not None and began < last + expiry:
                    report.add(
                        "session_kept",
                        f"{client} resumed its session {began - last:.1f} s after its last "
                        f"answer (expiry {expiry:g} s) and found none",
                        invoke,
                        ok,
                    )
            expiry = float(invoke.get("session_expiry_s") or 0)


# -- wills ------------------------------------------------------------------------------------


@dataclass
class WillCase:
    connection: Connection
    wid: str
    delay_s: float
    #: how the connection ended: clean, dropped, crashed, silent, ended, open, unknown
    ending: str = "open"
    end_record: Record | None = None
    #: bounds on when the server called the connection closed
    close_earliest: float | None = None
    close_latest: float | None = None


def _wills(model: Model, report: Report, grace_s: float) -> None:
    reaper_s = model.setting("reaper_s", 60.0)
    observed: dict[str, list[Delivery]] = defaultdict(list)
    for deliveries in model.deliveries.values():
        for delivery in deliveries:
            wid = delivery.record.get("wid")
            if wid is not None:
                observed[str(wid)].append(delivery)
    cases: dict[str, WillCase] = {}
    for connection in model.connections.values():
        will = connection.invoke.get("will")
        if not will:
            continue
        case = _will_case(model, connection, will, reaper_s)
        cases[case.wid] = case
    downs = model.server_down()
    for wid, seen in observed.items():
        if wid not in cases:
            report.add("will", f"a will ({wid}) was published for no connection", seen[0].record)
    decided = {"required": 0, "forbidden": 0, "either": 0, "disturbed": 0}
    unseen_excused = 0
    for wid, case in cases.items():
        seen = observed.get(wid, [])
        message_ids = {str(d.record.get("message_id")) for d in seen}
        connection = case.connection
        unseen = _unseen_channel(case)
        if unseen is not None and seen:
            # published for a channel the client never learned of, or for both: not judged by
            # this connection's own end or count
            first = min(_published_s(d) for d in seen)
            if first >= unseen + case.delay_s - CLOCK_TOLERANCE_S:
                unseen_excused += 1
                continue
        if len(message_ids) > 1:
            report.add(
                "will",
                f"{connection.client}'s will {wid} was published {len(message_ids)} times "
                "[MQTT-3.1.2-10]",
                connection.invoke,
                *[d.record for d in seen],
            )
        if _disturbed(model, case, downs):
            decided["disturbed"] += 1
            continue
        # a kill after the close defers the will's publication, as MQTT lets a failed server
        # do (§3.1.2.5): the time the server was down is added to its grace
        after = case.close_latest or model.end
        downtime = sum(up - max(down, after) for down, up in downs if up > after)
        verdict, why, evidence = _will_verdict(model, case, grace_s + downtime)
        decided[verdict] += 1
        if verdict == "forbidden" and seen:
            report.add(
                "will",
                f"{connection.client}'s will {wid} was published though {why}",
                connection.invoke,
                evidence,
                seen[0].record,
            )
        elif verdict == "required" and not seen:
            if not _observed_by_someone(model, connection, str(connection.invoke["will"]["topic"])):
                report.notes.append(f"no observer held {wid}'s topic: not judged")
                continue
            report.add(
                "will",
                f"{connection.client}'s will {wid} was never published though {why}",
                connection.invoke,
                evidence,
            )
        if seen and case.close_earliest is not None:
            published_at = min(
                float(d.record.get("published_at") or d.t * 1000) / 1000 for d in seen
            )
            earliest = case.close_earliest
            nxt = _next_connect(model, case) if case.delay_s == 0 else None
            if nxt is not None:
                # a new connection takes the session over and closes the old channel at once,
                # and with no delay its will goes then ([MQTT-3.1.4-3], §3.1.3.2.2)
                earliest = min(earliest, float(nxt.invoke["t"]))
            due = earliest + case.delay_s
            if published_at < due - CLOCK_TOLERANCE_S:
                report.add(
                    "will",
                    f"{connection.client}'s will {wid} was published {due - published_at:.2f} s "
                    f"before its delay of {case.delay_s:g} s ran out from the earliest close "
                    "(§3.1.3.2.2)",
                    connection.invoke,
                    case.end_record,
                    seen[0].record,
                )
    for name, n in decided.items():
        report.counts[f"wills_{name}"] = n
    report.counts["wills_observed"] = len(observed)
    report.counts["wills_of_unseen_channels"] = unseen_excused


def _unseen_channel(case: WillCase) -> float | None:
    """The earliest time a channel this HTTP connect registered unseen may have lost its will,
    or None. A connect answered more than 1.5 keepalives after it was sent was tried more than
    once: an earlier try may have registered a channel whose answer was lost. The retry, with
    the same ``connect_token``, gets that channel back only while it lives; the server, having
    had no request on it, loses it 1.5 keepalives after its registration ([MQTT-3.1.2-22]) and
    publishes the will it carries (§3.1.2.5), the same will as the channel the client got. The
    soak's restarts make such connects (answered 20-30 s after a kill, beside 200 reconnecting
    clients); deployed, a retry reaches its handler at once and finds the channel live."""
    connection = case.connection
    keepalive = float(connection.invoke.get("keepalive_s") or 0)
    if connection.transport != "http" or connection.ok is None or keepalive <= 0:
        return None
    sent, answered = float(connection.invoke["t"]), float(connection.ok["t"])
    if answered - sent <= 1.5 * keepalive:
        return None
    return sent + keepalive


def _published_s(delivery: Delivery) -> float:
    return float(delivery.record.get("published_at") or delivery.t * 1000) / 1000


def _disturbed(model: Model, case: WillCase, downs: list[tuple[float, float]]) -> bool:
    """Whether a kill of the server may have cut the connection before its own end (then the
    server closed it, at a moment no record shows). A normal DISCONNECT answered is decisive
    whatever came before: only a live channel can be disconnected."""
    if case.ending == "clean":
        return False
    opened = float(case.connection.invoke["t"])
    cut = case.close_latest
    if cut is None:
        cut = float(case.end_record["t"]) if case.end_record is not None else model.end
    return any(opened <= down <= cut for down, _ in downs)


def _will_case(
    model: Model, connection: Connection, will: dict[str, Any], reaper_s: float
) -> WillCase:
    delay = float(will.get("delay_s") or 0)
    expiry = connection.invoke.get("session_expiry_s")
    if expiry is not None:
        delay = min(delay, float(expiry))
    case = WillCase(connection, str(will["wid"]), delay)
    if connection.ok is None:
        case.ending = "refused" if connection.fail is not None else "unknown"
        return case
    keepalive = float(connection.invoke.get("keepalive_s") or 0)
    opened = float(connection.ok["t"])
    events: list[tuple[float, str, Record]] = []
    for record in model.disconnects.get(connection.conn, []):
        if record.get("phase") == "ok":
            events.append((float(record["t"]), "clean", record))
        elif record.get("phase") == "invoke":
            events.append((float(record["t"]), "disconnecting", record))
    lost = model.lost.get(connection.conn)
    if lost is not None:
        events.append((float(lost["t"]), str(lost.get("how", "dropped")), lost))
    for fault in model.kills_of(connection.client):
        if float(fault["t"]) >= opened:
            events.append((float(fault["t"]), "crashed", fault))
    if not events:
        return case
    events.sort(key=lambda e: e[0])
    at, how, record = events[0]
    if how == "disconnecting":
        # the answer decides: ok is a normal DISCONNECT, anything else leaves it undecided
        answered = [e for e in events if e[1] == "clean"]
        how, record = ("clean", answered[0][2]) if answered else ("unknown", record)
    case.ending, case.end_record = how, record
    if how in ("dropped", "crashed") and connection.transport == "ws":
        case.close_earliest, case.close_latest = at, at + CLOSE_SLACK_S
    elif how in ("silent", "crashed") and connection.transport == "http":
        calls = [opened] + [
            float(r["t"]) for r in model.heartbeats.get(connection.conn, []) if float(r["t"]) <= at
        ]
        last_invoke = float(record.get("last_invoke") or max(calls))
        last_answer = float(record.get("last_answer") or max(calls))
        case.close_earliest = last_invoke + keepalive
        case.close_latest = last_answer + 1.5 * keepalive + reaper_s + CLOSE_SLACK_S
    return case


def _next_connect(model: Model, case: WillCase) -> Connection | None:
    after = float(case.end_record["t"]) if case.end_record is not None else float("inf")
    for other in model.client_connections.get(case.connection.client, []):
        if other is not case.connection and float(other.invoke["t"]) >= after:
            return other
    return None


def _will_verdict(model: Model, case: WillCase, grace_s: float) -> tuple[str, str, Record | None]:
    """('required' | 'forbidden' | 'either', why, the record that decides)."""
    if case.ending == "refused":
        return "forbidden", "its connect was refused", case.connection.fail
    if case.ending == "clean":
        return "forbidden", "it ended with a normal DISCONNECT [MQTT-3.1.2-8]", case.end_record
    if case.ending not in ("dropped", "crashed", "silent") or case.close_earliest is None:
        return "either", "", None
    assert case.close_latest is not None
    nxt = _next_connect(model, case)
    nxt_invoke = float(nxt.invoke["t"]) if nxt is not None else float("inf")
    nxt_open = float(nxt.ok["t"]) if nxt is not None and nxt.ok is not None else float("inf")
    if case.delay_s > 0 and nxt_open < case.close_earliest + case.delay_s:
        assert nxt is not None
        return (
            "forbidden",
            f"a new connection came within its {case.delay_s:g} s delay [MQTT-3.1.3-9]",
            nxt.ok,
        )
    latest = case.close_latest
    if case.delay_s == 0:
        # lost, or taken over by the next connection: published either way, at once
        latest = min(latest, nxt_open)
    if nxt_invoke >= latest + case.delay_s and model.end >= latest + case.delay_s + grace_s:
        return (
            "required",
            f"it was {case.ending} and no new connection came within its {case.delay_s:g} s "
            "delay [MQTT-3.1.2-8]",
            case.end_record,
        )
    return "either", "", None


def _observed_by_someone(model: Model, connection: Connection, topic: str) -> bool:
    opened = float(connection.invoke["t"])
    for (_, name), intervals in model.intervals.items():
        if name.startswith("$share/") or not matches(name, topic):
            continue
        for interval in intervals:
            ok = interval.ok
            if ok is not None and interval.end is None and float(ok["t"]) < opened:
                return True
    return False


# -- push subscriptions -----------------------------------------------------------------------


def _push(model: Model, report: Report) -> None:
    for name, records in model.push_subs.items():
        made = next((r for r in records if r.get("phase") == "ok"), None)
        if made is None:
            continue
        final = model.push_final.get(name)
        if final is None:
            report.notes.append(f"push subscription {name}: no final state recorded: not judged")
            continue
        since = float(made["t"])
        owed = {
            p.mk: p
            for p in model.publishes.values()
            if p.acked and p.first_invoke > since and matches(str(made["filter"]), p.topic)
        }
        hits: dict[str, list[Record]] = defaultdict(list)
        for hit in model.push_hits:
            if hit.get("name", name) == name and hit.get("mk") is not None:
                hits[str(hit["mk"])].append(hit)
        delivered = {mk for mk, h in hits.items() if any(200 <= int(x["status"]) < 300 for x in h)}
        dead = {str(e["mk"]): e for e in final.get("dlq") or [] if e.get("mk") is not None}
        report.counts[f"push_{name}_owed"] = len(owed)
        report.counts[f"push_{name}_delivered"] = len(delivered & set(owed))
        report.counts[f"push_{name}_dead_lettered"] = len(set(dead) & set(owed))
        if final.get("retry_depth"):
            report.notes.append(
                f"push subscription {name} still had {final['retry_depth']} in retry at the end"
            )
        for mk, publish in owed.items():
            if mk not in delivered and mk not in dead:
                report.add(
                    "push",
                    f"{mk} ({publish.topic}) was neither delivered to {name}'s endpoint nor "
                    "dead-lettered",
                    publish.invokes[0],
                    publish.oks[0],
                    *hits.get(mk, []),
                )
        for mk in delivered & set(dead):
            report.add(
                "push",
                f"{mk} was both delivered to {name}'s endpoint and dead-lettered",
                *hits[mk],
                dead[mk],
            )
        for mk in (delivered | set(dead)) - set(model.publishes):
            report.add("push", f"{name} holds {mk}, which no client published", *hits.get(mk, []))
        _push_fates(
            model,
            report,
            name=name,
            owed=owed,
            hits=hits,
            delivered=delivered,
            dead=dead,
        )
        if made.get("ordered", True):
            _push_order(model, report, name, owed, hits)


def _push_fates(
    model: Model,
    report: Report,
    *,
    name: str,
    owed: dict[str, Publish],
    hits: dict[str, list[Record]],
    delivered: set[str],
    dead: dict[str, Record],
) -> None:
    # the first dead-lettered message of each key: what an ordered subscription keeps behind
    blocked_from: dict[tuple[str, str], float] = {}
    for mk in dead:
        if mk in owed:
            scope = _scope(model, owed[mk])
            blocked_from[scope] = min(blocked_from.get(scope, float("inf")), owed[mk].first_invoke)
    for mk, publish in owed.items():
        fates = {str(h.get("fate")) for h in hits.get(mk, [])}
        if fates & {"reject", "exhaust"} and mk in delivered:
            report.add("push", f"{mk} was delivered though the endpoint never takes it", *hits[mk])
        if mk in dead and not fates & {"reject", "exhaust"} and fates:
            earlier_blocked = blocked_from.get(_scope(model, publish), float("inf"))
            if not earlier_blocked < publish.first_invoke:
                report.add(
                    "push",
                    f"{mk} was dead-lettered though the endpoint takes it in the end, and no "
                    "earlier message of its key was",
                    *hits[mk],
                    dead[mk],
                )


def _push_order(
    model: Model, report: Report, name: str, owed: dict[str, Publish], hits: dict[str, list[Record]]
) -> None:
    firsts: list[tuple[float, Publish, Record]] = []
    for mk, records in hits.items():
        if mk not in owed:
            continue
        ok = [r for r in records if 200 <= int(r["status"]) < 300]
        if ok:
            first = min(ok, key=lambda r: float(r["t"]))
            firsts.append((float(first["t"]), owed[mk], first))
    firsts.sort(key=lambda x: x[0])
    for earlier, earlier_record, later, later_record in _order_violations(
        model, [(p, r) for _, p, r in firsts]
    ):
        report.add(
            "push",
            f"{name}'s endpoint got {earlier.mk} before {later.mk}, published before it "
            f"(key {later.key})",
            later.oks[0] if later.oks else later.invokes[0],
            earlier.invokes[0],
            earlier_record,
            later_record,
        )


# -- command line -----------------------------------------------------------------------------


def check_path(path: Path, **options: Any) -> Report:
    records, torn = read_history(path)
    return check(records, torn=torn, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak.checker", description=__doc__)
    parser.add_argument("history", type=Path, help="a history folder or file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ack-race-s", type=float, default=ACK_RACE_S)
    parser.add_argument("--will-grace-s", type=float, default=WILL_GRACE_S)
    args = parser.parse_args(argv)
    report = check_path(args.history, ack_race_s=args.ack_race_s, will_grace_s=args.will_grace_s)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
