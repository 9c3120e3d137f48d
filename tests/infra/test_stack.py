"""The synthesized CloudFormation template says what the declarations say, and no more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pynamodb.attributes import UnicodeAttribute
from pynamodb.indexes import AllProjection, GlobalSecondaryIndex
from pynamodb.models import Model
from shoal.aws.tables import TableDef
from shoal.declarations import DEFAULT_ROUTE, Deployment, FunctionDef, Route

from tests.infra.stacks import AUDIENCES, ISSUER, ROOT, Synth, as_list, context, synth

pytestmark = pytest.mark.infra

DYNAMODB_WRITES = {
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
    "dynamodb:DeleteItem",
    "dynamodb:BatchWriteItem",
}


def logical_id(name: str, suffix: str) -> str:
    from infra.stack import pascal

    return f"{pascal(name)}{suffix}"


# -- tables ----------------------------------------------------------------------------------


def test_each_declared_table_has_the_models_keys_and_indexes(deployed: Synth) -> None:
    # Given the real declarations / When synthesized
    tables = deployed.of_type("AWS::DynamoDB::Table")
    # Then there is one table per declaration, keyed exactly as its pynamodb model says
    assert len(tables) == len(deployed.deployment.tables)
    for table in deployed.deployment.tables:
        props = tables[logical_id(table.logical, "Table")]["Properties"]
        schema = table.schema()
        assert props["KeySchema"] == schema["KeySchema"]
        assert props["AttributeDefinitions"] == schema["AttributeDefinitions"]
        assert props.get("GlobalSecondaryIndexes", []) == schema.get("GlobalSecondaryIndexes", [])
        assert props.get("LocalSecondaryIndexes", []) == schema.get("LocalSecondaryIndexes", [])


def test_every_key_schema_starts_with_the_hash_key(deployed: Synth) -> None:
    # Given every table and index of the real declarations
    for table in deployed.of_type("AWS::DynamoDB::Table").values():
        props = table["Properties"]
        key_schemas = [props["KeySchema"]] + [
            index["KeySchema"]
            for kind in ("GlobalSecondaryIndexes", "LocalSecondaryIndexes")
            for index in props.get(kind, [])
        ]
        # Then each names its HASH key first, as CloudFormation requires
        for key_schema in key_schemas:
            assert key_schema[0]["KeyType"] == "HASH"


def test_tables_are_on_demand_with_point_in_time_recovery_and_retained(deployed: Synth) -> None:
    # Given cdk.json's default retainData=true
    for table in deployed.of_type("AWS::DynamoDB::Table").values():
        props = table["Properties"]
        # Then every table bills per request, can be restored, and outlives the stack
        assert props["BillingMode"] == "PAY_PER_REQUEST"
        assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
        assert props["DeletionProtectionEnabled"] is True
        assert table["DeletionPolicy"] == "Retain"


def test_declared_ttl_attribute_is_enabled(variant: Synth) -> None:
    # Given a table declared with ttl_attribute="expires_at" and one without
    tables = variant.of_type("AWS::DynamoDB::Table")
    # Then DynamoDB expires items by that attribute only where declared
    assert tables["LeasesTable"]["Properties"]["TimeToLiveSpecification"] == {
        "AttributeName": "expires_at",
        "Enabled": True,
    }
    assert "TimeToLiveSpecification" not in tables["TopicsTable"]["Properties"]


def test_retain_data_false_lets_the_stack_delete_its_data(variant: Synth) -> None:
    # Given -c retainData=false (a string, as the CLI passes it)
    for kind in ("AWS::DynamoDB::Table", "AWS::S3::Bucket"):
        for resource in variant.of_type(kind).values():
            # Then tables and buckets go with the stack
            assert resource["DeletionPolicy"] == "Delete"
    for table in variant.of_type("AWS::DynamoDB::Table").values():
        assert table["Properties"]["DeletionProtectionEnabled"] is False


def test_index_of_a_model_reaches_the_template(tmp_path: Path) -> None:
    # Given a table whose model declares a global secondary index
    class ByOwner(GlobalSecondaryIndex[Any]):
        class Meta:
            index_name = "by_owner"
            projection = AllProjection()

        owner = UnicodeAttribute(hash_key=True)
        name = UnicodeAttribute(range_key=True)

    class Owned(Model):
        class Meta:
            table_name = "owned"

        name = UnicodeAttribute(hash_key=True)
        owner = UnicodeAttribute()
        by_owner = ByOwner()

    table = TableDef("owned", Owned)
    (tmp_path / "plain").mkdir()
    deployment = Deployment(tables=(table,), buckets=(), functions=(FunctionDef("plain"),))
    # When synthesized
    props = synth(deployment, context(), functions_dir=tmp_path).of_type("AWS::DynamoDB::Table")
    # Then the index is there as the model defines it
    [index] = props["OwnedTable"]["Properties"]["GlobalSecondaryIndexes"]
    assert index == table.schema()["GlobalSecondaryIndexes"][0]
    assert index["KeySchema"] == [
        {"AttributeName": "owner", "KeyType": "HASH"},
        {"AttributeName": "name", "KeyType": "RANGE"},
    ]


# -- bucket ----------------------------------------------------------------------------------


def test_archive_bucket_is_encrypted_private_and_ssl_only(deployed: Synth) -> None:
    buckets = deployed.of_type("AWS::S3::Bucket")
    assert len(buckets) == len(deployed.deployment.buckets)
    for bucket in buckets.values():
        props = bucket["Properties"]
        [rule] = props["BucketEncryption"]["ServerSideEncryptionConfiguration"]
        assert rule["ServerSideEncryptionByDefault"] == {"SSEAlgorithm": "AES256"}
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True,
            "BlockPublicPolicy": True,
            "IgnorePublicAcls": True,
            "RestrictPublicBuckets": True,
        }
        assert "VersioningConfiguration" not in props
    for policy in deployed.of_type("AWS::S3::BucketPolicy").values():
        [statement] = policy["Properties"]["PolicyDocument"]["Statement"]
        assert statement["Effect"] == "Deny"
        assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_bucket_expire_days_becomes_a_lifecycle_rule(variant: Synth) -> None:
    # Given BucketDef("archive", expire_days=30)
    [bucket] = variant.of_type("AWS::S3::Bucket").values()
    rules = bucket["Properties"]["LifecycleConfiguration"]["Rules"]
    # Then objects expire after 30 days
    assert {"Id": "expire", "ExpirationInDays": 30, "Status": "Enabled"} in rules
    # and objects under tmp/ after 2
    assert {"Id": "expire-tmp", "Prefix": "tmp/", "ExpirationInDays": 2, "Status": "Enabled"} in (
        rules
    )


def test_large_payloads_expire_after_the_inbox_retention(deployed: Synth) -> None:
    # Given the real declaration: inbox items (which alone point at payloads/) live 14 days
    from shoal.core.config import DEFAULT_RETENTION_S

    [bucket] = deployed.of_type("AWS::S3::Bucket").values()
    rules = bucket["Properties"]["LifecycleConfiguration"]["Rules"]
    [rule] = [r for r in rules if r.get("Prefix") == "payloads/"]
    # Then payload objects outlive every inbox item that can point at them, and then go
    assert rule["ExpirationInDays"] * 86_400 > DEFAULT_RETENTION_S
    # and the archive itself is kept (no bucket-wide expiry)
    assert all("Prefix" in r or r["Id"] == "abort-incomplete-uploads" for r in rules)


def test_an_archive_expiring_what_inbox_items_name_is_refused() -> None:
    from shoal.core.config import DEFAULT_RETENTION_S
    from shoal.declarations import DEPLOYMENT, BucketDef, check_archive_lifetime

    # Given the real declaration and the default inbox retention (14 days): accepted
    check_archive_lifetime(DEPLOYMENT.buckets, DEFAULT_RETENTION_S)
    # Then an archive whose message lines (inbox items name them) or large payloads could
    # expire before the items is refused, whether by a bucket-wide rule or a prefix's
    for bucket, retention_s in [
        (BucketDef("archive", expire_days=14), DEFAULT_RETENTION_S),
        (
            BucketDef("archive", expire_prefixes=(("messages/topic=orders/", 7),)),
            DEFAULT_RETENTION_S,
        ),
        (BucketDef("archive", expire_prefixes=(("payloads/", 15),)), 30 * 86_400),
    ]:
        with pytest.raises(ValueError, match="inbox items"):
            check_archive_lifetime((bucket,), retention_s)
    # and other prefixes or a long enough expiry are not
    check_archive_lifetime(
        (BucketDef("archive", expire_days=31, expire_prefixes=(("tmp/", 1),)),), 30 * 86_400
    )


# -- functions -------------------------------------------------------------------------------


def test_one_function_per_declaration_with_handler_runtime_layer_and_env(deployed: Synth) -> None:
    python = {
        k: v
        for k, v in deployed.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("Runtime", "").startswith("python")
    }
    assert len(python) == len(deployed.deployment.functions)
    [layer] = deployed.of_type("AWS::Lambda::LayerVersion")
    for fdef in deployed.deployment.functions:
        props = deployed.function(fdef.name)["Properties"]
        assert props["Handler"] == fdef.handler
        assert props["Runtime"] == "python3.12"
        assert props["Architectures"] == ["arm64"]
        assert props["Layers"] == [{"Ref": layer}]
        # X-Ray is off (docs/design.md, "Metrics and tracing")
        assert "TracingConfig" not in props
        assert props["MemorySize"] == fdef.memory_mb
        assert props["Timeout"] == fdef.timeout_s
        assert "ReservedConcurrentExecutions" not in props
        env = props["Environment"]["Variables"]
        # the `service` dimension of the function's metrics: its own name, bounded
        assert env["POWERTOOLS_SERVICE_NAME"] == fdef.name
        for table in deployed.deployment.tables:
            ref = {"Ref": logical_id(table.logical, "Table")}
            assert env[f"SHOAL_TABLE_{table.logical.upper()}"] == ref
        for bucket in deployed.deployment.buckets:
            assert f"SHOAL_BUCKET_{bucket.logical.upper()}" in env
        for other in deployed.deployment.functions:
            assert env[f"SHOAL_FUNCTION_{other.name.upper()}"] == f"shoal-test-{other.name}"
        assert env["SHOAL_STREAM_PREFIX"] == deployed.deployment.stream_prefix
        for stream in deployed.deployment.streams:
            ref = {"Ref": logical_id(stream.logical, "Stream")}
            assert env[f"SHOAL_KINESIS_{stream.logical.upper()}"] == ref


def test_every_function_logs_to_a_group_kept_30_days(deployed: Synth) -> None:
    groups = deployed.of_type("AWS::Logs::LogGroup")
    for fdef in deployed.deployment.functions:
        group = deployed.function(fdef.name)["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
        assert groups[group]["Properties"]["RetentionInDays"] == 30


def test_default_partitions_come_from_context(variant: Synth) -> None:
    # Given -c defaultPartitions=4
    env = variant.function("router")["Properties"]["Environment"]["Variables"]
    # Then functions are told so
    assert env["SHOAL_DEFAULT_PARTITIONS"] == "4"


# -- API -------------------------------------------------------------------------------------


def _routes(synthesized: Synth) -> dict[str, dict[str, Any]]:
    """The HTTP API's routes (the WebSocket API's are tests/infra/test_websocket.py's)."""
    [http] = [
        k
        for k, v in synthesized.of_type("AWS::ApiGatewayV2::Api").items()
        if v["Properties"]["ProtocolType"] == "HTTP"
    ]
    return {
        r["Properties"]["RouteKey"]: r["Properties"]
        for r in synthesized.of_type("AWS::ApiGatewayV2::Route").values()
        if r["Properties"]["ApiId"] == {"Ref": http}
    }


