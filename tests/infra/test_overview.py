"""The Overview's query against the synthesized stack: every metric it asks CloudWatch for is
one the stack graphs, under the dimensions the stack's functions emit it with (their service
names and function names in the template), and the admin function may make that one call and
no other of CloudWatch's."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from shoal.core import metrics
from shoal.core.config import Config
from shoal.overview import RANGES, plan

from tests.infra.stacks import Synth, as_list
from tests.infra.test_operations import dashboard_body, function_id, graphed

pytestmark = pytest.mark.infra

NOW = dt.datetime(2026, 12, 4, 21, 57, 30, tzinfo=dt.UTC)
#: CloudWatch's limits on one GetMetricData: queries, and datapoints returned
MAX_QUERIES = 500
MAX_DATAPOINTS = 100_800


def admin_config(deployed: Synth) -> Config:
    """The admin function's configuration as its environment in the template gives it (a
    reference, a table's generated name, becomes its logical id)."""
    variables = deployed.function("admin")["Properties"]["Environment"]["Variables"]
    env = {
        key: value if isinstance(value, str) else f"ref:{value.get('Ref', key)}"
        for key, value in variables.items()
    }
    return Config.from_env(env)


def test_every_metric_the_overview_asks_for_is_one_the_stack_graphs(deployed: Synth) -> None:
    rows = graphed(dashboard_body(deployed))
    plain = {(row[0], row[1], row[3]) for _, row in rows if row[0] == metrics.NAMESPACE}
    searched = " ".join(row[0]["expression"] for _, row in rows if "expression" in row[0])
    lambda_rows = {(row[1], row[3]) for _, row in rows if row[0] == "AWS/Lambda"}
    services = {
        deployed.function(f.name)["Properties"]["Environment"]["Variables"][
            "POWERTOOLS_SERVICE_NAME"
        ]
        for f in deployed.deployment.functions
    }
    config = admin_config(deployed)
    for name in RANGES:
        # When the route plans a view, with a push subscription
        request = plan(name, NOW, config, ["orders"], deployed.deployment).request()
        queries = request["MetricDataQueries"]
        period = queries[0]["MetricStat"]["Period"]
        points = (request["EndTime"] - request["StartTime"]).total_seconds() // period
        # Then it is one call within CloudWatch's limits
        assert len(queries) <= MAX_QUERIES and len(queries) * points <= MAX_DATAPOINTS
        for query in queries:
            metric = query["MetricStat"]["Metric"]
            dims = {d["Name"]: d["Value"] for d in metric["Dimensions"]}
            if metric["Namespace"] == metrics.NAMESPACE:
                # a service name a function of the stack emits under
                assert dims[metrics.DIMENSION] in services, query
                graphed_plain = (metric["Namespace"], metric["MetricName"], dims["service"])
                graphed_search = f'MetricName="{metric["MetricName"]}"' in searched
                if metrics.SUBSCRIPTION_DIMENSION in dims:
                    assert graphed_search, query
                else:
                    # graphed by the dashboard as it is asked for, or found by its searches
                    assert graphed_plain in plain or graphed_search, query
            else:
                # Lambda's by the function's name, which the template gives that function
                assert metric["Namespace"] == "AWS/Lambda"
                assert metric["MetricName"] in {"Errors", "Throttles"}
                [declared] = [
                    n for n, v in deployed.stack.function_names.items() if v == dims["FunctionName"]
                ]
                function = deployed.function(declared)
                assert function["Properties"]["FunctionName"] == dims["FunctionName"]
                assert (metric["MetricName"], f"ref:{function_id(deployed, declared)}") in (
                    lambda_rows
                )


def _cloudwatch_statements(deployed: Synth, name: str) -> list[dict[str, Any]]:
    return [
        s
        for s in deployed.statements(name)
        if any(str(a).startswith("cloudwatch:") for a in as_list(s["Action"]))
    ]


def test_the_admin_function_may_get_metric_data_and_nothing_else_of_cloudwatch(
    deployed: Synth,
) -> None:
    # GetMetricData has no resource-level permissions: that one action, on "*" (CDK merges it
    # into one statement with the role's other actions on "*")
    [statement] = _cloudwatch_statements(deployed, "admin")
    cloudwatch = [a for a in as_list(statement["Action"]) if a.startswith("cloudwatch:")]
    assert cloudwatch == ["cloudwatch:GetMetricData"]
    assert (statement["Effect"], statement["Resource"]) == ("Allow", "*")
    assert "Condition" not in statement
    # and no other function may read the account's metrics
    others = [f.name for f in deployed.deployment.functions if f.name != "admin"]
    assert [n for n in others if _cloudwatch_statements(deployed, n)] == []
