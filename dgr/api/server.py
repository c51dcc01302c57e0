"""dgr's HTTP/1.1 server for ASGI apps: h11 over trio, one task per connection.

Why not hypercorn (the stack we started with): a node answers one seam step
per token per hop, and the tracker takes one delivery per token from a ring's tail.
hypercorn's per-request machinery (a task group, protocol and stream objects,
events between them) cost about 0.15 to 0.25 ms a request on these cores, as
much as the rest of a small step. Here each connection is one task that
parses with h11 and calls the app inline, plus one reader task; the app's
`receive` reads the socket on demand (on a plain socket it reads itself
while the reader is parked, so a streamed body's chunk wakes one task, not
two), so a refused seam frame's body is never buffered by the server, and a
response's head and first body leave in one write.

What it serves:
- HTTP/1.1 with keep-alive and pipelining (h11 keeps the cycle), `Expect:
  100-continue`, HEAD, sized or chunked bodies both ways; https when given an
  SSL context (dgr.seam.tlsstream: read as a plain socket is).
- ASGI 3 `http` scopes and the `lifespan` startup. No websockets, no HTTP/2.
- `http.disconnect` when the peer goes away, mid-body or while the response
  is being made (a streaming completion is cancelled then), and once the
  response has ended.
- Limits: an idle keep-alive connection closes after `keep_alive_s`; once a
  request's first byte has come, its head must be whole within
  `head_timeout_s`; a head over 16 KiB gets 431 and other bad HTTP 400 (then
  the connection closes); an app that fails before answering gets a 500 in
  OpenAI's error shape, one that fails mid-response loses the connection. A
  connection whose request body the app left unread is closed after the
  response, never reused.
- No work before authentication. A connection is a guest until the app says
  one of its requests proved a credential (an API key, a signature, a
  capability) by calling `authenticated(scope)`. A guest's request head must
  be whole within `guest_s` of the connection going idle (its accept, or its
  last response), not of its first byte, so sockets that never send are
  closed in seconds; its request body must make progress every
  `body_idle_s` and end within `body_timeout_s`, or the app sees
  `http.disconnect` and the connection closes (a half-sent body held open no
  longer pins its buffer). A guest's connection also has a total lifetime:
  the first response that starts `guest_life_s` after its accept carries
  `Connection: close`, and the connection closes after it (before, a guest
  kept one for ever by asking `/healthz` every few seconds). Once
  authenticated, a connection keeps `keep_alive_s`, and its bodies may stream
  for as long as they need (a ring's step stream lives as long as its
  session).
- Connection caps (dgr.api.gate): at most `max_connections` at once, of which
  the last `member_slots` are for authenticated connections and newcomers
  from their addresses, and at most `max_per_peer` guests from one address
  (one IPv6 /64). A newcomer over a cap closes the oldest idle guests under
  it (waiting for a request head) and comes in; only where none is idle is it
  closed at once, before any of it is read. O(1) per accept.

Left out: what the apps do (dgr.node.app, dgr.tracker.app), which
certificates are served (dgr.security.tls, dgr.serve).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import socket
import ssl
import time
from typing import Any, Callable
from urllib.parse import unquote

import attrs
import h11
import trio

from dgr.api.gate import Gate, Seat, peer_of
from dgr.errors import Failure, Reason, openai_error_body
from dgr.seam.tlsstream import TlsListener

__all__ = ["serve_asgi", "listening_socket", "raise_open_files_limit", "authenticated", "Limits", "MAX_HEAD_BYTES",
           "AUTHENTICATED"]

log = logging.getLogger("dgr.http")


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit; the limit now in force.

    Every connection is a file: at the common soft limit of 1,024, 300 idle connections and a route's own
    made a tracker stop accepting (EMFILE). The hard limit is what an operator allows.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # a container may refuse: keep what there is
            return soft
        return want
    return soft


class _OncePerSecond(logging.Filter):
    """Let one record through a second: trio retries a failed accept (EMFILE) every 0.1 s, with a log line each."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -1.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last < 1.0:
            return False
        self._last = now
        return True


