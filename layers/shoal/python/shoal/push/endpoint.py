"""Where pushes go: which endpoints a subscription may name (``EndpointPolicy``), and the
HTTP POST of one message to one (``HttpDeliverer``, behind the ``Deliverer`` protocol)."""

from __future__ import annotations

import base64
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlsplit

import requests

from shoal.core.config import Config, is_loopback
from shoal.core.errors import InvalidEndpoint
from shoal.records import Message

MAX_ENDPOINT_LENGTH = 2048
#: the endpoint's answer is read up to this much, then the connection is dropped
MAX_RESPONSE_BYTES = 64 * 1024
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EndpointPolicy:
    """Which endpoints a subscription may name.

    Deployed, only ``https://`` to a name or a public address; under ``shoal dev`` also
    ``http://`` to a loopback address, so a developer's local server can receive pushes.
    """

    allow_loopback_http: bool = False

    @classmethod
    def from_config(cls, config: Config) -> EndpointPolicy:
        return cls(allow_loopback_http=config.push_loopback_http)

    def validate(self, endpoint: object) -> str:
        if not isinstance(endpoint, str) or not endpoint or len(endpoint) > MAX_ENDPOINT_LENGTH:
            raise InvalidEndpoint(f"the endpoint is a URL of at most {MAX_ENDPOINT_LENGTH} chars")
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise InvalidEndpoint("the endpoint is not a URL") from None
        host = parts.hostname
        if not host or parts.username is not None or parts.password is not None:
            raise InvalidEndpoint("the endpoint needs a host and no user or password")
        if parts.fragment or any(c.isspace() for c in endpoint):
            raise InvalidEndpoint("the endpoint holds a fragment or whitespace")
        if parts.scheme == "https":
            if not self.allow_loopback_http and _is_internal(host):
                raise InvalidEndpoint("the endpoint names an internal address")
            return endpoint
        if parts.scheme == "http" and self.allow_loopback_http and is_loopback(host):
            return endpoint
        raise InvalidEndpoint(
            "the endpoint must be https://"
            + (" (or http:// to loopback under shoal dev)" if self.allow_loopback_http else "")
        )


def _address(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((host or "").strip("[]"))
    except ValueError:
        return None


def _is_internal(host: str) -> bool:
    """Loopback, link-local (the instance metadata service), unspecified or multicast."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _address(host)
    return address is not None and (
        address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    )


@dataclass(frozen=True)
class DeliveryResult:
    status: int | None = None
    #: why no status came: "timeout" (no answer in time), "connection_refused" (nothing
    #: listens at the endpoint), "connection_failed" (no connection for another reason: a reset,
    #: a name that does not resolve), "endpoint_refused" (the policy refused the endpoint),
    #: "request_failed"; "redirect" never: a 3xx is a status. All but the policy's refusal
    #: retry under the retry policy's "timeout" class (no answer)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def reason(self) -> str:
        return f"http_{self.status}" if self.status is not None else self.error or "error"


@dataclass(frozen=True)
class DeliveryRequest:
    endpoint: str
    body: bytes
    headers: Mapping[str, str]
    message_id: str
    ordering_key: str
    attempt: int


class Deliverer(Protocol):
    """Sends one message to an endpoint; never raises for what the endpoint does."""

    def deliver(self, request: DeliveryRequest) -> DeliveryResult: ...


def delivery_request(
    subscription: str, endpoint: str, message: Message, attempt: int
) -> DeliveryRequest:
    body = {
        "id": message.message_id,
        "topic": message.topic,
        "payload": base64.b64encode(message.payload).decode("ascii"),
        "qos": message.qos,
        "retain": message.retain,
        "ordering_key": message.ordering_key,
        "subscription": subscription,
        "properties": message.properties,
        "published_at": message.published_at_ms,
    }
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "shoal-push/1",
        "Shoal-Message-Id": message.message_id,
        "Shoal-Attempt": str(attempt),
        # an ordering key is any string; a header value is latin-1 without controls
        "Shoal-Ordering-Key": quote(message.ordering_key, safe=""),
        "Shoal-Subscription": subscription,
    }
    return DeliveryRequest(
        endpoint=endpoint,
        body=json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
        headers=headers,
        message_id=message.message_id,
        ordering_key=message.ordering_key,
        attempt=attempt,
    )


class HttpDeliverer:
    """POSTs with requests: timeouts, no redirects, no proxies from the environment, and at
    most ``MAX_RESPONSE_BYTES`` of the answer read. The endpoint is checked again here."""

    def __init__(
        self,
        policy: EndpointPolicy,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        pool_size: int = 32,
    ) -> None:
        self.policy = policy
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.session = requests.Session()
        # a proxy, netrc or CA bundle from the function's environment must not redirect pushes
        self.session.trust_env = False
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool_size, pool_maxsize=pool_size)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        try:
            self.policy.validate(request.endpoint)
        except InvalidEndpoint:
            return DeliveryResult(error="endpoint_refused")
        try:
            with self.session.post(
                request.endpoint,
                data=request.body,
                headers=dict(request.headers),
                timeout=self.timeout,
                allow_redirects=False,
                stream=True,
            ) as response:
                # bounded: the endpoint's answer is not ours to buffer
                response.raw.read(MAX_RESPONSE_BYTES, decode_content=False)
                return DeliveryResult(status=response.status_code)
        except requests.Timeout:
            # ConnectTimeout included (it is a ConnectionError too): no answer in time
            return DeliveryResult(error="timeout")
        except requests.ConnectionError as exc:
            return DeliveryResult(error=_connection_error(exc))
        except requests.RequestException:
            return DeliveryResult(error="request_failed")


def _connection_error(exc: requests.ConnectionError) -> str:
    """``connection_refused`` when the endpoint's host answered that nothing listens there (a
    wrong port, a server down), else ``connection_failed``: the DLQ tells an operator which."""
    cause: BaseException | None = exc
    seen = 0
    while cause is not None and seen < 10:
        if isinstance(cause, ConnectionRefusedError):
            return "connection_refused"
        # urllib3 wraps the socket's error in its own, inside requests' (reason or args)
        inner = getattr(cause, "reason", None)
        if not isinstance(inner, BaseException):
            inner = next(
                (a for a in getattr(cause, "args", ()) if isinstance(a, BaseException)), None
            )
        cause = inner or cause.__cause__ or cause.__context__
        seen += 1
    return "connection_failed"