def test_one_route_per_declared_route_with_its_authorization(deployed: Synth) -> None:
    routes = _routes(deployed)
    declared = deployed.deployment.routes()
    assert set(routes) == {route.key for route, _ in declared}
    for route, _ in declared:
        expected = "JWT" if route.authorized else "NONE"
        assert routes[route.key]["AuthorizationType"] == expected
    assert routes["GET /v1/health"]["AuthorizationType"] == "NONE"
    assert routes[DEFAULT_ROUTE]["AuthorizationType"] == "NONE"


def test_routes_reach_the_function_that_declares_them(variant: Synth) -> None:
    # Given four routes all declared by "front"
    integrations = variant.of_type("AWS::ApiGatewayV2::Integration")
    front = next(
        k
        for k, v in variant.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName") == "shoal-test-front"
    )
    for props in _routes(variant).values():
        # Then each targets an integration that invokes "front"
        integration = props["Target"]["Fn::Join"][1][1]["Ref"]
        uri = integrations[integration]["Properties"]["IntegrationUri"]
        assert uri == {"Fn::GetAtt": [front, "Arn"]}


def test_authorized_routes_use_the_jwt_authorizer_from_context(variant: Synth) -> None:
    # Given -c jwtIssuer=... -c jwtAudience=shoal-api,shoal-cli
    [(authorizer_id, authorizer)] = variant.of_type("AWS::ApiGatewayV2::Authorizer").items()
    props = authorizer["Properties"]
    # Then the authorizer checks that issuer and those audiences on the Authorization header
    assert props["AuthorizerType"] == "JWT"
    assert props["JwtConfiguration"] == {"Issuer": ISSUER, "Audience": list(AUDIENCES)}
    assert props["IdentitySource"] == ["$request.header.Authorization"]
    routes = _routes(variant)
    for key in ("GET /v1/topics/{name}", "POST /v1/messages:batch"):
        assert routes[key]["AuthorizationType"] == "JWT"
        assert routes[key]["AuthorizerId"] == {"Ref": authorizer_id}
    assert "AuthorizerId" not in routes["GET /v1/health"]


