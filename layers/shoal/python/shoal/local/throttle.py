"""``SHOAL_DEV_THROTTLE``: ``shoal dev`` refuses a share of calls as AWS throttles them.

Deployed, ``PostToConnection`` answers 429 ``LimitExceededException`` past the account's API
Gateway rate (10,000 a second by default, shared by every API of the region), and DynamoDB
answers ``ProvisionedThroughputExceededException`` past a partition's or a table's capacity.
Nothing throttles locally, so the code that copes with it would never run; this makes it run:

    SHOAL_DEV_THROTTLE="posts=0.2,dynamodb=0.02,seed=7" shoal dev

refuses a fifth of the functions' ``@connections`` POSTs and 2 % of DynamoDB calls (by any
caller of the emulator), drawn from a random source seeded by ``seed`` (one sequence for the
process: which call meets a refusal depends on the order calls come in). A refused call
changes nothing, as on AWS. Off unless set; for tests, the soak and benchmarks only.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Literal

ENV = "SHOAL_DEV_THROTTLE"

Kind = Literal["posts", "dynamodb"]
KINDS: tuple[Kind, ...] = ("posts", "dynamodb")


@dataclass
class Throttles:
    """The share of calls of each kind refused, and the random source deciding which."""

    posts: float = 0.0
    dynamodb: float = 0.0
    seed: int | None = None
    #: refusals so far, by kind (what a test or the soak compares its counts with)
    refused: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in KINDS:
            share = getattr(self, kind)
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{ENV}: {kind}={share} is not a share between 0 and 1")
        self._rng = random.Random(self.seed)  # fault injection, not security
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str) -> Throttles:
        """``posts=0.2,dynamodb=0.02,seed=7`` (any of them; an empty text throttles nothing)."""
        values: dict[str, float] = {}
        seed: int | None = None
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or (name not in KINDS and name != "seed"):
                raise ValueError(
                    f"{ENV}: {part!r} is not posts=<share>, dynamodb=<share> or seed=<n>"
                )
            try:
                if name == "seed":
                    seed = int(value)
                else:
                    values[name] = float(value)
            except ValueError as exc:
                raise ValueError(f"{ENV}: {part!r} has no number") from exc
        return cls(posts=values.get("posts", 0.0), dynamodb=values.get("dynamodb", 0.0), seed=seed)

    @classmethod
    def from_environment(cls) -> Throttles:
        return cls.parse(os.environ.get(ENV, ""))

    @property
    def active(self) -> bool:
        return any(getattr(self, kind) > 0 for kind in KINDS)

    def refuse(self, kind: Kind) -> bool:
        """Whether this call of ``kind`` is refused (counted when it is)."""
        share = getattr(self, kind)
        if share <= 0:
            return False
        with self._lock:
            refused = self._rng.random() < share
            if refused:
                self.refused[kind] = self.refused.get(kind, 0) + 1
        return refused


#: API Gateway's answer to a throttled ``@connections`` call (botocore reads the type from the
#: header: ``LimitExceededException``)
POST_THROTTLED_HEADERS = (("x-amzn-ErrorType", "LimitExceededException"),)
POST_THROTTLED_BODY = {"message": "Rate exceeded"}
#: DynamoDB's answer to a throttled call (status 400, as AWS sends it)
DYNAMODB_THROTTLED = (
    b'{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException",'
    b'"message":"The level of configured provisioned throughput for the table was exceeded. '
    b'Consider increasing your provisioning level with the UpdateTable API."}'
)
