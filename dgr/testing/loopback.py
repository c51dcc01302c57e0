"""A real route in one process: a tracker and stub nodes on 127.0.0.1, for tests that patch a member at run time.

`loopback_route` runs, in the caller's trio run, what `dgr tracker` and `dgr node` run: the tracker's
gateway with its own key (so nodes pin it, and every session call carries its capability and each open
its ticket) behind the tracker app, and each node's service behind the node app, every one served over
loopback HTTP by the real server; each node joins through its membership loop, as `dgr node` does. A test
speaks to the tracker as a client does (`LoopbackRoute.client`), and holds what a process would hide:
the gateway and its registry, to read, and each node's service and backend, to patch at run time (a member
gone bad: slow, lying).

Left out: processes and signals (dgr.testing.harness `LocalRoute`), TLS, artifacts, join tokens.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, AsyncIterator, Sequence

import attrs
import httpx
import trio

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.node.app import make_node_app
from dgr.node.membership import stay_registered
from dgr.node.service import NodeService
from dgr.security.auth import CapabilityAuthority
from dgr.security.identity import Identity
from dgr.serve import serve_app
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.registry import Registry

__all__ = ["LoopbackRoute", "SlowCompute", "loopback_route"]


@attrs.define(eq=False)
class SlowCompute:
    """A member's compute, patched to sleep `seconds` before every forward, in the scheduler's thread: its loop
    (its /healthz, its heartbeats) answers as ever, its steps come late. `release` ends every sleep at once."""

    inner: Any  # the backend the scheduler held
    seconds: float
    released: threading.Event = attrs.field(factory=threading.Event)

    def forward_batch(self, steps: Sequence[Any]) -> list[Any]:
        self.released.wait(self.seconds)
        return self.inner.forward_batch(steps)

    @property
    def n_threads(self) -> int:
        return max(2, self.inner.n_threads)  # never run inline: a sleep on the node's loop would hang it

    def release(self) -> None:
        self.released.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@attrs.define(eq=False)
class LoopbackRoute:
    url: str  # the tracker's
    gateway: Gateway
    services: dict[str, NodeService]  # node id -> its service (its backend: `.backend`)
    client: httpx.AsyncClient  # to the tracker, as an OpenAI client speaks to it

    @property
    def registry(self) -> Registry:
        return self.gateway.registry

    def slow(self, node_id: str, seconds: float) -> SlowCompute:
        """Patch node `node_id`'s compute to sleep `seconds` before every forward (undone by `fast`)."""
        scheduler = self.services[node_id].scheduler
        scheduler.backend = SlowCompute(self.services[node_id].backend, seconds)
        return scheduler.backend

    def fast(self, node_id: str) -> None:
        scheduler = self.services[node_id].scheduler
        if isinstance(scheduler.backend, SlowCompute):
            scheduler.backend.release()
            scheduler.backend = scheduler.backend.inner

    async def complete(self, **body) -> httpx.Response:
        """POST /v1/completions (the stub model, greedy) and its whole answer."""
        return await self.client.post("/v1/completions", json={"model": "stub", "temperature": 0, **body})


async def _node(service: NodeService, tracker: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        url = await nursery.start(functools.partial(serve_app, make_node_app(service), "127.0.0.1", 0))
        await nursery.start(functools.partial(stay_registered, service, tracker, url))
        task_status.started()


@contextlib.asynccontextmanager
async def loopback_route(splits: dict[str, tuple[int, int]], *, config: GatewayConfig = GatewayConfig(),
                         registry: Registry | None = None, capacity: int = 8,
                         within_s: float = 20.0) -> AsyncIterator[LoopbackRoute]:
    """A tracker and one stub node per entry of `splits` (node id -> its layers), each registered and
    routable before the body runs; everything stops when it ends."""
    identity = Identity.generate()
    gateway = Gateway(registry=registry or Registry(), config=config,
                      authority=CapabilityAuthority.issuer(identity))
    app = make_tracker_app(gateway, identity=identity)
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        url = await nursery.start(functools.partial(serve_app, app, "127.0.0.1", 0))
        services = {}
        for node_id, (a, b) in splits.items():
            backend = StubBackend(spec=StubSpec(), layers=LayerRange(a, b), capacity=capacity)
            services[node_id] = NodeService(backend, node_id, joining=True, identity=Identity.generate(),
                                            tracker_url=url)
            await nursery.start(_node, services[node_id], url)
        with trio.fail_after(within_s):
            while {n.node_id for n in gateway.registry.nodes.values() if n.routable} != set(splits):
                await trio.sleep(0.02)
        async with httpx.AsyncClient(base_url=url, timeout=within_s) as client:
            route = LoopbackRoute(url, gateway, services, client)
            try:
                yield route
            finally:
                for node_id in services:
                    route.fast(node_id)  # a sleeping forward would hold its scheduler's cancel
        nursery.cancel_scope.cancel()