def test_synth_fails_clearly_without_issuer_context() -> None:
    import aws_cdk as cdk

    from infra.stack import MissingContextError, ShoalStack

    # Given no jwtIssuer in the context
    ctx = context()
    del ctx["jwtIssuer"]
    # When the stack is built / Then it refuses, naming the context key to set
    with pytest.raises(MissingContextError, match="jwtIssuer"):
        ShoalStack(cdk.App(context=ctx), "no-issuer")


# -- least privilege -------------------------------------------------------------------------


def test_functions_touch_only_the_tables_they_declare(deployed: Synth) -> None:
    for fdef in deployed.deployment.functions:
        granted = {g.name: g.access for g in fdef.grants if g.kind == "table"}
        for statement in deployed.statements(fdef.name):
            actions = set(as_list(statement["Action"]))
            if not any(a.startswith("dynamodb:") for a in actions):
                continue
            resources = json.dumps(statement["Resource"])
            touched = {
                t.logical
                for t in deployed.deployment.tables
                if f'"{logical_id(t.logical, "Table")}"' in resources
            }
            assert touched, f"{fdef.name}: dynamodb actions on an undeclared resource"
            assert touched <= set(granted), f"{fdef.name} touches undeclared {touched}"
            if actions & DYNAMODB_WRITES:
                assert all(granted[t] != "read" for t in touched)


