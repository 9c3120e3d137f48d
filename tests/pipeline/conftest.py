"""One local SparkSession for every pipeline test (it costs seconds to start).

Tests build small inline DataFrames with the factories of ``tests.pipeline.data`` and call the
jobs' transforms directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    # the Python workers must be this venv's interpreter, with shoal installed
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pipeline.common import spark_session

    session = spark_session("shoal-pipeline-tests", master="local[2]")
    # tiny inputs: one shuffle partition and no adaptive re-planning mean fewer stages
    session.conf.set("spark.sql.shuffle.partitions", "1")
    session.conf.set("spark.sql.adaptive.enabled", "false")
    yield session
    session.stop()
