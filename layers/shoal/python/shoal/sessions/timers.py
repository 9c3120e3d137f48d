"""Due timers: an item of the sessions table reaped when it is due, not at the reaper's next run.

The reaper's schedule runs once a minute (EventBridge's finest), so an item it finds through
the due index waits up to a minute after it is due, and one due *after* a run's own write (the
will of a channel it just expired) waits for the run after: a 3 s will went out a minute or
two late, and a client that reconnected meanwhile cancelled it, where MQTT 5 §3.1.3.2.2 wants
it published once its delay passed unless a new connection came before.

Nothing waits in a Lambda. Where an item becomes due soon, after the write that made it so
succeeded, a *timer* is armed: a message of the standard SQS queue ``wills`` naming the
client id and the item, delayed (``DelaySeconds``) until the item is due. The reaper takes the
queue's messages through its event source mapping and runs, for each, the step its schedule
would run on the item (``Reaper.on_timers``). Every step is a conditional write on what it
read, so a duplicate timer, or one that comes after the schedule reaped the item, does
nothing; a gone item is nothing to do. SQS delays a message 15 minutes at most: a timer due
later is sent with that, and armed again for the rest when it comes early (as one that
arrives early for any other reason is).

Timers are best effort. A failed send is logged and the item stays in the due index, where
the scheduled sweep finds it a minute late at most; a timer that fails its step returns to the
queue (the mapping's partial batch response), and one that fails five times goes to the
dead-letter queue, whose alarm says so (the sweep still reaps the item).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shoal.aws import clients
from shoal.core.clock import Clock, SystemClock
from shoal.core.config import Config
from shoal.core.observability import logger
from shoal.sessions.ports import DueTimer

#: the wills queue's logical name (``shoal.declarations``)
WILLS_QUEUE = "wills"
#: SQS delays a message at most this long
MAX_DELAY_S = 900
#: an item due later than this gets no timer: the scheduled sweep reaps it (a minute late at
#: most), so a timer's chain of 15-minute delays is at most four links, whatever will delay a
#: client asks for (MQTT allows one of 136 years)
TIMER_HORIZON_S = 3600
VERSION = 1


def delay_s(due_at_ms: int, now_ms: int, longest_s: int = MAX_DELAY_S) -> int:
    """The ``DelaySeconds`` of a timer for an item due at ``due_at_ms``: whole seconds until
    then, rounded up (a timer never comes before its item is due for a fraction of a second),
    0 for an item due already, ``longest_s`` at most (the rest: armed again on arrival)."""
    return max(0, min(longest_s, -(-(due_at_ms - now_ms) // 1000)))


@dataclass(frozen=True)
class Timer:
    """One timer: the item ``item`` of client ``client_id``, due at ``due_at_ms``."""

    client_id: str
    item: str
    due_at_ms: int

    def body(self) -> str:
        data = {"v": VERSION, "c": self.client_id, "i": self.item, "d": self.due_at_ms}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def parse(cls, body: str) -> Timer:
        """``ValueError`` for a body this version cannot read."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict) or data.get("v") != VERSION:
                raise ValueError("not a timer of this version")
            client_id, item, due = data["c"], data["i"], data["d"]
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError("not a timer") from exc
        if not isinstance(client_id, str) or not isinstance(item, str) or type(due) is not int:
            raise ValueError("not a timer")
        return cls(client_id, item, due)


class SqsDueTimer:
    """Timers as delayed messages of the wills queue (``DueTimer``)."""

    def __init__(
        self, sqs: Any, url: str, clock: Clock | None = None, *, longest_s: int = MAX_DELAY_S
    ) -> None:
        self.sqs = sqs
        self.url = url
        self.clock = clock or SystemClock()
        #: the longest delay a timer is sent with (SQS's 15 minutes; tests make it 0, since
        #: the emulated queue delays by the wall clock and their clock is a manual one)
        self.longest_s = longest_s
        #: timers sent by this process (tests count them)
        self.armed = 0

    @classmethod
    def from_config(cls, config: Config, clock: Clock | None = None) -> SqsDueTimer | None:
        """None without a wills queue: the schedule alone reaps (a deployment before it)."""
        url = config.queues.get(WILLS_QUEUE)
        if not url:
            return None
        return cls(clients.client("sqs", config.region), url, clock)

    def arm(self, client_id: str, item: str, due_at_ms: int) -> None:
        delay = delay_s(due_at_ms, self.clock.now_ms(), self.longest_s)
        body = Timer(client_id, item, due_at_ms).body()
        self.sqs.send_message(QueueUrl=self.url, MessageBody=body, DelaySeconds=delay)
        self.armed += 1


def arm_timer(
    timer: DueTimer | None, client_id: str, item: str, due_at_ms: int, now_ms: int
) -> bool:
    """Arms ``timer`` for an item whose write succeeded, when the item is due within
    ``TIMER_HORIZON_S``; best effort: a failed send is logged, and the scheduled sweep reaps
    the item. Whether a timer was armed."""
    if timer is None or due_at_ms - now_ms > TIMER_HORIZON_S * 1000:
        return False
    try:
        timer.arm(client_id, item, due_at_ms)
    except (ClientError, BotoCoreError) as exc:
        logger.warning(
            "due timer not armed: the schedule reaps the item",
            extra={"error_type": type(exc).__name__},
        )
        return False
    return True
