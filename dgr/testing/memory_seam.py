"""The seam's pool over in-process ASGI apps: streamed and whole requests without sockets.

`MemoryNet` maps URLs to ASGI apps (a node app, the tracker app) and hands
out `MemoryPool`s with the calls dgr.seam.transport.ConnectionPool offers
(`request`, `open_stream` and its `OutStream`'s `send`/`end`/`answer`/
`release`). Each request is one task in the net's nursery that calls the
target app with an ASGI `receive` fed from a trio memory channel as the
caller sends, so a ring runs in one `trio.run`, on a MockClock too: nothing
here reads the wall clock, and the only sleeps are a URL's `latency`, on
trio's clock (what each record takes to arrive: compute and link, chosen by
the test).

Rules:
- What a socket would show, this shows: a killed URL (`kill`) refuses new
  requests and breaks those in flight with `TransportError`, and its apps'
  tasks are cancelled; a stream its sender releases before ending it reads
  as `http.disconnect` on the server's side, as a closed socket does.
- A stalled URL (`stall`) takes requests and stream records but serves none
  of them until `resume` (one session's only, when asked): a process whose
  compute hangs while its socket still accepts. A gateway's control calls
  (`control_pool`) are answered meanwhile; `hang` stalls them too (its
  /healthz stops answering: a hung process).
- Sending on a stream whose server has answered (or ended) raises
  `TransportError`, as a write to a closed connection eventually does.

Left out: HTTP framing (the apps get ASGI messages, not bytes), TLS (the
SSL context is accepted and ignored), and which app is whose (dgr.testing.inproc).
"""

from __future__ import annotations

import math
import ssl
from typing import Any, Callable

import attrs
import trio

from dgr.seam.transport import AnswerTooLarge, HttpResponse, TransportError
from dgr.seam.wire import ROUTE_SESSION_HEADER

__all__ = ["MemoryNet", "MemoryPool", "MemoryStream"]

Asgi = Callable[..., Any]


def _scope(method: str, url: str, target: str, headers: list[tuple[str, str]], length: int | None) -> dict[str, Any]:
    host = url.split("://", 1)[-1].rstrip("/")
    path, _, query = target.partition("?")
    framing = (b"transfer-encoding", b"chunked") if length is None else (b"content-length", str(length).encode())
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
            "headers": [(b"host", host.encode()), framing,
                        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers)],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


_SESSION = ROUTE_SESSION_HEADER.lower().encode()


@attrs.frozen(eq=False)
class _Stall:
    over: trio.Event  # set when it ends
    hang: bool  # control calls stall too
    session: str | None  # only this session's requests stall; None: all


@attrs.define(eq=False)
class _Exchange:
    """One request: the caller's body going in, the app's answer coming out."""

    url: str
    net: "MemoryNet"
    session: str  # the Route Session it carries (X-Dgr-Route-Session), "" for none
    send_body: trio.MemorySendChannel
    recv_body: trio.MemoryReceiveChannel
    status: int = 0
    headers: dict[str, str] = attrs.field(factory=dict)
    body: list[bytes] = attrs.field(factory=list)
    answered: bool = False  # the whole answer came
    over: trio.Event = attrs.field(factory=trio.Event)  # the app returned (or was cancelled)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    broken: str = ""  # why the connection broke, if it did
    control: bool = False  # a gateway's control call: only a hang stalls it

    @classmethod
    def new(cls, url: str, net: "MemoryNet", session: str, control: bool = False) -> "_Exchange":
        send, recv = trio.open_memory_channel(math.inf)
        return cls(url, net, session, send, recv, control=control)

    async def receive(self) -> dict[str, Any]:
        try:
            message = await self.recv_body.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return {"type": "http.disconnect"}
        delay = self.net.latency.get(self.url, 0.0)
        if delay and message.get("body"):
            await trio.sleep(delay)
        await self.net.unstalled(self.url, self.session, self.control)
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            self.body.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                self.answered = True

    def response(self) -> HttpResponse:
        if self.broken or not self.answered:
            raise TransportError(self.broken or "the server closed the connection mid-response")
        return HttpResponse(self.status, self.headers, b"".join(self.body))


