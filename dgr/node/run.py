"""`dgr node`: load a backend, serve it, join the tracker, expire idle sessions.

With a Model Artifact (dgr.node.artifact), the node also seeds its file and
claims its layers at registration; seeding starts first so that the claim
can carry the seed address, and the HTTP app before registration so that the
tracker's challenges find it answering.

With a cluster secret the node signs its membership messages and demands a
capability on every session call. Without one it accepts any caller, so it
refuses to listen anywhere but loopback.
"""

from __future__ import annotations

import functools
import time

import trio

from dgr.api.http import is_loopback
from dgr.backends.base import ShardBackend
from dgr.errors import CallerError, Reason
from dgr.node.app import make_node_app
from dgr.node.artifact import NodeArtifact, seed_artifact
from dgr.node.membership import stay_registered
from dgr.node.service import NodeService
from dgr.security.auth import CapabilityAuthority
from dgr.serve import print_ready, serve_app

__all__ = ["run_node"]


async def _expire(service: NodeService) -> None:
    while True:
        await trio.sleep(1.0)
        await service.expire_idle(time.monotonic())


async def run_node(backend: ShardBackend, *, node_id: str, host: str, port: int, tracker: str | None,
                   idle_timeout_s: float = 120.0, artifact: NodeArtifact | None = None, seed_port: int = 0,
                   secret: bytes | None = None) -> None:
    """Serve until cancelled.

    Raises:
        CallerError(INVALID_REQUEST): bound beyond loopback without a cluster secret.
    """
    if secret is None and not is_loopback(host):
        raise CallerError(Reason.INVALID_REQUEST,
                          f"a node listening on {host} needs a cluster secret (--cluster-secret-file or "
                          "DGR_CLUSTER_SECRET): without one anyone who reaches it can open sessions")
    authority = None if secret is None else CapabilityAuthority(secret)
    service = NodeService(backend=backend, node_id=node_id, idle_timeout_s=idle_timeout_s, authority=authority,
                          tracker_url=tracker.rstrip("/") if tracker else None)
    app = make_node_app(service, artifact=artifact)
    try:
        async with trio.open_nursery() as nursery:
            if artifact is not None:
                await nursery.start(seed_artifact, artifact, host, seed_port)
            await nursery.start(service.run)  # the scheduler: the one owner of the backend
            url = await nursery.start(serve_app, app, host, port)
            nursery.start_soon(_expire, service)
            if tracker:
                await nursery.start(functools.partial(stay_registered, service, tracker, url, artifact=artifact,
                                                      secret=secret))
            print_ready({"role": "node", "node": node_id, "url": url, "layers": str(backend.layers)})
    finally:
        backend.close()
