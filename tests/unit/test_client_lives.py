"""A receiving client that lives: it waits out a lost server, renews its token, and says why it
stops in one line (against the fake Shoal of ``test_client_support``)."""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shoal.cli.main import main
from shoal.client.errors import ApiError
from shoal.client.http import ShoalClient
from shoal.client.support import CallRetry, Outages
from shoal.client.tokens import CommandToken, FileToken, TokenKeeper

from tests.unit.test_client import SleepLog
from tests.unit.test_client_support import FakeShoal, serve, transport

URL = "http://shoal.test"
POLICY = CallRetry(timeout_s=2.0, attempts=2, backoff_s=0.5, max_backoff_s=4.0)


def jwt(sub: str, exp: float) -> str:
    """An unsigned JWT-shaped token (the fake verifies nothing; the client reads sub and exp)."""

    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part({'sub': sub, 'exp': exp})}.sig"


@pytest.fixture
def fake() -> FakeShoal:
    return FakeShoal()


def client_of(fake: FakeShoal, tmp_path: Path, token: Any, clock: SleepLog) -> ShoalClient:
    http, _ = transport(fake)
    return ShoalClient(
        URL,
        token,
        client_id="w1",
        state=tmp_path / "state.json",
        policy=POLICY,
        http=http,
        clock=clock,
        rng=random.Random(3),
    )


def publish(fake: FakeShoal, *texts: str) -> None:
    for n, text in enumerate(texts, start=len(fake.published) + 1):
        fake._publish({"topic": "jobs/a", "text": text, "publisher_id": "p", "publisher_seq": n})


def test_the_loop_waits_out_a_lost_server_says_so_once_and_prints_each_message_once(
    fake: FakeShoal, tmp_path: Path
) -> None:
    # Given a subscribed client with two messages waiting
    clock = SleepLog()
    client = client_of(fake, tmp_path, jwt("w", time.time() + 3600), clock)
    client.subscribe("jobs/#")
    publish(fake, "one", "two")
    # And a server that then answers nothing for six rounds of the client's retries
    fake.fail("", "refuse", times=POLICY.attempts * 6)
    notices: list[str] = []
    # When the loop runs
    got = [m.text for m in client.messages(count=2, wait_ms=0, on_outage=notices.append)]
    # Then it kept trying with a growing pause, said so once when lost and once when back,
    # went on with the same session (no new connect), and handed each message once
    assert got == ["one", "two"]
    assert notices[0].startswith(f"lost {URL} (") and "trying again" in notices[0]
    assert notices[1:] == [f"{URL} answers again; the session goes on"]
    assert fake.requests.count("PUT /v1/sessions/w1") == 1
    assert sum(1 for s in clock.sleeps if s >= 2) >= 2
    client.close()


def test_the_pause_between_tries_doubles_up_to_its_cap() -> None:
    outages = Outages(first_s=0.5, max_s=30.0)
    for retry, ceiling in enumerate([0.5, 1, 2, 4, 8, 16, 30, 30, 30]):
        delay = outages.delay_s(retry, random.Random(retry))
        assert ceiling / 2 <= delay <= ceiling


def test_a_session_the_server_lost_is_connected_again_and_subscribed_again(
    fake: FakeShoal, tmp_path: Path
) -> None:
    # Given a subscribed client, and a server that comes back without its session
    client = client_of(fake, tmp_path, jwt("w", time.time() + 3600), SleepLog())
    client.subscribe([{"filter": "jobs/#", "qos": 1}])
    fake.fail("GET /v1/sessions/w1/messages", "refuse", times=POLICY.attempts)
    fake.fail("POST /v1/sessions/w1/heartbeat", 404, code="session_not_found")
    del fake.sessions["w1"]
    notices: list[str] = []

    def notice(text: str) -> None:
        notices.append(text)
        if "answers again" in text:
            publish(fake, "after")

    # When the loop runs through the outage
    got = [m.text for m in client.messages(count=1, wait_ms=0, on_outage=notice)]
    # Then the client connected again (not clean), subscribed again, and got what came next
    assert got == ["after"]
    assert [b["clean_start"] for b in fake.bodies_of("PUT /v1/sessions/w1")] == [False, False]
    assert len(fake.bodies_of("POST /v1/sessions/w1/subscriptions")) == 2
    assert notices[-1].endswith("the session had ended: a new one, subscribed again")
    client.close()