logging.getLogger("trio.serve_listeners").addFilter(_OncePerSecond())
_refusals = logging.getLogger("dgr.http.caps")
_refusals.addFilter(_OncePerSecond())  # a flood of connections over a cap: one line a second, not one each

# The ASGI scope extension an app calls, once a request has proved a credential, to end the connection's guest
# limits (see `authenticated`).
AUTHENTICATED = "dgr.authenticated"


def authenticated(scope: dict[str, Any]) -> None:
    """Tell the server that this request's connection proved a credential: it leaves the guest limits.

    Call it after an API key, a signed request or a capability has been checked and held, never before:
    the guest limits are what keep a stranger's idle or half-sent connections from costing anything.
    A no-op under a server that does not offer the extension.
    """
    hook = scope.get("extensions", {}).get(AUTHENTICATED)
    if hook is not None:
        hook["mark"]()


@attrs.frozen
class Limits:
    """How long and how many: a connection's deadlines, and the caps on connections (see the module's rules)."""

    keep_alive_s: float = 300.0  # an authenticated connection, idle between requests
    head_timeout_s: float = 30.0  # an authenticated connection's head, from its first byte
    # A guest's whole head, from accept or its last response. Above httpx's 5 s pool expiry, so that a client
    # drops its idle connection before the server does, not while it is sending a request on it.
    guest_s: float = 8.0
    body_idle_s: float = 10.0  # a guest's body, between two reads that brought bytes
    body_timeout_s: float = 30.0  # a guest's whole body, from its head
    # A guest's connection, from accept: its first response after this says `Connection: close`. Well above
    # guest_s, so that a client's few requests in a row share one connection.
    guest_life_s: float = 60.0
    max_connections: int = 1024
    max_per_peer: int = 256  # guests from one address
    member_slots: int = 256  # of max_connections, for authenticated connections only


MAX_HEAD_BYTES = 16 * 1024
_READ = 256 * 1024
# A guest's reads: its head is at most MAX_HEAD_BYTES, and a socket read allocates its whole size before it
# shrinks to what came, so a stranger's flood of short reads at 256 KB each churned a node's heap
_GUEST_READ = MAX_HEAD_BYTES
_WATCH_LIMIT = 1024 * 1024  # bytes read ahead while a response is made, watching for the peer to go away
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_NO_DEADLINE = contextlib.nullcontext()  # an authenticated peer's body reads: none to enter per chunk
_NET_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError)


def _error_body(reason: Reason, message: str) -> bytes:
    return json.dumps(openai_error_body(Failure(reason, message[:300]))).encode()


class _Gone(Exception):
    """The peer went away or broke HTTP: drop the connection."""


