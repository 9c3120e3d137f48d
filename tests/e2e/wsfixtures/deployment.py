"""The fixture deployment: ``wsfixture_auth`` guards ``$connect``; ``wsfixture_edge`` serves
``$connect``, ``$disconnect``, ``echo``, ``boom``, ``hold`` (until the test releases it),
``quiet`` (one-way) and ``$default``."""

from __future__ import annotations

from shoal.declarations import Deployment, FunctionDef, WebSocketDef, WsRoute


class FixtureFunction(FunctionDef):
    """A function whose module is a test module, not ``functions/<name>/``."""

    @property
    def module(self) -> str:
        return "tests.e2e.wsfixtures.functions"


AUTH = FixtureFunction(name="wsfixture_auth", handler="functions.authorize")
EDGE = FixtureFunction(
    name="wsfixture_edge",
    handler="functions.edge",
    ws_routes=(
        WsRoute("$connect", two_way=False),
        WsRoute("$disconnect", two_way=False),
        WsRoute("echo"),
        WsRoute("boom"),
        WsRoute("hold"),
        WsRoute("quiet", two_way=False),
        WsRoute("$default"),
    ),
)

DEPLOYMENT = Deployment(
    tables=(),
    buckets=(),
    functions=(AUTH, EDGE),
    websocket=WebSocketDef(authorizer=AUTH.name),
)