def test_a_function_without_grants_has_no_data_permissions(variant: Synth) -> None:
    # Given "plain", which declares nothing
    # Then its role may write traces and nothing else
    for service in ("dynamodb", "s3", "kinesis", "lambda"):
        assert variant.actions("plain", service) == set()


def test_a_read_grant_gives_no_write_actions(variant: Synth) -> None:
    # Given "reader" with Grant("table", "leases", "read")
    actions = variant.actions("reader", "dynamodb")
    # Then it may read that table and write nothing
    assert {"dynamodb:GetItem", "dynamodb:Query"} <= actions
    assert not actions & DYNAMODB_WRITES


def test_stream_grants_are_scoped_to_the_stream_prefix(variant: Synth) -> None:
    # Given a reader (router), a writer (publisher) and a manager (admin) of the streams
    router = variant.actions("router", "kinesis")
    publisher = variant.actions("publisher", "kinesis")
    admin = variant.actions("admin", "kinesis")
    # Then each has what its access says
    assert {"kinesis:GetRecords", "kinesis:ListShards", "kinesis:SubscribeToShard"} <= router
    assert not router & {"kinesis:PutRecord", "kinesis:PutRecords", "kinesis:CreateStream"}
    assert publisher == {"kinesis:PutRecord", "kinesis:PutRecords"}
    assert {"kinesis:CreateStream", "kinesis:DeleteStream", "kinesis:PutRecords"} <= admin
    # And every stream-level resource is a stream named "<prefix>-*"
    for statement in variant.statements("publisher"):
        if "kinesis:PutRecords" in statement["Action"]:
            assert ":stream/shoal-*" in json.dumps(statement["Resource"])


