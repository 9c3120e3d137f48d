"""Shoal's data pipeline: PySpark jobs over the S3 archive (see docs/pipeline.md).

``compact`` copies the archive's JSON lines into Parquet (``columnar``: the readers merge both),
``audit`` proves exactly-once delivery after the fact, ``replay`` re-injects archived messages
into a consumer, ``stats`` reports throughput, lag, retry and dead-letter rates. Each module is
a thin ``main()`` over pure DataFrame transforms that the tests call directly; ``common`` holds
the archive's schemas, the readers and the session. They run locally (``shoal pipeline ...``,
Spark in local mode over a folder ``shoal pipeline sync`` filled) and on EMR Serverless
(``infra/pipeline.py``, reading ``s3://`` directly).
"""
