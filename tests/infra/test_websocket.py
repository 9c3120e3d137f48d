"""The WebSocket API (infra/websocket.py) in the synthesized template: what the declarations
say (routes, mock routes, the $connect authorizer, grants, environment), and its operations."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from shoal.declarations import DEPLOYMENT

from tests.infra.stacks import AUDIENCES, ISSUER, ROOT, Synth, as_list

pytestmark = pytest.mark.infra

WS = DEPLOYMENT.websocket


def _ws_api(synthesized: Synth) -> str:
    [api] = [
        k
        for k, v in synthesized.of_type("AWS::ApiGatewayV2::Api").items()
        if v["Properties"]["ProtocolType"] == "WEBSOCKET"
    ]
    return api


def _of_ws(synthesized: Synth, kind: str) -> dict[str, dict[str, Any]]:
    api = {"Ref": _ws_api(synthesized)}
    return {k: v for k, v in synthesized.of_type(kind).items() if v["Properties"]["ApiId"] == api}


def _routes(synthesized: Synth) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        v["Properties"]["RouteKey"]: (k, v["Properties"])
        for k, v in _of_ws(synthesized, "AWS::ApiGatewayV2::Route").items()
    }


def _integration_of(synthesized: Synth, route: dict[str, Any]) -> dict[str, Any]:
    # Target: {"Fn::Join": ["", ["integrations/", {"Ref": <integration>}]]}
    ref = route["Target"]["Fn::Join"][1][1]["Ref"]
    return dict(synthesized.resources[ref]["Properties"])


def _function_logical_id(synthesized: Synth, name: str) -> str:
    wanted = synthesized.stack.function_names[name]
    [fn] = [
        k
        for k, v in synthesized.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName") == wanted
    ]
    return fn


def test_the_websocket_api_selects_routes_by_action(deployed: Synth) -> None:
    # Given the real declarations / When synthesized
    api = deployed.resources[_ws_api(deployed)]["Properties"]
    # Then there is one WebSocket API, routing frames by their action
    assert api["RouteSelectionExpression"] == "$request.body.action"
    [stage] = _of_ws(deployed, "AWS::ApiGatewayV2::Stage").values()
    assert stage["Properties"]["StageName"] == WS.stage
    assert stage["Properties"]["AutoDeploy"] is True


def test_one_route_per_declared_key_reaching_its_function(deployed: Synth) -> None:
    routes = _routes(deployed)
    declared = deployed.deployment.ws_routes()
    # Then every declared key and mock key has a route, and no other
    assert set(routes) == {r.key for r, _ in declared} | {m.key for m in WS.mock_routes}
    assert {"$connect", "$disconnect", "$default", "subscribe", "ping"} <= set(routes)
    for route, fdef in declared:
        _, props = routes[route.key]
        integration = _integration_of(deployed, props)
        # a Lambda proxy integration invoking the declaring function
        assert integration["IntegrationType"] == "AWS_PROXY"
        assert integration["IntegrationMethod"] == "POST"
        assert _function_logical_id(deployed, fdef.name) in json.dumps(
            integration["IntegrationUri"]
        )
        # two-way routes send the function's answer back through a $default route response
        if route.two_way:
            assert props["RouteResponseSelectionExpression"] == "$default"
        else:
            assert "RouteResponseSelectionExpression" not in props
    responses = {
        json.dumps(v["Properties"]["RouteId"])
        for v in _of_ws(deployed, "AWS::ApiGatewayV2::RouteResponse").values()
        if v["Properties"]["RouteResponseKey"] == "$default"
    }
    for key, (logical, props) in routes.items():
        two_way = "RouteResponseSelectionExpression" in props
        assert (json.dumps({"Ref": logical}) in responses) == two_way, key


def test_ping_is_answered_by_a_mock_with_its_response_verbatim(deployed: Synth) -> None:
    # Given the declared mock route ping -> {"action":"pong"}
    [mock] = [m for m in WS.mock_routes if m.key == "ping"]
    _, route = _routes(deployed)["ping"]
    integration = _integration_of(deployed, route)
    # Then no function runs: a MOCK integration answers 200 ...
    assert integration["IntegrationType"] == "MOCK"
    assert integration["RequestTemplates"] == {"$default": '{"statusCode": 200}'}
    # ... with the declared frame, sent back through the route response
    [response] = [
        v["Properties"] for v in _of_ws(deployed, "AWS::ApiGatewayV2::IntegrationResponse").values()
    ]
    assert response["IntegrationResponseKey"] == "$default"
    assert response["ResponseTemplates"] == {"$default": mock.response}
    assert route["RouteResponseSelectionExpression"] == "$default"
    assert route["AuthorizationType"] == "NONE"


def test_keepalive_is_a_one_way_mock_route(deployed: Synth) -> None:
    # Given the declared one-way mock route keepalive (no response)
    [mock] = [m for m in WS.mock_routes if m.key == "keepalive"]
    assert mock.response is None
    _, route = _routes(deployed)["keepalive"]
    # Then no function runs, and no route response: API Gateway sends nothing back
    assert _integration_of(deployed, route)["IntegrationType"] == "MOCK"
    assert "RouteResponseSelectionExpression" not in route
    assert route["AuthorizationType"] == "NONE"


def test_only_connect_is_authorized_by_the_wsauth_request_authorizer(deployed: Synth) -> None:
    [(authorizer_id, authorizer)] = _of_ws(deployed, "AWS::ApiGatewayV2::Authorizer").items()
    props = authorizer["Properties"]
    # Then a REQUEST authorizer invoking wsauth, without identity sources (the token may be
    # in either of two headers)
    assert props["AuthorizerType"] == "REQUEST"
    assert _function_logical_id(deployed, WS.authorizer) in json.dumps(props["AuthorizerUri"])
    assert "IdentitySource" not in props
    for key, (_, route) in _routes(deployed).items():
        if key == "$connect":
            assert route["AuthorizationType"] == "CUSTOM"
            assert route["AuthorizerId"] == {"Ref": authorizer_id}
        else:
            assert route["AuthorizationType"] == "NONE", key
            assert "AuthorizerId" not in route


def test_api_gateway_may_invoke_the_integrated_functions_and_the_authorizer(
    deployed: Synth,
) -> None:
    permitted = {
        json.dumps(p["Properties"]["FunctionName"])
        for p in deployed.of_type("AWS::Lambda::Permission").values()
        if p["Properties"]["Principal"] == "apigateway.amazonaws.com"
        and _ws_api(deployed) in json.dumps(p["Properties"]["SourceArn"])
    }
    for name in {f.name for _, f in deployed.deployment.ws_routes()} | {WS.authorizer}:
        fn = _function_logical_id(deployed, name)
        assert json.dumps({"Fn::GetAtt": [fn, "Arn"]}) in permitted, name


def _manage_connections(synthesized: Synth, name: str) -> list[str]:
    return [
        json.dumps(resource)
        for statement in synthesized.statements(name)
        if "execute-api:ManageConnections" in as_list(statement["Action"])
        for resource in as_list(statement["Resource"])
    ]


def test_only_the_pushing_functions_may_manage_connections(deployed: Synth) -> None:
    # Given the functions declared with the connections grant
    granted = {
        f.name
        for f in deployed.deployment.functions
        if any(g.kind == "connections" for g in f.grants)
    }
    # the edge (answers, a takeover's close), the pusher (deliveries); the others hand pushes
    # to the push queue
    assert granted == {"edge", "pusher"}
    for fdef in deployed.deployment.functions:
        resources = _manage_connections(deployed, fdef.name)
        if fdef.name not in granted:
            assert resources == [], fdef.name
            continue
        # Then they may push (POST) and close (DELETE) on this API's stage, nothing else
        assert len(resources) == 2
        for method, resource in zip(
            ("POST", "DELETE"), sorted(resources, reverse=True), strict=True
        ):
            assert f"/{WS.stage}/{method}/@connections/*" in resource
            assert _ws_api(deployed) in resource
            assert ":execute-api:" in resource


def test_every_function_gets_the_connections_endpoint_and_the_jwt_rules(deployed: Synth) -> None:
    api = _ws_api(deployed)
    for fdef in deployed.deployment.functions:
        env = deployed.function(fdef.name)["Properties"]["Environment"]["Variables"]
        # the HTTP API's JWT authorizer's issuer and audiences (the stack's context)
        assert env["SHOAL_JWT_ISSUER"] == ISSUER
        assert env["SHOAL_JWT_AUDIENCE"] == ",".join(AUDIENCES)
        endpoint = json.dumps(env["SHOAL_CONNECTIONS_ENDPOINT"])
        assert api in endpoint and "https://" in endpoint and f"/{WS.stage}" in endpoint
        assert ".execute-api." in endpoint


def test_the_authorizer_gets_the_http_apis_issuer_and_audiences(deployed: Synth) -> None:
    [http] = [
        v["Properties"]["JwtConfiguration"]
        for v in deployed.of_type("AWS::ApiGatewayV2::Authorizer").values()
        if v["Properties"]["AuthorizerType"] == "JWT"
    ]
    env = deployed.function(WS.authorizer)["Properties"]["Environment"]["Variables"]
    assert env["SHOAL_JWT_ISSUER"] == http["Issuer"]
    assert env["SHOAL_JWT_AUDIENCE"].split(",") == http["Audience"]


def test_alarms_watch_errors_connect_rate_and_failed_pushes(deployed: Synth) -> None:
    alarms = {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in deployed.of_type("AWS::CloudWatch::Alarm").values()
    }
    for name in ("integration-errors", "execution-errors", "connect-rate", "push-failed"):
        alarm = alarms[f"shoal-test-ws-{name}"]
        assert alarm["AlarmActions"], name
        assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
    assert alarms["shoal-test-ws-integration-errors"]["Threshold"] == 0
    # 80 % of 500 new connections a second, over the 5-minute period
    assert alarms["shoal-test-ws-connect-rate"]["Threshold"] == 0.8 * 500 * 300
    # failed pushes: the Shoal metric of every pushing function
    pushes = json.dumps(alarms["shoal-test-ws-push-failed"]["Metrics"])
    for service in ("edge", "pusher"):
        assert f'"Value": "{service}"' in pushes
    assert '"MetricName": "PushFailed"' in pushes and '"Namespace": "Shoal"' in pushes


def test_dashboard_has_the_websocket_rows(deployed: Synth) -> None:
    [dashboard] = deployed.of_type("AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for metric in ("ConnectCount", "MessageCount", "IntegrationError", "ClientError"):
        assert metric in body
    assert "ExecutionError" in body and "PushFailed" in body and "FramesPushed" in body
    # the push queue's row: its backlog, the backlog's age, throttled posts and failed pushes
    for metric in (
        "ApproximateNumberOfMessagesVisible",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateAgeOfOldestMessage",
        "PostsThrottled",
    ):
        assert metric in body, metric


# --- the push queue (shoal.edge.pushwork) ----------------------------------------------------


def _queues(synthesized: Synth) -> dict[str, dict[str, Any]]:
    """The queues' properties by their construct ids (CDK adds a hash to the logical id)."""
    found = synthesized.of_type("AWS::SQS::Queue")
    return {
        name: found[_queue_id(synthesized, name)]["Properties"]
        for name in ("PushQueue", "PushDeadLetterQueue")
    }


