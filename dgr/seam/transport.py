"""A lean HTTP/1.1 client for seam steps: h11 over trio, pooled keep-alive connections.

The decode seam sends one small frame per token per hop, so per-request
overhead is the route's tax on every token. A general client (httpx) costs
about a millisecond per request here; this one does the minimum: one
keep-alive connection per concurrent step per node, reused in LIFO order, no
redirects, no cookies, no retries.

An `https://` URL is spoken over TLS (dgr.seam.tlsstream) with the caller's
SSL context (dgr.security.tls decides what it trusts); the handshake is part
of opening a connection, so it is paid once per pooled connection.

A ring link's steps go as one streamed request (`ConnectionPool.open_stream`):
the body is chunked, one chunk a step, and the server answers only when the
stream ends or when it refuses a step; the connection then goes back to the pool.

No retries on purpose: a seam step is not idempotent (the node advances its
session when it accepts a frame), so a request that may have reached the node
is never sent twice. A connection that broke is dropped and the caller sees
`TransportError`.

An answer is read up to `max_answer` bytes (a frame's limit by default), as
it arrives; a longer one breaks the connection with `TransportError`, so a
faulty or hostile server cannot make the caller buffer without end.
"""

from __future__ import annotations

import ssl
import time
from urllib.parse import urlsplit

import attrs
import h11
import trio

from dgr.seam.wire import MAX_FRAME_BYTES
from dgr.seam.tlsstream import SocketTLS

__all__ = ["TransportError", "HttpResponse", "ConnectionPool", "OutStream"]

_READ = 256 * 1024
_IDLE_S = 60.0  # the server keeps connections 300 s; drop ours well before


class TransportError(Exception):
    """The connection failed: refused, reset, closed early, or spoke bad HTTP."""


class AnswerTooLarge(TransportError):
    """The server's answer went past the bytes its request allowed: cut there, the connection closed."""


@attrs.frozen
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def _dropped(stream: trio.abc.Stream) -> bool:
    """True when an idle connection's peer closed it (or sent what nobody asked for): it is readable.

    A restarted server leaves its old connections half closed; a request sent on one is lost, and a
    stream opened on one (a ring tail's answers to a restarted tracker) would fail its session.
    """
    sock = stream if isinstance(stream, SocketTLS) else getattr(stream, "socket", None)  # TLS: OpenSSL's buffer too
    try:
        return sock is not None and sock.is_readable()
    except OSError:
        return True


