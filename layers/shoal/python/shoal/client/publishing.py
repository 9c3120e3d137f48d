"""Publishing with ``ShoalClient`` (``shoal.client.http``): each message kept once by the server
across lost answers and the client's own crashes. How (the state file's sequences and publishes
in flight, batching): ``shoal.client.http``'s docstring."""

from __future__ import annotations

import base64
import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shoal.client.errors import ApiError, Unavailable, error_of, retry_after
from shoal.client.state import ClientState
from shoal.client.support import BatchSettings, CallRetry, PublishResult
from shoal.core.clock import Clock


class Publishing:
    """The publishing half of ``ShoalClient``: what it needs of the client is declared here and
    set by ``ShoalClient.__init__``."""

    state: ClientState
    policy: CallRetry
    clock: Clock
    rng: random.Random
    on_resend: Callable[[list[dict[str, Any]]], None] | None
    _publisher_id: str | None
    _named_publisher: bool
    #: this process's run: a publish in flight from another run was never answered
    _run: str

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        channel: str | None = None,
        extra_wait_s: float = 0.0,
    ) -> tuple[Any, bool]:
        raise NotImplementedError("ShoalClient sends")

    # -- publishing ---------------------------------------------------------------------

    @property
    def publisher_id(self) -> str:
        """The given one, else one made once per (URL, principal) (a restart keeps it)."""
        if self._publisher_id is None:
            self._publisher_id = self.state.default_publisher_id()
        return self._publisher_id

    def _publisher(self) -> dict[str, Any]:
        return self.state.publisher(self.publisher_id)

    @property
    def next_seq(self) -> int:
        """The seq the next publish will carry (the first in-flight one's, if any)."""
        publisher = self._publisher()
        in_flight = publisher["in_flight"]
        return int(in_flight[0]["seq"]) if in_flight else int(publisher["last_seq"]) + 1

    @property
    def pending_publish(self) -> dict[str, Any] | None:
        """The body of the first publish in flight (sent but not known to be accepted)."""
        in_flight = self._publisher()["in_flight"]
        return dict(in_flight[0]["body"]) if in_flight else None

    @property
    def pending_publishes(self) -> list[dict[str, Any]]:
        """The bodies of every publish in flight, in seq order."""
        return [dict(entry["body"]) for entry in self._publisher()["in_flight"]]

    def discard_pending(self) -> int:
        """Forget the publishes in flight; the number forgotten.

        The server may hold some of their seqs, so the sequence must not be reused: a default
        publisher id is replaced by a new one; a named one goes on after the highest forgotten
        seq (a gap the server reports is closed by renumbering, see ``_settle``).
        """
        publisher = self._publisher()
        dropped = list(publisher["in_flight"])
        if not dropped:
            return 0
        publisher["in_flight"] = []
        publisher["last_seq"] = max(int(publisher["last_seq"]), *(int(e["seq"]) for e in dropped))
        if self._named_publisher:
            self.state.save()
        else:
            self._publisher_id = self.state.new_default_publisher_id()
        return len(dropped)

    @staticmethod
    def message_body(
        topic: str,
        *,
        text: str | None = None,
        payload: bytes | None = None,
        qos: int = 1,
        retain: bool = False,
        ordering_key: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The JSON body of one message (without its publisher id and seq)."""
        if (text is None) == (payload is None):
            raise ValueError("give exactly one of text and payload")
        body: dict[str, Any] = {"topic": topic, "qos": qos, "retain": retain}
        if text is not None:
            body["text"] = text
        else:
            assert payload is not None
            body["payload"] = base64.b64encode(payload).decode("ascii")
        if ordering_key is not None:
            body["ordering_key"] = ordering_key
        if properties:
            body["properties"] = dict(properties)
        return body

    def publish(
        self,
        topic: str,
        *,
        text: str | None = None,
        payload: bytes | None = None,
        qos: int = 1,
        retain: bool = False,
        ordering_key: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish one message exactly once (``POST /v1/messages`` with the next seq).

        When publishes are in flight from before (their answer never came, or the process
        died), the same message reuses its seq, and a different one first finishes them.
        """
        body = self.message_body(
            topic,
            text=text,
            payload=payload,
            qos=qos,
            retain=retain,
            ordering_key=ordering_key,
            properties=properties,
        )
        digest = _digest(body)
        publisher = self._publisher()
        entry = next((e for e in publisher["in_flight"] if e["digest"] == digest), None)
        if entry is None:
            (entry,) = self._enqueue([body])
        outcome = self._drain(until=entry).get(id(entry))
        if isinstance(outcome, ApiError):
            raise outcome
        assert outcome is not None
        return outcome

    def publish_many(
        self, bodies: Sequence[Mapping[str, Any]], settings: BatchSettings | None = None
    ) -> list[PublishResult | ApiError]:
        """Publish messages (bodies of ``message_body``) exactly once, in order, in batches of
        ``POST /v1/messages:batch``: the result or refusal of each.

        They are numbered and written to the state file in one write before anything is sent;
        ``Unavailable`` leaves the unsent ones in flight, to be finished by the next publish.
        """
        entries = self._enqueue(bodies)
        outcomes = self._drain(settings, until=entries[-1] if entries else None)
        return [outcomes[id(e)] for e in entries]

    def finish_pending(self) -> list[PublishResult | ApiError]:
        """Send the publishes in flight with their own seqs."""
        return list(self._drain().values())

    def _enqueue(self, bodies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        publisher = self._publisher()
        in_flight: list[dict[str, Any]] = publisher["in_flight"]
        seq = int(in_flight[-1]["seq"]) if in_flight else int(publisher["last_seq"])
        entries = []
        for body in bodies:
            seq += 1
            entry = {
                "seq": seq,
                "digest": _digest(body),
                "body": dict(body),
                "tries": 0,
                "run": self._run,
            }
            entries.append(entry)
        in_flight.extend(entries)
        # saved (durably) before the first send in _drain: a crash from there resends them
        return entries

    def _drain(
        self, settings: BatchSettings | None = None, *, until: dict[str, Any] | None = None
    ) -> dict[int, PublishResult | ApiError]:
        """Send the publishes in flight in order, chunk by chunk (``settings`` bounds a chunk's
        count and bytes), until ``until`` is settled (default: all of them).

        Outcomes are keyed by ``id(entry)``. A chunk answered with refusals only, or busy
        answers for ``policy.attempts`` rounds, ends the drain with its error.
        """
        settings = settings or BatchSettings()
        publisher = self._publisher()
        outcomes: dict[int, PublishResult | ApiError] = {}
        busy_rounds = 0
        while publisher["in_flight"] and (until is None or id(until) not in outcomes):
            chunk = _chunk(publisher["in_flight"], settings)
            earlier = [e for e in chunk if e.get("run") != self._run]
            if earlier and self.on_resend is not None:
                self.on_resend([dict(e["body"]) | {"publisher_seq": e["seq"]} for e in earlier])
            for entry in chunk:
                entry["tries"] = int(entry.get("tries", 0)) + 1
                entry["run"] = self._run
            # durable before it is sent: a crash from here on resends it with this seq
            self.state.save()
            answers, uncertain = self._post(chunk)
            progress, busy = self._settle(publisher, chunk, answers, uncertain, outcomes)
            if busy and not progress:
                busy_rounds += 1
                if busy_rounds >= self.policy.attempts:
                    raise Unavailable(busy.status, busy.code, busy.message, {"uncertain": True})
                self.clock.sleep(self.policy.delay_s(busy_rounds - 1, self.rng, retry_after(busy)))
            elif not progress:
                # refused without being freed: a later run may finish it (or discard it)
                first = next(o for e in chunk if isinstance(o := answers[id(e)], ApiError))
                raise first
            else:
                busy_rounds = 0
        return outcomes

    def _post(self, chunk: list[dict[str, Any]]) -> tuple[dict[int, Any], bool]:
        """One request for ``chunk``: an answer (``PublishResult`` fields or ``ApiError``) per
        entry, and whether an earlier attempt of it may have been carried out unheard."""
        requests_ = [
            {**e["body"], "publisher_id": self.publisher_id, "publisher_seq": int(e["seq"])}
            for e in chunk
        ]
        if len(chunk) == 1:
            try:
                answer, uncertain = self._send("POST", "/v1/messages", body=requests_[0])
            except Unavailable:
                raise  # the outcome is unknown: it stays in flight
            except ApiError as exc:
                return {id(chunk[0]): exc}, bool(exc.details.get("uncertain"))
            return {id(chunk[0]): answer}, uncertain
        try:
            answer, uncertain = self._send(
                "POST", "/v1/messages:batch", body={"messages": requests_}
            )
        except Unavailable:
            raise
        except ApiError as exc:
            # the whole request refused (401, a body too large): the same refusal for each
            return {id(e): exc for e in chunk}, bool(exc.details.get("uncertain"))
        results = list((answer or {}).get("results", []))
        out: dict[int, Any] = {}
        for entry, result in zip(chunk, results, strict=False):
            if isinstance(result, dict) and isinstance(result.get("error"), dict):
                status = int(result["error"].get("status", 400))
                out[id(entry)] = error_of(status, result)
            else:
                out[id(entry)] = result
        for entry in chunk[len(results) :]:
            out[id(entry)] = Unavailable(0, "no_result", "the batch answer lacks a result", {})
        return out, uncertain

    def _settle(
        self,
        publisher: dict[str, Any],
        chunk: list[dict[str, Any]],
        answers: dict[int, Any],
        uncertain: bool,
        outcomes: dict[int, PublishResult | ApiError],
    ) -> tuple[bool, ApiError | None]:
        """Apply one chunk's answers: (whether anything was settled or renumbered, a busy
        answer to back off for)."""
        in_flight: list[dict[str, Any]] = publisher["in_flight"]
        progress = False
        busy: ApiError | None = None
        renumber_from: int | None = None
        for entry in chunk:
            answer = answers[id(entry)]
            seq = int(entry["seq"])
            if not isinstance(answer, ApiError):
                publisher["last_seq"] = max(int(publisher["last_seq"]), seq)
                in_flight.remove(entry)
                outcomes[id(entry)] = self._result(entry, answer)
                progress = True
            elif answer.code == "publisher_seq_gap" and isinstance(
                answer.details.get("expected"), int
            ):
                # the server holds every seq below `expected` and none from it: what is in
                # flight from there on is renumbered from it, in order
                expected = int(answer.details["expected"])
                renumber_from = min(renumber_from or expected, expected)
            elif answer.status in self.policy.retry_statuses or answer.status >= 500:
                busy = busy or answer  # tried again with the same seq: the server may hold it
            elif int(entry["tries"]) == 1 and not uncertain:
                # refused on its only attempt: never accepted, its seq is free (a later one in
                # flight is told of the gap and renumbered)
                in_flight.remove(entry)
                outcomes[id(entry)] = answer
                progress = True
        if renumber_from is not None:
            seq = renumber_from
            for entry in in_flight:
                if int(entry["seq"]) >= renumber_from:
                    entry["seq"], entry["tries"] = seq, 0
                    seq += 1
            progress = True
        self.state.save()
        return progress, busy

    def _result(self, entry: dict[str, Any], answer: Mapping[str, Any]) -> PublishResult:
        return PublishResult(
            message_id=str(answer["message_id"]),
            topic=str(answer.get("topic", entry["body"]["topic"])),
            storage_topic=answer.get("storage_topic"),
            partition=answer.get("partition"),
            duplicate=bool(answer.get("duplicate", False)),
            publisher_id=self.publisher_id,
            publisher_seq=int(entry["seq"]),
        )


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _chunk(in_flight: list[dict[str, Any]], settings: BatchSettings) -> list[dict[str, Any]]:
    """The first publishes in flight that fit one request (at least one)."""
    chunk: list[dict[str, Any]] = []
    size = 0
    for entry in in_flight[: settings.max_messages]:
        weight = _weight(entry["body"])
        if chunk and size + weight > settings.max_bytes:
            break
        chunk.append(entry)
        size += weight
    return chunk


def _weight(body: Mapping[str, Any]) -> int:
    """About the bytes a message adds to a batch request (its payload dominates)."""
    return len(str(body.get("payload") or body.get("text") or "")) + len(body["topic"]) + 64
