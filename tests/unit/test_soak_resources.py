"""What ``/proc`` says of the soak's server (``bench.soak.server.resources``): the CPU seconds
its process tree has used, read from each process's stat line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.soak.server import CLOCK_TICKS, resources

#: CPU seconds the busy child uses before it says so
BUSY_S = 0.3
#: a process's name with spaces and a parenthesis, as a field of its stat line
#: (``pid (name) state ...``) would be misread by a split on spaces
ODD_NAME = b"busy) 1 2 3"
#: prctl(2)'s option that sets the calling thread's name
PR_SET_NAME = 15

BUSY = f"""
import ctypes, sys, time
ctypes.CDLL("libc.so.6").prctl({PR_SET_NAME}, {ODD_NAME!r}, 0, 0, 0)
while time.process_time() < {BUSY_S}:
    pass
print("busy", flush=True)
sys.stdin.read()
"""


def _spin(cpu_s: float) -> None:
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


def test_the_cpu_seconds_of_a_process_grow_as_it_works() -> None:
    before = resources(os.getpid())
    assert before is not None and before["cpu_s"] > 0

    _spin(0.2)

    after = resources(os.getpid())
    assert after is not None
    assert after["cpu_s"] - before["cpu_s"] >= 0.2 - 2 / CLOCK_TICKS


def test_a_childs_cpu_counts_for_the_tree_and_stays_counted_once_it_ends() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"busy\n"
        alone = resources(child.pid)
        tree = resources(os.getpid())
        own = os.times()
    finally:
        child.kill()
        child.wait()
    ended = resources(os.getpid())

    # the child's own line is read past its odd name
    assert alone is not None and alone["cpu_s"] >= BUSY_S - 1 / CLOCK_TICKS
    # this process's tree holds the child's CPU beside its own (read after the tree's)
    assert tree is not None
    assert tree["cpu_s"] - (own.user + own.system) >= alone["cpu_s"] - 2 / CLOCK_TICKS
    # waited for, the child's ticks are this process's children's: the total does not fall
    assert ended is not None and ended["cpu_s"] >= tree["cpu_s"]
