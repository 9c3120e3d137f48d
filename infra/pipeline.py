"""The data pipeline on EMR Serverless: an application, a job role, and the jobs' code.

``PipelineJobs`` deploys what ``shoal pipeline compact|audit|replay|stats`` runs locally:

* a Spark application (EMR release ``RELEASE_LABEL``, ARM, stops itself when idle, capped), so
  a job costs nothing between runs; the release's Spark is the pyspark the project pins
  (requirements.in) and its Python (3.9) is the one the jobs' code is checked on
  (tests/pipeline/test_emr_release.py);
* a job execution role that EMR Serverless assumes (only for this account), which may read the
  archive's ``messages/`` and ``events/`` and nothing else in the bucket, read and write the
  columnar copy under ``parquet/`` (``shoal pipeline compact``), and read and write only under
  the results prefix;
* a schedule (EventBridge Scheduler) that starts the ``compact`` job every hour, through the
  scheduler's universal target for EMR Serverless ``StartJobRun``;
* the code as CDK assets: ``pipeline/entry.py`` is the entry point, and one zip holds the
  ``pipeline`` package with the stdlib-only part of ``shoal`` it imports
  (``shoal.topics.filters`` and ``shoal.core.errors``), passed as ``--py-files``.

A job run is not a CloudFormation resource; the stack outputs what ``start-job-run`` needs and
docs/pipeline.md shows the command. Replay into a live target needs the service's tables, so on
EMR it writes its plan (``--target plan:s3://.../``) and ``shoal pipeline replay`` injects it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import aws_emrserverless as emrserverless
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_scheduler as scheduler
from constructs import Construct

from infra.nag import acknowledge_wildcards, role_statements
from pipeline.common import submit_parameters

ROOT = Path(__file__).resolve().parent.parent
#: the newest EMR Serverless 7.x release whose release page lists its Spark (3.5.5): the
#: Spark 3.5 line as 7.5.0 (3.5.2) had, three maintenance releases of fixes later, on the
#: same Python 3.9; requirements.in pins pyspark to it
RELEASE_LABEL = "emr-7.9.0"
#: the Spark and Python of each release the stack may pin (the EMR Serverless user guide's
#: release pages; EMR 7.x runs jobs on Amazon Linux 2023's Python 3.9)
RELEASES = {
    "emr-7.5.0": ("3.5.2", "3.9"),
    "emr-7.9.0": ("3.5.5", "3.9"),
}
RESULTS_PREFIX = "pipeline-results"
#: what the jobs read in the archive bucket (shoal.router.archive, shoal.delivery.events)
ARCHIVE_PREFIXES = ("messages", "events")
#: the columnar copy compact writes and the other jobs read (pipeline.columnar)
PARQUET_PREFIX = "parquet"
#: compaction: every hour at minute 20 (the router's objects of the hour before are in)
COMPACT_SCHEDULE = "cron(20 * * * ? *)"
#: the part of the shoal package the jobs import: no third-party dependency
SHOAL_MODULES = (
    "__init__.py",
    "core/__init__.py",
    "core/errors.py",
    "topics/__init__.py",
    "topics/filters.py",
)
CODE_EXCLUDE = ["**/__pycache__", "**/*.pyc"]


def stage_code(root: Path = ROOT) -> Path:
    """A folder holding ``pipeline/`` and the jobs' slice of ``shoal/``, zipped by the asset."""
    staged = Path(tempfile.mkdtemp(prefix="shoal-pipeline-"))
    shutil.copytree(
        root / "pipeline", staged / "pipeline", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in SHOAL_MODULES:
        (staged / "shoal" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / "layers" / "shoal" / "python" / "shoal" / name, staged / "shoal" / name)
    return staged


class PipelineJobs(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        archive: s3.IBucket,
        release_label: str = RELEASE_LABEL,
        results_prefix: str = RESULTS_PREFIX,
        root: Path = ROOT,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = cdk.Stack.of(self)
        self.results_uri = f"s3://{archive.bucket_name}/{results_prefix}/"

        self.application = emrserverless.CfnApplication(
            self,
            "Application",
            name=f"{stack.stack_name}-pipeline",
            release_label=release_label,
            type="SPARK",
            architecture="ARM64",
            auto_start_configuration=emrserverless.CfnApplication.AutoStartConfigurationProperty(
                enabled=True
            ),
            auto_stop_configuration=emrserverless.CfnApplication.AutoStopConfigurationProperty(
                enabled=True, idle_timeout_minutes=15
            ),
            maximum_capacity=emrserverless.CfnApplication.MaximumAllowedResourcesProperty(
                cpu="32 vCPU", memory="128 GB", disk="500 GB"
            ),
        )

        self.role = iam.Role(
            self,
            "JobRole",
            description="EMR Serverless job runs of the Shoal pipeline",
            assumed_by=iam.ServicePrincipal(
                "emr-serverless.amazonaws.com",
                # the confused-deputy guard: only job runs of this account assume it
                conditions={"StringEquals": {"aws:SourceAccount": stack.account}},
            ),
        )
        read_prefixes = [f"{p}/*" for p in ARCHIVE_PREFIXES]
        parquet = f"{PARQUET_PREFIX}/*"
        for statement in (
            iam.PolicyStatement(
                sid="ReadArchive",
                actions=["s3:GetObject"],
                resources=[archive.arn_for_objects(p) for p in read_prefixes],
            ),
            iam.PolicyStatement(
                sid="ListArchiveAndResults",
                actions=["s3:ListBucket"],
                resources=[archive.bucket_arn],
                conditions={
                    "StringLike": {
                        "s3:prefix": [
                            *ARCHIVE_PREFIXES,
                            *read_prefixes,
                            PARQUET_PREFIX,
                            parquet,
                            results_prefix,
                            f"{results_prefix}/*",
                        ]
                    }
                },
            ),
            iam.PolicyStatement(
                sid="WriteResults",
                # Spark's committer writes, reads back and deletes its temporary files
                actions=["s3:PutObject", "s3:GetObject", "s3:DeleteObject"],
                resources=[archive.arn_for_objects(f"{results_prefix}/*")],
            ),
            iam.PolicyStatement(
                sid="CompactArchive",
                # compact writes Parquet and its manifests, and deletes the files a newer
                # compaction of the hour superseded
                actions=["s3:PutObject", "s3:GetObject", "s3:DeleteObject"],
                resources=[archive.arn_for_objects(parquet)],
            ),
        ):
            self.role.add_to_policy(statement)

        self.code = s3_assets.Asset(self, "Code", path=str(stage_code(root)), exclude=CODE_EXCLUDE)
        self.entry = s3_assets.Asset(self, "Entry", path=str(root / "pipeline" / "entry.py"))
        self.code.grant_read(self.role)
        self.entry.grant_read(self.role)
        acknowledge_wildcards(
            self.role,
            role_statements(self.role),
            "the job reads and writes objects under its prefixes of the archive (events/, "
            "messages/, parquet/, pipeline-results/), keys made at run time, and reads its code "
            "from CDK's asset bucket (CDK's grant and its action groups)",
        )

        submit = submit_parameters(self.code.s3_object_url)
        self.archive_uri = f"s3://{archive.bucket_name}"
        self.compaction = self._compaction_schedule(submit)
        cdk.CfnOutput(self, "ApplicationId", value=self.application.attr_application_id)
        cdk.CfnOutput(self, "JobRoleArn", value=self.role.role_arn)
        cdk.CfnOutput(self, "EntryPoint", value=self.entry.s3_object_url)
        cdk.CfnOutput(self, "SparkSubmitParameters", value=submit)
        cdk.CfnOutput(self, "ResultsUri", value=self.results_uri)
        cdk.CfnOutput(self, "ArchiveUri", value=self.archive_uri)

    def _compaction_schedule(self, submit: str) -> scheduler.CfnSchedule:
        """Every hour, ``compact`` as an EMR Serverless job run: the scheduler's universal
        target calls ``StartJobRun`` with the job's driver, as ``aws emr-serverless
        start-job-run`` would (docs/pipeline.md)."""
        stack = cdk.Stack.of(self)
        role = iam.Role(
            self,
            "CompactScheduleRole",
            description="EventBridge Scheduler starting the pipeline's compaction",
            assumed_by=iam.ServicePrincipal(
                "scheduler.amazonaws.com",
                conditions={"StringEquals": {"aws:SourceAccount": stack.account}},
            ),
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="StartCompaction",
                actions=["emr-serverless:StartJobRun"],
                resources=[self.application.attr_arn],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                sid="PassJobRole",
                actions=["iam:PassRole"],
                resources=[self.role.role_arn],
                conditions={
                    "StringEquals": {"iam:PassedToService": "emr-serverless.amazonaws.com"}
                },
            )
        )
        run = {
            "ApplicationId": self.application.attr_application_id,
            "ExecutionRoleArn": self.role.role_arn,
            # one run per scheduled invocation, whatever the scheduler retries
            "ClientToken": "<aws.scheduler.execution-id>",
            "Name": "compact",
            "JobDriver": {
                "SparkSubmit": {
                    "EntryPoint": self.entry.s3_object_url,
                    "EntryPointArguments": ["compact", "--input", self.archive_uri],
                    "SparkSubmitParameters": submit,
                }
            },
        }
        return scheduler.CfnSchedule(
            self,
            "CompactSchedule",
            description="hourly: the JSON lines of the archive into Parquet (pipeline compact)",
            schedule_expression=COMPACT_SCHEDULE,
            flexible_time_window=scheduler.CfnSchedule.FlexibleTimeWindowProperty(mode="OFF"),
            target=scheduler.CfnSchedule.TargetProperty(
                arn="arn:aws:scheduler:::aws-sdk:emrserverless:startJobRun",
                role_arn=role.role_arn,
                input=stack.to_json_string(run),
                retry_policy=scheduler.CfnSchedule.RetryPolicyProperty(maximum_retry_attempts=2),
            ),
        )
