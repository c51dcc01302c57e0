"""`dgr node`: load a backend, serve it, join the tracker, expire idle sessions."""

from __future__ import annotations

import time

import trio

from dgr.backends.base import ShardBackend
from dgr.node.app import make_node_app
from dgr.node.membership import stay_registered
from dgr.node.service import NodeService
from dgr.serve import print_ready, serve_app

__all__ = ["run_node"]


async def _expire(service: NodeService) -> None:
    while True:
        await trio.sleep(1.0)
        service.expire_idle(time.monotonic())


async def run_node(backend: ShardBackend, *, node_id: str, host: str, port: int, tracker: str | None,
                   idle_timeout_s: float = 120.0) -> None:
    service = NodeService(backend=backend, node_id=node_id, idle_timeout_s=idle_timeout_s)
    app = make_node_app(service)
    try:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_app, app, host, port)
            nursery.start_soon(_expire, service)
            if tracker:
                await nursery.start(stay_registered, service, tracker, url)
            print_ready({"role": "node", "node": node_id, "url": url, "layers": str(backend.layers)})
    finally:
        backend.close()
