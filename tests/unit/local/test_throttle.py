"""``SHOAL_DEV_THROTTLE``: a share of posts and DynamoDB calls refused as AWS throttles them,
and the post's own retry against it (``shoal.edge.posts.Connections.post``)."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError
from shoal.core.clock import ManualClock
from shoal.edge.posts import POST_ATTEMPTS, ConnectionGone, Connections, PostThrottled
from shoal.local.throttle import Throttles


def test_the_setting_names_shares_and_a_seed() -> None:
    throttles = Throttles.parse("posts=0.25, dynamodb=0.02,seed=7")
    assert (throttles.posts, throttles.dynamodb, throttles.seed) == (0.25, 0.02, 7)
    assert throttles.active
    assert not Throttles.parse("").active


@pytest.mark.parametrize("text", ["posts", "reads=0.1", "posts=lots", "posts=1.5", "seed=x"])
def test_a_setting_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="SHOAL_DEV_THROTTLE"):
        Throttles.parse(text)


def test_one_seed_refuses_the_same_calls_and_about_the_share() -> None:
    # Given two throttles with one seed
    first, second = Throttles.parse("posts=0.3,seed=11"), Throttles.parse("posts=0.3,seed=11")
    # When each is asked about 2,000 posts
    fates = [first.refuse("posts") for _ in range(2000)]
    # Then they refuse the same ones, about 30 % of them, and count them; DynamoDB is spared
    assert fates == [second.refuse("posts") for _ in range(2000)]
    assert 500 < sum(fates) < 700
    assert first.refused == {"posts": sum(fates)}
    assert not any(first.refuse("dynamodb") for _ in range(100))


class _Throttling:
    """``post_to_connection`` refusing the first ``refusals`` posts with ``code``."""

    def __init__(self, refusals: int, code: str = "LimitExceededException") -> None:
        self.refusals = refusals
        self.code = code
        self.calls = 0

    def post_to_connection(self, **_: Any) -> None:
        self.calls += 1
        if self.calls <= self.refusals:
            status = 410 if self.code == "GoneException" else 429
            answer: Any = {
                "Error": {"Code": self.code},
                "ResponseMetadata": {"HTTPStatusCode": status},
            }
            raise ClientError(answer, "PostToConnection")


def test_a_throttled_post_is_tried_again_after_a_jittered_wait() -> None:
    # Given @connections refusing the first three posts as throttled
    client, clock = _Throttling(3), ManualClock(0)
    # When a frame is posted
    Connections(client, clock).post("c1", "{}")
    # Then it went on the fourth try, after waits that grew within their caps
    assert client.calls == 4
    assert 0 <= clock.now_ms() <= (50 + 100 + 200)


def test_a_post_throttled_every_time_gives_up_with_its_own_error() -> None:
    client, clock = _Throttling(100), ManualClock(0)
    with pytest.raises(PostThrottled):
        Connections(client, clock).post("c1", "{}")
    assert client.calls == POST_ATTEMPTS


def test_a_gone_connection_is_not_tried_again() -> None:
    client = _Throttling(1, "GoneException")
    with pytest.raises(ConnectionGone):
        Connections(client, ManualClock(0)).post("c1", "{}")
    assert client.calls == 1