def test_a_refusal_ends_the_loop_at_once(fake: FakeShoal, tmp_path: Path) -> None:
    # Given a server that refuses the session's reads (403)
    client = client_of(fake, tmp_path, jwt("w", time.time() + 3600), SleepLog())
    client.subscribe("jobs/#")
    fake.fail("GET /v1/sessions/w1/messages", 403, code="forbidden")
    # Then the loop raises the refusal, without waiting
    with pytest.raises(ApiError) as refused:
        list(client.messages(count=1, wait_ms=0))
    assert (refused.value.status, refused.value.code) == (403, "forbidden")
    client.close()


def test_an_expired_token_is_renewed_from_its_file(fake: FakeShoal, tmp_path: Path) -> None:
    # Given a token file holding a token that expired, then rewritten with a fresh one
    path = tmp_path / "token"
    old, fresh = jwt("w", time.time() - 10), jwt("w", time.time() + 3600)
    path.write_text(old + "\n")
    keeper = TokenKeeper(FileToken(path))
    path.write_text(fresh + "\n")
    client = client_of(fake, tmp_path, keeper, SleepLog())
    # When the client calls: the expired token is not sent, the file's fresh one is
    client.subscribe("jobs/#")
    assert fake.headers[-1]["Authorization"] == f"Bearer {fresh}"
    client.close()


def test_a_refused_token_is_sent_again_renewed_or_is_final(fake: FakeShoal, tmp_path: Path) -> None:
    # Given a token file whose token the server refuses once (revoked), then a new one in it
    path = tmp_path / "token"
    first, second = jwt("w", time.time() + 3600), jwt("w", time.time() + 7200)
    path.write_text(first)
    client = client_of(fake, tmp_path, TokenKeeper(FileToken(path)), SleepLog())
    fake.fail("PUT /v1/sessions/w1", 401, code="unauthorized")
    path.write_text(second)
    # Then the call is sent again at once with the new token, and succeeds
    client.connect()
    auth = [h["Authorization"] for h in fake.headers]
    assert auth == [f"Bearer {first}", f"Bearer {second}"]
    client.close()
    # And with a token that cannot be renewed, the 401 is final
    plain = client_of(fake, tmp_path, jwt("w", time.time() + 3600), SleepLog())
    fake.fail("PUT /v1/sessions/w1", 401, code="unauthorized")
    with pytest.raises(ApiError) as refused:
        plain.connect()
    assert refused.value.status == 401
    plain.close()


def test_a_token_command_gives_its_last_line() -> None:
    source = CommandToken("printf 'minted for you:\\nabc.def.ghi\\n'")
    assert source.read() == "abc.def.ghi"


# -- the command line ------------------------------------------------------------------------


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("SHOAL_TOKEN", "SHOAL_TOKEN_COMMAND", "SHOAL_URL"):
        monkeypatch.delenv(name, raising=False)
    yield


def test_a_url_without_a_scheme_is_refused_before_anything_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    state = tmp_path / "s.json"
    argv = ["publish", "--url", "127.0.0.1:8099", "--token", "t", "-t", "a", "-m", "x"]
    assert main([*argv, "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "shoal: error: --url '127.0.0.1:8099' is not an http:// or https:// URL; "
        "did you mean http://127.0.0.1:8099?\n"
    )
    # and nothing was kept in flight for it
    assert not state.exists()


def test_subscribe_to_a_server_that_does_not_answer_says_so_as_publish_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_env: None
) -> None:
    argv = ["subscribe", "--url", "http://127.0.0.1:1", "--token", "t", "--retries", "0"]
    argv += ["--transport", "poll"]
    status = main([*argv, "-t", "a/#", "--state", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1
    assert err.startswith("shoal: error: http://127.0.0.1:1 did not answer (")
    assert "nothing was subscribed (is the server up, and is --url right?)" in err


def test_ctrl_c_exits_130_after_a_clean_disconnect(
    fake: FakeShoal,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    quiet_env: None,
) -> None:
    # Given a subscriber that printed one message when Ctrl-C comes
    def interrupted(self: ShoalClient, **_: Any) -> Iterator[Any]:
        yield from []
        raise KeyboardInterrupt

    monkeypatch.setattr(ShoalClient, "messages", interrupted)
    with serve(fake) as url:
        argv = ["subscribe", "--url", url, "--token", jwt("w", time.time() + 60), "-i", "w1"]
        argv += ["--transport", "poll"]
        status = main([*argv, "-t", "a/#", "--state", str(tmp_path / "s.json")])
    # Then it exits 130, having disconnected normally (so no will is published)
    assert status == 130
    assert fake.requests[-1] == "DELETE /v1/sessions/w1"