def test_event_source_mapping_changes_are_limited_to_the_named_function(variant: Synth) -> None:
    # Given admin with Grant("event_source_mappings", "router", "read_write")
    changes = [
        s
        for s in variant.statements("admin")
        if {"lambda:CreateEventSourceMapping", "lambda:DeleteEventSourceMapping"}
        & set(as_list(s["Action"]))
    ]
    # Then every create/update/delete is conditioned on invoking shoal-test-router
    assert changes
    for statement in changes:
        condition = json.dumps(statement["Condition"]["StringLike"]["lambda:FunctionArn"])
        assert ":function:shoal-test-router" in condition
    # And the router itself may not manage mappings
    assert variant.actions("router", "lambda") == set()


def test_bucket_write_grant_gives_no_read(variant: Synth) -> None:
    # Given router with Grant("bucket", "archive", "write")
    actions = variant.actions("router", "s3")
    assert "s3:PutObject" in actions
    assert not any(a.startswith("s3:GetObject") for a in actions)


# -- the delivery-event log ------------------------------------------------------------------


def test_the_event_log_is_one_provisioned_shard_named_outside_the_storage_streams(
    deployed: Synth,
) -> None:
    from fnmatch import fnmatch

    # Given the real declarations
    [stream] = deployed.of_type("AWS::Kinesis::Stream").values()
    props = stream["Properties"]
    # Then the stack owns one provisioned stream of one shard, kept a day, deleted with it
    assert props["StreamModeDetails"] == {"StreamMode": "PROVISIONED"}
    assert (props["ShardCount"], props["RetentionPeriodHours"]) == (1, 24)
    assert stream["DeletionPolicy"] == "Delete"
    # And its name is no storage stream's, so their grants never reach it
    assert props["Name"] == "events.shoal-test"
    assert not fnmatch(props["Name"], f"{deployed.deployment.stream_prefix}-*")


def test_the_archiver_is_mapped_to_the_event_log_in_large_batches_that_never_skip(
    deployed: Synth,
) -> None:
    # Given the real declarations: the archiver's mapping (the pusher's is on the push queue)
    [mapping] = [
        m
        for m in deployed.of_type("AWS::Lambda::EventSourceMapping").values()
        if m["Properties"]["EventSourceArn"] == {"Fn::GetAtt": ["EventsStream", "Arn"]}
    ]
    props = mapping["Properties"]
    # Then the archiver reads the log from its start, in batches of up to 10,000 or a minute
    assert props["FunctionName"] == {"Ref": next(iter(_function_ids(deployed, "archiver")))}
    assert props["EventSourceArn"] == {"Fn::GetAtt": ["EventsStream", "Arn"]}
    assert props["StartingPosition"] == "TRIM_HORIZON"
    assert (props["BatchSize"], props["MaximumBatchingWindowInSeconds"]) == (10_000, 60)
    # And a failing batch is bisected and retried until it succeeds, as the router's
    assert props["BisectBatchOnFunctionError"] is True
    assert (props["MaximumRetryAttempts"], props["MaximumRecordAgeInSeconds"]) == (-1, -1)
    assert props["FunctionResponseTypes"] == ["ReportBatchItemFailures"]


