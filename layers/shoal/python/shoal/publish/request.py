"""What a publish request may hold: one message, or a batch of them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from pydantic import model_validator as _model_validator

from shoal.core.errors import BadRequest

MAX_BATCH = 500
MAX_PUBLISHER_ID = 128
MAX_SEQ = 2**63 - 1


class Properties(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content_type: str | None = Field(default=None, max_length=1024)
    #: a name is never empty: moto (DynamoDB under shoal dev) garbles a map key "", and the
    #: inbox of every session the message went to could not be read any more
    user_properties: dict[Annotated[str, Field(min_length=1)], str] = Field(default_factory=dict)
    message_expiry_s: StrictInt | None = Field(default=None, ge=0, le=2**32 - 1)


class PublishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topic: str
    payload: str | None = None
    text: str | None = None
    qos: StrictInt = Field(default=1, ge=0, le=2)
    retain: StrictBool = False
    ordering_key: str | None = Field(default=None, min_length=1)
    publisher_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_PUBLISHER_ID, pattern=r"^[^\x00-\x1f\x7f]+$"
    )
    publisher_seq: StrictInt | None = Field(default=None, ge=1, le=MAX_SEQ)
    properties: Properties | None = None

    @_model_validator(mode="after")
    def _publisher_pair(self) -> PublishRequest:
        if (self.publisher_id is None) != (self.publisher_seq is None):
            raise ValueError("publisher_id and publisher_seq come together")
        return self


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Any] = Field(min_length=1, max_length=MAX_BATCH)


def bad_request(error: ValidationError) -> BadRequest:
    """The same answer ``shoal.http`` gives a schema error, for one message of a batch."""
    fields = [
        {"field": ".".join(str(p) for p in e["loc"]), "problem": e["msg"]}
        for e in error.errors(include_input=False, include_url=False)
    ]
    return BadRequest("the message does not fit the schema", fields=fields)
