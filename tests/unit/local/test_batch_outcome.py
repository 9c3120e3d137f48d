"""What Lambda makes of a Kinesis function's answer (partial batch responses), as a table."""

from __future__ import annotations

from typing import Any

import pytest
from shoal.local.esm.config import MappingConfig
from shoal.local.esm.invocation import FAILURE, SUCCESS, BatchOutcome, batch_outcome, lane_of

BATCH = [1, 2, 3, 9, 10]


@pytest.mark.parametrize(
    "response",
    [None, {}, {"batchItemFailures": []}, {"batchItemFailures": None}, {"other": 1}],
    ids=["null-response", "empty-response", "empty-list", "null-list", "no-list"],
)
def test_no_reported_failure_is_complete_success(response: Any) -> None:
    # Given/When a response that reports nothing / Then the batch succeeded
    assert batch_outcome(response, BATCH, report_item_failures=True) == SUCCESS


@pytest.mark.parametrize(
    "response",
    [
        {"batchItemFailures": [{"itemIdentifier": ""}]},
        {"batchItemFailures": [{"itemIdentifier": None}]},
        {"batchItemFailures": [{"sequenceNumber": "2"}]},
        {"batchItemFailures": [{"itemIdentifier": "2"}, {"itemIdentifier": ""}]},
        {"batchItemFailures": [{"itemIdentifier": "4"}]},
        {"batchItemFailures": [{"itemIdentifier": 2}]},
        {"batchItemFailures": ["2"]},
        {"batchItemFailures": "2"},
        "ok",
        ["2"],
    ],
    ids=[
        "empty-id",
        "null-id",
        "bad-key",
        "one-bad-among-good",
        "not-in-batch",
        "not-a-string",
        "item-not-an-object",
        "list-not-a-list",
        "string-response",
        "list-response",
    ],
)
def test_unusable_report_is_complete_failure(response: Any) -> None:
    # Given/When an unusable failure report / Then the whole batch failed
    assert batch_outcome(response, BATCH, report_item_failures=True) == FAILURE


def test_lowest_failed_sequence_number_is_compared_as_a_number() -> None:
    # Given failures "10" and "9" (as strings "10" sorts before "9")
    response = {"batchItemFailures": [{"itemIdentifier": "10"}, {"itemIdentifier": "9"}]}

    # When the response is read / Then the batch resumes at 9
    assert batch_outcome(response, BATCH, report_item_failures=True) == BatchOutcome(
        "partial", failed_from=9
    )


def test_any_answer_is_success_without_report_batch_item_failures() -> None:
    # Given/When a mapping without ReportBatchItemFailures / Then every answer is success
    for response in ["ok", {"batchItemFailures": [{"itemIdentifier": ""}]}, 42]:
        assert batch_outcome(response, BATCH, report_item_failures=False) == SUCCESS


def test_mapping_without_optional_settings_gets_lambdas_defaults() -> None:
    # Given a Kinesis mapping as moto lists it, with every optional setting left out
    raw = {
        "UUID": "u-1",
        "EventSourceArn": "arn:aws:kinesis:us-east-1:123456789012:stream/s",
        "FunctionArn": "arn:aws:lambda:us-east-1:123456789012:function:shoal-router",
        "StartingPosition": "LATEST",
        "State": "Enabled",
    }

    # When it is read
    config = MappingConfig.from_api(raw)

    # Then it has Lambda's defaults and the function's name
    assert config is not None
    assert (config.batch_size, config.batching_window_s, config.parallelization_factor) == (
        100,
        0.0,
        1,
    )
    assert (config.max_retry_attempts, config.max_record_age_s) == (-1, -1)
    assert not config.report_item_failures and not config.bisect_on_error
    assert config.function_name == "shoal-router"
    assert config.active


def test_mapping_of_another_source_is_not_a_kinesis_mapping() -> None:
    # Given/When an SQS mapping / Then the Kinesis emulator leaves it alone
    raw = {
        "UUID": "u-2",
        "EventSourceArn": "arn:aws:sqs:us-east-1:123456789012:q",
        "FunctionArn": "arn:aws:lambda:us-east-1:123456789012:function:f",
    }
    assert MappingConfig.from_api(raw) is None


def test_lane_of_a_partition_key_is_stable_and_in_range() -> None:
    # Given/When keys spread over 10 lanes / Then a key's lane never changes and all are used
    lanes = {lane_of(f"key-{i}", 10) for i in range(200)}
    assert lanes == set(range(10))
    assert [lane_of("orders/eu/1", 10) for _ in range(3)] == [lane_of("orders/eu/1", 10)] * 3