def test_a_declared_stream_and_mapping_reach_the_template_as_declared(variant: Synth) -> None:
    # Given the variant's stream of 2 shards kept 48 h, read by "tailer" through a mapping
    # that gives only a start and a batch size, and written by "publisher"
    [stream] = variant.of_type("AWS::Kinesis::Stream").values()
    props = stream["Properties"]
    assert (props["Name"], props["ShardCount"], props["RetentionPeriodHours"]) == (
        "log.shoal-test",
        2,
        48,
    )
    [mapping] = variant.of_type("AWS::Lambda::EventSourceMapping").values()
    # Then the mapping has those arguments and leaves the rest to Lambda's defaults
    assert {
        k: v for k, v in mapping["Properties"].items() if k not in ("FunctionName", "Tags")
    } == {
        "EventSourceArn": {"Fn::GetAtt": ["LogStream", "Arn"]},
        "StartingPosition": "LATEST",
        "BatchSize": 50,
    }
    # And the stream grants reach that stream only: reads for the tailer, puts for the
    # publisher (besides its storage-stream puts)
    tailer = [s for s in variant.statements("tailer") if "LogStream" in json.dumps(s["Resource"])]
    assert {a for s in tailer for a in as_list(s["Action"])} >= {"kinesis:GetRecords"}
    assert variant.actions("tailer", "kinesis") & {"kinesis:PutRecords"} == set()
    publisher = [
        s for s in variant.statements("publisher") if "LogStream" in json.dumps(s["Resource"])
    ]
    assert {a for s in publisher for a in as_list(s["Action"])} == {
        "kinesis:PutRecord",
        "kinesis:PutRecords",
    }


def _function_ids(synth: Synth, name: str) -> list[str]:
    wanted = synth.stack.function_names[name]
    return [
        k
        for k, v in synth.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName") == wanted
    ]


def test_only_the_recorders_append_to_the_log_and_only_the_archiver_reads_it(
    deployed: Synth,
) -> None:
    log = '"EventsStream"'

    def on_log(name: str) -> set[str]:
        return {
            action
            for statement in deployed.statements(name)
            if log in json.dumps(statement["Resource"])
            for action in as_list(statement["Action"])
        }

    # Then the functions that record put records, nothing else (the WebSocket edge records
    # what it pushes and what is acked, as messages does for gets, and the reaper's sweep what
    # it pushes again; sessions and subscriptions the held QoS 2 group deliveries an ended or
    # leaving member drops); the archiver reads, no more
    recorders = (
        "router",
        "messages",
        "push",
        "edge",
        "pusher",
        "reaper",
        "sessions",
        "subscriptions",
    )
    for name in recorders:
        assert on_log(name) == {"kinesis:PutRecord", "kinesis:PutRecords"}, name
    assert "kinesis:GetRecords" in on_log("archiver")
    assert not on_log("archiver") & {"kinesis:PutRecords", "kinesis:PutRecord"}
    for fdef in deployed.deployment.functions:
        if fdef.name not in (*recorders, "archiver"):
            assert on_log(fdef.name) == set(), fdef.name
    # And the archiver writes the archive bucket without reading it; the recorders of gets,
    # acks and pushes no longer write it
    s3 = deployed.actions("archiver", "s3")
    assert "s3:PutObject" in s3 and not any(a.startswith("s3:GetObject") for a in s3)
    assert "s3:PutObject" not in deployed.actions("push", "s3")
    assert "s3:PutObject" not in deployed.actions("messages", "s3")


# -- schedules, bootstrap, alarms, outputs ---------------------------------------------------


def test_scheduled_functions_run_on_an_eventbridge_rate(deployed: Synth, variant: Synth) -> None:
    # Given the real declarations' schedules, and a test function every 30 s
    for synthesized in (deployed, variant):
        rules = synthesized.of_type("AWS::Events::Rule")
        scheduled = [f for f in synthesized.deployment.functions if f.schedule_s is not None]
        assert len(rules) == len(scheduled)
    [rule] = variant.of_type("AWS::Events::Rule").values()
    # Then EventBridge runs it at its finest rate, once a minute
    assert rule["Properties"]["ScheduleExpression"] == "rate(1 minute)"
    [target] = rule["Properties"]["Targets"]
    reaper = next(
        k
        for k, v in variant.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName") == "shoal-test-reaper"
    )
    assert target["Arn"] == {"Fn::GetAtt": [reaper, "Arn"]}


