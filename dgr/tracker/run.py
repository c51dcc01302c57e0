"""`dgr tracker`: the registry, the gateway and the OpenAI API in one process."""

from __future__ import annotations

import trio

from dgr.serve import print_ready, serve_app
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.proofs import Prover
from dgr.tracker.registry import Registry

__all__ = ["run_tracker"]


async def run_tracker(*, host: str, port: int, config: GatewayConfig, dead_after_s: float = 1.0,
                      prover: Prover | None = None, require_proof: bool = False) -> None:
    """Serve until cancelled. `prover` holds the manifests layer proofs are checked against."""
    gateway = Gateway(registry=Registry(dead_after_s=dead_after_s, require_proof=require_proof), config=config)
    prover = prover or Prover()
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        await nursery.start(prover.run)
        url = await nursery.start(serve_app, make_tracker_app(gateway, prover=prover), host, port)
        print_ready({"role": "tracker", "url": url, "api": f"{url}/v1"})
