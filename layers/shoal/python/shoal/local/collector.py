"""The cycle collector's full passes under ``shoal dev``: in the process's quiet moments, not
in its bursts.

``shoal dev`` holds a whole account in one process: every item, record and object the
emulator keeps, every connection. CPython collects cycles by generations; the young two are
cheap, but a full pass walks everything that survived into the oldest, and every thread
(each sandbox, the emulator, the WebSocket gateway) waits for it. CPython starts one when
what survived into the oldest generation since the last full pass reaches a quarter of what
survived that pass: so full passes come with the process's growth, and growth is what a burst
is. Measured (1,000 WebSocket sessions, one message to all of them, 205 MB held): 19 full
passes over the run, 230 to 290 ms each by its end, three of them (600 ms) in the fan-out's
first 6 s; each found 200 to 1,800 objects to free, against the hundreds of thousands it walked.

So the young generations run as CPython runs them (most cycles die there), and the full
passes run from a thread of their own, ``Collector``: once the process has been quiet for a
moment (under a quarter of a core over the last second) and ``QUIET_GAP_S`` have passed since
the last, or at the latest ``MAX_GAP_S`` after it, busy or not; never when no young pass has
promoted anything since. Between passes the oldest generation's garbage waits, which is what
those few objects cost. The thresholds of CPython's young generations are left as they are.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("shoal-dev.collector")

#: CPython's third threshold: young passes of the middle generation before a full pass may
#: run. Past any count a process reaches, it never does on its own.
NEVER = 1 << 30
#: the least time between two full passes started because the process was quiet
QUIET_GAP_S = 10.0
#: the most time between two full passes: a process that is never quiet still frees its cycles
MAX_GAP_S = 60.0
#: quiet: under this share of one core used over the last look
QUIET_SHARE = 0.25
#: how often the thread looks
LOOK_EVERY_S = 1.0


@dataclass
class Look:
    """What the collector's thread sees at one look."""

    now_s: float
    #: the process's CPU time (all threads)
    cpu_s: float
    #: young passes of the middle generation since the last full pass (``gc.get_count()[2]``)
    promoted: int


class Schedule:
    """When a full pass is due, from the looks (no clock or collector of its own: tested alone)."""

    def __init__(
        self,
        started_s: float,
        cpu_s: float,
        *,
        quiet_gap_s: float = QUIET_GAP_S,
        max_gap_s: float = MAX_GAP_S,
        quiet_share: float = QUIET_SHARE,
    ) -> None:
        self.quiet_gap_s = quiet_gap_s
        self.max_gap_s = max_gap_s
        self.quiet_share = quiet_share
        self._last_pass_s = started_s
        self._last_look = Look(started_s, cpu_s, 0)

    def due(self, look: Look) -> bool:
        """Whether a full pass should run now; a pass that runs must be told (``ran``)."""
        previous, self._last_look = self._last_look, look
        if look.promoted == 0:
            return False  # the oldest generation holds nothing it did not hold at the last pass
        since = look.now_s - self._last_pass_s
        if since >= self.max_gap_s:
            return True
        elapsed = look.now_s - previous.now_s
        if since < self.quiet_gap_s or elapsed <= 0:
            return False
        return (look.cpu_s - previous.cpu_s) / elapsed < self.quiet_share

    def ran(self, now_s: float, cpu_s: float) -> None:
        self._last_pass_s = now_s
        # the pass's own CPU is not the process's load
        self._last_look = Look(now_s, cpu_s, 0)


class Collector:
    """Full passes of the cycle collector at the ``Schedule``'s times, from a daemon thread;
    CPython's own full passes off while it runs."""

    def __init__(
        self,
        *,
        clock_s: Callable[[], float] = time.monotonic,
        cpu_s: Callable[[], float] = time.process_time,
        look_every_s: float = LOOK_EVERY_S,
        schedule: Schedule | None = None,
    ) -> None:
        self._clock_s = clock_s
        self._cpu_s = cpu_s
        self._look_every_s = look_every_s
        self.schedule = schedule or Schedule(clock_s(), cpu_s())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thresholds: tuple[int, int, int] | None = None
        #: full passes run (tests read it)
        self.passes = 0

    def start(self) -> None:
        young0, young1, full = gc.get_threshold()
        self._thresholds = (young0, young1, full)
        gc.set_threshold(young0, young1, NEVER)
        self._thread = threading.Thread(target=self._run, name="shoal-collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def look(self) -> bool:
        """One look: a full pass if one is due. Whether one ran."""
        if not self.schedule.due(Look(self._clock_s(), self._cpu_s(), gc.get_count()[2])):
            return False
        started = time.perf_counter()
        freed = gc.collect()
        took = time.perf_counter() - started
        self.passes += 1
        self.schedule.ran(self._clock_s(), self._cpu_s())
        log.debug("full pass", extra={"freed": freed, "ms": round(took * 1000, 1)})
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._look_every_s):
            self.look()
