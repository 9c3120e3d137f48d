"""The fleet cost model's arithmetic (``bench.cost.fleet_model``) on made-up counted units: each
transport's month is its connection, keep-alive, reconnect and per-delivery lines, at list
prices."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench import cost


def _unit(name: str, **counts: float) -> cost.Unit:
    return cost.Unit(name, 1, **counts)  # type: ignore[arg-type]


@pytest.fixture
def model() -> dict[str, Any]:
    counted = {
        "long_poll": {
            "delivery": _unit(
                "long-poll delivery", lambda_requests=2, api_requests=2, dynamodb_wru=3
            ),
            "empty_poll": _unit(
                "empty poll",
                lambda_requests=1,
                api_requests=1,
                dynamodb_rru=24,
                lambda_gb_s=10,
                lambda_s=20,
            ),
        },
        "push": {
            "delivery": _unit(
                "push delivery",
                lambda_requests=1,
                dynamodb_wru=9,
                ws_in=1,
                ws_out=2,
                lambda_gb_s=0.01,
                lambda_s=0.02,
                aws_calls=20,
            ),
            # an ack frame: its function's request, the state's write, the frame in
            "ack": _unit("ack frame", lambda_requests=1, dynamodb_wru=1, ws_in=1, lambda_s=0.01),
            "reconnect": _unit(
                "reconnect", lambda_requests=4, dynamodb_wru=16, ws_in=1, ws_out=1, lambda_s=0.1
            ),
        },
    }
    return cost.fleet_model(counted)


def _row(model: dict[str, Any], traffic: str, transport: str) -> dict[str, Any]:
    return model[traffic]["rows"][transport]


def test_an_idle_websocket_client_pays_its_minutes_pings_and_reconnects(model: dict) -> None:
    row = _row(model, "idle", "WebSocket push")
    minutes = 30 * 24 * 60
    keepalives = minutes / 9.5  # the client's default: one every 570 s of its silence
    # the client renews 2 to 4 minutes (3 on average) before API Gateway's 2 hours
    reconnects = 30 * 86400 / (7200 - 180)
    lines = row["lines"]
    assert lines["ws_connection_minutes"] == pytest.approx(minutes * 0.25 / 1e6)
    # three one-way keepalive frames in, then a ping in and its pong out: 5 messages per 4
    assert lines["ws_keepalive"] == pytest.approx(1.25 * keepalives / 1e6)
    # each reconnect: 4 Lambda requests, 16 write units, a frame each way
    assert lines["lambda_requests"] == pytest.approx(reconnects * 4 * 0.20 / 1e6)
    assert lines["dynamodb_wru"] == pytest.approx(reconnects * 16 * 0.625 / 1e6)
    assert lines["ws_messages"] == pytest.approx(reconnects * 2 / 1e6)
    assert row["per_client_month"] == pytest.approx(sum(lines.values()))
    assert row["fleet_per_month"] == pytest.approx(cost.FLEET * row["per_client_month"])
    assert row["dominant"] == "ws_connection_minutes"


def test_an_idle_long_poll_client_holds_a_lambda_all_month(model: dict) -> None:
    row = _row(model, "idle", "long-poll")
    month_s = 30 * 86400
    polls = month_s / 20
    assert model["idle"]["empty_polls_per_client_month"] == pytest.approx(polls)
    # priced once as the held time (512 MB all month), not again per empty poll
    assert row["lines"]["lambda_gb_s"] == pytest.approx(0.5 * month_s * 0.0000133334)
    assert row["lines"]["dynamodb_rru"] == pytest.approx(polls * 24 * 0.125 / 1e6)
    assert row["lambda_concurrency"] == pytest.approx(cost.FLEET)


def test_a_message_a_minute_adds_deliveries_and_fewer_empty_polls(model: dict) -> None:
    deliveries = 30 * 24 * 60
    # the poll ending at 20 s and 40 s finds nothing, the one at 60 s the message
    assert model["1 a minute"]["empty_polls_per_client_month"] == pytest.approx(2 * deliveries)
    push = _row(model, "1 a minute", "WebSocket push")
    idle = _row(model, "idle", "WebSocket push")
    # the delivery's three frames (ws_in 1, ws_out 2) and an ack frame a delivery (one a
    # minute is never within the client's ack delay of another)
    added = push["lines"]["ws_messages"] - idle["lines"]["ws_messages"]
    assert added == pytest.approx((3 + 1) * deliveries / 1e6)
    iot = _row(model, "1 a minute", "IoT Core")
    assert iot["lines"]["iot_messages"] == pytest.approx(3 * deliveries / 1e6)
    assert iot["lines"]["iot_connection_minutes"] == pytest.approx(deliveries * 0.08 / 1e6)
    assert iot["lambda_concurrency"] == 0


def test_push_concurrency_is_lambda_seconds_a_second(model: dict) -> None:
    row = _row(model, "1 a second", "WebSocket push")
    delivery_s = 0.02 + 20 * cost.CALL_RTT_S
    reconnect_s = 0.1
    # at 1 a second the default delay (300 ms) takes one id an ack frame
    ack_s = 0.01
    expected = cost.FLEET * (1.0 * delivery_s + 1.0 * ack_s + reconnect_s / (7200 - 180))
    assert row["lambda_concurrency"] == pytest.approx(expected)
    # the delivery's GB-s: its counted time's, plus a round trip a call at its mean memory
    deliveries = 30 * 86400
    gb_s = 0.01 + 0.5 * 20 * cost.CALL_RTT_S
    assert row["lines"]["lambda_gb_s"] == pytest.approx(deliveries * gb_s * 0.0000133334, rel=1e-3)
    assert not math.isnan(row["per_client_month"])


@pytest.mark.parametrize(
    ("rate", "delay", "frames"),
    [(1.0, 0.3, 1.0), (1.0, 2.0, 1 / 3), (10.0, 0.3, 1 / 4), (1 / 60, 2.0, 1.0), (0.0, 2.0, 1.0)],
)
def test_acks_per_delivery_follow_the_clients_delay(
    rate: float, delay: float, frames: float
) -> None:
    # one frame takes the ids processed within the delay after the first it holds
    assert cost.acks_per_delivery(rate, delay) == pytest.approx(frames)


def test_acks_held_longer_cost_fewer_frames_and_writes_at_one_a_second(model: dict) -> None:
    held = _row(model, "1 a second", "WebSocket push, acks held 2 s")
    default = _row(model, "1 a second", "WebSocket push")
    deliveries = 30 * 86400
    # three ids an ack frame instead of one: two thirds of the acks' frames and writes saved
    saved = default["lines"]["ws_messages"] - held["lines"]["ws_messages"]
    assert saved == pytest.approx(deliveries * (1 - 1 / 3) / 1e6)
    saved_wru = default["lines"]["dynamodb_wru"] - held["lines"]["dynamodb_wru"]
    assert saved_wru == pytest.approx(deliveries * (1 - 1 / 3) * 0.625 / 1e6)


def test_the_sweep_looks_at_a_session_once_a_delivery_up_to_once_a_run() -> None:
    """Each push arms a due list; the reaper's run (every minute) reads the state of each
    session whose lists came due once, however many: one look a delivery at 1 a minute, one a
    run at 1 a second, none idle."""
    push = {
        "delivery": _unit("push delivery", ws_out=1),
        "ack": _unit("ack frame", ws_in=1),
        "reconnect": _unit("reconnect"),
    }
    look = cost.Unit(
        "sweep look, acked in time",
        1,
        dynamodb_rru=1,
        dynamodb_wru=0.05,
        lambda_s=0.001,
        aws_calls=0.5,
        calls={"dynamodb.DeleteItem": 0.05, "dynamodb.BatchGetItem": 0.45},
    )
    without = cost.fleet_model(
        {
            "long_poll": {
                "delivery": _unit("long-poll delivery"),
                "empty_poll": _unit("empty poll"),
            },
            "push": push,
        }
    )
    with_look = cost.fleet_model(
        {
            "long_poll": {
                "delivery": _unit("long-poll delivery"),
                "empty_poll": _unit("empty poll"),
            },
            "push": {**push, "sweep_acked": look},
        }
    )
    month_s = 30 * 86400
    # the state's read once a look; the due lists taken (the look's deletes and write units)
    # once a delivery, as every push arms its batch's list
    for traffic, looks, deliveries in (
        ("idle", 0, 0),
        ("1 a minute", month_s / 60, month_s / 60),
        ("1 a second", month_s / 60, month_s),
    ):
        for transport in ("WebSocket push", "WebSocket push, acks held 2 s"):
            a = _row(without, traffic, transport)
            b = _row(with_look, traffic, transport)
            added = b["lines"].get("dynamodb_rru", 0.0) - a["lines"].get("dynamodb_rru", 0.0)
            assert added == pytest.approx(looks * 0.125 / 1e6), (traffic, transport)
            wru = b["lines"].get("dynamodb_wru", 0.0) - a["lines"].get("dynamodb_wru", 0.0)
            assert wru == pytest.approx(deliveries * 0.05 * 0.625 / 1e6), (traffic, transport)
            concurrency = b["lambda_concurrency"] - a["lambda_concurrency"]
            # past a look a run, a delivery's lists: a tenth of the look's calls and time
            expected = (
                cost.FLEET
                / month_s
                * (
                    looks * (0.001 + 0.5 * cost.CALL_RTT_S)
                    + (deliveries - looks) * (0.0001 + 0.05 * cost.CALL_RTT_S)
                )
            )
            assert concurrency == pytest.approx(expected), (traffic, transport)
    assert cost.sweep_looks(1 / 600) == pytest.approx(month_s / 600)


def test_keep_alives_fill_only_the_clients_silences(model: dict) -> None:
    # an ack frame a minute: the client is never silent 570 s, so it sends no keep-alive
    assert "ws_keepalive" not in _row(model, "1 a minute", "WebSocket push")["lines"]
    assert "ws_keepalive" not in _row(model, "1 a second", "WebSocket push")["lines"]
    month_s = 30 * 86400
    assert cost.keepalives_a_month(0, 0.3) == pytest.approx(month_s / 570)
    # a message every 20 minutes: one keep-alive 570 s into each gap, a second at 1,140 s
    gaps = month_s / 1200
    assert cost.keepalives_a_month(1 / 1200, 0.3) == pytest.approx(2 * gaps)
    # every 10 minutes: one a gap; held acks make a gap of two messages
    assert cost.keepalives_a_month(1 / 600, 0.3) == pytest.approx(month_s / 600)
    assert cost.keepalives_a_month(1 / 300, 301) == pytest.approx(month_s / 600)