@attrs.define(eq=False)
class MemoryStream:
    """One streamed request (OutStream's calls): `send` chunks, `end`, `answer`, `release`."""

    exchange: _Exchange

    async def send(self, data: bytes) -> None:
        """One chunk of the body. Raises TransportError."""
        await self._put({"type": "http.request", "body": data, "more_body": True})

    async def end(self) -> None:
        """End the body (the app then answers). Raises TransportError."""
        await self._put({"type": "http.request", "body": b"", "more_body": False})

    async def _put(self, message: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()
        if self.exchange.broken or self.exchange.over.is_set():
            raise TransportError(self.exchange.broken or "the server closed the connection")
        try:
            self.exchange.send_body.send_nowait(message)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise TransportError("the stream was released") from None

    async def answer(self) -> HttpResponse:
        await self.exchange.over.wait()
        return self.exchange.response()

    async def release(self) -> None:
        """The connection closes: an app still reading the body reads `http.disconnect`."""
        self.exchange.send_body.close()


@attrs.define(eq=False)
class MemoryPool:
    """ConnectionPool's calls to one URL of a `MemoryNet`."""

    net: "MemoryNet"
    url: str
    ssl_context: ssl.SSLContext | None = None  # accepted for the pool's signature; nothing is encrypted
    control: bool = False  # a gateway's control calls: a stalled node answers them unless it hangs

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[-1].rstrip("/")

    @property
    def idle_connections(self) -> int:
        return 0

    async def open_stream(self, target: str, headers: list[tuple[str, str]]) -> MemoryStream:
        exchange = await self.net.start(self.url, _scope("POST", self.url, target, headers, None))
        return MemoryStream(exchange)

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: list[tuple[str, str]] | None = None, limit: int | None = None) -> HttpResponse:
        exchange = await self.net.start(self.url, _scope(method, self.url, target, headers or [], len(body)),
                                        control=self.control)
        exchange.send_body.send_nowait({"type": "http.request", "body": body, "more_body": False})
        try:
            await exchange.over.wait()
        finally:
            exchange.send_body.close()
        response = exchange.response()
        if limit is not None and len(response.body) > limit:
            raise AnswerTooLarge(f"the answer exceeds {limit} bytes")
        return response

    async def aclose(self) -> None:
        pass


@attrs.define(eq=False)
class MemoryNet:
    """URLs to ASGI apps, and the faults of the processes behind them."""

    apps: dict[str, Asgi] = attrs.field(factory=dict)
    _nursery: trio.Nursery | None = None
    _dead: set[str] = attrs.field(factory=set)
    latency: dict[str, float] = attrs.field(factory=dict)  # url -> how long each record sent there takes to arrive
    _stalled: dict[str, _Stall] = attrs.field(factory=dict)  # url -> what of it is stalled
    _serving: dict[str, set[_Exchange]] = attrs.field(factory=dict)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Host the apps' request tasks until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def pool(self, url: str, ssl_context: ssl.SSLContext | None = None) -> MemoryPool:
        """A pool to `url` (the signature of ConnectionPool's constructor)."""
        return MemoryPool(self, url.rstrip("/"), ssl_context)

    def control_pool(self, url: str) -> MemoryPool:
        """A pool for a gateway's control calls to `url`: they stall only while it hangs (`stall(hang=True)`)."""
        return MemoryPool(self, url.rstrip("/"), control=True)

    def _refuse(self, url: str) -> None:
        if url in self._dead:
            raise TransportError(f"connect to {url} failed: connection refused (killed)")
        if url not in self.apps:
            raise TransportError(f"connect to {url} failed: no such host")

    async def start(self, url: str, scope: dict[str, Any], control: bool = False) -> _Exchange:
        """A new request to `url`'s app, served in the net's nursery (`control`: a control call, which only a
        hang stalls). Raises TransportError."""
        await trio.lowlevel.checkpoint()
        self._refuse(url)
        if self._nursery is None:
            raise TransportError(f"the in-memory net is not running (a request to {url})")
        session = next((v.decode("latin-1") for k, v in scope["headers"] if k == _SESSION), "")
        exchange = _Exchange.new(url, self, session, control)
        self._serving.setdefault(url, set()).add(exchange)
        self._nursery.start_soon(self._serve, self.apps[url], scope, exchange)
        return exchange

    async def _serve(self, app: Asgi, scope: dict[str, Any], exchange: _Exchange) -> None:
        try:
            with exchange.scope:
                await self.unstalled(exchange.url, exchange.session, exchange.control)
                await app(scope, exchange.receive, exchange.send)
            if exchange.scope.cancelled_caught:
                exchange.broken = exchange.broken or f"{exchange.url} went away"
        finally:
            self._serving.get(exchange.url, set()).discard(exchange)
            exchange.over.set()

    def kill(self, url: str) -> None:
        """`url`'s process dies: its connections break and nothing reaches it any more."""
        url = url.rstrip("/")
        self._dead.add(url)
        for exchange in list(self._serving.get(url, ())):
            exchange.broken = f"{url} went away (killed)"
            exchange.scope.cancel()

    def stall(self, url: str, *, hang: bool = False, session: str | None = None) -> None:
        """`url` stops serving its streams and steps (its compute is stuck) until `resume`; `hang`: its
        control calls (/healthz included) stall too, as a hung process's do; `session`: only that Route
        Session's streams and steps stall (one slow member of a phase group)."""
        url = url.rstrip("/")
        self.resume(url)
        self._stalled[url] = _Stall(trio.Event(), hang, session)

    def resume(self, url: str) -> None:
        stall = self._stalled.pop(url.rstrip("/"), None)
        if stall is not None:
            stall.over.set()

    async def unstalled(self, url: str, session: str, control: bool = False) -> None:
        """Return once `url` serves `session`'s requests (at once unless it is stalled); `control`: a control
        call's, which only a hang stalls."""
        while (stall := self._stalled.get(url)) is not None and (
                stall.hang if control else stall.session in (None, session)):
            await stall.over.wait()

