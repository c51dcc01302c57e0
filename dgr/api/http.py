"""Errors and JSON bodies over HTTP, the same way on the gateway and on nodes.

Every error leaves as OpenAI's error shape with the status from
`dgr.errors.HTTP_TABLE`, so a client sees one format whichever process
refused it. Unexpected exceptions become a 500 `internal_error` and the
process keeps serving.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Response, request

from dgr.errors import DgrError, Failure, Reason, http_status, openai_error_body

__all__ = ["error_response", "json_response", "install_error_handlers", "read_json"]

log = logging.getLogger("dgr.http")


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data), status=status, mimetype="application/json", headers=headers or {})


def error_response(failure: Failure, *, headers: dict[str, str] | None = None, **extra: Any) -> Response:
    return json_response(openai_error_body(failure, **extra), http_status(failure.reason), headers)


def _from_dgr(exc: DgrError) -> Response:
    headers = {}
    if exc.reason is Reason.NODE_AT_CAPACITY:
        headers["Retry-After"] = str(exc.details.get("retry_after", 1))
    extra = {k: v for k, v in exc.details.items() if k in ("param", "missing", "expected", "got")}
    return error_response(exc.failure(), headers=headers, **extra)


def install_error_handlers(app) -> None:
    @app.errorhandler(DgrError)
    async def _dgr(exc: DgrError):
        return _from_dgr(exc)

    @app.errorhandler(404)
    async def _nf(exc):
        return error_response(Failure(Reason.NOT_FOUND, f"no route {request.method} {request.path}"))

    @app.errorhandler(405)
    async def _method(exc):
        return error_response(Failure(Reason.NOT_FOUND, f"method {request.method} not allowed on {request.path}"))

    @app.errorhandler(413)
    async def _too_large(exc):
        return error_response(Failure(Reason.BODY_TOO_LARGE, "request body exceeds the limit"))

    @app.errorhandler(400)
    async def _bad(exc):
        return error_response(Failure(Reason.INVALID_REQUEST, "malformed request"))

    @app.errorhandler(Exception)
    async def _other(exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(Failure(Reason.INTERNAL, f"internal error: {type(exc).__name__}"))


async def read_json(max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        CallerError(BODY_TOO_LARGE | INVALID_JSON | INVALID_REQUEST)
    """
    from dgr.errors import CallerError

    if request.content_length is not None and request.content_length > max_bytes:
        raise CallerError(Reason.BODY_TOO_LARGE, f"body of {request.content_length} bytes exceeds {max_bytes}")
    raw = await request.get_data(cache=False)
    if len(raw) > max_bytes:
        raise CallerError(Reason.BODY_TOO_LARGE, f"body exceeds {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CallerError(Reason.INVALID_JSON, f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CallerError(Reason.INVALID_REQUEST, "body must be a JSON object")
    return data
