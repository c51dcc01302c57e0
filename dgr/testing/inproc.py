"""An in-process route for trio-level tests: real node apps and a real gateway, no sockets, no processes.

`InProcRoute` builds stub nodes (a `NodeService` behind the real node app),
a `Registry`, a `Gateway` and the tracker app that takes the ring's answers,
all joined by an in-memory net (dgr.testing.memory_seam): the gateway's
control calls go through httpx's `ASGITransport` to a node's app, its stream
to the head and every node's streams (to its next hop, the tail's to the head
and to the tracker) go through the net's pools. So gateway tests run the real
node and gateway code paths of the default topology, the ring, inside one
`trio.run` (a MockClock's too), and decide themselves when a node registers
or heartbeats (`register`, `heartbeat`), with the payloads the real
membership loop sends, under each node's own key (`signed` makes the headers
of a membership message for a node, as its membership loop would), and when
a node dies (`kill`) or stops computing (`stall`).
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
from dgr.seam.types import DeviceMemory
from dgr.security.auth import Signer
from dgr.security.identity import Identity
from dgr.testing.memory_seam import MemoryNet
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.pieces import stub_pieces
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.seam_client import NodeClient

__all__ = ["InProcRoute", "TRACKER_URL", "asgi_client", "http_scope", "receive_once"]

TRACKER_URL = "http://127.0.0.1:7000"  # where the nodes' answers and failure reports go (a loopback tracker)


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
    net: MemoryNet
    tracker: Any  # the tracker app (make_tracker_app): the ring's answers and the nodes' reports reach it
    wrap: Callable[[NodeClient], NodeClient] = lambda c: c  # tests may wrap clients to inject faults
    _alive: list[trio.CancelScope] = attrs.Factory(list)  # each node's run: `kill` cancels it

    @classmethod
    def stub(cls, splits: tuple[tuple[int, int], ...] = ((0, 15), (15, 30)), *, n_ctx: tuple[int | None, ...] = (),
             spec: StubSpec = StubSpec(), delay_s: float = 0.0, config: GatewayConfig = GatewayConfig(),
             capacity: int = 8, inline: bool = False,
             devices: tuple[tuple[DeviceMemory, ...], ...] = ()) -> "InProcRoute":
        """A ring of stub nodes over `splits`; `inline` runs their schedulers on the loop, for tests on a
        MockClock; `devices[i]`: node i's fake accelerators (none past the tuple's end: CPU nodes)."""
        net = MemoryNet()
        services, urls, apps = [], [], {}
        for i, (a, b) in enumerate(splits):
            ctx = n_ctx[i] if i < len(n_ctx) else None
            backend = StubBackend(spec=spec, layers=LayerRange(a, b), delay_s=delay_s, capacity=capacity, n_ctx=ctx,
                                  devices=devices[i] if i < len(devices) else ())
            service = NodeService(backend=backend, node_id=f"n{i}", identity=Identity.generate(),
                                  tracker_url=TRACKER_URL, connect_pool=net.pool)
            service.scheduler.inline = inline
            url = f"http://n{i}.test:{8000 + i}"
            services.append(service)
            urls.append(url)
            apps[url] = net.apps[url] = make_node_app(service)
        registry = Registry()
        gateway = Gateway(registry=registry, config=config)
        gateway.vocabularies.add(*stub_pieces(spec))  # the tail's answers are checked as a tracker checks them
        tracker = net.apps[TRACKER_URL] = make_tracker_app(gateway)
        route = cls(services=services, urls=urls, registry=registry, gateway=gateway, apps=apps, net=net,
                    tracker=tracker, alive=[trio.CancelScope() for _ in services])
        gateway.connect = route.connect
        return route

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the net, every node's scheduler (the one owner of its backend), then the gateway, until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.net.run)
            for service, alive in zip(self.services, self._alive):
                await nursery.start(_run_until_killed, service, alive)
            await nursery.start(self.gateway.run)
            task_status.started()

    def connect(self, node_id: str, url: str) -> NodeClient:
        client = NodeClient(node_id, url)
        client._control = self.net.control_pool(url)
        client._seam = self.net.pool(url)
        return self.wrap(client)

    def kill(self, i: int) -> None:
        """Node `i`'s process dies: its connections break, its tasks stop, and nothing reaches it any more."""
        self.net.kill(self.urls[i])
        self._alive[i].cancel()

    def stall(self, i: int, *, hang: bool = False, session: str | None = None) -> None:
        """Node `i` stops computing what reaches it (its streams and steps) until `resume`; `hang`: its
        /healthz and other control calls stop answering too (a hung process, not a busy one); `session`:
        only that Route Session's records wait."""
        self.net.stall(self.urls[i], hang=hang, session=session)

    def latency(self, seconds: float) -> None:
        """Each record or request sent to a node takes `seconds` (of trio's clock) to arrive: compute time
        and links, for tests on a MockClock where inline compute takes none."""
        for url in self.urls:
            self.net.latency[url] = seconds

    def resume(self, i: int) -> None:
        self.net.resume(self.urls[i])

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


async def _run_until_killed(service: NodeService, alive: trio.CancelScope, *,
                            task_status=trio.TASK_STATUS_IGNORED) -> None:
    with alive:
        await service.run(task_status=task_status)


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

