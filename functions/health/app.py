"""GET /v1/health, and API Gateway's $default route: a coded 404 for any unknown route."""

from shoal import __version__
from shoal.http.resolver import lambda_handler, make_resolver

app = make_resolver()


@app.get("/v1/health")
def health() -> dict[str, str]:
    return {"status": "ok", "version": __version__}


handler = lambda_handler(app)
