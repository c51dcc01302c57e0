"""An in-process route for trio-level tests: real node apps and a real gateway, no sockets, no processes.

`InProcRoute` builds stub nodes (a `NodeService` behind the real node app),
a `Registry` and a `Gateway` whose `connect` reaches each node's ASGI app
through httpx's `ASGITransport`, seam steps included. So gateway tests run
the real node code paths inside one `trio.run`, and decide themselves when
a node registers or heartbeats (`register`, `heartbeat`), with the payloads
the real membership loop sends, under each node's own key (`signed` makes the
headers of a membership message for a node, as its membership loop would).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Iterable
from typing import Any, Callable

import attrs
import httpx
import trio

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.node.app import make_node_app
from dgr.node.membership import heartbeat_body, registration
from dgr.node.service import NodeService
from dgr.security.auth import Signer
from dgr.security.identity import Identity
from dgr.seam.transport import HttpResponse
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.seam_client import NodeClient

__all__ = ["InProcRoute", "asgi_client", "http_scope", "receive_once"]


@attrs.define
class _AsgiSeam:
    """The seam pool's one method, over an in-process ASGI client."""

    http: httpx.AsyncClient

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: list[tuple[str, str]] | None = None) -> HttpResponse:
        r = await self.http.request(method, target, content=body, headers=headers or [])
        return HttpResponse(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)

    async def aclose(self) -> None:
        await self.http.aclose()


def asgi_client(app: Any, url: str) -> httpx.AsyncClient:
    """An httpx client whose requests go straight into `app` (an ASGI callable)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=url)


@attrs.define
class InProcRoute:
    services: list[NodeService]
    urls: list[str]
    registry: Registry
    gateway: Gateway
    apps: dict[str, Any]
    wrap: Callable[[NodeClient], NodeClient] = lambda c: c  # tests may wrap clients to inject faults

    @classmethod
    def stub(cls, splits: tuple[tuple[int, int], ...] = ((0, 15), (15, 30)), *, n_ctx: tuple[int | None, ...] = (),
             spec: StubSpec = StubSpec(), delay_s: float = 0.0, config: GatewayConfig = GatewayConfig(),
             capacity: int = 8, inline: bool = False) -> "InProcRoute":
        """Stub nodes over `splits`; `inline` runs their schedulers on the loop, for tests on a MockClock."""
        services, urls, apps = [], [], {}
        for i, (a, b) in enumerate(splits):
            ctx = n_ctx[i] if i < len(n_ctx) else None
            backend = StubBackend(spec=spec, layers=LayerRange(a, b), delay_s=delay_s, capacity=capacity, n_ctx=ctx)
            service = NodeService(backend=backend, node_id=f"n{i}", identity=Identity.generate())
            service.scheduler.inline = inline
            url = f"http://n{i}.test:{8000 + i}"
            services.append(service)
            urls.append(url)
            apps[url] = make_node_app(service)
        registry = Registry()
        route = cls(services=services, urls=urls, registry=registry, gateway=Gateway(registry=registry, config=config),
                    apps=apps)
        route.gateway.connect = route.connect
        return route

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run every node's scheduler (the one owner of its backend), then the gateway, until cancelled."""
        async with trio.open_nursery() as nursery:
            for service in self.services:
                await nursery.start(service.run)
            await nursery.start(self.gateway.run)
            task_status.started()

    def connect(self, node_id: str, url: str) -> NodeClient:
        client = NodeClient(node_id, url)
        http = asgi_client(self.apps[url], url)
        client._http = http
        client._seam = _AsgiSeam(http)
        return self.wrap(client)

    def register(self, i: int) -> NodeEntry:
        service = self.services[i]
        return self.registry.register(registration(service, self.urls[i]), trio.current_time(),
                                      key=service.identity.public)

    def heartbeat(self, i: int) -> NodeEntry:
        service = self.services[i]
        return self.registry.heartbeat(heartbeat_body(service), trio.current_time(), key=service.identity.public)

    def signed(self, i: int, path: str, data: Any) -> tuple[bytes, dict[str, str]]:
        """(body, headers) of a membership message for node `i`, signed with its key (no join token)."""
        body = json.dumps(data, allow_nan=True).encode()
        headers = {"Content-Type": "application/json",
                   **Signer(self.services[i].identity).headers("POST", path, body, time.time())}
        return body, headers

    def register_all(self) -> None:
        for i in range(len(self.services)):
            self.register(i)


def http_scope(method: str, path: str, body: bytes = b"", *, headers: Iterable[tuple[bytes, bytes]] = (),
               query_string: bytes = b"") -> dict[str, Any]:
    """The ASGI scope of one HTTP/1.1 request from 127.0.0.1 with a JSON body, for calling an app directly.

    For tests that play the server themselves (a client that stalls, or leaves
    mid-response) where httpx's ASGITransport cannot.
    """
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query_string, "root_path": "",
            "headers": [(b"host", b"127.0.0.1:2"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), *headers],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


def receive_once(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI `receive` that gives `body` in one message, then waits forever: a client that stays connected."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # sleep_forever only returns by raising

    return receive

