"""Running the stack: the dashboard, the lag/DLQ/throttling alarms, the teardown custom
resource and the CDK feature flags, read from the session's synthesized templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from shoal.core import metrics
from shoal.declarations import DEPLOYMENT
from shoal.push.model import MAX_BACKOFF_S
from shoal.teardown import MAPPED_FUNCTIONS

from tests.infra.stacks import Synth, as_list

pytestmark = pytest.mark.infra


def logical(synthesized: Synth, kind: str, prefix: str) -> str:
    [found] = [k for k in synthesized.of_type(kind) if k.startswith(prefix)]
    return found


def function_id(synthesized: Synth, name: str) -> str:
    wanted = synthesized.stack.function_names[name]
    [found] = [
        k
        for k, v in synthesized.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName") == wanted
    ]
    return found


def alarms(synthesized: Synth) -> dict[str, dict[str, Any]]:
    return {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in synthesized.of_type("AWS::CloudWatch::Alarm").values()
    }


# -- dashboard -------------------------------------------------------------------------------


def dashboard_body(synthesized: Synth) -> dict[str, Any]:
    """The dashboard's JSON, each CloudFormation reference written as {"ref": <logical id>}."""
    [dashboard] = synthesized.of_type("AWS::CloudWatch::Dashboard").values()
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]

    def text(part: Any) -> str:
        if isinstance(part, str):
            return part
        target = part.get("Ref") or part.get("Fn::GetAtt", ["?"])[0]
        return f"ref:{target}"

    return dict(json.loads("".join(text(p) for p in parts)))


