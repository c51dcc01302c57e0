"""What a keyless loopback tracker refuses so that a web page cannot drive it.

A tracker without API keys listens on loopback only (dgr.tracker.run), but a
browser on the same machine can still reach it: a page elsewhere can POST to
http://127.0.0.1:8000 (a "simple" request, text/plain, needs no CORS
preflight), and a DNS-rebinding name can point at it (the class of Ollama's
CVE-2024-28224). Such a request names a foreign host in `Host` or comes with
a foreign `Origin`, or carries a body type a JSON API never takes. So, with no
API keys, every request must name a loopback host, come from no origin or a
loopback one, and a POST must be JSON (or a seam frame). With API keys the key
is the guard, and these checks are off.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from dgr.api.hosts import is_loopback
from dgr.api.http import respond_raw
from dgr.errors import CallerError, Reason, http_status, openai_error_body
from dgr.seam.wire import CONTENT_TYPE as SEAM_CONTENT_TYPE

__all__ = ["check_browser_request", "loopback_only"]

_POST_TYPES = ("application/json", SEAM_CONTENT_TYPE)


def check_browser_request(method: str, headers: dict[str, str]) -> None:
    """Refuse a request a web page could have made to a keyless loopback tracker.

    `headers`: lower-case names.

    Raises:
        CallerError(FORBIDDEN): a Host that is not loopback, or an Origin that is not loopback.
        CallerError(INVALID_REQUEST): a POST whose Content-Type is not JSON or a seam frame.
    """
    host = headers.get("host", "")  # `name`, `name:port` or `[v6]:port`: a URL's authority, read as one
    if not is_loopback(urlsplit("//" + host).hostname or ""):
        raise CallerError(Reason.FORBIDDEN, f"this tracker has no API keys and answers loopback hosts only, not {host[:64]!r}")
    origin = headers.get("origin")  # "null" for a sandboxed page or a file: no host, refused like a foreign one
    if origin is not None and not is_loopback(urlsplit(origin).hostname or ""):
        raise CallerError(Reason.FORBIDDEN, f"this tracker has no API keys and answers no web page of {origin[:64]!r}")
    if method == "POST":
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype not in _POST_TYPES:
            raise CallerError(Reason.INVALID_REQUEST, "POST bodies here are JSON: send 'Content-Type: application/json'")


def loopback_only(app):
    """`app` behind check_browser_request, for a tracker without API keys (ASGI)."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            try:
                check_browser_request(scope["method"], headers)
            except CallerError as exc:
                # refused before its body is read: that connection cannot carry another request
                body = json.dumps(openai_error_body(exc.failure())).encode()
                await respond_raw(send, http_status(exc.reason), body, extra=[(b"connection", b"close")])
                return
        await app(scope, receive, send)

    return asgi
