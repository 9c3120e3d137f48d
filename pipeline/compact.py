"""``shoal pipeline compact``: the archive's JSON lines into Parquet (see ``pipeline.columnar``).

Per source hour (``date=/hour=`` of the router's and the recorder's objects): the hour's
objects read once with the explicit schema, written as Parquet under
``parquet/<messages|events>/date=/hour=/`` (snappy, at most ``--rows-per-file`` rows a file),
then the hour's manifest, last. Hours whose manifest covers every object are left alone, so a
second run changes nothing; an hour with late objects is compacted again from all of them.
The stack runs it on a schedule on EMR Serverless (``infra/pipeline.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pipeline.columnar import ROWS_PER_FILE, compact
from pipeline.common import EVENTS, MESSAGES, Progress, job_parser, parse_time, spark_session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="archive root: a folder or s3://bucket")
    parser.add_argument("--since", help="hours from (ISO 8601 or epoch ms)")
    parser.add_argument("--until", help="hours before (ISO 8601 or epoch ms)")
    parser.add_argument("--kind", choices=(MESSAGES, EVENTS), action="append", help="default: both")
    parser.add_argument("--rows-per-file", type=int, default=ROWS_PER_FILE)
    parser.add_argument("--quiet", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser("compact")
    add_arguments(parser)
    args = parser.parse_args(argv)
    progress = Progress("compact", quiet=args.quiet)
    progress("starting Spark")
    spark = spark_session("shoal-compact")
    progress(f"listing {args.input}")
    results = compact(
        spark,
        args.input,
        kinds=args.kind or (MESSAGES, EVENTS),
        since=parse_time(args.since),
        until=parse_time(args.until),
        rows_per_file=args.rows_per_file,
        progress=progress,
    )
    for r in results:
        progress(
            f"{r.kind}: {r.hours} hours compacted ({r.objects} objects into {r.files} files), "
            f"{r.skipped} already compacted" + (f", {r.named} given names" if r.named else "")
        )
    return 0
