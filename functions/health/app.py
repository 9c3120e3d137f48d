"""GET /v1/health, and API Gateway's $default route: a coded 404 for any unknown route, and
the console's static files (``shoal.console``) at /console/, on the HTTP API's own origin."""

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from shoal import __version__
from shoal.console import serve, websocket_url
from shoal.core.config import get_config
from shoal.core.observability import observed
from shoal.http.resolver import make_resolver

app = make_resolver()


@app.get("/v1/health")
def health() -> dict[str, str]:
    return {"status": "ok", "version": __version__}


def console(event: dict[str, Any]) -> dict[str, Any] | None:
    """The console's file the request asks for, as API Gateway's 2.0 answer; else None."""
    http = (event.get("requestContext") or {}).get("http") or {}
    ws_url = websocket_url(get_config().connections_endpoint)
    served = serve(str(http.get("method", "")), str(event.get("rawPath", "")), ws_url=ws_url)
    if served is None:
        return None
    return {
        "statusCode": served.status,
        "headers": dict(served.headers),
        "body": served.body.decode(),
        "isBase64Encoded": False,
    }


@observed
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    return console(event) or app.resolve(event, context)
