"""Deploy-time bootstrap, run by CloudFormation through CDK's Provider framework (on_event).

Create and Update make sure the `default` composite topic exists with the configured partition
count (idempotent: an existing topic is kept as it is). Delete keeps the topic and its
streams: they hold messages, and the tables that describe them may be retained too.
"""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.composite import DEFAULT_TOPIC, ensure_default_topic
from shoal.core.observability import logger


@logger.inject_lambda_context(clear_state=True)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    physical = event.get("PhysicalResourceId") or f"shoal-topic-{DEFAULT_TOPIC}"
    if event.get("RequestType") not in ("Create", "Update"):
        return {"PhysicalResourceId": physical}
    # custom resource properties arrive as strings
    partitions = (event.get("ResourceProperties") or {}).get("DefaultPartitions")
    topic = ensure_default_topic(partitions=int(partitions) if partitions else None)
    return {
        "PhysicalResourceId": physical,
        "Data": {
            "Topic": topic.name,
            "Streams": ",".join(s.stream for s in topic.storage_topics),
        },
    }
