"""The client's errors, and how an error answer of Shoal or of API Gateway becomes one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ClientError(Exception):
    """Base of every error this module raises."""


class ApiError(ClientError):
    """An error answer from Shoal (``{"error": {"code", "message", ...}}``), or no answer."""

    def __init__(self, status: int, code: str, message: str, details: Mapping[str, Any]) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = dict(details)


class SessionTakenOver(ApiError):
    """A newer channel owns the client id; this client's channel can change nothing."""


class Unavailable(ApiError):
    """Every attempt timed out, lost its connection or was told to come back later."""


class StateInUse(ClientError):
    """Another live client holds the state file."""


#: codes for the answers API Gateway gives itself (``{"message": ...}``): its JWT authorizer's
#: 401, its payload limit's 413, throttling's 429, a function's crash or timeout
GATEWAY_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "route_not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    429: "too_many_requests",
    431: "headers_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_of(status: int, answer: Any, headers: Mapping[str, str] | None = None) -> ApiError:
    """An error answer in either shape: Shoal's ``{"error": {"code", "message"}}`` from the
    functions, or API Gateway's own ``{"message": ...}`` (the 401's reason in a header)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
        return ApiError(
            status, str(error.get("code", "error")), str(error.get("message", "")), details
        )
    code = GATEWAY_CODES.get(status, f"http_{status}")
    message = answer.get("message") if isinstance(answer, dict) else None
    reason = _auth_reason((headers or {}).get("www-authenticate", ""))
    if reason:
        message = f"{message}: {reason}" if message else reason
    return ApiError(status, code, str(message or "an answer without a Shoal error body"), {})


def _auth_reason(header: str) -> str:
    """``error_description`` of a ``WWW-Authenticate: Bearer ...`` header, if any."""
    _, found, rest = header.partition('error_description="')
    return rest.split('"', 1)[0] if found else ""


def retry_after(error: ApiError | None) -> float | None:
    """The seconds an error answer asked to wait (``Retry-After``), if it asked."""
    value = error.details.get("retry_after") if error is not None else None
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
