"""Routes are written twice, in the declarations and in each handler's decorators: equal."""

from __future__ import annotations

import importlib
import re

import pytest
from shoal.declarations import DEFAULT_ROUTE, DEPLOYMENT

PARAM = re.compile(r"<(\w+)>")


def served(module: str) -> set[str]:
    """``METHOD /path/{param}`` of every route a handler module's resolver serves."""
    app = importlib.import_module(module).app
    routes = app._static_routes + app._dynamic_routes
    # Powertools writes "<param>"; the declarations (and API Gateway) write "{param}"
    return {r.method + " " + PARAM.sub(r"{\1}", r.path) for r in routes}


@pytest.mark.parametrize(
    "function", [f for f in DEPLOYMENT.functions if f.routes], ids=lambda f: f.name
)
def test_a_handler_serves_exactly_its_declared_routes(function: object) -> None:
    declared = {r.key for r in function.routes if r.path != DEFAULT_ROUTE}  # type: ignore[attr-defined]
    # Given the function's declared routes, when its handler module is loaded,
    # then its resolver serves those routes and no other
    assert served(function.module) == declared  # type: ignore[attr-defined]