def _queue_id(synthesized: Synth, name: str) -> str:
    [logical] = [
        k for k in synthesized.of_type("AWS::SQS::Queue") if re.fullmatch(f"{name}[0-9A-F]{{8}}", k)
    ]
    return logical


def test_the_push_queue_is_fifo_with_a_dead_letter_queue_encrypted_tls_only(
    deployed: Synth,
) -> None:
    queues = _queues(deployed)
    push, dead = queues["PushQueue"], queues["PushDeadLetterQueue"]
    # Then a session's pushes keep their order (FIFO, deduplicated per group, throughput per
    # group), a failed one goes to the dead-letter queue after ten receives, and a batch is
    # never handed to a second worker while the first runs it (six times the pusher's timeout)
    assert push["FifoQueue"] is True and dead["FifoQueue"] is True
    assert push["DeduplicationScope"] == "messageGroup"
    assert push["FifoThroughputLimit"] == "perMessageGroupId"
    assert push["ContentBasedDeduplication"] is False
    pusher = deployed.function("pusher")["Properties"]
    assert push["VisibilityTimeout"] == 6 * pusher["Timeout"]
    redrive = push["RedrivePolicy"]
    assert redrive["maxReceiveCount"] == 10
    dead_id = _queue_id(deployed, "PushDeadLetterQueue")
    assert redrive["deadLetterTargetArn"] == {"Fn::GetAtt": [dead_id, "Arn"]}
    for queue in (push, dead):
        assert queue["SqsManagedSseEnabled"] is True
    policies = json.dumps(list(deployed.of_type("AWS::SQS::QueuePolicy").values()))
    assert '"aws:SecureTransport": "false"' in policies