@attrs.define(eq=False)
class _Exchange:
    """The ASGI side of one request: what the app has read and sent so far."""

    head: bool  # a HEAD request: the response's body is not sent
    body_deadline: float  # when a guest's body must have ended (trio's clock)
    body_done: bool = False
    start: tuple[int, list] | None = None  # the response's status and headers, held until the first body
    head_sent: bool = False
    ended: bool = False
    over: trio.Event = attrs.field(factory=trio.Event)  # the response ended or the connection is gone


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    app: Callable
    scheme: str
    server: tuple[str, int] | None
    client: tuple[str, int] | None
    limits: Limits
    state: dict[str, Any]
    gate: Gate  # the server's caps: this connection's seat goes idle, busy or to a member there
    seat: Seat
    conn: h11.Connection = attrs.field(
        factory=lambda: h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES))
    _demand: trio.Event = attrs.field(factory=trio.Event)  # set: the reader should read
    _arrived: trio.Event = attrs.field(factory=trio.Event)  # set (and replaced) after each read
    _eof: bool = False
    _watching: trio.Event | None = None  # the current exchange's `over`, once its request body is read
    authenticated: bool = False  # set by the app through the scope's AUTHENTICATED extension
    born: float = attrs.field(factory=trio.current_time)  # its accept (trio's clock): a guest's lifetime counts from it
    _idle: trio.CancelScope | None = None  # a guest's wait for its next head, which the gate may end (eviction)

    def __attrs_post_init__(self) -> None:
        self.seat.evict = self._evicted

    def _authenticate(self) -> None:
        self.authenticated = True
        self.gate.promote(self.seat)

    def _evicted(self) -> None:
        """The gate closes this idle guest to make room for a newcomer."""
        if self._idle is not None:
            self._idle.cancel()

    async def _read(self) -> None:
        """The reader task: reads when asked (`_feed`) or while a response is watched.

        Reading in its own task lets a peer that goes away be seen while the
        app is still answering (`http.disconnect` mid-stream), without ever
        cancelling a read half-way (which would break a TLS stream).
        """
        watched = 0
        while True:
            await self._demand.wait()
            try:
                data = await self.stream.receive_some(_READ if self.authenticated else _GUEST_READ)
            except _NET_ERRORS:
                data = b""
            if self._watching is not None:
                watched += len(data)
            else:
                watched = 0
            self.conn.receive_data(data)  # b"": the peer closed its side; h11 turns that into an event
            arrived, self._arrived = self._arrived, trio.Event()
            arrived.set()
            if not data:
                self._eof = True
                if self._watching is not None:
                    self._watching.set()  # the peer went away while its response was being made
                return
            # Keep reading (for the peer going away) only while a response is watched, and not for a
            # peer that streams more than a pipelined request or two meanwhile.
            if self._watching is None or watched > _WATCH_LIMIT:
                self._demand = trio.Event()

    async def _feed(self) -> None:
        """Wait for the next read's bytes to reach h11 (nothing more once the peer has closed)."""
        if self._eof:
            raise _Gone
        if not self._demand.is_set() and not isinstance(self.stream, trio.SSLStream):
            # The reader is parked (it resets its demand after each read unless a response is
            # watched), so read here: a plain socket's read can be cancelled without losing bytes,
            # and a step streamed in record by record then costs one wake-up, not the reader's and ours.
            try:
                data = await self.stream.receive_some(_READ if self.authenticated else _GUEST_READ)
            except _NET_ERRORS:
                data = b""
            self.conn.receive_data(data)
            if not data:
                self._eof = True
            return
        arrived = self._arrived
        self._demand.set()
        await arrived.wait()

    async def _event(self) -> Any:
        """The next h11 event from the peer, reading as needed. Raises h11.RemoteProtocolError."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            await self._feed()

    async def _write(self, data: bytes) -> None:
        if not data:  # an answer's empty end: a TLS stream its client has closed would refuse even that
            return
        try:
            await self.stream.send_all(data)
        except _NET_ERRORS:
            raise _Gone from None

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        """Answer bad HTTP with its status and `Connection: close`, if a response can still go out."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        body = _error_body(Reason.INVALID_REQUEST, f"bad HTTP: {exc}")
        try:
            data = self.conn.send(h11.Response(status_code=status, headers=[
                ("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close")]))
            data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        with trio.move_on_after(1.0):
            try:
                await self.stream.send_all(data)
            except _NET_ERRORS:
                pass

    async def _next_request(self) -> h11.Request | None:
        """The next request's head; None when the connection should close (idle, slow, closed, bad HTTP)."""
        try:
            event = self.conn.next_event()
            if not self.authenticated:
                # a guest: the whole head within guest_s of going idle, its first byte or not; meanwhile the
                # gate may close it to make room for a newcomer
                if event is h11.NEED_DATA:
                    with trio.CancelScope() as self._idle:
                        self.gate.idle(self.seat)
                        try:
                            with trio.fail_after(self.limits.guest_s):
                                event = await self._event()
                        finally:
                            self.gate.busy(self.seat)
                    self._idle = None
                    if self.seat.gone:  # evicted, even if its head came meanwhile: it has no seat to be served in
                        return None
            else:
                if event is h11.NEED_DATA:
                    with trio.move_on_after(self.limits.keep_alive_s) as idle:
                        await self._feed()
                    if idle.cancelled_caught:
                        return None
                with trio.fail_after(self.limits.head_timeout_s):
                    event = await self._event() if event is h11.NEED_DATA else event
        except h11.RemoteProtocolError as exc:
            await self._refuse(exc)
            return None
        except trio.TooSlowError:
            return None
        if not isinstance(event, h11.Request):
            return None
        # h11 bounds only a head still arriving; one that came whole in a single read is measured here
        if len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEAD_BYTES:
            await self._refuse(h11.RemoteProtocolError("request head too large", error_status_hint=431))
            return None
        return event

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read)
                try:
                    await self._serve_requests()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await self.stream.aclose()
                except _NET_ERRORS:
                    pass

    async def _serve_requests(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                await self._exchange(request)
                if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                    return  # Connection: close, an unread body, or a broken exchange
                self.conn.start_next_cycle()
        except _Gone:
            return

    def _scope(self, request: h11.Request) -> dict[str, Any]:
        path, _, query = request.target.partition(b"?")
        return {
            "type": "http", "asgi": _ASGI, "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"), "scheme": self.scheme,
            "path": unquote(path.decode("latin-1")), "raw_path": path, "query_string": query, "root_path": "",
            "headers": list(request.headers), "client": self.client, "server": self.server,
            "extensions": {AUTHENTICATED: {"mark": self._authenticate}}, "state": dict(self.state),
        }

    async def _exchange(self, request: h11.Request) -> None:
        ex = _Exchange(head=request.method == b"HEAD", body_deadline=trio.current_time() + self.limits.body_timeout_s)

        async def receive() -> dict[str, Any]:
            if ex.body_done:
                # the next message is the end: of the response, or of the peer
                if self._eof:
                    ex.over.set()
                else:
                    self._watching = ex.over
                    self._demand.set()
                await ex.over.wait()
                return {"type": "http.disconnect"}
            # A guest's body must keep coming, and end in time; an authenticated one may stream at its pace.
            wait = (math.inf if self.authenticated
                    else max(0.0, min(self.limits.body_idle_s, ex.body_deadline - trio.current_time())))
            event = None
            with trio.move_on_after(wait) if wait < math.inf else _NO_DEADLINE:
                try:
                    if self.conn.they_are_waiting_for_100_continue:
                        await self._write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                    event = await self._event()
                except (_Gone, h11.RemoteProtocolError, h11.LocalProtocolError):
                    pass
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            ex.body_done = True
            if isinstance(event, h11.EndOfMessage):
                return {"type": "http.request", "body": b"", "more_body": False}
            # the peer went away mid-body, broke its framing, or (a guest) held its body past a deadline: the
            # connection closes after the app returns, as h11 never saw the body end
            ex.over.set()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                if ex.start is not None:
                    raise RuntimeError("http.response.start sent twice")
                # held until the first body message, so that head and body leave in one write
                headers = list(message.get("headers", ()))
                if not self.authenticated and trio.current_time() - self.born >= self.limits.guest_life_s:
                    if not any(bytes(k).lower() == b"connection" for k, _ in headers):
                        headers.append((b"connection", b"close"))  # a guest's last: its lifetime is over
                ex.start = (message["status"], headers)
                return
            if kind != "http.response.body" or ex.start is None or ex.ended:
                raise RuntimeError(f"unexpected ASGI message {kind!r}")
            out = b""
            try:
                if not ex.head_sent:
                    status, headers = ex.start
                    out += self.conn.send(h11.Response(status_code=status, headers=headers))
                    ex.head_sent = True
                body = message.get("body", b"")
                if body and not ex.head:
                    out += self.conn.send(h11.Data(data=body))
                if not message.get("more_body", False):
                    out += self.conn.send(h11.EndOfMessage())
                    ex.ended = True
            except h11.LocalProtocolError as exc:  # e.g. more body than its Content-Length
                ex.over.set()
                raise _Gone from exc
            await self._write(out)
            if ex.ended:
                ex.over.set()

        try:
            await self.app(self._scope(request), receive, send)
        except _Gone:
            raise
        except Exception:  # the app's own failure: the process keeps serving
            log.exception("unhandled error in %s %s", request.method.decode(), request.target[:200].decode("latin-1"))
            if ex.head_sent:
                raise _Gone from None
            ex.start = (500, [(b"content-type", b"application/json"), (b"connection", b"close")])
            await send({"type": "http.response.body", "body": _error_body(Reason.INTERNAL, "internal error")})
        finally:
            ex.over.set()
            self._watching = None
        if not ex.ended:
            raise _Gone  # the app returned without finishing its response


