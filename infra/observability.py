"""The stack's dashboard and the alarms on lag, dead letters and DynamoDB throttling.

Custom metrics come from ``shoal.core.metrics`` (namespace ``Shoal``, one dimension
``service``: the function's declared name, which is its Powertools service name), the rest
from AWS' own namespaces. docs/operations.md lists each alarm with its threshold and why.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import aws_cdk as cdk
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_sns as sns
from shoal.core import metrics as names
from shoal.overview import DELIVERERS, PUBLISHERS
from shoal.push.model import MAX_BACKOFF_S

from infra.parts import StackParts, pascal

ALARM_PERIOD = cdk.Duration.minutes(5)
GRAPH_PERIOD = cdk.Duration.minutes(1)

#: The router normally runs about a second behind its shards (Lambda polls a shard about once
#: a second; bench/'s end-to-end p50 is 1.6 s). A minute behind, held for two 5-minute periods,
#: means a blocked shard (a failing batch is retried forever: NEVER_SKIP) or a shard that
#: outruns one invocation at a time. Kinesis keeps records 24 hours: time to act remains.
ROUTER_ITERATOR_AGE_MS = 60_000
#: push reads its taps and every retry queue through one function, and Lambda's IteratorAge
#: does not tell them apart: an RQ entry waits at its shard's head until its attempt time, up
#: to a subscription's max_backoff_s (at most ``MAX_BACKOFF_S``, an hour). Anything older than
#: that plus 15 minutes is a stuck tap or queue, never a backoff.
PUSH_ITERATOR_AGE_MS = int(MAX_BACKOFF_S * 1000) + 15 * 60_000
#: the archiver waits up to a minute to fill a batch (ARCHIVER_MAPPING) and writes a few
#: objects: five minutes behind is a failing batch (retried forever: NEVER_SKIP) or a log that
#: outgrew its shards. Records stay 24 hours, so there is time to act before events are lost.
ARCHIVER_ITERATOR_AGE_MS = 5 * 60_000
ITERATOR_AGE_PERIODS = 2
#: throttled requests in two 5-minute periods running: one period of throttling while an
#: on-demand table grows past twice its previous peak is expected (the SDK and Shoal retry);
#: ten minutes means a hot key or the table's throughput limit, which does not pass by itself
DYNAMODB_THROTTLE_PERIODS = 2


def service_metric(
    name: str,
    service: str,
    *,
    statistic: str = "Sum",
    period: cdk.Duration = GRAPH_PERIOD,
    label: str | None = None,
) -> cloudwatch.Metric:
    """One of Shoal's custom metrics as one function emits it."""
    return cloudwatch.Metric(
        namespace=names.NAMESPACE,
        metric_name=name,
        dimensions_map={names.DIMENSION: service},
        statistic=statistic,
        period=period,
        label=label or f"{name} ({service})",
    )


def search(expression: str, statistic: str, label: str) -> cloudwatch.MathExpression:
    """Every metric a CloudWatch search finds (streams made at run time have no fixed name)."""
    return cloudwatch.MathExpression(
        expression=f"SEARCH('{expression}', '{statistic}', {int(GRAPH_PERIOD.to_seconds())})",
        label=label,
        period=GRAPH_PERIOD,
        using_metrics={},
    )