def test_bootstrap_function_runs_as_a_custom_resource(deployed: Synth, variant: Synth) -> None:
    # Given a deployment that declares "bootstrap", and -c defaultPartitions=4
    [resource] = variant.of_type("Custom::ShoalDefaultTopic").values()
    # Then CloudFormation asks it for the default topic with that partition count
    assert resource["Properties"]["DefaultTopic"] == "default"
    assert resource["Properties"]["DefaultPartitions"] == 4
    # And only after every other function (the ones it wires event sources to) exists
    others = {
        k
        for k, v in variant.of_type("AWS::Lambda::Function").items()
        if v["Properties"].get("FunctionName", "").startswith("shoal-test-")
        and v["Properties"]["FunctionName"] != "shoal-test-bootstrap"
    }
    assert others <= set(resource["DependsOn"])
    # And with retainData=false, deleting the stack asks the bootstrap to delete the topic
    assert resource["DeletionPolicy"] == "Delete"
    # And the real declarations have the resource exactly when they declare the function
    declared = any(f.name == "bootstrap" for f in deployed.deployment.functions)
    assert bool(deployed.of_type("Custom::ShoalDefaultTopic")) == declared


def test_alarms_watch_every_function_and_the_api(deployed: Synth) -> None:
    names = {
        a["Properties"]["AlarmName"] for a in deployed.of_type("AWS::CloudWatch::Alarm").values()
    }
    for fdef in deployed.deployment.functions:
        assert f"shoal-test-{fdef.name}-errors" in names
        assert f"shoal-test-{fdef.name}-throttles" in names
    assert "shoal-test-api-5xx" in names
    for alarm in deployed.of_type("AWS::CloudWatch::Alarm").values():
        props = alarm["Properties"]
        # lag, dead letters and table throttling have thresholds of their own (test_operations)
        if not props["AlarmName"].endswith(("-errors", "-throttles", "-5xx")):
            continue
        assert props["Threshold"] == 0
        assert props["ComparisonOperator"] == "GreaterThanThreshold"
        assert props["AlarmActions"]


def test_outputs_name_the_api_tables_and_buckets(deployed: Synth) -> None:
    outputs = deployed.template_json["Outputs"]
    assert "ApiUrl" in outputs
    for table in deployed.deployment.tables:
        assert outputs[logical_id(table.logical, "TableName")]["Value"] == {
            "Ref": logical_id(table.logical, "Table")
        }
    for bucket in deployed.deployment.buckets:
        assert logical_id(bucket.logical, "BucketName") in outputs
    assert outputs["EventsStreamName"]["Value"] == {"Ref": "EventsStream"}


# -- cfn-lint --------------------------------------------------------------------------------


def test_cfn_lint_finds_no_errors(deployed: Synth, variant: Synth, tmp_path: Path) -> None:
    paths = []
    for name, synthesized in (("deployed", deployed), ("variant", variant)):
        path = tmp_path / f"{name}.template.json"
        path.write_text(json.dumps(synthesized.template.to_json()))
        paths.append(str(path))
    cfn_lint = Path(sys.executable).parent / "cfn-lint"
    # W3005: CDK writes DependsOn that cfn-lint finds redundant; that is CDK's output, not ours
    result = subprocess.run(
        [str(cfn_lint), "--ignore-checks", "W3005", "--", *paths],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_route_declarations_without_a_function_folder_fail_loudly(tmp_path: Path) -> None:
    # Given a declared function whose folder does not exist
    deployment = Deployment(
        tables=(), buckets=(), functions=(FunctionDef("ghost", routes=(Route("GET", "/x"),)),)
    )
    # When synthesized / Then CDK refuses instead of deploying an empty function
    with pytest.raises(Exception, match="ghost"):
        synth(deployment, context(), functions_dir=tmp_path)
