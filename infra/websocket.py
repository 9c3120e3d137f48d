"""The WebSocket API beside the HTTP API, built only from the declarations (``shoal.edge``).

``DEPLOYMENT.websocket`` (``WebSocketDef``) and the functions' ``ws_routes`` say everything: one
route per declared route key, a Lambda proxy integration per function, the mock routes answered
by API Gateway itself (no function runs for a keep-alive), ``$connect`` guarded by the declared
REQUEST authorizer, ``execute-api:ManageConnections`` for the functions granted ``connections``,
and the ``@connections`` endpoint and JWT rules in every function's environment. A deployment
without WebSocket routes gets no WebSocket API (``WebSocketEdge.enabled``).

Built with the L1 constructs: they map one to one onto the contract (docs/ws-contract), and
the integration and route responses of the mock routes have no L2 form.

The API is made before the functions (their environment names it) and wired to them after
(``connect``), then given alarms and dashboard rows (``observe``); ``infra.stack`` calls the
three in that order. This module does not import ``infra.stack``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_apigatewayv2 as apigw
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from constructs import Construct
from shoal.core import metrics
from shoal.declarations import Deployment, FunctionDef, Grant, WsRoute

from infra.nag import acknowledge, acknowledge_wildcards

ALARM_PERIOD = cdk.Duration.minutes(5)
GRAPH_PERIOD = cdk.Duration.minutes(1)
LOG_RETENTION = logs.RetentionDays.ONE_MONTH

#: the selection key of a route's (and an integration's) only response
DEFAULT_RESPONSE = "$default"
#: what a mock integration's request template must produce for API Gateway to answer 200
MOCK_REQUEST = '{"statusCode": 200}'

#: ``@connections`` per access: GET reads a connection, POST pushes a frame, DELETE closes it
CONNECTIONS_METHODS = {"read": ("GET",), "write": ("POST", "DELETE")}

#: API Gateway's quota: new connections per second per account and region (docs/operations.md).
#: Connections opened in an alarm period past 80 % of it: clients are about to be refused 429.
NEW_CONNECTIONS_PER_S = 500
CONNECT_ALARM_SHARE = 0.8
#: the custom metric the pushing functions count (``shoal.core.metrics``; namespace Shoal,
#: dimension service): frames pushed, and pushes that failed. A push to a connection that is
#: gone fails by design (the inbox keeps the message), so the alarm is on the share of
#: failures, over enough pushes to mean something, two periods running.
FRAMES_PUSHED = metrics.PUSHED
PUSH_FAILED = metrics.PUSH_FAILED
PUSH_FAILED_SHARE = 0.5
PUSH_FAILED_MIN_PUSHES = 100
POSTS_THROTTLED = metrics.POSTS_THROTTLED
#: the push queue's oldest message older than this (its lanes fall behind: the pusher's
#: concurrency or the account's API Gateway rate is too small for the fan-out) raises an alarm
PUSH_BACKLOG_AGE_ALARM_S = 60
#: context flag: access logs for the WebSocket stage. Off by default: unlike an HTTP API's, a
#: WebSocket stage can log only once the account's API Gateway CloudWatch Logs role is set
#: (an account-wide setting this stack does not take over); with it unset the stage fails
WS_ACCESS_LOGS_CONTEXT = "wsAccessLogs"
#: the stage's steady rate and burst of messages (per second): half the account's default
#: quota per region, as the HTTP API's stage (infra/stack.py)
WS_RATE_LIMIT = 5_000
WS_BURST_LIMIT = 2_500


def route_id(key: str) -> str:
    """A construct id for a route key: ``$connect`` -> ``DollarConnect``, ``ping`` -> ``Ping``."""
    word = key.replace("$", "Dollar-")
    return "".join(part[:1].upper() + part[1:] for part in word.replace("_", "-").split("-"))


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value or "").strip().lower() in {"1", "true", "yes"}


class WebSocketEdge(Construct):
    """The WebSocket API, its stage, routes, authorizer, grants, alarms and output."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        deployment: Deployment,
        jwt_issuer: str,
        jwt_audiences: Sequence[str],
    ) -> None:
        super().__init__(scope, construct_id)
        self.stack = cdk.Stack.of(self)
        self.deployment = deployment
        self.definition = deployment.websocket
        self.jwt_issuer = jwt_issuer
        self.jwt_audiences = tuple(jwt_audiences)
        self.enabled = bool(deployment.ws_routes())
        self.api: apigw.CfnApi | None = None
        self.stage: apigw.CfnStage | None = None
        self.routes: dict[str, apigw.CfnRoute] = {}
        self.alarms: list[cloudwatch.Alarm] = []
        if self.enabled:
            self._api()

    # -- made before the functions -----------------------------------------------------------

    def _api(self) -> None:
        stack = self.stack
        self.api = apigw.CfnApi(
            self,
            "Api",
            name=f"{stack.stack_name}-ws",
            description="Shoal: a session's life in JSON frames, deliveries pushed",
            protocol_type="WEBSOCKET",
            route_selection_expression=self.definition.route_selection,
        )
        access_logs = None
        if _flag(self.node.try_get_context(WS_ACCESS_LOGS_CONTEXT)):
            group = logs.LogGroup(
                self,
                "AccessLogs",
                retention=LOG_RETENTION,
                removal_policy=cdk.RemovalPolicy.DESTROY,
            )
            # the HTTP API's fields; identity by principal (sub) only, never a token or a frame
            access_logs = apigw.CfnStage.AccessLogSettingsProperty(
                destination_arn=group.log_group_arn,
                format=json.dumps(
                    {
                        "requestId": "$context.requestId",
                        "requestTime": "$context.requestTimeEpoch",
                        "eventType": "$context.eventType",
                        "routeKey": "$context.routeKey",
                        "connectionId": "$context.connectionId",
                        "status": "$context.status",
                        "integrationLatency": "$context.integrationLatency",
                        "integrationError": "$context.integrationErrorMessage",
                        "authorizerError": "$context.authorizer.error",
                        "sub": "$context.authorizer.principalId",
                        "sourceIp": "$context.identity.sourceIp",
                    }
                ),
            )
        self.stage = apigw.CfnStage(
            self,
            "Stage",
            api_id=self.api.ref,
            stage_name=self.definition.stage,
            auto_deploy=True,
            description="Shoal's WebSocket stage",
            access_log_settings=access_logs,
            default_route_settings=apigw.CfnStage.RouteSettingsProperty(
                throttling_rate_limit=WS_RATE_LIMIT, throttling_burst_limit=WS_BURST_LIMIT
            ),
        )
        if access_logs is None:
            for rule in ("AwsSolutions-APIG1", "Serverless-APIGWAccessLogging"):
                acknowledge(
                    self.stage,
                    rule,
                    "a WebSocket stage logs only once the account's API Gateway CloudWatch "
                    f"Logs role is set, which this stack does not take over: -c "
                    f"{WS_ACCESS_LOGS_CONTEXT}=true turns them on where it is",
                )

    @property
    def endpoint(self) -> str:
        """The ``@connections`` endpoint the functions' SDK client is given."""
        assert self.api is not None
        return (
            f"https://{self.api.ref}.execute-api.{self.stack.region}."
            f"{self.stack.url_suffix}/{self.definition.stage}"
        )

    @property
    def url(self) -> str:
        """The ``wss://`` URL clients connect to."""
        assert self.api is not None
        return (
            f"wss://{self.api.ref}.execute-api.{self.stack.region}."
            f"{self.stack.url_suffix}/{self.definition.stage}"
        )

    def environment(self) -> dict[str, str]:
        """What every function's environment gains: the JWT rules (the HTTP API's JWT
        authorizer's) and, with a WebSocket API, its ``@connections`` endpoint."""
        env = {
            "SHOAL_JWT_ISSUER": self.jwt_issuer,
            "SHOAL_JWT_AUDIENCE": ",".join(self.jwt_audiences),
        }
        if self.enabled:
            env["SHOAL_CONNECTIONS_ENDPOINT"] = self.endpoint
        return env

    def grant_connections(self, fdef: FunctionDef, fn: lambda_.IFunction, grant: Grant) -> None:
        """``execute-api:ManageConnections`` on the stage's ``@connections``: GET to read,
        POST and DELETE to write (push a frame, close a connection)."""
        if self.api is None:
            raise ValueError(
                f"function {fdef.name} is granted connections {grant.name!r}, but the "
                "deployment declares no WebSocket routes"
            )
        methods = [
            *(CONNECTIONS_METHODS["read"] if grant.access in ("read", "read_write") else ()),
            *(CONNECTIONS_METHODS["write"] if grant.access in ("write", "read_write") else ()),
        ]
        stage = self.definition.stage
        statement = iam.PolicyStatement(
            actions=["execute-api:ManageConnections"],
            resources=[self._execute_arn(f"{stage}/{m}/@connections/*") for m in methods],
        )
        fn.add_to_role_policy(statement)
        acknowledge_wildcards(
            fn,
            [statement],
            "a connection's id is made when a client connects: the grant names the API, the "
            "stage and the methods, and every connection",
        )

    def _execute_arn(self, path: str) -> str:
        assert self.api is not None
        return self.stack.format_arn(
            service="execute-api", resource=self.api.ref, resource_name=path
        )

    # -- wired to the functions ---------------------------------------------------------------

    def connect(self, functions: Mapping[str, lambda_.IFunction]) -> None:
        """Integrations, routes, the ``$connect`` authorizer and the invoke permissions."""
        if self.api is None:
            return
        api_id = self.api.ref
        authorizer = self._authorizer(functions)
        integrations: dict[str, apigw.CfnIntegration] = {}
        for route, fdef in self.deployment.ws_routes():
            if fdef.name not in integrations:
                fn = functions[fdef.name]
                integrations[fdef.name] = apigw.CfnIntegration(
                    self,
                    f"{route_id(fdef.name)}Integration",
                    api_id=api_id,
                    integration_type="AWS_PROXY",
                    # Lambda is invoked with POST, whatever the route (API Gateway requires it)
                    integration_method="POST",
                    integration_uri=self._invoke_uri(fn),
                    # the contract's events are the Lambda proxy events; a function answers
                    # within API Gateway's 29 s
                    timeout_in_millis=29_000,
                )
                fn.add_permission(
                    f"{route_id(fdef.name)}WebSocketInvoke",
                    principal=iam.ServicePrincipal("apigateway.amazonaws.com"),
                    source_arn=self._execute_arn(f"{self.definition.stage}/*"),
                )
            self._route(
                route,
                f"integrations/{integrations[fdef.name].ref}",
                authorizer=authorizer if route.key == "$connect" else None,
            )
        for mock in self.definition.mock_routes:
            self._mock_route(mock.key, mock.response)

    def _invoke_uri(self, fn: lambda_.IFunction) -> str:
        return (
            f"arn:{self.stack.partition}:apigateway:{self.stack.region}:lambda:path/"
            f"2015-03-31/functions/{fn.function_arn}/invocations"
        )

    def _authorizer(self, functions: Mapping[str, lambda_.IFunction]) -> apigw.CfnAuthorizer:
        assert self.api is not None
        name = self.definition.authorizer
        if name not in functions:
            raise ValueError(
                f"the WebSocket API's authorizer {name!r} is not a declared function "
                f"(declared: {sorted(functions)})"
            )
        fn = functions[name]
        authorizer = apigw.CfnAuthorizer(
            self,
            "Authorizer",
            api_id=self.api.ref,
            name=name,
            authorizer_type="REQUEST",
            authorizer_uri=self._invoke_uri(fn),
            # no identity sources: the token may be in Authorization or in
            # Sec-WebSocket-Protocol, so the authorizer runs for every handshake
        )
        fn.add_permission(
            "WebSocketAuthorizerInvoke",
            principal=iam.ServicePrincipal("apigateway.amazonaws.com"),
            source_arn=self._execute_arn(f"authorizers/{authorizer.ref}"),
        )
        return authorizer

    def _route(
        self,
        route: WsRoute,
        target: str,
        *,
        authorizer: apigw.CfnAuthorizer | None = None,
    ) -> apigw.CfnRoute:
        assert self.api is not None
        cid = route_id(route.key)
        cfn = apigw.CfnRoute(
            self,
            f"{cid}Route",
            api_id=self.api.ref,
            route_key=route.key,
            target=target,
            authorization_type="CUSTOM" if authorizer is not None else "NONE",
            authorizer_id=authorizer.ref if authorizer is not None else None,
            # two-way: the function's (or the mock's) answer goes back as a frame
            route_response_selection_expression=DEFAULT_RESPONSE if route.two_way else None,
        )
        if route.two_way:
            apigw.CfnRouteResponse(
                self,
                f"{cid}RouteResponse",
                api_id=self.api.ref,
                route_id=cfn.ref,
                route_response_key=DEFAULT_RESPONSE,
            )
        if authorizer is None:
            acknowledge(
                cfn,
                "AwsSolutions-APIG4",
                "a WebSocket API authorizes a connection once, at $connect (its REQUEST "
                "authorizer); API Gateway takes no authorizer on its other routes, which only "
                "an authorized connection can reach",
            )
        self.routes[route.key] = cfn
        return cfn

    def _mock_route(self, key: str, response: str | None) -> None:
        assert self.api is not None
        # The answer is a mapping template, which API Gateway runs through Velocity: a "$" or
        # "#" in it would be read as a reference or a directive, not sent verbatim
        if response is not None and ("$" in response or "#" in response):
            raise ValueError(
                f"mock route {key!r}: its response cannot hold '$' or '#' (a mapping "
                "template would read them), so API Gateway could not answer it verbatim"
            )
        cid = route_id(key)
        integration = apigw.CfnIntegration(
            self,
            f"{cid}MockIntegration",
            api_id=self.api.ref,
            integration_type="MOCK",
            template_selection_expression="\\$default",
            request_templates={DEFAULT_RESPONSE: MOCK_REQUEST},
        )
        if response is None:
            # one way: no route response, so API Gateway sends nothing back
            self._route(WsRoute(key, two_way=False), f"integrations/{integration.ref}")
            return
        apigw.CfnIntegrationResponse(
            self,
            f"{cid}MockIntegrationResponse",
            api_id=self.api.ref,
            integration_id=integration.ref,
            integration_response_key=DEFAULT_RESPONSE,
            template_selection_expression="\\$default",
            response_templates={DEFAULT_RESPONSE: response},
        )
        self._route(WsRoute(key, two_way=True), f"integrations/{integration.ref}")

    # -- operations ---------------------------------------------------------------------------

    def _api_metric(self, name: str, label: str, period: cdk.Duration) -> cloudwatch.Metric:
        assert self.api is not None
        return cloudwatch.Metric(
            namespace="AWS/ApiGateway",
            metric_name=name,
            dimensions_map={"ApiId": self.api.ref, "Stage": self.definition.stage},
            statistic="Sum",
            period=period,
            label=label,
        )

    def _pushers(self) -> list[str]:
        """The functions that push: those granted the connections."""
        return [
            f.name
            for f in self.deployment.functions
            if any(g.kind == "connections" for g in f.grants)
        ]

    def _shoal_sum(self, name: str, period: cdk.Duration, prefix: str) -> cloudwatch.MathExpression:
        metrics = {
            f"{prefix}{i}": cloudwatch.Metric(
                namespace="Shoal",
                metric_name=name,
                dimensions_map={"service": service},
                statistic="Sum",
                period=period,
            )
            for i, service in enumerate(self._pushers())
        }
        expression = " + ".join(f"FILL({m}, 0)" for m in metrics) or "0"
        return cloudwatch.MathExpression(
            expression=expression, using_metrics=metrics, label=name, period=period
        )

    def observe(
        self,
        alarm_topic: sns.ITopic,
        dashboard: cloudwatch.Dashboard,
        *,
        push_queue: sqs.IQueue | None = None,
        push_dead_letters: sqs.IQueue | None = None,
    ) -> None:
        """Alarms on errors, the new-connection quota, failed pushes and the push queue's
        backlog (its age, its dead letters); one dashboard row of connections, messages,
        errors and pushes, and one of the push queue; the ``wss://`` URL as an output."""
        if self.api is None:
            return
        notify = cloudwatch_actions.SnsAction(alarm_topic)

        def alarm(
            cid: str,
            name: str,
            metric: cloudwatch.IMetric,
            description: str,
            *,
            threshold: float = 0,
            periods: int = 1,
        ) -> None:
            made = cloudwatch.Alarm(
                self,
                cid,
                alarm_name=f"{self.stack.stack_name}-{name}",
                alarm_description=f"{description} (see docs/operations.md, WebSocket API)",
                metric=metric,
                threshold=threshold,
                evaluation_periods=periods,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            )
            made.add_alarm_action(notify)
            self.alarms.append(made)

        alarm(
            "IntegrationErrorAlarm",
            "ws-integration-errors",
            self._api_metric("IntegrationError", "integration errors", ALARM_PERIOD),
            "the WebSocket API's functions failed (clients got 'Internal server error')",
        )
        alarm(
            "ExecutionErrorAlarm",
            "ws-execution-errors",
            self._api_metric("ExecutionError", "execution errors", ALARM_PERIOD),
            "API Gateway failed to run a WebSocket route",
        )
        alarm(
            "ConnectRateAlarm",
            "ws-connect-rate",
            self._api_metric("ConnectCount", "connects", ALARM_PERIOD),
            f"new WebSocket connections above {int(CONNECT_ALARM_SHARE * 100)}% of the "
            f"account's {NEW_CONNECTIONS_PER_S}/s quota",
            threshold=NEW_CONNECTIONS_PER_S * CONNECT_ALARM_SHARE * ALARM_PERIOD.to_seconds(),
        )
        if self._pushers():
            pushed = self._shoal_sum(FRAMES_PUSHED, ALARM_PERIOD, "p")
            failed = self._shoal_sum(PUSH_FAILED, ALARM_PERIOD, "f")
            alarm(
                "PushFailedAlarm",
                "ws-push-failed",
                cloudwatch.MathExpression(
                    expression=(
                        f"IF(pushed + failed >= {PUSH_FAILED_MIN_PUSHES}, "
                        "failed / (pushed + failed), 0)"
                    ),
                    using_metrics={"pushed": pushed, "failed": failed},
                    label="share of pushes failed",
                    period=ALARM_PERIOD,
                ),
                f"more than {int(PUSH_FAILED_SHARE * 100)}% of pushes to WebSocket "
                "connections failed, two periods running",
                threshold=PUSH_FAILED_SHARE,
                periods=2,
            )

        if push_queue is not None:
            alarm(
                "PushBacklogAgeAlarm",
                "ws-push-backlog-age",
                push_queue.metric_approximate_age_of_oldest_message(
                    period=GRAPH_PERIOD, statistic="Maximum"
                ),
                f"the push queue's oldest push waited over {PUSH_BACKLOG_AGE_ALARM_S} s, three "
                "minutes running: pushes fall behind (pushConcurrency, or the account's API "
                "Gateway rate)",
                threshold=PUSH_BACKLOG_AGE_ALARM_S,
                periods=3,
            )
        if push_dead_letters is not None:
            alarm(
                "PushDeadLettersAlarm",
                "ws-push-dead-letters",
                push_dead_letters.metric_approximate_number_of_messages_visible(
                    period=ALARM_PERIOD, statistic="Maximum"
                ),
                "a push failed ten times and went to the push queue's dead-letter queue (its "
                "deliveries wait in the inboxes for the session's next push or reconnect)",
            )

        def graph(title: str, *metrics: cloudwatch.IMetric) -> cloudwatch.GraphWidget:
            return cloudwatch.GraphWidget(title=title, left=list(metrics), width=6, height=6)

        if push_queue is not None:
            dashboard.add_widgets(
                graph(
                    "Pushes: backlog",
                    push_queue.metric_approximate_number_of_messages_visible(
                        period=GRAPH_PERIOD, statistic="Maximum", label="waiting"
                    ),
                    push_queue.metric_approximate_number_of_messages_not_visible(
                        period=GRAPH_PERIOD, statistic="Maximum", label="in flight"
                    ),
                ),
                graph(
                    "Pushes: backlog age (s)",
                    push_queue.metric_approximate_age_of_oldest_message(
                        period=GRAPH_PERIOD, statistic="Maximum", label="oldest push"
                    ),
                ),
                graph(
                    "Pushes: throttled posts and failed pushes",
                    self._shoal_sum(POSTS_THROTTLED, GRAPH_PERIOD, "t"),
                    self._shoal_sum(PUSH_FAILED, GRAPH_PERIOD, "f"),
                ),
            )

        dashboard.add_widgets(
            graph(
                "WebSocket: connects and messages",
                self._api_metric("ConnectCount", "connects", GRAPH_PERIOD),
                self._api_metric("MessageCount", "messages", GRAPH_PERIOD),
            ),
            graph(
                "WebSocket: errors",
                self._api_metric("IntegrationError", "integration errors", GRAPH_PERIOD),
                self._api_metric("ClientError", "client errors", GRAPH_PERIOD),
                self._api_metric("ExecutionError", "execution errors", GRAPH_PERIOD),
            ),
            graph(
                "WebSocket: pushes",
                self._shoal_sum(FRAMES_PUSHED, GRAPH_PERIOD, "p"),
                self._shoal_sum(PUSH_FAILED, GRAPH_PERIOD, "f"),
            ),
        )
        cdk.CfnOutput(self.stack, "WebSocketUrl", value=self.url)
