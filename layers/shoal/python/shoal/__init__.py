"""Shoal: durable publish/subscribe with MQTT topic semantics on AWS serverless primitives."""

__version__ = "0.1.0"
