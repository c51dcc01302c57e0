"""Join a tracker and stay joined: register, then heartbeat.

A heartbeat the tracker does not recognise (it restarted, or declared us
dead) is answered 404, and the node registers again. A tracker that cannot
be reached is retried at the heartbeat period; the node keeps serving its
open sessions meanwhile.

A node with a Model Artifact adds its claim (manifest id, seed address) to
each registration; the tracker answers with the proof's state, and every
heartbeat reply repeats it, so the node can say on stderr when its layers
are proven (or why not).

With a cluster secret every registration and heartbeat is signed over its
exact body bytes (dgr.security.auth.Signer), so the tracker can refuse
forged and replayed ones. A 401 is not final: the tracker may be restarting
with a rotated secret, a clock may be off for a while, or a signature may
collide with a nonce it saw. The node says why on its log and retries with
exponential backoff (`RETRY_MIN_S` doubling to `RETRY_MAX_S`), serving its
open sessions meanwhile.

Each heartbeat lists the ids of the sessions the node holds, so the tracker
can close the ones it no longer runs (a node it declared lost, an open whose
reply it never got). Each registration advertises `max_positions`, the
positions per session this node really allocates (`--ctx`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import httpx
import trio

from dgr.errors import CallerError, Reason, parse_error_body
from dgr.node.artifact import NodeArtifact, say
from dgr.node.service import NodeService
from dgr.security.auth import Signer

__all__ = ["HEARTBEAT_S", "RETRY_MIN_S", "RETRY_MAX_S", "stay_registered", "registration", "heartbeat_body"]

log = logging.getLogger("dgr.node")
HEARTBEAT_S = 0.25
RETRY_MIN_S = 1.0  # first wait after the tracker refused this node's credentials
RETRY_MAX_S = 30.0


def registration(service: NodeService, url: str, artifact: NodeArtifact | None = None) -> dict[str, Any]:
    backend = service.backend
    claim = {} if artifact is None else {"artifact": artifact.claim()}
    return {
        **claim,
        "node": service.node_id,
        "url": url,
        "pid": os.getpid(),
        "layers": [backend.layers.start, backend.layers.stop],
        "backend": backend.name,
        "model": backend.info.to_json(),
        "capacity": service.capacity,
        "max_positions": service.max_positions,
        "describe": service.described,
    }


def heartbeat_body(service: NodeService) -> dict[str, Any]:
    """Load and the sessions held: the tracker closes any it does not run."""
    return {"node": service.node_id, "sessions": len(service.sessions), "kv_bytes": service.scheduler.kv_bytes,
            "session_ids": sorted(service.sessions)}


def _note_proof(artifact: NodeArtifact | None, reply: Any) -> None:
    """Keep the tracker's latest proof verdict and say it on stderr when it changes."""
    proof = reply.get("proof") if isinstance(reply, dict) else None
    if artifact is None or not isinstance(proof, dict) or proof == artifact.proof:
        return
    before = artifact.proof.get("state")
    artifact.proof = proof
    state = proof.get("state")
    if state == before:
        return
    if state == "passed":
        artifact.timings.setdefault("proved_after_s", artifact.age())
        say(f"layers {artifact.layers} proven to the tracker: {proof.get('message', '')}; routable")
    elif state == "failed":
        say(f"the tracker refused the layer proof ({proof.get('reason')}): {proof.get('message', '')}; not routed")
    elif state == "pending":
        say("registered; the tracker is challenging the layer claim")


def _decided(artifact: NodeArtifact | None) -> bool:
    return artifact is None or artifact.proof.get("state") in ("passed", "failed", "none")


async def _post(client: httpx.AsyncClient, signer: Signer | None, path: str, data: dict[str, Any]) -> httpx.Response:
    """POST `data` as JSON, signed over the exact bytes sent.

    Raises:
        CallerError(UNAUTHENTICATED | REPLAYED): the tracker refused our signature (or its absence).
    """
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json"}
    if signer is not None:
        headers.update(signer.headers("POST", path, body, time.time()))
    r = await client.post(path, content=body, headers=headers)
    if r.status_code == 401:
        code, message = parse_error_body(r.content)
        try:
            reason = Reason(code)
        except ValueError:  # not an error body, or a code this node does not know
            reason = Reason.UNAUTHENTICATED
        raise CallerError(reason, f"the tracker refused this node ({reason.value}): {message}")
    return r


async def stay_registered(service: NodeService, tracker: str, url: str, *, artifact: NodeArtifact | None = None,
                          secret: bytes | None = None, transport: httpx.AsyncBaseTransport | None = None,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Register with the tracker, report ready, then heartbeat forever.

    With an artifact, ready means the tracker has decided on the layer claim
    (passed or failed), so `dgr up` announces the API once nodes are routable.
    A refusal of this node's credentials (401) is logged with its reason and
    retried with backoff; `transport` is for in-process tests.
    """
    started = False
    signer = None if secret is None else Signer(secret)
    backoff = RETRY_MIN_S
    async with httpx.AsyncClient(base_url=tracker, timeout=2.0, transport=transport) as client:
        registered = False
        while True:
            try:
                if not registered:
                    r = await _post(client, signer, "/v1/nodes/register", registration(service, url, artifact))
                    r.raise_for_status()
                    _note_proof(artifact, r.json())
                    registered = True
                    log.info("registered with %s as %s", tracker, service.node_id)
                    if not started and _decided(artifact):
                        started = True
                        task_status.started()
                r = await _post(client, signer, "/v1/nodes/heartbeat", heartbeat_body(service))
                if r.status_code == 404:
                    registered = False
                    continue
                if r.status_code == 200:
                    _note_proof(artifact, r.json())
                if not started and _decided(artifact):
                    started = True
                    task_status.started()
                backoff = RETRY_MIN_S
            except CallerError as exc:  # 401: our secret, our clock, or a replayed nonce
                registered = False
                log.warning("%s; retrying in %gs (check the cluster secret and the clocks)", exc.message, backoff)
                await trio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
                continue
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError) as exc:  # ValueError: a non-JSON reply
                registered = False
                log.warning("tracker %s unreachable or refused: %s", tracker, exc)
            await trio.sleep(HEARTBEAT_S)
