"""The one logger, tracer and metrics object every function uses. Never log payloads or tokens."""

from aws_lambda_powertools import Logger, Metrics, Tracer

logger = Logger(service="shoal")
tracer = Tracer(service="shoal")
metrics = Metrics(namespace="Shoal", service="shoal")
