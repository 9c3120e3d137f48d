"""The WebSocket protocol's frames: one schema source for the handlers and the contract.

Every frame is a JSON object in a text frame whose ``action`` names it (the WebSocket API's
route selection expression is ``$request.body.action``). A client frame may carry a ``ref``,
which the service's answer to it echoes, so a client can match answers to requests. The
client frames take the fields of the HTTP API's requests (``PUT /v1/sessions/{id}``, the
subscribe, unsubscribe, publish and ack bodies) plus their own; the service's frames are the
HTTP API's answers plus ``action``. ``docs/asyncapi.yaml`` is generated from these models
(``python -m shoal.edge.contract``) and a test holds the committed file equal to them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    TypeAdapter,
    ValidationError,
)

from shoal.core.errors import BadRequest, MalformedJson, ShoalError
from shoal.delivery.model import AckRequest, SubscribeRequest, UnsubscribeRequest
from shoal.publish.request import PublishRequest
from shoal.sessions.model import MAX_CLIENT_ID_BYTES, ConnectRequest

#: MQTT 5 §3.1.2.11.3: Receive Maximum is a two-byte integer, 0 is a protocol error
MAX_RECEIVE_MAXIMUM = 65_535
#: a client's ``ref`` is echoed back as it came: short, printable
MAX_REF = 128

Ref = Annotated[str, Field(min_length=1, max_length=MAX_REF, pattern=r"^[^\x00-\x1f\x7f]+$")]


class ConnectFrame(ConnectRequest):
    """``connect``: the body of ``PUT /v1/sessions/{client_id}``, the client id, and MQTT 5's
    Receive Maximum (§3.1.2.11.3): how many QoS 1/2 deliveries may be unacked at once."""

    action: Literal["connect"]
    ref: Ref | None = None
    client_id: str = Field(min_length=1, max_length=MAX_CLIENT_ID_BYTES)
    receive_maximum: int | None = Field(default=None, ge=1, le=MAX_RECEIVE_MAXIMUM)


class RenewFrame(BaseModel):
    """``renew``: the first frame of a new connection that takes over the client's own live
    channel from its older connection, before API Gateway closes that one at two hours.

    MQTT has no such packet: an MQTT connection has no fixed end. A renewal is not a new
    CONNECT: the channel, the session and what is in flight stay as they are, and no will is
    published (the connection was not lost; MQTT 5 §3.1.2.5 publishes the will of a
    taken-over connection). The older connection gets no ``disconnect``: the client closes it
    once ``connected`` came. Refused (``renew_refused``) when ``channel`` is not the live
    channel of a connection this principal holds: the client sends ``connect`` then."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["renew"]
    ref: Ref | None = None
    client_id: str = Field(min_length=1, max_length=MAX_CLIENT_ID_BYTES)
    channel: str = Field(min_length=1, max_length=MAX_REF)


class SubscribeFrame(SubscribeRequest):
    action: Literal["subscribe"]
    ref: Ref | None = None


class UnsubscribeFrame(UnsubscribeRequest):
    action: Literal["unsubscribe"]
    ref: Ref | None = None


class PublishFrame(PublishRequest):
    action: Literal["publish"]
    ref: Ref | None = None


class AckFrame(AckRequest):
    """``ack``: the ids processed, up to 1,000, in any order; an id not handed out to this
    session, or acked already, acks nothing. One write of the session's state a frame,
    whatever its number of ids. Clients hold their acks for a delay and send those of the
    delay together (``shoal.client`` and the console: 300 ms by default, 0 to 10 s; sooner
    when half the window, ``receive_maximum``, waits for its acks): a longer delay is fewer
    billed frames and ``ack`` invocations, and more messages sent again with ``dup`` after a
    crash or past the ack timeout (a client that recorded them acks them again without handing
    them out). Answered ``acked`` only when it carries a ``ref``: an MQTT PUBACK gets no answer
    (MQTT 5 §3.4), and each answer is a billed message."""

    action: Literal["ack"]
    ref: Ref | None = None


class PingFrame(BaseModel):
    """``ping``: answered ``pong`` by API Gateway itself (a mock route): no function runs."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["ping"]
    ref: Ref | None = None


class KeepaliveFrame(BaseModel):
    """``keepalive``: taken by API Gateway itself (a mock route), answered with nothing: it
    keeps a silent connection open (10 minutes idle) for one billed message, where ``ping``
    and its ``pong`` are two. It tells the client nothing of the connection's health."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["keepalive"]


class DisconnectFrame(BaseModel):
    """``disconnect``: a normal disconnect discards the will (MQTT 5 §3.14.4); ``with_will``
    true is MQTT 5's "Disconnect with Will Message" (reason 0x04): the will is published
    after its delay, as for a lost connection."""

    model_config = ConfigDict(extra="forbid", strict=True)

    action: Literal["disconnect"]
    ref: Ref | None = None
    with_will: StrictBool = False


ClientFrame = Annotated[
    ConnectFrame
    | RenewFrame
    | SubscribeFrame
    | UnsubscribeFrame
    | PublishFrame
    | AckFrame
    | PingFrame
    | KeepaliveFrame
    | DisconnectFrame,
    Field(discriminator="action"),
]

