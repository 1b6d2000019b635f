"""ASGI middleware that refuses a request before any of it is parsed.

* ``HostCheckMiddleware``: DNS-rebinding protection. A server on a loopback
  address without an API key trusts whoever can reach it, and a web page can
  reach it through a DNS name that resolves to 127.0.0.1; its requests carry
  that name in ``Host``. Such a server answers only loopback Host names
  (``--allowed-hosts`` widens or narrows the list).
* ``BodyLimitMiddleware``: 413 for a body over ``--max-request-body-bytes``,
  from ``Content-Length`` before reading anything, or while reading a chunked body.
* ``APIKeyMiddleware``: 401 unless ``Authorization: Bearer <key>``.

Each answers in OpenAI's error shape.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from fastapi import HTTPException

from vframe.entrypoints.openai.errors import error_response

# Reachable without the API key: probes, scrapes and the API's own description.
OPEN_PATHS = frozenset(
    {"/health", "/ping", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """``host`` (a bind address or a Host header's name, without port) names this machine only."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header: ``[::1]:8000`` -> ``::1``, ``Example.com:80`` -> ``example.com``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class HostCheckMiddleware:
    """400 unless the Host header names an allowed host; ``None`` allows loopback names only."""

    def __init__(self, app: Any, allowed_hosts: list[str] | None) -> None:
        self.app = app
        self.allowed = None if allowed_hosts is None else {h.strip().strip("[]").lower() for h in allowed_hosts}

    def allows(self, host: str) -> bool:
        if self.allowed is None:
            return is_loopback(host)
        return "*" in self.allowed or host in self.allowed

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if self.allows(host_name(header)):
            await self.app(scope, receive, send)
            return
        allowed = "loopback names (localhost, 127.0.0.1, [::1])" if self.allowed is None else sorted(self.allowed)
        message = (
            f"Host {header!r} is not allowed; this server answers {allowed}. An operator can allow more "
            "with --allowed-hosts (comma-separated names, '*' for any)"
        )
        await error_response(400, message, code="host_not_allowed")(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, size: str) -> str:
        return (
            f"the request body is {size}, over this server's limit of {self.max_bytes} bytes; send less "
            "(an operator can raise --max-request-body-bytes)"
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = error_response(413, self._message(f"{int(length)} bytes"), code="request_too_large")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes FastAPI's body parsing untouched and is
                    # answered by the app's handler in OpenAI's shape.
                    raise HTTPException(413, self._message(f"over {received} bytes"))
            return message

        await self.app(scope, limited_receive, send)


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <api key>`` (the scheme in any case), except on ``OPEN_PATHS``."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided" if given else "Missing API key: send 'Authorization: Bearer <key>'"
        )
        response = error_response(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
