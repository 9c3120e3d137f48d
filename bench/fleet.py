"""A fleet of clients for a month: long-poll, WebSocket push and IoT Core, priced.

The counted runs and the model are ``bench.cost``'s (``count_long_poll``, ``count_push``,
``fleet_model``): a benchmark of its own so that ``python -m bench fleet`` reprices the fleet
without rerunning the per-message scenarios.
"""

from __future__ import annotations

from typing import Any

from bench import cost


def run() -> dict[str, Any]:
    return cost.fleet_run()


def report(figures: dict[str, Any]) -> str:
    return cost.fleet_report(figures)
