"""A request's messages and reservations on their way through the publish path."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.composite.model import Destination, StorageTopic
from shoal.core.errors import ShoalError
from shoal.publish.request import PublishRequest
from shoal.publish.sequences import Reservation, route_key
from shoal.records import Message


@dataclass(eq=False)
class Item:
    """One message of a request on its way through the publish path."""

    position: int
    request: PublishRequest | None = None
    payload: bytes = b""
    ordering_key: str = ""
    destination: Destination | None = None
    partition: int = 0
    message_id: str = ""
    published_at: int = 0
    #: the clock just before the storage topic was chosen: the put must end within
    #: ``ROUTED_PUT_BOUND_MS`` of it (None: never routed)
    routed_at: int | None = None
    key: str | None = None
    seq: int | None = None
    sub: str = ""
    # outcomes
    error: ShoalError | None = None
    duplicate: bool = False
    answer: tuple[int, int] | None = None  # (storage topic index, partition) of a duplicate
    ticket: Ticket | None = None
    mirror_of: Item | None = None
    found: bool = False  # a recovery read the record back: no put
    #: the route key ("<composite>/<storage topic index>") where the read-back found it
    found_at: str | None = None
    put_ok: bool = False

    @property
    def storage(self) -> StorageTopic:
        assert self.destination is not None
        return self.destination.storage

    @property
    def route(self) -> str:
        assert self.destination is not None
        return route_key(self.destination.topic.name, self.destination.storage.index)

    @property
    def resolved(self) -> bool:
        return (
            self.error is not None
            or self.ticket is not None
            or self.mirror_of is not None
            or self.answer is not None
        )

    def message(self) -> Message:
        request = self.request
        assert request is not None
        properties = request.properties.model_dump(exclude_none=True) if request.properties else {}
        if not properties.get("user_properties"):
            properties.pop("user_properties", None)
        return Message(
            message_id=self.message_id,
            topic=request.topic,
            payload=self.payload,
            qos=request.qos,
            retain=request.retain,
            ordering_key=self.ordering_key,
            published_at_ms=self.published_at,
            sub=self.sub,
            publisher_id=request.publisher_id,
            publisher_seq=request.publisher_seq,
            properties=properties,
            keyed=request.ordering_key is not None,
        )


@dataclass(eq=False)
class Ticket:
    """A reservation this request holds: its messages are put (or read back) and confirmed."""

    key: str
    run: Reservation
    items: list[Item]
    recovery: bool = False
    #: a recovery reads back where earlier attempts routed, up to this instant
    earlier_targets: tuple[str, ...] = ()
    earlier_hold_end: int = 0
