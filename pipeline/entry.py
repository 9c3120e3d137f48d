"""One entry point for every job: ``shoal pipeline JOB ...``, ``python -m pipeline JOB ...``, and
the script EMR Serverless runs (``infra/pipeline.py`` uploads this file as the entry point and
the ``pipeline`` and ``shoal.topics`` packages as ``--py-files``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: job name -> module with main(argv) -> exit status
JOBS = {
    "audit": "pipeline.audit",
    "compact": "pipeline.compact",
    "replay": "pipeline.replay",
    "stats": "pipeline.stats",
    "sync": "pipeline.sync",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in JOBS:
        print(f"usage: shoal pipeline {{{','.join(JOBS)}}} [--help]", file=sys.stderr)
        return 2
    module = importlib.import_module(JOBS[args[0]])
    status: int = module.main(args[1:])
    return status


if __name__ == "__main__":
    sys.exit(main())