def graphed(body: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """(widget title, metric row) for every row of every graph."""
    return [
        (w["properties"]["title"], row)
        for w in body["widgets"]
        if w["type"] == "metric"
        for row in w["properties"]["metrics"]
    ]


def test_dashboard_shows_every_custom_metric_by_its_emitting_function(deployed: Synth) -> None:
    rows = graphed(dashboard_body(deployed))
    plain = {(row[0], row[1], row[3]) for _, row in rows if row[0] == metrics.NAMESPACE}
    searched = " ".join(row[0]["expression"] for _, row in rows if "expression" in row[0])
    # Then each count and lag is on it, under the one bounded dimension
    for _, row in rows:
        if row[0] == metrics.NAMESPACE:
            assert row[2] == metrics.DIMENSION
    for name in (*metrics.COUNTS, *metrics.LAGS):
        assert any(m == name for _, m, _ in plain) or f'MetricName="{name}"' in searched, name
    # and the service values are declared functions (Powertools' service = the folder name)
    declared = {f.name for f in deployed.deployment.functions}
    assert {service for *_, service in plain} <= declared
    assert (metrics.NAMESPACE, metrics.PUBLISHED, "publish") in plain
    assert (metrics.NAMESPACE, metrics.ROUTER_LAG, "router") in plain
    assert (metrics.NAMESPACE, metrics.PUSH_LAG, "push") in plain


def test_dashboard_shows_lag_errors_throttles_dlq_and_pipeline_runs(deployed: Synth) -> None:
    rows = graphed(dashboard_body(deployed))
    aws = {(row[0], row[1]) for _, row in rows if isinstance(row[0], str)}
    expressions = " ".join(row[0]["expression"] for _, row in rows if "expression" in row[0])
    # Lambda's lag, errors and throttles; DynamoDB's throttles; EMR Serverless job runs
    assert {
        ("AWS/Lambda", "IteratorAge"),
        ("AWS/Lambda", "Errors"),
        ("AWS/Lambda", "Throttles"),
        ("AWS/DynamoDB", "ReadThrottleEvents"),
        ("AWS/DynamoDB", "WriteThrottleEvents"),
        ("AWS/EMRServerless", "SuccessJobs"),
        ("AWS/EMRServerless", "FailedJobs"),
        ("AWS/ApiGateway", "5xx"),
    } <= aws
    # IteratorAge of the three functions that read streams, each by its own function
    ages = {row[3] for _, row in rows if row[:2] == ["AWS/Lambda", "IteratorAge"]}
    assert ages == {f"ref:{function_id(deployed, n)}" for n in ("router", "push", "archiver")}
    # the event log's records in and refused, by its name
    log = {row[1]: row[3] for _, row in rows if row[0] == "AWS/Kinesis" and len(row) > 3}
    assert log == {
        "IncomingRecords": "ref:EventsStream",
        "WriteProvisionedThroughputExceeded": "ref:EventsStream",
    }
    # every table's throttles
    tables = {row[3] for _, row in rows if row[:2] == ["AWS/DynamoDB", "WriteThrottleEvents"]}
    assert tables == {f"ref:{k}" for k in deployed.of_type("AWS::DynamoDB::Table")}
    # the pipeline's application
    app = logical(deployed, "AWS::EMRServerless::Application", "Pipeline")
    assert all(
        row[3] == f"ref:{app}" for _, row in rows if isinstance(row[0], str) and "EMR" in row[0]
    )
    # DLQs are Kinesis streams made at run time: their growth, and their streams' puts found by
    # a search (retry queues too)
    assert "FILL(dead, 0) - FILL(redriven, 0)" in expressions
    for queue in ("rq", "dlq"):
        assert f'{{AWS/Kinesis,StreamName}} MetricName="IncomingRecords" shoal {queue}' in (
            expressions
        )


# -- alarms ----------------------------------------------------------------------------------


def test_iterator_age_alarms_of_router_push_and_archiver(deployed: Synth) -> None:
    found = alarms(deployed)
    router = found["shoal-test-router-iterator-age"]
    push = found["shoal-test-push-iterator-age"]
    archiver = found["shoal-test-archiver-iterator-age"]
    # archiver: five minutes behind (its batches wait up to a minute to fill), for ten minutes
    assert (archiver["Threshold"], archiver["EvaluationPeriods"]) == (300_000, 2)
    # router: a minute behind, for two 5-minute periods
    assert (router["Threshold"], router["EvaluationPeriods"], router["Period"]) == (60_000, 2, 300)
    # push: beyond the longest backoff a retry queue may hold a record for, plus 15 minutes
    assert push["Threshold"] == MAX_BACKOFF_S * 1000 + 15 * 60_000
    for alarm, name in ((router, "router"), (push, "push"), (archiver, "archiver")):
        assert (alarm["Namespace"], alarm["MetricName"]) == ("AWS/Lambda", "IteratorAge")
        assert alarm["Statistic"] == "Maximum"
        assert alarm["Dimensions"] == [
            {"Name": "FunctionName", "Value": {"Ref": function_id(deployed, name)}}
        ]


def test_dead_letter_growth_alarm(deployed: Synth) -> None:
    alarm = alarms(deployed)["shoal-test-dlq-growth"]
    by_id = {m["Id"]: m for m in alarm["Metrics"]}
    [expression] = [m for m in alarm["Metrics"] if "Expression" in m]
    # more dead-lettered than redriven in 5 minutes
    assert expression["Expression"] == "FILL(dead, 0) - FILL(redriven, 0)"
    assert (alarm["Threshold"], alarm["EvaluationPeriods"]) == (0, 1)
    dead = by_id["dead"]["MetricStat"]
    assert dead["Metric"]["MetricName"] == metrics.DEAD_LETTERED
    assert dead["Metric"]["Dimensions"] == [{"Name": metrics.DIMENSION, "Value": "push"}]
    assert (dead["Period"], dead["Stat"]) == (300, "Sum")
    assert by_id["redriven"]["MetricStat"]["Metric"]["MetricName"] == metrics.REDRIVEN


def test_every_table_has_a_throttling_alarm(deployed: Synth) -> None:
    found = alarms(deployed)
    for table in deployed.deployment.tables:
        alarm = found[f"shoal-test-{table.logical}-table-throttles"]
        # throttled in two 5-minute periods running
        assert (alarm["Threshold"], alarm["EvaluationPeriods"]) == (0, 2)
        names = {
            m["MetricStat"]["Metric"]["MetricName"] for m in alarm["Metrics"] if "MetricStat" in m
        }
        assert names == {"ReadThrottleEvents", "WriteThrottleEvents"}
        for m in alarm["Metrics"]:
            if "MetricStat" in m:
                assert m["MetricStat"]["Metric"]["Dimensions"] == [
                    {"Name": "TableName", "Value": {"Ref": f"{_pascal(table.logical)}Table"}}
                ]


def test_new_alarms_notify_the_alarm_topic_and_ignore_missing_data(deployed: Synth) -> None:
    topic = logical(deployed, "AWS::SNS::Topic", "AlarmTopic")
    for props in alarms(deployed).values():
        assert props["AlarmActions"] == [{"Ref": topic}]
        assert props["TreatMissingData"] == "notBreaching"
        assert props["ComparisonOperator"] == "GreaterThanThreshold"


def _pascal(name: str) -> str:
    from infra.stack import pascal

    return pascal(name)


# -- the runtime resources' custom resource --------------------------------------------------


def test_teardown_resource_outlives_nothing_it_needs(deployed: Synth) -> None:
    [(cid, resource)] = deployed.of_type("Custom::ShoalRuntimeResources").items()
    # Given cdk.json (retainStreams unset): deleting the stack deletes the runtime resources
    assert resource["Properties"]["Retain"] is False
    # and CloudFormation always sends the Delete (retention is the handler's decision)
    assert resource["DeletionPolicy"] == "Delete"
    # It is deleted before the functions whose mappings it removes and the tables it reads
    depends = set(resource["DependsOn"])
    for name in MAPPED_FUNCTIONS:
        assert function_id(deployed, name) in depends
    assert set(deployed.of_type("AWS::DynamoDB::Table")) <= depends
    # and before its own function, which its provider invokes
    provider = deployed.resources[resource["Properties"]["ServiceToken"]["Fn::GetAtt"][0]]
    env = provider["Properties"]["Environment"]["Variables"]
    assert env["USER_ON_EVENT_FUNCTION_ARN"]["Fn::GetAtt"][0] == function_id(deployed, "teardown")
    # The bootstrap's default topic is made after it, so a failed create rolls back through it
    [default_topic] = deployed.of_type("Custom::ShoalDefaultTopic").values()
    assert cid in default_topic["DependsOn"]


def test_teardown_may_delete_streams_and_mappings_and_read_its_stack(deployed: Synth) -> None:
    assert {"kinesis:DeleteStream", "kinesis:DescribeStreamSummary"} <= deployed.actions(
        "teardown", "kinesis"
    )
    assert {"lambda:DeleteEventSourceMapping", "lambda:ListEventSourceMappings"} <= (
        deployed.actions("teardown", "lambda")
    )
    [describe] = [
        s
        for s in deployed.statements("teardown")
        if "cloudformation:DescribeStacks" in as_list(s["Action"])
    ]
    assert describe["Resource"] == {"Ref": "AWS::StackId"}
    # it reads the tables that record runtime streams, and writes none
    assert not deployed.actions("teardown", "dynamodb") & {
        "dynamodb:PutItem",
        "dynamodb:UpdateItem",
        "dynamodb:DeleteItem",
    }


def test_retain_streams_context_reaches_the_resource(variant: Synth) -> None:
    # Given -c retainStreams=true (a string, as the CLI passes it)
    [resource] = variant.of_type("Custom::ShoalRuntimeResources").values()
    assert resource["Properties"]["Retain"] is True
    assert resource["DeletionPolicy"] == "Delete"


def test_runtime_mappings_invoke_only_the_functions_the_teardown_searches() -> None:
    # Every mapping made at run time comes from an event_source_mappings grant: its target
    # must be one whose mappings the teardown lists
    targets = {
        g.name for f in DEPLOYMENT.functions for g in f.grants if g.kind == "event_source_mappings"
    }
    assert targets <= set(MAPPED_FUNCTIONS)


# -- feature flags ---------------------------------------------------------------------------


def test_no_feature_flag_is_left_unconfigured(deployed: Synth) -> None:
    # Given cdk.json's context (the fixtures synthesize with it)
    assembly = deployed.stack.node.root.synth()
    manifest = json.loads((Path(assembly.directory) / "manifest.json").read_text())
    [report] = [a for a in manifest["artifacts"].values() if a["type"] == "cdk:feature-flag-report"]
    flags = report["properties"]["flags"]
    assert len(flags) > 80
    # Then none is one the CLI warns about: unset while its recommended value differs from how
    # an unset flag behaves (aws-cdk's displayFlagsMessage)
    unconfigured = [
        name
        for name, flag in flags.items()
        if "userValue" not in flag
        and (flag.get("unconfiguredBehavesLike") or {}).get("v2", False)
        != flag.get("recommendedValue")
    ]
    assert unconfigured == []
    # And explicitStackTags, which stops Tags.of(stack) from tagging the stack itself, leaves
    # the stack's tag (CloudFormation copies it onto every resource it creates) as it was
    stack = manifest["artifacts"][deployed.stack.artifact_id]
    assert stack["properties"]["tags"] == {"app": "shoal"}
