"""docs/openapi.yaml stays in step with what the deployment serves."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from openapi_spec_validator import validate
from shoal.declarations import DEFAULT_ROUTE, DEPLOYMENT

from functions.health.app import handler as health
from tests.helpers import FakeContext, http_event, response_json

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
METHODS = {"get", "put", "post", "delete", "patch"}


@cache
def spec() -> dict[str, Any]:
    return yaml.safe_load(SPEC_PATH.read_text())


def schema(name: str) -> dict[str, Any]:
    # Resolve component references against the whole document.
    return {"$ref": f"#/components/schemas/{name}", "components": spec()["components"]}


def operations() -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): op
        for path, item in spec()["paths"].items()
        for method, op in item.items()
        if method in METHODS
    }


def test_document_is_valid_openapi() -> None:
    validate(spec())


def test_every_declared_route_is_documented() -> None:
    declared = {(r.method, r.path) for r, _ in DEPLOYMENT.routes() if r.path != DEFAULT_ROUTE}
    missing = declared - operations().keys()
    assert not missing, f"routes served but not in docs/openapi.yaml: {sorted(missing)}"


def test_every_served_operation_is_declared_and_planned_ones_are_not() -> None:
    declared = {(r.method, r.path) for r, _ in DEPLOYMENT.routes()}
    for key, op in operations().items():
        planned = op.get("x-shoal-status") == "planned"
        # Given the document marks what is not served yet, the declarations must agree.
        assert (key in declared) is not planned, (
            f"{key}: planned={planned}, declared={key in declared}"
        )


def test_health_answer_fits_its_schema() -> None:
    response = health(http_event("GET", "/v1/health"), FakeContext())
    assert response["statusCode"] == 200
    jsonschema.validate(response_json(response), schema("Health"))


def test_coded_error_fits_the_error_schema() -> None:
    response = health(http_event("GET", "/v1/nope", route_key=DEFAULT_ROUTE), FakeContext())
    assert response["statusCode"] == 404
    jsonschema.validate(response_json(response), schema("Error"))