def test_the_pusher_takes_the_push_queue_at_the_stacks_concurrency(deployed: Synth) -> None:
    [mapping] = [
        m["Properties"]
        for m in deployed.of_type("AWS::Lambda::EventSourceMapping").values()
        if m["Properties"]["EventSourceArn"]
        == {"Fn::GetAtt": [_queue_id(deployed, "PushQueue"), "Arn"]}
    ]
    assert mapping["FunctionName"] == {"Ref": _function_logical_id(deployed, "pusher")}
    # ten chunks an invocation, a failed one returned alone (with its group's later ones)
    assert mapping["BatchSize"] == 10
    assert mapping["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    # Then the workers are at most the default push concurrency (context pushConcurrency)
    assert mapping["ScalingConfig"] == {"MaximumConcurrency": 50}


def test_push_concurrency_is_a_context_value_within_lambdas_bounds() -> None:
    from infra.stack import MissingContextError, Settings, _push_concurrency

    assert _push_concurrency(None) == 50
    assert _push_concurrency("200") == 200
    for bad in ("1", "1001"):
        with pytest.raises(MissingContextError, match="pushConcurrency"):
            _push_concurrency(bad)
    assert Settings(jwt_issuer="https://i", jwt_audience=("a",)).push_concurrency == 50


def test_who_may_send_to_and_take_from_the_push_queue(deployed: Synth) -> None:
    queue = {"Fn::GetAtt": [_queue_id(deployed, "PushQueue"), "Arn"]}
    senders, takers = set(), set()
    for fdef in deployed.deployment.functions:
        for statement in deployed.statements(fdef.name):
            # CDK merges a role's statements of the same actions: one may name both queues
            if queue not in as_list(statement.get("Resource")):
                continue
            actions = set(as_list(statement["Action"]))
            if "sqs:SendMessage" in actions:
                senders.add(fdef.name)
            if "sqs:ReceiveMessage" in actions:
                takers.add(fdef.name)
                assert {"sqs:DeleteMessage", "sqs:ChangeMessageVisibility"} <= actions
    # Then whoever has deliveries for connected sessions hands their pushes over, and only
    # the pusher takes them
    # (the pusher too: the members its gets hand group lanes to get pushes of their own; the
    # sessions function: a connect that takes a WebSocket channel over hands its lanes on)
    assert senders == {
        "router",
        "edge",
        "messages",
        "subscriptions",
        "reaper",
        "pusher",
        "sessions",
    }
    assert takers == {"pusher"}


def test_alarms_watch_the_push_backlogs_age_and_its_dead_letters(deployed: Synth) -> None:
    alarms = {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in deployed.of_type("AWS::CloudWatch::Alarm").values()
    }
    age = alarms["shoal-test-ws-push-backlog-age"]
    assert age["MetricName"] == "ApproximateAgeOfOldestMessage"
    assert (age["Threshold"], age["EvaluationPeriods"]) == (60, 3)
    dead = alarms["shoal-test-ws-push-dead-letters"]
    assert dead["MetricName"] == "ApproximateNumberOfMessagesVisible"
    dead_id = _queue_id(deployed, "PushDeadLetterQueue")
    assert dead["Dimensions"][0]["Value"] == {"Fn::GetAtt": [dead_id, "QueueName"]}
    assert age["AlarmActions"] and dead["AlarmActions"]


# --- the wills queue (shoal.sessions.timers) --------------------------------------------------


def test_the_wills_queue_is_standard_with_a_dead_letter_queue_encrypted_tls_only(
    deployed: Synth,
) -> None:
    found = deployed.of_type("AWS::SQS::Queue")
    wills = found[_queue_id(deployed, "WillsQueue")]["Properties"]
    dead = found[_queue_id(deployed, "WillsDeadLetterQueue")]["Properties"]
    # Then its timers are delayed each on its own (a standard queue: a FIFO queue delays only
    # as a whole), a timer that failed five times goes to the dead-letter queue, and a batch is
    # never handed to a second reaper while the first runs it (six times its timeout)
    assert "FifoQueue" not in wills and "FifoQueue" not in dead
    reaper = deployed.function("reaper")["Properties"]
    assert wills["VisibilityTimeout"] == 6 * reaper["Timeout"]
    redrive = wills["RedrivePolicy"]
    assert redrive["maxReceiveCount"] == 5
    dead_id = _queue_id(deployed, "WillsDeadLetterQueue")
    assert redrive["deadLetterTargetArn"] == {"Fn::GetAtt": [dead_id, "Arn"]}
    for queue in (wills, dead):
        assert queue["SqsManagedSseEnabled"] is True
    policies = [
        p["Properties"]
        for p in deployed.of_type("AWS::SQS::QueuePolicy").values()
        if {"Ref": _queue_id(deployed, "WillsQueue")} in p["Properties"]["Queues"]
    ]
    assert '"aws:SecureTransport": "false"' in json.dumps(policies)


def test_the_reaper_takes_the_wills_queues_timers_through_a_mapping(deployed: Synth) -> None:
    [mapping] = [
        m["Properties"]
        for m in deployed.of_type("AWS::Lambda::EventSourceMapping").values()
        if m["Properties"]["EventSourceArn"]
        == {"Fn::GetAtt": [_queue_id(deployed, "WillsQueue"), "Arn"]}
    ]
    assert mapping["FunctionName"] == {"Ref": _function_logical_id(deployed, "reaper")}
    # ten timers an invocation, a failed one returned alone
    assert mapping["BatchSize"] == 10
    assert mapping["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    # Then a burst of lost connections takes ten reapers at most, not the push concurrency
    assert mapping["ScalingConfig"] == {"MaximumConcurrency": 10}
    # and the schedule stays, the timers' backstop
    reaper = {"Fn::GetAtt": [_function_logical_id(deployed, "reaper"), "Arn"]}
    assert [
        rule["Properties"]["ScheduleExpression"]
        for rule in deployed.of_type("AWS::Events::Rule").values()
        if any(t["Arn"] == reaper for t in rule["Properties"]["Targets"])
    ] == ["rate(1 minute)"]


def test_who_may_arm_and_take_the_wills_queues_timers(deployed: Synth) -> None:
    queue = {"Fn::GetAtt": [_queue_id(deployed, "WillsQueue"), "Arn"]}
    senders, takers = set(), set()
    for fdef in deployed.deployment.functions:
        for statement in deployed.statements(fdef.name):
            # CDK merges a role's statements of the same actions: one may name both queues
            if queue not in as_list(statement.get("Resource")):
                continue
            actions = set(as_list(statement["Action"]))
            if "sqs:SendMessage" in actions:
                senders.add(fdef.name)
            if "sqs:ReceiveMessage" in actions:
                takers.add(fdef.name)
                assert {"sqs:DeleteMessage", "sqs:ChangeMessageVisibility"} <= actions
    # Then the functions that lose a connection (edge: $disconnect), take a live channel over
    # (edge, sessions: a connect) or expire a channel (reaper) arm timers; the reaper alone
    # takes them (and arms again one that came early)
    assert senders == {"edge", "sessions", "reaper"}
    assert takers == {"reaper"}


def test_an_alarm_watches_the_wills_queues_dead_letters(deployed: Synth) -> None:
    alarms = {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in deployed.of_type("AWS::CloudWatch::Alarm").values()
    }
    dead = alarms["shoal-test-wills-dead-letters"]
    assert dead["MetricName"] == "ApproximateNumberOfMessagesVisible"
    dead_id = _queue_id(deployed, "WillsDeadLetterQueue")
    assert dead["Dimensions"][0]["Value"] == {"Fn::GetAtt": [dead_id, "QueueName"]}
    assert (dead["Threshold"], dead["ComparisonOperator"]) == (0, "GreaterThanThreshold")
    assert dead["AlarmActions"]


def test_the_wss_url_is_an_output(deployed: Synth) -> None:
    value = json.dumps(deployed.template_json["Outputs"]["WebSocketUrl"]["Value"])
    assert "wss://" in value and _ws_api(deployed) in value and f"/{WS.stage}" in value


def test_a_deployment_without_websocket_routes_gets_no_websocket_api(variant: Synth) -> None:
    # Given the test-only variant, which declares no WebSocket routes
    apis = [
        v["Properties"]["ProtocolType"] for v in variant.of_type("AWS::ApiGatewayV2::Api").values()
    ]
    # Then only its HTTP API, and no @connections endpoint in the functions' environment
    assert apis == ["HTTP"]
    env = variant.function("router")["Properties"]["Environment"]["Variables"]
    assert "SHOAL_CONNECTIONS_ENDPOINT" not in env
    assert env["SHOAL_JWT_ISSUER"] == ISSUER


def test_the_layer_ships_the_authorizers_jwt_dependencies() -> None:
    # Given the layer's requirements and the project's pins
    layer = (ROOT / "layers" / "shoal" / "requirements.txt").read_text().lower()
    pins = dict(
        re.findall(r"^([a-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    )
    # Then PyJWT and cryptography are in the layer, at the versions the tests ran with
    for package in ("pyjwt", "cryptography"):
        assert re.search(rf"^{package}(\[[a-z]+\])?=={re.escape(pins[package])}$", layer, re.M)
