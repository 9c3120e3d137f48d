"""The enhanced fan-out option's price model (bench/cost.py): the pricing page's two meters,
times a month of the router's consumer on a shard and the bytes it reads."""

from __future__ import annotations

import math

import pytest

from bench import cost


def test_a_shard_a_month_is_its_consumer_shard_hours_read_or_idle() -> None:
    # Given a quiet shard (nothing read), Then the month is 720 consumer-shard-hours
    idle = cost.fan_out_month(0)
    assert idle["consumer_shard_hours"] == pytest.approx(720 * 0.015) == 10.80
    assert idle["data_retrieval"] == 0 and math.isinf(idle["per_million_messages"])


def test_a_thousand_messages_a_second_add_the_bytes_the_consumer_reads() -> None:
    # Given 1,000 messages a second of 400 bytes each on one shard
    month = cost.fan_out_month(1_000)
    # Then the data read is 2.592e9 messages' bytes at $0.013 per GiB
    gib = 1_000 * 30 * 86_400 * 400 / 2**30
    assert month["data_retrieval"] == pytest.approx(gib * 0.013)
    assert month["total"] == pytest.approx(10.80 + gib * 0.013)
    # and per million messages it is the total over 2,592 million
    assert month["per_million_messages"] == pytest.approx(month["total"] / 2_592)


def test_from_the_rate_it_pays_the_option_costs_at_most_a_tenth_of_the_goal() -> None:
    # Given the rate from which the option is cheap per message
    rate = cost.fan_out_pays_from_per_s()
    # Then at that rate it is within a tenth of the batched goal, and just below it is not
    assert cost.fan_out_month(rate)["per_million_messages"] <= cost.GOAL / 10
    assert cost.fan_out_month(rate - 1)["per_million_messages"] > cost.GOAL / 10


def test_the_latency_table_names_a_source_for_every_figure() -> None:
    # Every step with a figure says where it is from; a step without one says so
    for step in cost.DEPLOYED_LATENCY:
        assert step.figure
        assert step.source != "-" or "no AWS figure" in step.figure