class Observability:
    """The dashboard and the lag, dead-letter and throttling alarms of one stack."""

    def __init__(self, stack: StackParts, alarm_topic: sns.ITopic) -> None:
        self.stack = stack
        #: where the alarms and the dashboard are built: the stack these parts belong to
        self.scope = cdk.Stack.of(stack)
        self.notify = cloudwatch_actions.SnsAction(alarm_topic)
        self.declared = {f.name for f in stack.deployment.functions}
        self.alarms: list[cloudwatch.Alarm] = []
        self._iterator_age_alarms()
        self._dead_letter_alarm()
        self._dynamodb_alarms()
        self.dashboard = self._dashboard()

    # -- alarms ------------------------------------------------------------------------------

    def _alarm(
        self,
        cid: str,
        name: str,
        metric: cloudwatch.IMetric,
        description: str,
        *,
        threshold: float,
        periods: int,
    ) -> None:
        # the stack's alarm pattern (infra/stack.py): named after the stack, notify the topic,
        # missing data is not an alarm
        alarm = cloudwatch.Alarm(
            self.scope,
            cid,
            alarm_name=f"{self.stack.stack_name}-{name}",
            alarm_description=f"{description} (see docs/operations.md)",
            metric=metric,
            threshold=threshold,
            evaluation_periods=periods,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        alarm.add_alarm_action(self.notify)
        self.alarms.append(alarm)

    def _iterator_age_alarms(self) -> None:
        for name, threshold in (
            ("router", ROUTER_ITERATOR_AGE_MS),
            ("push", PUSH_ITERATOR_AGE_MS),
            ("archiver", ARCHIVER_ITERATOR_AGE_MS),
        ):
            function = self.stack.functions.get(name)
            if function is None:
                continue
            self._alarm(
                f"{name.capitalize()}IteratorAgeAlarm",
                f"{name}-iterator-age",
                function.metric("IteratorAge", statistic="Maximum", period=ALARM_PERIOD),
                f"{name} reads its streams more than {threshold // 1000} s behind",
                threshold=threshold,
                periods=ITERATOR_AGE_PERIODS,
            )

    def _dead_letter_growth(self, period: cdk.Duration) -> cloudwatch.MathExpression:
        """Messages into dead-letter queues minus those redriven out: the DLQs' net growth
        (a DLQ is a Kinesis stream per subscription, made at run time; its depth is what
        went in and was not sent back)."""
        return cloudwatch.MathExpression(
            expression="FILL(dead, 0) - FILL(redriven, 0)",
            using_metrics={
                "dead": service_metric(names.DEAD_LETTERED, "push", period=period),
                "redriven": service_metric(names.REDRIVEN, "pushadmin", period=period),
            },
            label="DLQ growth (dead-lettered - redriven)",
            period=period,
        )

    def _dead_letter_alarm(self) -> None:
        if "push" not in self.declared:
            return
        self._alarm(
            "DeadLetterGrowthAlarm",
            "dlq-growth",
            self._dead_letter_growth(ALARM_PERIOD),
            "push subscriptions' dead-letter queues grew: messages no retry will deliver",
            threshold=0,
            periods=1,
        )

    def _throttles(self, table: str, period: cdk.Duration) -> cloudwatch.MathExpression:
        def metric(name: str) -> cloudwatch.Metric:
            return cloudwatch.Metric(
                namespace="AWS/DynamoDB",
                metric_name=name,
                dimensions_map={"TableName": self.stack.tables[table].ref},
                statistic="Sum",
                period=period,
            )

        # ids unique per table: one graph holds every table's expression
        key = re.sub(r"[^a-z0-9_]", "_", table.lower())
        return cloudwatch.MathExpression(
            expression=f"FILL(r_{key}, 0) + FILL(w_{key}, 0)",
            using_metrics={
                f"r_{key}": metric("ReadThrottleEvents"),
                f"w_{key}": metric("WriteThrottleEvents"),
            },
            label=table,
            period=period,
        )

    def _dynamodb_alarms(self) -> None:
        for logical in self.stack.tables:
            self._alarm(
                f"{pascal(logical)}TableThrottlesAlarm",
                f"{logical}-table-throttles",
                self._throttles(logical, ALARM_PERIOD),
                f"DynamoDB throttled requests to the {logical} table for 10 minutes",
                threshold=0,
                periods=DYNAMODB_THROTTLE_PERIODS,
            )

    # -- dashboard ---------------------------------------------------------------------------

    def _present(self, pairs: Sequence[tuple[str, str]]) -> list[cloudwatch.IMetric]:
        """(metric, service) pairs of the functions this deployment declares."""
        return [service_metric(m, s) for m, s in pairs if s in self.declared]

    def _lambda(
        self, metric: str, statistic: str, only: Sequence[str] = ()
    ) -> list[cloudwatch.IMetric]:
        return [
            fn.metric(metric, statistic=statistic, period=GRAPH_PERIOD, label=name)
            for name, fn in self.stack.functions.items()
            if not only or name in only
        ]

    def _dashboard(self) -> cloudwatch.Dashboard:
        stack = self.stack
        prefix = stack.stream_prefix

        def graph(
            title: str,
            left: Sequence[cloudwatch.IMetric],
            right: Sequence[cloudwatch.IMetric] = (),
            width: int = 12,
            left_label: str | None = None,
        ) -> cloudwatch.GraphWidget:
            return cloudwatch.GraphWidget(
                title=title,
                left=list(left),
                right=list(right),
                width=width,
                height=6,
                left_y_axis=cloudwatch.YAxisProps(label=left_label, show_units=False)
                if left_label
                else None,
            )

        rows: list[list[cloudwatch.IWidget]] = [
            [
                cloudwatch.TextWidget(
                    markdown=(
                        f"# {stack.stack_name}\nThroughput, lag, errors, throttles, dead letters "
                        "and pipeline runs. Alarms and what to do: docs/operations.md."
                    ),
                    width=24,
                    height=2,
                )
            ],
            # throughput: the path of a message, per minute
            [
                graph(
                    "Messages per minute",
                    self._present(
                        [
                            # every function that publishes (HTTP, WebSocket frames, wills)
                            # and delivers (gets, WebSocket pushes, push subscriptions), as
                            # the console's Overview sums them (shoal.overview)
                            *((names.PUBLISHED, s) for s in PUBLISHERS),
                            (names.ROUTED, "router"),
                            (names.DELIVERIES, "router"),
                            *((names.DELIVERED, s) for s in DELIVERERS),
                            (names.ACKED, "messages"),
                        ]
                    ),
                ),
                graph(
                    "Redeliveries, dead letters, redrives, replays, rebalances",
                    [
                        *self._present(
                            [
                                (names.REDELIVERED, "messages"),
                                (names.REDELIVERED, "push"),
                                (names.DEAD_LETTERED, "push"),
                                (names.REDRIVEN, "pushadmin"),
                            ]
                        ),
                        # replays and rebalances are counted by whichever function does them
                        search(
                            f"{{{names.NAMESPACE},{names.DIMENSION}}} "
                            f'MetricName="{names.REPLAYED}"',
                            "Sum",
                            names.REPLAYED,
                        ),
                        search(
                            f"{{{names.NAMESPACE},{names.DIMENSION}}} "
                            f'MetricName="{names.REBALANCES}"',
                            "Sum",
                            names.REBALANCES,
                        ),
                    ],
                ),
            ],
            # lag: Lambda's view of the mappings, and Shoal's own per invocation
            [
                graph(
                    "Lag: IteratorAge (max, ms)",
                    self._lambda("IteratorAge", "Maximum", only=("router", "push", "archiver")),
                    left_label="ms",
                ),
                graph(
                    "Lag: oldest record of a batch (max, ms)",
                    [
                        service_metric(lag, service, statistic="Maximum")
                        for lag, service in (
                            (names.ROUTER_LAG, "router"),
                            (names.PUSH_LAG, "push"),
                            (names.ARCHIVER_LAG, "archiver"),
                        )
                        if service in self.declared
                    ],
                    left_label="ms",
                ),
            ],
            # the delivery-event log: what goes in, what the archiver writes, and refusals
            [
                graph(
                    "Delivery-event log: records in, refused (throttled)",
                    [
                        cloudwatch.Metric(
                            namespace="AWS/Kinesis",
                            metric_name=metric,
                            dimensions_map={"StreamName": stream.ref},
                            statistic="Sum",
                            period=GRAPH_PERIOD,
                            label=f"{logical}: {metric}",
                        )
                        for logical, stream in stack.streams.items()
                        for metric in ("IncomingRecords", "WriteProvisionedThroughputExceeded")
                    ],
                ),
                graph(
                    "Delivery events archived (lines per minute)",
                    self._present([(names.ARCHIVED_EVENTS, "archiver")]),
                ),
            ],
            # errors
            [
                graph("Lambda errors", self._lambda("Errors", "Sum")),
                graph(
                    "HTTP API answers",
                    [
                        stack.api.metric_server_error(period=GRAPH_PERIOD, label="5xx"),
                        stack.api.metric_client_error(period=GRAPH_PERIOD, label="4xx"),
                    ],
                    [stack.api.metric_count(period=GRAPH_PERIOD, label="requests")],
                ),
            ],
            # throttles
            [
                graph("Lambda throttles", self._lambda("Throttles", "Sum")),
                graph(
                    "DynamoDB throttled requests",
                    [self._throttles(t, GRAPH_PERIOD) for t in stack.tables],
                ),
            ],
            # the reaper's census (shoal.census): what is connected, and what waits in DLQs
            [
                graph(
                    "Census: WebSocket connections, connected sessions, shared groups (max)",
                    [
                        service_metric(gauge, "reaper", statistic="Maximum")
                        for gauge in (
                            names.CONNECTIONS,
                            names.SESSIONS_CONNECTED,
                            names.SHARED_GROUPS,
                        )
                    ]
                    if "reaper" in self.declared
                    else [],
                ),
                graph(
                    "Census: dead letters by push subscription (max)",
                    [
                        search(
                            f"{{{names.NAMESPACE},{names.DIMENSION},"
                            f"{names.SUBSCRIPTION_DIMENSION}}} "
                            f'MetricName="{names.DEAD_LETTERS}"',
                            "Maximum",
                            names.DEAD_LETTERS,
                        )
                    ],
                ),
            ],
            # dead letters and retries: per subscription streams, found by name
            [
                graph(
                    "Dead-letter queues: net growth",
                    [self._dead_letter_growth(GRAPH_PERIOD)] if "push" in self.declared else [],
                ),
                graph(
                    "Records put into retry and dead-letter queue streams",
                    [
                        search(
                            f'{{AWS/Kinesis,StreamName}} MetricName="IncomingRecords" '
                            f"{prefix} {queue}",
                            "Sum",
                            f"{queue.upper()} records",
                        )
                        for queue in ("rq", "dlq")
                    ],
                ),
            ],
        ]
        pipeline = getattr(stack, "pipeline", None)
        if pipeline is not None:
            app = pipeline.application.attr_application_id

            def jobs(metric: str) -> cloudwatch.Metric:
                return cloudwatch.Metric(
                    namespace="AWS/EMRServerless",
                    metric_name=metric,
                    dimensions_map={"ApplicationId": app},
                    statistic="Maximum" if metric == "RunningJobs" else "Sum",
                    period=cdk.Duration.minutes(5),
                    label=metric,
                )

            rows.append(
                [
                    graph(
                        "Pipeline job runs (EMR Serverless)",
                        [jobs(m) for m in ("SubmittedJobs", "SuccessJobs", "FailedJobs")],
                        [jobs("RunningJobs")],
                        width=24,
                    )
                ]
            )
        dashboard = cloudwatch.Dashboard(
            self.scope,
            "Dashboard",
            dashboard_name=stack.stack_name,
            default_interval=cdk.Duration.hours(3),
        )
        for row in rows:
            dashboard.add_widgets(*row)
        cdk.CfnOutput(
            self.scope,
            "DashboardName",
            value=dashboard.dashboard_name,
        )
        return dashboard
