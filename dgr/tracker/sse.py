"""A streaming completion as Server-Sent Events: its chunks, its telemetry comments, and the client's pace.

One job: turn a LiveSession's deltas into the SSE body of a streaming
completion (`completion_stream`), and frame one event (`sse`). Rules: a
telemetry comment (`: dgr-telemetry {...}`) opens the stream, follows at
least every `TELEMETRY_EVERY_S` and closes it; the stream ends with
`[DONE]` after a finish, or with an OpenAI error body after a failure. Each
hand-over to the server is timed (`live.writing_since`) so the gateway's
watcher can cancel a session whose reader stalled; a client that goes away
cancels its session. No cancel scope spans a yield.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, AsyncIterator

import trio

from dgr.api.openai import GenerationRequest, chunk_body
from dgr.errors import Failure, Reason, openai_error_body
from dgr.fsm.route import RouteState
from dgr.tracker.gateway import Delta, Gateway, LiveSession

__all__ = ["TELEMETRY_EVERY_S", "completion_stream", "sse"]

TELEMETRY_EVERY_S = 0.25


def sse(data: dict[str, Any] | str) -> bytes:
    """One SSE `data:` event of `data` (JSON unless already text)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n".encode()


def _comment(snapshot: dict[str, Any]) -> bytes:
    return f": dgr-telemetry {json.dumps(snapshot)}\n\n".encode()



async def _next(live: LiveSession, wait_s: float) -> Delta | None | bool:
    """The next delta; None when waiting timed out; False when the stream ended."""
    try:  # one already waiting (a busy tracker, many sessions) is taken without a timeout's cancel scope
        return live.recv.receive_nowait()
    except trio.WouldBlock:
        pass
    except trio.EndOfChannel:
        return False
    with trio.move_on_after(wait_s):
        try:
            return await live.recv.receive()
        except trio.EndOfChannel:
            return False
    return None


async def completion_stream(gateway: Gateway, live: LiveSession) -> AsyncIterator[bytes]:
    """SSE for a streaming completion, timing each hand-over to the client.

    `live.writing_since` is set while a chunk waits for the server to take it,
    which it does once the client has read enough of the last ones; the
    gateway's watcher cancels a session whose reader has stalled too long.
    A client that goes away cancels its session.
    """
    live.unclaimed_since = None
    finished = False
    try:
        async with contextlib.aclosing(_sse_chunks(live)) as chunks:
            async for chunk in chunks:
                live.writing_since = trio.current_time()
                yield chunk
                live.writing_since = None
        finished = True
    finally:
        if not finished:
            gateway.cancel(live.rs.sid, "the client went away mid-stream")


async def _sse_chunks(live: LiveSession) -> AsyncIterator[bytes]:
    """The SSE chunks of a streaming completion. No cancel scope spans a yield."""
    req: GenerationRequest = live.request
    rs = live.rs
    created = int(time.time())
    yield _comment(live.telemetry.latest or rs.snapshot(trio.current_time()))
    if req.telemetry_chunks:
        yield sse(chunk_body(req, rs.sid, created, telemetry=rs.snapshot(trio.current_time())))
    if req.kind == "chat":
        yield sse(chunk_body(req, rs.sid, created, role=True, text=""))
    last_telemetry = trio.current_time()
    while True:
        item = await _next(live, TELEMETRY_EVERY_S)
        if item is False:
            break
        if item is not None:
            yield sse(chunk_body(req, rs.sid, created, text=item.text))
        now = trio.current_time()
        if now - last_telemetry >= TELEMETRY_EVERY_S:
            last_telemetry = now
            snapshot = rs.snapshot(now)
            yield _comment(snapshot)
            if req.telemetry_chunks:
                yield sse(chunk_body(req, rs.sid, created, telemetry=snapshot))
    snapshot = rs.snapshot(trio.current_time())
    yield _comment(snapshot)
    if rs.state is RouteState.DONE:
        yield sse(chunk_body(req, rs.sid, created, finish_reason=rs.finish_reason or "stop"))
        if req.telemetry_chunks:
            yield sse(chunk_body(req, rs.sid, created, telemetry=snapshot))
        if req.include_usage:
            yield sse(chunk_body(req, rs.sid, created, usage=live.usage()))
        yield sse("[DONE]")
    else:
        failure = rs.failure or Failure(Reason.INTERNAL, "session ended without an answer")
        yield sse(openai_error_body(failure, route_session=rs.sid))
