"""``shoal pipeline sync``: copy the local runtime's archive out of its emulated S3 into a folder.

Spark here has no S3 connector, so locally the jobs read a folder that mirrors the bucket
(``messages/...``, ``events/...``). The emulator's address is the ``aws_url`` that ``shoal dev``
writes into ``<state dir>/runtime.json`` (default state dir ``.shoal``, the one ``make run``
uses); ``--endpoint`` (the shoal dev URL) is checked against that file, so a sync never reads
another runtime's account by mistake. ``--aws-endpoint`` names the emulator directly instead.

Delivery events reach S3 through the archiver, a moment after the calls that recorded them
(``shoal.delivery.events``): with a state folder, the sync first waits (``--wait-s``, 30 s
by default) until the archiver's mapping has done every record of the event log, read from the
emulator and that shoal dev's checkpoints; a shoal dev that no longer runs its triggers makes
it warn and copy what is there.

The copy is incremental: an object whose ETag is the one copied last time is not fetched again
(``.sync.json`` in the folder remembers them); an object rewritten under the same key (a retried
batch) is. No Spark: this runs in a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.common import job_parser

MANIFEST = ".sync.json"
PREFIXES = ("messages/", "events/")


class SyncError(RuntimeError):
    pass


@dataclass
class SyncResult:
    objects: int = 0
    fetched: int = 0
    bytes: int = 0


def aws_endpoint(endpoint: str | None, state_dir: Path, aws_endpoint: str | None) -> str:
    """The emulator's URL: given, or from the runtime file of the shoal dev serving ``endpoint``."""
    if aws_endpoint:
        return aws_endpoint
    from shoal.local.runtime import RUNTIME_FILE

    runtime = state_dir / RUNTIME_FILE
    try:
        info = json.loads(runtime.read_text())
    except (OSError, ValueError) as exc:
        raise SyncError(
            f"no running shoal dev on {state_dir} ({runtime} unreadable); pass --state-dir of "
            "the shoal dev you mean, or --aws-endpoint"
        ) from exc
    if endpoint and info.get("url", "").rstrip("/") != endpoint.rstrip("/"):
        raise SyncError(
            f"the shoal dev on {state_dir} serves {info.get('url')}, not {endpoint}; pass its "
            "--state-dir, or --aws-endpoint"
        )
    return str(info["aws_url"])


def default_bucket() -> str:
    from shoal.local.provision import LocalNames

    return LocalNames.for_deployment().buckets["archive"]


def wait_for_archiver(session: Any, state_dir: Path, timeout_s: float) -> bool:
    """Until the archiver has taken every record of the event log (True), or ``timeout_s``."""
    from shoal.local.checkpoints import FileCheckpoints
    from shoal.local.esm.mappings import caught_up
    from shoal.local.provision import LocalNames
    from shoal.local.runtime import CHECKPOINTS_DIR

    archiver = LocalNames.for_deployment().functions["archiver"]
    checkpoints = FileCheckpoints(state_dir / CHECKPOINTS_DIR)
    deadline = time.monotonic() + timeout_s
    while not caught_up(session, checkpoints, archiver):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _local_path(root: Path, key: str) -> Path:
    parts = PurePosixPath(key).parts
    if not parts or any(p in ("..", "") for p in parts) or key.startswith("/"):
        raise SyncError(f"refusing an object key outside the folder: {key!r}")
    return root.joinpath(*parts)


def sync(
    s3: Any, bucket: str, target: Path, prefixes: Sequence[str] = PREFIXES, quiet: bool = False
) -> SyncResult:
    target.mkdir(parents=True, exist_ok=True)
    manifest_path = target / MANIFEST
    try:
        manifest: dict[str, str] = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    result = SyncResult()
    paginator = s3.get_paginator("list_objects_v2")
    for prefix in prefixes:
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                key, etag = obj["Key"], obj.get("ETag", "")
                result.objects += 1
                path = _local_path(target, key)
                if manifest.get(key) == etag and path.exists():
                    continue
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(path.name + ".part")
                partial.write_bytes(body)
                partial.replace(path)
                manifest[key] = etag
                result.fetched += 1
                result.bytes += len(body)
    partial_manifest = manifest_path.with_name(MANIFEST + ".part")
    partial_manifest.write_text(json.dumps(manifest, indent=0, sort_keys=True))
    partial_manifest.replace(manifest_path)
    if not quiet:
        print(
            f"shoal pipeline sync: {result.objects} objects in s3://{bucket}, fetched "
            f"{result.fetched} ({result.bytes:,} bytes) into {target}",
            file=sys.stderr,
        )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="URL of the shoal dev to copy from (checked)")
    parser.add_argument("--to", required=True, type=Path, help="folder to copy into")
    parser.add_argument(
        "--state-dir", type=Path, default=Path(".shoal"), help="that shoal dev's state folder"
    )
    parser.add_argument("--aws-endpoint", help="the emulator's URL, instead of the state folder")
    parser.add_argument("--bucket", help="default: the local archive bucket")
    parser.add_argument(
        "--wait-s",
        type=float,
        default=30.0,
        help="wait this long for the archiver to write the delivery events already recorded "
        "(0: copy what is there); needs the state folder",
    )
    parser.add_argument("--quiet", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("sync")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        url = aws_endpoint(args.endpoint, args.state_dir, args.aws_endpoint)
        from shoal.local.aws import EndpointSession

        session = EndpointSession(url)
        waited = args.wait_s > 0 and not args.aws_endpoint
        if waited and not wait_for_archiver(session, args.state_dir, args.wait_s):
            print(
                f"shoal pipeline sync: the archiver has not written every delivery event "
                f"after {args.wait_s:g} s; copying what is there",
                file=sys.stderr,
            )
        s3 = session.client("s3")
        sync(s3, args.bucket or default_bucket(), args.to, quiet=args.quiet)
    except SyncError as exc:
        print(f"shoal pipeline sync: {exc}", file=sys.stderr)
        return 2
    return 0
