"""Backoff between attempts (a raced conditional write, a throttled or failed put): one rule
for every context."""

from __future__ import annotations

import random


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before attempt ``attempt + 1``: exponential with full jitter.

    Racing writers (connects of one client id, members of one group, subscribes of one bucket)
    that back off by the same amount collide again; a uniform draw below the exponential
    ceiling spreads them out ("full jitter", as the AWS SDKs' standard retry mode does).
    """
    return random.uniform(0, min(cap_s, base_s * 2**attempt))
