"""Every error a client can see, in one place.

Domain code raises these; the data layer turns SDK errors into them (``raise ... from exc``);
only ``shoal.http.resolver`` turns them into status codes and ``{"error": {...}}`` bodies.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ShoalError(Exception):
    """A failure with a stable, snake_case code and the HTTP status it maps to."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code.replace("_", " ")
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.details}}

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries besides its body."""
        return {}


class BadRequest(ShoalError):
    status = 400
    code = "invalid_request"


class MalformedJson(BadRequest):
    code = "malformed_json"


class InvalidTopicName(BadRequest):
    code = "invalid_topic_name"


class InvalidPartitions(BadRequest):
    code = "invalid_partitions"


class InvalidTopic(BadRequest):
    code = "invalid_topic"


class InvalidPayload(BadRequest):
    """A payload that is not base64, or both ``payload`` and ``text`` given."""

    code = "invalid_payload"


class InvalidFilter(BadRequest):
    """A malformed topic filter, including a malformed ``$share/{ShareName}/{filter}``."""

    code = "invalid_filter"


class Unauthorized(ShoalError):
    status = 401
    code = "unauthorized"


class Forbidden(ShoalError):
    status = 403
    code = "forbidden"


class NotFound(ShoalError):
    status = 404
    code = "not_found"


class RouteNotFound(NotFound):
    code = "route_not_found"


class TopicNotFound(NotFound):
    code = "topic_not_found"


class Conflict(ShoalError):
    status = 409
    code = "conflict"


class TopicExists(Conflict):
    code = "topic_exists"


class NoNextStorageTopic(Conflict):
    code = "no_next_storage_topic"


class PublisherSeqGap(Conflict):
    code = "publisher_seq_gap"


class StorageTopicPending(Conflict):
    """Another storage topic is being added to the topic; repeating that request finishes it."""

    code = "storage_topic_pending"


class StreamConflict(Conflict):
    """A stream with a storage topic's name exists but is not what the topic needs."""

    code = "stream_conflict"


class PayloadTooLarge(ShoalError):
    status = 413
    code = "payload_too_large"


class BodyTooLarge(ShoalError):
    status = 413
    code = "body_too_large"


class UnsupportedMediaType(ShoalError):
    status = 415
    code = "unsupported_media_type"


class ServerBusy(ShoalError):
    """Retry later; ``retry_after_s``, when given, says when (also as ``Retry-After``)."""

    status = 503
    code = "server_busy"

    def __init__(self, message: str = "", *, retry_after_s: int | None = None, **details: Any):
        if retry_after_s is not None:
            details["retry_after_s"] = max(1, retry_after_s)
        super().__init__(message, **details)

    def headers(self) -> dict[str, str]:
        after = self.details.get("retry_after_s")
        return {"Retry-After": str(after)} if after is not None else {}


class SessionNotFound(NotFound):
    code = "session_not_found"


class GroupNotFound(NotFound):
    """No shared group of that ShareName and filter (it has no member now)."""

    code = "group_not_found"


class ChannelOutdated(Conflict):
    """A newer connect for this client id exists: this one can never become the newest."""

    code = "channel_outdated"


class SessionTakenOver(Conflict):
    """The channel named by ``Shoal-Channel`` is no longer the client id's live channel."""

    code = "session_taken_over"


# -- push subscriptions (shoal.push) --------------------------------------------------------


class InvalidSubscriptionName(BadRequest):
    code = "invalid_subscription_name"


class InvalidEndpoint(BadRequest):
    """Not https (http only to loopback under ``shoal dev``), credentials in it, or no host."""

    code = "invalid_endpoint"


class InvalidRetryPolicy(BadRequest):
    code = "invalid_retry_policy"


class InvalidParallelism(BadRequest):
    code = "invalid_parallelism"


class InvalidSeek(BadRequest):
    """Not exactly one of ``to_time`` and ``to`` ("earliest" or "latest")."""

    code = "invalid_seek"


class InvalidRedrive(BadRequest):
    """Not exactly one of ``ordering_keys``, ``message_ids``, ``failed_after``, or over a cap."""

    code = "invalid_redrive"


class InvalidCursor(BadRequest):
    """A page cursor (``after``) this service did not hand out."""

    code = "invalid_cursor"


class SubscriptionNotFound(NotFound):
    code = "subscription_not_found"


class SubscriptionExists(Conflict):
    """A push subscription of that name exists (or is being created with another spec)."""

    code = "subscription_exists"


class UnknownEncoding(ShoalError):
    """An inbox item in an encoding this release does not know (written by a newer one): a
    500, since the reader must be upgraded (``shoal.delivery.codec``)."""

    code = "unknown_item_encoding"
