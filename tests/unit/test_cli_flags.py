"""The ``shoal`` command line without a server: help on every flag, environment defaults,
one-line errors, mosquitto's short flags, the pipeline's job list, the emulator's port."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from shoal.cli.common import token_of
from shoal.cli.dev import AWS_PORT_FILE, _emulator_port
from shoal.cli.main import PIPELINE_JOBS, _parser, main
from shoal.cli.pubsub import state_file


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from parsers(sub)


def test_every_flag_of_every_command_has_help_and_none_with_a_default_is_required() -> None:
    missing = []
    for parser in parsers(_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
            if action.required and action.default is not None:
                missing.append(f"{parser.prog} {action.dest} is required with a default")
    assert missing == []


def test_url_and_token_default_from_the_environment_and_say_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHOAL_URL", "http://shoal.example:9000")
    monkeypatch.setenv("SHOAL_TOKEN", "t.o.k")
    monkeypatch.delenv("SHOAL_TOKEN_COMMAND", raising=False)
    args = _parser().parse_args(["publish", "-t", "a", "-m", "x"])
    assert (args.url, token_of(args).token()) == ("http://shoal.example:9000", "t.o.k")
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: $SHOAL_URL or http://127.0.0.1:8080" in text
    assert "else $SHOAL_TOKEN_COMMAND, else $SHOAL_TOKEN" in text


def test_mosquitto_short_flags_mean_what_they_mean_there() -> None:
    publish = _parser().parse_args(
        ["publish", "-t", "a/b", "-m", "hi", "-q", "2", "-r", "-i", "pub-1"]
    )
    assert (publish.topic, publish.text, publish.qos, publish.retain) == ("a/b", "hi", 2, True)
    assert publish.publisher_id == "pub-1"
    subscribe = _parser().parse_args(
        ["subscribe", "-t", "a/#", "-t", "b", "-i", "c1", "-C", "3", "-v", "-k", "30", "-x", "0"]
    )
    assert subscribe.filters == ["a/#", "b"]
    assert (subscribe.client_id, subscribe.count, subscribe.verbose) == ("c1", 3, True)
    assert (subscribe.keepalive, subscribe.session_expiry_s) == (30, 0)
    # MQTT 5 §3.8.3.1: a persistent session prints a retained message once, not every run
    assert subscribe.retain_handling == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["publish", "-t", "a", "-m", "x", "-f", "y"], "not allowed with argument"),
        (["subscribe", "-t", "a", "-q", "3"], "invalid choice"),
        (["topics", "frobnicate"], "invalid choice"),
        (["publish", "-t", "a", "-m", "x"], "no token"),
        (["publish", "--token", "t", "-t", "a"], "give the payload"),
        (["publish", "--token", "t", "-t", "a", "-l", "--batch-size", "501"], "--batch-size"),
        (["subscribe", "--token", "t", "-t", "a", "--ack-delay-ms", "10001"], "--ack-delay-ms"),
        (["subscribe", "--token", "t", "-t", "a", "--ack-delay-ms", "-1"], "--ack-delay-ms"),
    ],
)
def test_every_usage_error_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    says: str,
) -> None:
    monkeypatch.delenv("SHOAL_TOKEN", raising=False)
    monkeypatch.delenv("SHOAL_TOKEN_COMMAND", raising=False)
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("shoal: error: ") and err.count("\n") == 1
    assert says in err


def test_a_server_that_does_not_answer_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "s.json")
    argv = ["publish", "--url", "http://127.0.0.1:1", "--token", "t", "--retries", "0"]
    assert main([*argv, "--state", state, "-t", "a", "-m", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 message(s) stay in flight" in err


def test_pipeline_help_lists_each_job_with_what_it_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["pipeline", "--help"])
    out = capsys.readouterr().out
    for job, text in PIPELINE_JOBS.items():
        assert f"  {job:<8}{text}" in out
    # the command offers every job the pipeline's entry point runs (the CLI cannot import
    # pipeline/ before it knows the project root, so the list is written twice)
    from pipeline.entry import JOBS

    assert set(PIPELINE_JOBS) == set(JOBS)


def test_state_files_differ_per_server_and_principal() -> None:
    names = {
        state_file("publish", url, sub)
        for url in ("http://127.0.0.1:8080", "http://127.0.0.1:1")
        for sub in ("alice", "bob")
    }
    assert len(names) == 4
    assert state_file("publish", "http://127.0.0.1:8080", "alice").name.startswith(
        "publish-127.0.0.1_8080-alice-"
    )


def _dev_args(state_dir: Path, aws_port: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(aws_host="127.0.0.1", aws_port=aws_port, state_dir=state_dir)


def test_the_emulator_port_of_the_last_run_is_used_again(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    (tmp_path / AWS_PORT_FILE).write_text(f"{free}\n")
    assert _emulator_port(_dev_args(tmp_path)) == free
    # --aws-port says otherwise
    assert _emulator_port(_dev_args(tmp_path, aws_port=0)) == 0


def test_a_taken_port_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / AWS_PORT_FILE).write_text(f"{port}\n")
        # the remembered one: a free port instead, and a line that says so
        assert _emulator_port(_dev_args(tmp_path)) == 0
        assert capsys.readouterr().err.count("\n") == 1
        # the one asked for with --aws-port: no start, and a line that says why
        assert _emulator_port(_dev_args(tmp_path, aws_port=port)) is None
        assert f"--aws-port {port} is in use" in capsys.readouterr().err


@pytest.mark.parametrize("job", sorted(PIPELINE_JOBS))
def test_each_pipeline_jobs_help_says_what_it_does_in_plain_words(
    job: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.common import DESCRIPTIONS

    with pytest.raises(SystemExit) as done:
        main(["pipeline", job, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(DESCRIPTIONS[job].split()) in out
    # no reStructuredText from the module docstrings (``literals``, :roles:)
    assert "``" not in out and ":class:" not in out
