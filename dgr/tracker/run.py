"""`dgr tracker`: the registry, the gateway and the OpenAI API in one process.

Exposure rule: on loopback a tracker may run open (development); bound to
any other address it refuses to start unless it has both a cluster secret
(so only members register and nodes demand capabilities) and API keys (so
only key holders generate).
"""

from __future__ import annotations

import trio

from dgr.api.http import is_loopback
from dgr.errors import CallerError, Reason
from dgr.security.auth import CapabilityAuthority
from dgr.serve import print_ready, serve_app
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.proofs import Prover
from dgr.tracker.registry import DEAD_AFTER_S, Registry

__all__ = ["run_tracker"]


async def run_tracker(*, host: str, port: int, config: GatewayConfig, dead_after_s: float = DEAD_AFTER_S,
                      prover: Prover | None = None, require_proof: bool = False, secret: bytes | None = None,
                      api_keys: frozenset[str] = frozenset(), max_body_bytes: int = 4 * 1024 * 1024) -> None:
    """Serve until cancelled. `prover` holds the manifests layer proofs are checked against.

    Raises:
        CallerError(INVALID_REQUEST): bound beyond loopback without a cluster secret and API keys.
    """
    if not is_loopback(host):
        missing = [what for what, have in (("a cluster secret (--cluster-secret-file or DGR_CLUSTER_SECRET)", secret),
                                           ("API keys (--api-key-file or DGR_API_KEYS)", api_keys)) if not have]
        if missing:
            raise CallerError(Reason.INVALID_REQUEST,
                              f"a tracker listening on {host} needs " + " and ".join(missing)
                              + "; only a loopback tracker may run without them")
    gateway = Gateway(registry=Registry(dead_after_s=dead_after_s, require_proof=require_proof), config=config,
                      authority=None if secret is None else CapabilityAuthority(secret))
    prover = prover or Prover()
    app = make_tracker_app(gateway, prover=prover, secret=secret, api_keys=api_keys, max_body_bytes=max_body_bytes)
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        await nursery.start(prover.run)
        url = await nursery.start(serve_app, app, host, port)
        print_ready({"role": "tracker", "url": url, "api": f"{url}/v1", "cluster_secret": secret is not None,
                     "api_keys": len(api_keys)})
