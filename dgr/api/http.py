"""Errors and JSON bodies over HTTP, the same way on the gateway and on nodes.

Every error leaves as OpenAI's error shape with the status from
`dgr.errors.HTTP_TABLE`, so a client sees one format whichever process
refused it. Unexpected exceptions become a 500 `internal_error` and the
process keeps serving.

Every response, errors and Quart's automatic OPTIONS answers included, goes
out only once the request body has been read (or, when it cannot be: too
large, the client stalls, or the caller is refused as unauthenticated or
forbidden (401, 403), or from its headers (`unread`), whose body is never
read, with `Connection: close`): a response that
leaves while the previous body is still arriving wedged a keep-alive
connection's next request under hypercorn (found by schemathesis: OPTIONS
or TRACE with a body, then GET, on one connection), and a client cannot
tell what such a server read.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any, Callable

import attrs
import trio
from quart import Response, request

from dgr.errors import CallerError, DgrError, Failure, Reason, http_status, openai_error_body
from dgr.seam.stream import Record, RecordReader
from dgr.seam.wire import CAPABILITY_HEADER, ROUTE_SESSION_HEADER, raw_header

__all__ = ["error_response", "json_response", "install_error_handlers", "read_json", "read_body", "parse_json",
           "unread", "RawSeamRequest", "SESSION_ID", "seam_headers", "read_raw_seam", "serve_seam_stream", "respond_raw",
           "respond_raw_error"]

log = logging.getLogger("dgr.http")


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data), status=status, mimetype="application/json", headers=headers or {})


def error_response(failure: Failure, *, headers: dict[str, str] | None = None, **extra: Any) -> Response:
    return json_response(openai_error_body(failure, **extra), http_status(failure.reason), headers)


def _from_dgr(exc: DgrError) -> Response:
    headers = {}
    if exc.reason is Reason.NODE_AT_CAPACITY:
        headers["Retry-After"] = str(exc.details.get("retry_after", 1))
    if exc.details.get("bearer"):
        headers["WWW-Authenticate"] = 'Bearer realm="dgr"'
    if exc.details.get("unread"):
        headers["Connection"] = "close"  # refused from its headers: its body is never read (`_settled`)

    extra = {k: v for k, v in exc.details.items() if k in ("param", "missing", "expected", "got")}
    return error_response(exc.failure(), headers=headers, **extra)


_DRAIN_S = 5.0


async def _settled(response: Response) -> Response:
    """Read what is left of the request body before answering; if that fails, close the connection.

    A no-op for handlers that read the body themselves: it is complete by then.
    """
    limit = request.max_content_length
    drained = False
    if response.status_code in (401, 403) or response.headers.get("Connection", "").lower() == "close":
        # refused for want of a key or capability, or from its headers (`unread`): such a caller gets nothing
        # read, not even the body it announced (an open may announce 4 MiB); its connection is closed instead
        pass
    elif request.content_length is None or limit is None or request.content_length <= limit:
        with trio.move_on_after(_DRAIN_S):
            try:
                await request.get_data(cache=False)
                drained = True
            except Exception:  # too large, cut off, malformed: any of them means do not reuse the connection
                drained = False
    if not drained:
        response.headers["Connection"] = "close"
    return response


def unread(exc: DgrError) -> DgrError:
    """Mark `exc` as a refusal made from the request's headers: its answer closes the connection, and the body
    is never read (not even drained)."""
    exc.details["unread"] = True
    return exc


def install_error_handlers(app) -> None:
    """OpenAI-shaped errors for everything, and no response before its request's body is read."""
    app.after_request(_settled)

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


async def read_body(max_bytes: int) -> bytes:
    """The raw request body, refused past `max_bytes`.

    Raises:
        CallerError(BODY_TOO_LARGE)
    """
    if request.content_length is not None and request.content_length > max_bytes:
        raise CallerError(Reason.BODY_TOO_LARGE, f"body of {request.content_length} bytes exceeds {max_bytes}")
    raw = await request.get_data(cache=False)
    if len(raw) > max_bytes:
        raise CallerError(Reason.BODY_TOO_LARGE, f"body exceeds {max_bytes} bytes")
    return raw


