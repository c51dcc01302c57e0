"""`dgr tracker`: the registry, the gateway and the OpenAI API in one process."""

from __future__ import annotations

import trio

from dgr.serve import print_ready, serve_app
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.registry import Registry

__all__ = ["run_tracker"]


async def run_tracker(*, host: str, port: int, config: GatewayConfig, dead_after_s: float = 1.0) -> None:
    gateway = Gateway(registry=Registry(dead_after_s=dead_after_s), config=config)
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        url = await nursery.start(serve_app, make_tracker_app(gateway), host, port)
        print_ready({"role": "tracker", "url": url, "api": f"{url}/v1"})