@attrs.define
class _Conn:
    stream: trio.abc.Stream
    h11: h11.Connection
    last_used: float
    max_answer: int = MAX_FRAME_BYTES  # the most body bytes one answer may carry

    async def request(self, method: str, target: str, host: str, headers: list[tuple[str, str]],
                      body: bytes) -> HttpResponse:
        conn = self.h11
        out = conn.send(h11.Request(method=method, target=target,
                                    headers=[("Host", host), ("Content-Length", str(len(body))), *headers]))
        out += conn.send(h11.Data(data=body)) if body else b""
        out += conn.send(h11.EndOfMessage())
        await self.stream.send_all(out)
        return await self.response()

    async def response(self) -> HttpResponse:
        """Read the server's whole answer. Raises TransportError when the connection ends first."""
        conn = self.h11
        status, resp_headers, chunks, size = 0, {}, [], 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(_READ)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    raise TransportError("the server closed the connection mid-response")
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                resp_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_answer:
                    raise AnswerTooLarge(f"the answer exceeds {self.max_answer} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise TransportError("connection closed")
        return HttpResponse(status, resp_headers, b"".join(chunks))


_ERRORS = (OSError, ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)


def _broken(exc: BaseException) -> "TransportError":
    """One of _ERRORS, as the TransportError callers see."""
    return TransportError(f"{type(exc).__name__}: {exc}")


@attrs.define(eq=False)
class OutStream:
    """One streamed request: the owner sends chunks and ends the body; one watcher reads the answer.

    The server answers early only to refuse (or when it goes away), so `answer` is how the owner
    learns of either while it is still sending; `send` and `answer` may run at once (one writer,
    one reader).
    """

    pool: "ConnectionPool"
    conn: _Conn
    _released: bool = False
    # answered 200, which a server does only once it has read the body's end: it then reads its next
    # request on this connection. A refusal cut the body short, and the server closes the connection.
    _reusable: bool = False

    async def send(self, data: bytes) -> None:
        """One chunk of the body. Raises TransportError."""
        conn = self.conn.h11
        try:
            if data and conn.our_state is h11.SEND_BODY:  # framed as h11's chunked writer does: a chunk moves no state
                # joined, not %-formatted: formatting sizes its result a quarter over and shrinks it after, so
                # a prefill chunk's frame cost a 1.25x buffer, and the heap the holes of assorted sizes
                await self.conn.stream.send_all(b"".join((b"%x\r\n" % len(data), data, b"\r\n")))
                return
            await self.conn.stream.send_all(conn.send(h11.Data(data=data)))
        except _ERRORS as exc:
            raise _broken(exc) from None

    async def end(self) -> None:
        """End the body (the server then answers). Raises TransportError."""
        try:
            await self.conn.stream.send_all(self.conn.h11.send(h11.EndOfMessage()))
        except _ERRORS as exc:
            raise _broken(exc) from None

    async def answer(self) -> HttpResponse:
        """The server's whole answer, whenever it comes. Raises TransportError when the connection ends first."""
        try:
            r = await self.conn.response()
        except _ERRORS as exc:
            raise _broken(exc) from None
        self._reusable = r.status == 200
        return r

    async def release(self) -> None:
        """Done with it: the connection goes back to the pool if the stream ended cleanly, else it closes."""
        if not self._released:
            self._released = True
            if self._reusable:
                await self.pool._checkin(self.conn)  # which still closes it unless both sides are done
            else:
                with trio.CancelScope(shield=True):
                    await self.conn.stream.aclose()


@attrs.define
class ConnectionPool:
    """Keep-alive connections to one server."""

    url: str
    ssl_context: ssl.SSLContext | None = None  # for https://; None: the system's default trust
    max_answer: int = MAX_FRAME_BYTES  # the most body bytes an answer may carry (_Conn.response)
    _idle: list[_Conn] = attrs.field(factory=list)
    _host: str = attrs.field(init=False)
    _port: int = attrs.field(init=False)
    _tls: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        parts = urlsplit(self.url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)

    async def _connect(self) -> _Conn:
        try:
            sock = await trio.open_tcp_stream(self._host, self._port)
        except OSError as exc:
            raise TransportError(f"connect to {self._host}:{self._port} failed: {exc}") from None
        sock.setsockopt(6, 1, 1)  # TCP_NODELAY: a frame must not wait for Nagle
        stream: trio.abc.Stream = sock
        if self._tls:
            ctx = self.ssl_context or ssl.create_default_context()
            try:
                tls = SocketTLS.wrap(sock, ctx, server_side=False, server_hostname=self._host)
            except OSError as exc:
                await sock.aclose()
                raise TransportError(f"connect to {self._host}:{self._port} failed: {exc}") from None
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                await tls.aclose()
                raise TransportError(f"TLS handshake with {self._host}:{self._port} failed: {exc}") from None
            stream = tls
        return _Conn(stream, h11.Connection(h11.CLIENT), time.monotonic(), self.max_answer)

    async def _checkout(self) -> _Conn:
        """An idle connection the peer has not closed, else a new one."""
        now = time.monotonic()
        while self._idle:
            candidate = self._idle.pop()
            if now - candidate.last_used < _IDLE_S and not _dropped(candidate.stream):
                candidate.max_answer = self.max_answer  # a request's own `limit` ended with it
                return candidate
            await candidate.stream.aclose()
        return await self._connect()

    async def _checkin(self, conn: _Conn) -> None:
        """Keep a connection whose exchange ended cleanly; close any other."""
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            conn.last_used = time.monotonic()
            self._idle.append(conn)
        else:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()

    @property
    def idle_connections(self) -> int:
        """Connections kept open for the next request."""
        return len(self._idle)

    @property
    def host(self) -> str:
        return f"{self._host}:{self._port}"

    async def open_stream(self, target: str, headers: list[tuple[str, str]]) -> OutStream:
        """Start a POST with a chunked body on a pooled connection: its chunks go with `OutStream.send`."""
        conn = await self._checkout()
        try:
            await conn.stream.send_all(conn.h11.send(h11.Request(method="POST", target=target, headers=[
                ("Host", self.host), ("Transfer-Encoding", "chunked"), *headers])))
        except _ERRORS as exc:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
            raise _broken(exc) from None
        return OutStream(self, conn)

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: list[tuple[str, str]] | None = None, limit: int | None = None) -> HttpResponse:
        """One request on a pooled connection; its answer's body capped at `limit` bytes (None: `max_answer`).

        Raises: AnswerTooLarge (over the cap), TransportError.
        """
        conn = await self._checkout()
        if limit is not None:
            conn.max_answer = limit
        ok = False
        try:
            response = await conn.request(method, target, self.host, headers or [], body)
            ok = True
        except _ERRORS as exc:
            raise _broken(exc) from None
        finally:
            if not ok:
                with trio.CancelScope(shield=True):
                    await conn.stream.aclose()
        await self._checkin(conn)
        return response

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().stream.aclose()
