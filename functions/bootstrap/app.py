"""Deploy-time bootstrap, run by CloudFormation through CDK's Provider framework (on_event).

Create and Update make sure the `default` composite topic exists with the configured partition
count (idempotent: an existing topic is kept as it is). Delete keeps the topic and its
streams: they hold messages, and the tables that describe them may be retained too.
"""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal.composite.model import DEFAULT_TOPIC
from shoal.composite.service import ensure_default_topic
from shoal.core.config import get_config
from shoal.core.observability import observed
from shoal.wiring import topic_service

#: the bootstrap may wait for a new stream as long as its function's timeout allows
STREAM_WAIT_S = 240.0


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    physical = event.get("PhysicalResourceId") or f"shoal-topic-{DEFAULT_TOPIC}"
    if event.get("RequestType") not in ("Create", "Update"):
        return {"PhysicalResourceId": physical}
    # custom resource properties arrive as strings
    partitions = (event.get("ResourceProperties") or {}).get("DefaultPartitions")
    service = topic_service(get_config(), stream_wait_s=STREAM_WAIT_S)
    topic = ensure_default_topic(service, int(partitions) if partitions else None)
    return {
        "PhysicalResourceId": physical,
        "Data": {
            "Topic": topic.name,
            "Streams": ",".join(s.stream for s in topic.storage_topics),
        },
    }
