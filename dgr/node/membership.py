"""Join a tracker and stay joined: register, then heartbeat.

A heartbeat the tracker does not recognise (it restarted, or declared us
dead) is answered 404, and the node registers again. A tracker that cannot
be reached is retried at the heartbeat period; the node keeps serving its
open sessions meanwhile.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx
import trio

from dgr.node.service import NodeService

__all__ = ["HEARTBEAT_S", "stay_registered", "registration"]

log = logging.getLogger("dgr.node")
HEARTBEAT_S = 0.25


def registration(service: NodeService, url: str) -> dict[str, Any]:
    backend = service.backend
    return {
        "node": service.node_id,
        "url": url,
        "pid": os.getpid(),
        "layers": [backend.layers.start, backend.layers.stop],
        "backend": backend.name,
        "model": backend.info.to_json(),
        "capacity": backend.max_sessions(),
        "describe": backend.describe(),
    }


def _load(service: NodeService) -> dict[str, Any]:
    return {"node": service.node_id, "sessions": len(service.sessions), "kv_bytes": service.backend.kv_bytes()}


async def stay_registered(service: NodeService, tracker: str, url: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Register with the tracker, report ready, then heartbeat forever."""
    started = False
    async with httpx.AsyncClient(base_url=tracker, timeout=2.0) as client:
        registered = False
        while True:
            try:
                if not registered:
                    r = await client.post("/v1/nodes/register", json=registration(service, url))
                    r.raise_for_status()
                    registered = True
                    log.info("registered with %s as %s", tracker, service.node_id)
                    if not started:
                        started = True
                        task_status.started()
                r = await client.post("/v1/nodes/heartbeat", json=_load(service))
                if r.status_code == 404:
                    registered = False
                    continue
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                registered = False
                log.warning("tracker %s unreachable or refused: %s", tracker, exc)
            await trio.sleep(HEARTBEAT_S)