CLIENT_FRAMES: tuple[type[BaseModel], ...] = (
    ConnectFrame,
    RenewFrame,
    SubscribeFrame,
    UnsubscribeFrame,
    PublishFrame,
    AckFrame,
    PingFrame,
    KeepaliveFrame,
    DisconnectFrame,
)
CLIENT_ACTIONS = tuple(m.model_fields["action"].annotation.__args__[0] for m in CLIENT_FRAMES)  # type: ignore[union-attr]

_CLIENT_FRAME: TypeAdapter[Any] = TypeAdapter(ClientFrame)


def frame_ref(text: str | bytes | None) -> str | None:
    """The ``ref`` of a frame that may not parse, for its error frame; None when there is none
    to echo (only a well-formed ``ref`` is echoed back)."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return None
    ref = data.get("ref") if isinstance(data, dict) else None
    if isinstance(ref, str) and 0 < len(ref) <= MAX_REF and ref.isprintable():
        return ref
    return None


def parse_client_frame(text: str | bytes | None) -> Any:
    """A client frame as its model; ``BadRequest`` (coded as the HTTP API codes it) when it is
    not JSON, not an object, names no known action, or does not fit its action's schema."""
    try:
        data = json.loads(text or "")
    except ValueError as exc:
        raise MalformedJson("the frame is not JSON") from exc
    if not isinstance(data, dict):
        raise BadRequest("a frame is a JSON object")
    action = data.get("action")
    if action not in CLIENT_ACTIONS:
        raise UnknownAction(
            f"a frame's action is one of {', '.join(CLIENT_ACTIONS)}", field="action"
        )
    try:
        return _CLIENT_FRAME.validate_python(data)
    except ValidationError as exc:
        fields = [
            # the action's own model is the first element of the location: leave it out
            {"field": ".".join(str(p) for p in e["loc"][1:]), "problem": e["msg"]}
            for e in exc.errors(include_input=False, include_url=False)
        ]
        raise BadRequest("the frame does not fit the schema", fields=fields) from exc


class UnknownAction(BadRequest):
    code = "unknown_action"


# --- the service's frames -----------------------------------------------------------------------


class _ServiceFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: the ``ref`` of the client frame this answers
    ref: str | None = None


class ConnectedFrame(_ServiceFrame):
    """The answer to ``connect`` (MQTT's CONNACK) and to ``renew``: the channel this
    connection holds."""

    action: Literal["connected"] = "connected"
    session_present: bool
    channel: str
    keepalive_s: int
    #: the in-flight window the service keeps to: the client's Receive Maximum, at most the
    #: service's own
    receive_maximum: int


class MessageFrame(BaseModel):
    """A delivery, pushed: the fields of a get's messages. Ack its ``id`` (QoS 1/2)."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["message"] = "message"
    id: str
    message_id: str
    topic: str
    #: base64
    payload: str
    qos: StrictInt = Field(ge=0, le=2)
    retain: bool
    dup: bool
    subscription: str
    properties: dict[str, Any]
    published_at: int


class SubscribedFrame(_ServiceFrame):
    action: Literal["subscribed"] = "subscribed"
    #: per requested filter, in order: the granted QoS or an error code
    granted: list[int | str]


class UnsubscribedFrame(_ServiceFrame):
    """The answer to ``unsubscribe``: the HTTP API's body (MQTT 5's UNSUBACK, §3.11.2.2)."""

    action: Literal["unsubscribed"] = "unsubscribed"
    #: per requested filter, in order: ``success`` or ``no_subscription_existed``
    unsubscribed: list[Literal["success", "no_subscription_existed"]]


class PublishedFrame(_ServiceFrame):
    """The answer to ``publish``: the HTTP API's 201/200 body."""

    model_config = ConfigDict(extra="allow")

    action: Literal["published"] = "published"
    message_id: str
    topic: str
    duplicate: bool


class AckedFrame(_ServiceFrame):
    action: Literal["acked"] = "acked"
    acked: int


class PongFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["pong"] = "pong"


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class ErrorFrame(_ServiceFrame):
    """A client frame refused: the HTTP API's error body and its status."""

    action: Literal["error"] = "error"
    status: int
    error: ErrorBody


DisconnectReason = Literal[
    "normal",
    "session_taken_over",
    "keepalive_timeout",
    "session_ended",
]


class ServerDisconnectFrame(_ServiceFrame):
    """The service ends the connection (MQTT 5 §3.14, a DISCONNECT sent by the server), then
    closes it: ``session_taken_over`` (a newer connect for the client id, §4.13), ``normal``
    (the answer to the client's own ``disconnect``), ..."""

    action: Literal["disconnect"] = "disconnect"
    reason: DisconnectReason


SERVICE_FRAMES: tuple[type[BaseModel], ...] = (
    ConnectedFrame,
    MessageFrame,
    SubscribedFrame,
    UnsubscribedFrame,
    PublishedFrame,
    AckedFrame,
    PongFrame,
    ErrorFrame,
    ServerDisconnectFrame,
)


def error_frame(error: ShoalError, ref: str | None = None) -> ErrorFrame:
    body = error.body()["error"]
    return ErrorFrame(ref=ref, status=error.status, error=ErrorBody.model_validate(body))


def encode(frame: BaseModel) -> str:
    """A service frame as sent: compact JSON, ``None`` fields left out."""
    return json.dumps(frame.model_dump(exclude_none=True, mode="json"), separators=(",", ":"))