async def _lifespan(app: Callable, state: dict[str, Any], task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the app's lifespan startup, then hold it until cancelled (shutdown is by cancellation).

    An app without lifespan support is served all the same; one that reports
    a failed startup is not served at all.

    Raises:
        RuntimeError: the app sent lifespan.startup.failed.
    """
    started, failed = trio.Event(), []
    asked = [False]

    async def receive() -> dict[str, Any]:
        if not asked[0]:
            asked[0] = True
            return {"type": "lifespan.startup"}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.failed":
            failed.append(message.get("message", ""))
        if message["type"] in ("lifespan.startup.complete", "lifespan.startup.failed"):
            started.set()

    async def call() -> None:
        try:
            await app({"type": "lifespan", "asgi": _ASGI, "state": state}, receive, send)
        except Exception as exc:
            if started.is_set():
                raise
            log.debug("the app does not speak ASGI lifespan (%s); serving without it", exc)
        started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await started.wait()
        if failed:
            raise RuntimeError(f"the app failed to start: {failed[0]}")
        task_status.started()


def _address(stream: trio.abc.Stream, peer: bool) -> tuple[str, int] | None:
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        name = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return None
    return (name[0], name[1])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0 picks a free one).

    Made apart from `serve_asgi` so that a parent can bind before its child
    server has started, hand it the socket, and give the address out at once:
    connections made meanwhile wait in the backlog (`dgr up`).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_asgi(app: Callable, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                     keep_alive_s: float = 300.0, head_timeout_s: float = 30.0, listening: socket.socket | None = None,
                     limits: Limits | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port until cancelled; started with the bound URL (port 0 picks a free one).

    Given `listening` (a bound, listening socket), serve on it instead, and ignore host and port.
    `limits` sets the guest deadlines and the connection caps (`Limits()` by default); `keep_alive_s`
    and `head_timeout_s` override its two fields of the same names.
    """
    limits = attrs.evolve(limits or Limits(), keep_alive_s=keep_alive_s, head_timeout_s=head_timeout_s)
    gate = Gate(limits.max_connections, limits.max_per_peer, limits.member_slots)
    raise_open_files_limit()
    if listening is None:
        listening = listening_socket(host, port)
    else:
        host = listening.getsockname()[0]
    bound = listening.getsockname()[1]
    sock = trio.socket.from_stdlib_socket(listening)
    listener: trio.abc.Listener = trio.SocketListener(sock)
    scheme = "http"
    if ssl_context is not None:
        listener = TlsListener(listener, ssl_context)
        scheme = "https"
    state: dict[str, Any] = {}

    async def handle(stream: trio.abc.Stream) -> None:
        client = _address(stream, True)
        peer = peer_of(client)
        seat = gate.enter(peer)  # may close the oldest idle guest to make room
        if seat is None:
            _refusals.warning("refused a connection from %s: %d open in all (cap %d), %d guests (cap %d), %d from "
                              "it (cap %d), none of them idle", peer, gate.total, limits.max_connections,
                              gate.guests, gate.max_guests, gate.per_peer.get(peer, 0), limits.max_per_peer)
            await trio.aclose_forcefully(stream)  # nothing read, nothing answered
            return
        try:
            await _Connection(stream, app, scheme, _address(stream, False), client, limits, state, gate,
                              seat).serve()
        finally:
            gate.leave(seat)

    async with trio.open_nursery() as nursery:
        await nursery.start(_lifespan, app, state)
        url_host = f"[{host}]" if ":" in host else host
        task_status.started(f"{scheme}://{url_host}:{bound}")
        await trio.serve_listeners(handle, [listener])