async def read_json(max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        CallerError(BODY_TOO_LARGE | INVALID_JSON | INVALID_REQUEST)
    """
    return parse_json(await read_body(max_bytes))


def parse_json(raw: bytes) -> dict[str, Any]:
    """Bytes as a JSON object.

    Raises:
        CallerError(INVALID_JSON | INVALID_REQUEST)
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CallerError(Reason.INVALID_JSON, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        # a few MiB of '[' nest deeper than the parser's stack
        raise CallerError(Reason.INVALID_JSON, "body nests too deeply") from None
    if not isinstance(data, dict):
        raise CallerError(Reason.INVALID_REQUEST, "body must be a JSON object")
    return data


# -- the seam's fast paths: bare ASGI in front of Quart ----------------------------------------------
# A node's POST /v1/seam/stream and the tracker's POST /v1/seam/deliver and
# /v1/seam/deliver/stream run once per token per hop, so they skip the framework; these are the readers
# and the writer they use.

_CAP_RAW = raw_header(CAPABILITY_HEADER)
_SESSION_RAW = raw_header(ROUTE_SESSION_HEADER)
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # a Route Session id as X-Dgr-Route-Session names it


def seam_headers(scope) -> tuple[str, str | None]:
    """The session a bare ASGI request names in `X-Dgr-Route-Session` ("" for none) and the capability it carries
    in `X-Dgr-Capability`: what is checked before any of its body is read."""
    sid, capability = "", None
    for name, value in scope["headers"]:
        if name == _CAP_RAW:
            capability = value.decode("latin-1")
        elif name == _SESSION_RAW:
            sid = value.decode("latin-1")
    return sid, capability


@attrs.frozen
class RawSeamRequest:
    """A seam request's body and the seam headers it carried."""

    body: bytes
    capability: str | None
    is_json: bool  # Content-Type application/json (a failure report, not a frame)


async def read_raw_seam(scope, receive, limit: int, what: str) -> RawSeamRequest | None:
    """Read a bare ASGI request's seam headers and its body, refusing more than `limit` bytes.

    `what` names the body in errors ("a delivery"). None when the sender went
    away mid-body: nothing was read that may be applied.

    Raises:
        CallerError(FRAME_TOO_LARGE): announced or sent past `limit`.
        ValueError: a malformed Content-Length.
    """
    capability, is_json = None, False
    for name, value in scope["headers"]:
        if name == b"content-length" and int(value) > limit:
            raise CallerError(Reason.FRAME_TOO_LARGE, f"{what} of {int(value)} bytes exceeds {limit}")
        if name == _CAP_RAW:
            capability = value.decode("latin-1")
        elif name == b"content-type":
            is_json = value.split(b";")[0].strip() == b"application/json"
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise CallerError(Reason.FRAME_TOO_LARGE, f"{what} exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return RawSeamRequest(b"".join(chunks), capability, is_json)


async def serve_seam_stream(scope, receive, send, *, limit: int, what: str,
                            authorize: Callable[[str | None, str], None],
                            apply: Callable[[str, Record], None],
                            check_head: Callable[[str, bytes], None] | None = None) -> None:
    """Serve one ring link's stream of a session's steps (dgr.seam.stream) on a bare ASGI request.

    The session (`X-Dgr-Route-Session`) and its capability come in the headers: `authorize(capability,
    session)` checks them before any of the body is read. `check_head(session, header)` (where given) checks
    each record's frame header as soon as it has come, before its payload is waited for; `apply(session,
    record)` takes each record as it completes, frames up to `limit` bytes. The first refusal (a DgrError, or
    a ValueError for a malformed frame, named `what`) answers the stream at once and ends it, the rest of the
    body unread (`Connection: close`); the sender reports it. A clean
    end of the body is answered 200 with the count of frames applied. A sender that goes away gets
    nothing: whoever sends to it names it if it was lost.
    """
    sid, capability = seam_headers(scope)
    reader = RecordReader(limit, None if check_head is None else functools.partial(check_head, sid))
    frames = 0
    try:
        if not SESSION_ID.fullmatch(sid):
            raise CallerError(Reason.BAD_FRAME, f"a stream names its session in {ROUTE_SESSION_HEADER}: 32 hex digits")
        authorize(capability, sid)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            for record in reader.feed(message.get("body", b"")):
                apply(sid, record)
                frames += 1
            if not message.get("more_body", False):
                break
        if reader.pending:
            raise CallerError(Reason.BAD_FRAME, f"the stream ended inside a record ({reader.pending} bytes)")
    except (DgrError, ValueError) as exc:
        # the rest of the stream is never read: the connection closes after the answer, whatever was announced
        await respond_raw_error(send, exc, what, unread=True)
        return
    await respond_raw(send, 200, json.dumps({"session": sid, "frames": frames}).encode())


async def respond_raw(send, status: int, body: bytes, content_type: bytes = b"application/json", extra=()) -> None:
    """One whole response on a bare ASGI `send`."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


async def respond_raw_error(send, exc: DgrError | ValueError, what: str, *, unread: bool = False) -> None:
    """The OpenAI-shaped error for a fast path's failure: a DgrError's own, or BAD_FRAME for a ValueError.

    A body refused by its announced size, or refused before the rest of it was read (`unread`), is never
    drained: that connection cannot carry another request, and the answer says it is closed.
    """
    if isinstance(exc, DgrError):
        failure, status = exc.failure(), http_status(exc.reason)
    else:
        failure, status = Failure(Reason.BAD_FRAME, f"bad {what}: {exc}"[:300]), 400
    extra = [(b"connection", b"close")] if unread or failure.reason is Reason.FRAME_TOO_LARGE else []
    await respond_raw(send, status, json.dumps(openai_error_body(failure)).encode(), extra=extra)

