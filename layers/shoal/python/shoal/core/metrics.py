"""The custom metrics Shoal emits, declared once: the functions emit them (EMF through Powertools)
and the stack's dashboard and alarms read the same names.

Every metric is in the ``Shoal`` namespace with one dimension, ``service``: the function's
name (a handful of values); ``DEAD_LETTERS`` has a push subscription's name besides. Never a
client id, a topic name or a group name as a dimension: each distinct value is a billed custom
metric, and a client id would make them unbounded.
"""

from __future__ import annotations

from typing import Final

NAMESPACE: Final = "Shoal"
# Powertools puts the service name in this dimension on every metric it flushes.
DIMENSION: Final = "service"

# Counts (Unit.Count), each summed over a function's invocations.
PUBLISHED: Final = "MessagesPublished"  # publish: messages accepted (not duplicates)
ROUTED: Final = "MessagesRouted"  # router: messages read from the storage topics
DELIVERIES: Final = "DeliveriesWritten"  # router: deliveries written to inboxes
# messages: deliveries handed out by a get for the first time; push: first POSTs
DELIVERED: Final = "MessagesDelivered"
ACKED: Final = "MessagesAcked"  # messages: deliveries acknowledged; push: POSTs answered 2xx
REDELIVERED: Final = "MessagesRedelivered"  # messages/push: deliveries sent again (dup)
DEAD_LETTERED: Final = "MessagesDeadLettered"  # push: messages moved to the DLQ
REDRIVEN: Final = "MessagesRedriven"  # pushadmin: DLQ messages sent back
# push: archived messages a replay put back in a retry queue, at their first POST since
REPLAYED: Final = "MessagesReplayed"
# shared groups: a leader's transition that changed who holds which stream, once committed
REBALANCES: Final = "GroupRebalances"
# edge/router: frames pushed to WebSocket connections (deliveries), and pushes that failed
# (the connection was gone, or @connections refused): the inbox keeps what they carried
PUSHED: Final = "FramesPushed"
PUSH_FAILED: Final = "PushFailed"
# edge: @connections posts refused as throttled (each refusal; the post is tried again)
POSTS_THROTTLED: Final = "PostsThrottled"
# archiver: delivery-event lines written to the archive (a retried batch counts again)
ARCHIVED_EVENTS: Final = "DeliveryEventsArchived"

# Lag (Unit.Milliseconds): age of the oldest record of an invocation's batch, measured from
# Kinesis' ApproximateArrivalTimestamp. The same quantity as the mapping's IteratorAge, but
# per function and available under `shoal dev`, where no IteratorAge exists.
ROUTER_LAG: Final = "RouterLag"
PUSH_LAG: Final = "PushLag"
ARCHIVER_LAG: Final = "ArchiverLag"

# Levels (Unit.Count) the reaper's census reports each run (``shoal.census``), graphed with
# the Maximum statistic: WebSocket connections that hold a session, sessions whose channel is
# connected (HTTP or WebSocket), shared groups, and each push subscription's dead letters.
CONNECTIONS: Final = "WebSocketConnections"
SESSIONS_CONNECTED: Final = "SessionsConnected"
SHARED_GROUPS: Final = "SharedGroups"
DEAD_LETTERS: Final = "DeadLetters"
#: the one extra dimension a metric may have: ``DEAD_LETTERS``' push subscription. Bounded (an
#: admin makes each subscription), unlike a client id or a topic name
SUBSCRIPTION_DIMENSION: Final = "subscription"

COUNTS: Final = (
    PUBLISHED,
    ROUTED,
    DELIVERIES,
    DELIVERED,
    ACKED,
    REDELIVERED,
    DEAD_LETTERED,
    REDRIVEN,
    REPLAYED,
    REBALANCES,
    ARCHIVED_EVENTS,
)
LAGS: Final = (ROUTER_LAG, PUSH_LAG, ARCHIVER_LAG)
GAUGES: Final = (CONNECTIONS, SESSIONS_CONNECTED, SHARED_GROUPS, DEAD_LETTERS)
