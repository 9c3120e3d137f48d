"""docs/asyncapi.yaml is what ``shoal.edge.contract`` makes from the frame models: the contract
and the handlers have one source."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml
from shoal.core.errors import Forbidden
from shoal.edge.contract import document, render
from shoal.edge.frames import ConnectedFrame, ErrorFrame, MessageFrame, encode, error_frame

DOC = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.yaml"


def test_the_committed_document_is_the_generated_one() -> None:
    # Given the frame models; When the contract is made; Then the committed file is it
    assert DOC.read_text() == render(), "run: python -m shoal.edge.contract > docs/asyncapi.yaml"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = yaml.safe_load(DOC.read_text())
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def test_frames_the_service_sends_validate_against_the_document() -> None:
    frames = {
        "ConnectedFrame": ConnectedFrame(
            ref="r", session_present=True, channel="1-a", keepalive_s=0, receive_maximum=5
        ),
        "ErrorFrame": error_frame(Forbidden("no"), "r"),
        "MessageFrame": MessageFrame(
            id="s.1",
            message_id="m",
            topic="a/b",
            payload="eA==",
            qos=1,
            retain=False,
            dup=False,
            subscription="a/#",
            properties={},
            published_at=1,
        ),
    }
    for name, frame in frames.items():
        _validator(name).validate(json.loads(encode(frame)))


def test_a_frame_that_breaks_the_document_is_caught() -> None:
    bad = {"action": "error", "status": 403}  # no error body
    errors = list(_validator("ErrorFrame").iter_errors(bad))
    assert errors
    assert ErrorFrame.model_fields["error"].is_required()


def test_every_client_action_is_a_receive_message() -> None:
    doc = document()
    received = doc["operations"]["receiveClientFrame"]["messages"]
    names = {m["$ref"].rsplit("/", 1)[1] for m in received}
    assert names == {
        f"client.{a}"
        for a in (
            "connect",
            "renew",
            "subscribe",
            "unsubscribe",
            "publish",
            "ack",
            "ping",
            "keepalive",
            "disconnect",
        )
    }
