"""The pipeline construct: an EMR Serverless Spark application, a least-privilege job role,
and the jobs' code as assets."""

from __future__ import annotations

from typing import Any

import pytest

from tests.infra.stacks import Synth, as_list

pytestmark = pytest.mark.infra


def job_role(synth: Synth) -> tuple[str, dict[str, Any]]:
    [(logical, role)] = [
        (k, v)
        for k, v in synth.of_type("AWS::IAM::Role").items()
        if any(
            s["Principal"].get("Service") == "emr-serverless.amazonaws.com"
            for s in v["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        )
    ]
    return logical, role


def role_statements(synth: Synth, logical: str) -> list[dict[str, Any]]:
    return [
        s
        for policy in synth.of_type("AWS::IAM::Policy").values()
        if {"Ref": logical} in policy["Properties"]["Roles"]
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
    ]


def rendered(value: Any) -> str:
    """A CloudFormation value as text, intrinsic functions and all."""
    import json

    return json.dumps(value, sort_keys=True)


def test_a_spark_application_on_an_emr_7_release(deployed: Synth) -> None:
    [app] = deployed.of_type("AWS::EMRServerless::Application").values()
    props = app["Properties"]
    assert props["Type"] == "SPARK"
    assert props["ReleaseLabel"].startswith("emr-7.")
    # it stops when idle and is capped, so a forgotten job costs little
    assert props["AutoStopConfiguration"]["Enabled"] is True
    assert "Cpu" in props["MaximumCapacity"]


def test_the_job_role_is_for_emr_serverless_of_this_account_only(deployed: Synth) -> None:
    _, role = job_role(deployed)
    [trust] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Action"] == "sts:AssumeRole"
    assert "aws:SourceAccount" in trust["Condition"]["StringEquals"]


def test_the_job_role_reads_only_the_archive_prefixes_and_writes_only_results(
    deployed: Synth,
) -> None:
    logical, _ = job_role(deployed)
    statements = role_statements(deployed, logical)
    archive_ref = "ArchiveBucket"
    writes = {"s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"}
    for statement in statements:
        actions = set(as_list(statement["Action"]))
        resources = rendered(statement["Resource"])
        assert statement["Resource"] != "*"
        if archive_ref in resources:
            # no wildcard action on the archive (the asset grants CDK makes are its own)
            assert not any(a.endswith("*") for a in actions)
        if actions & writes:
            # Then every write is confined to the results prefix and the columnar copy
            for resource in as_list(statement["Resource"]):
                text = rendered(resource)
                assert "pipeline-results/*" in text or "parquet/*" in text
        if "s3:GetObject" in actions and archive_ref in resources:
            for resource in as_list(statement["Resource"]):
                text = rendered(resource)
                assert any(
                    p in text for p in ("messages/*", "events/*", "parquet/*", "pipeline-results/*")
                )
    listing = [s for s in statements if "s3:ListBucket" in as_list(s["Action"])]
    archive_listing = [s for s in listing if archive_ref in rendered(s["Resource"])]
    assert archive_listing
    for statement in archive_listing:
        assert "s3:prefix" in statement["Condition"]["StringLike"]


def test_compaction_is_scheduled_as_an_emr_serverless_job_run(deployed: Synth) -> None:
    # Given the stack's schedules
    [schedule] = deployed.of_type("AWS::Scheduler::Schedule").values()
    props = schedule["Properties"]
    target = props["Target"]
    run = rendered(target["Input"])
    [app_logical] = deployed.of_type("AWS::EMRServerless::Application")
    job_logical, _ = job_role(deployed)
    # Then it starts a job run of the pipeline's application, hourly, running compact over
    # the archive as the job role
    assert target["Arn"] == "arn:aws:scheduler:::aws-sdk:emrserverless:startJobRun"
    assert props["ScheduleExpression"].startswith("cron(")
    assert app_logical in run and job_logical in run
    assert "compact" in run and "--input" in run and "SparkSubmitParameters" in run
    # and the scheduler's role may start runs of that application and pass only the job role
    role_logical = target["RoleArn"]["Fn::GetAtt"][0]
    statements = role_statements(deployed, role_logical)
    starts = [s for s in statements if "emr-serverless:StartJobRun" in as_list(s["Action"])]
    passes = [s for s in statements if "iam:PassRole" in as_list(s["Action"])]
    assert starts and all(app_logical in rendered(s["Resource"]) for s in starts)
    assert passes and all(job_logical in rendered(s["Resource"]) for s in passes)


def test_job_runs_give_driver_and_executors_the_jobs_jvm_options(deployed: Synth) -> None:
    from pipeline.common import JVM_OPTIONS

    # Given the submit parameters the stack outputs and the ones its compaction runs with
    outputs = deployed.template.to_json()["Outputs"]
    [submit] = [v["Value"] for k, v in outputs.items() if "SparkSubmitParameters" in k]
    [schedule] = deployed.of_type("AWS::Scheduler::Schedule").values()
    run = rendered(schedule["Properties"]["Target"]["Input"])
    # Then both give the driver and the executors the JVM options local sessions start with
    for process in ("driver", "executor"):
        option = f"--conf spark.{process}.extraJavaOptions={JVM_OPTIONS}"
        assert option in rendered(submit)
        assert option in run


def test_the_jobs_code_is_uploaded_and_named_in_the_outputs(deployed: Synth) -> None:
    outputs = deployed.template.to_json()["Outputs"]
    names = {k for k in outputs if k.startswith("Pipeline")}
    for suffix in ("ApplicationId", "JobRoleArn", "EntryPoint", "SparkSubmitParameters"):
        assert any(n.endswith(suffix) or suffix in n for n in names), suffix
    # the role may read the code assets it runs
    logical, _ = job_role(deployed)
    assert any(
        "s3:GetObject*" in as_list(s["Action"]) or "s3:GetObject" in as_list(s["Action"])
        for s in role_statements(deployed, logical)
        if "cdk" in rendered(s["Resource"]) or "Asset" in rendered(s["Resource"])
    )


def test_the_staged_code_holds_the_pipeline_and_only_stdlib_shoal(tmp_path: Any) -> None:
    from infra.pipeline import SHOAL_MODULES, stage_code

    staged = stage_code()
    assert (staged / "pipeline" / "entry.py").is_file()
    assert (staged / "pipeline" / "audit.py").is_file()
    shipped = [p.relative_to(staged / "shoal").as_posix() for p in (staged / "shoal").rglob("*.py")]
    assert sorted(shipped) == sorted(SHOAL_MODULES)
