"""Ask the tracker which layers to serve (`dgr node --manifest M --memory SIZE` without `--layers`).

Before a node loads or fetches anything it needs its layer range; the
tracker knows what the route already covers (dgr.tracker.assign). One
request, before the node's trio services start; a refusal is the tracker's
typed error, passed on.
"""

from __future__ import annotations

import httpx

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, PeerError, Reason
from dgr.security.tls import TlsTrust

__all__ = ["ASSIGN_PATH", "ask_layers"]

ASSIGN_PATH = "/v1/assign"


def ask_layers(tracker: str, manifest_id: str, memory_bytes: int, *, context: int, sessions: int,
               tls: TlsTrust = TlsTrust(), timeout_s: float = 30.0) -> tuple[LayerRange, dict]:
    """The layer range the tracker assigns this node, and its whole answer.

    Raises:
        CallerError: the tracker refused (an unknown manifest, memory that holds no layer), with its reason.
        PeerError(NODE_ERROR): the tracker could not be reached or answered nonsense.
    """
    body = {"manifest_id": manifest_id, "memory_bytes": memory_bytes, "context": context, "sessions": sessions}
    try:
        r = httpx.post(tracker.rstrip("/") + ASSIGN_PATH, json=body, timeout=timeout_s,
                       verify=tls.httpx_verify(tracker))
        answer = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PeerError(Reason.NODE_ERROR, f"cannot ask tracker {tracker} for layers: {exc}") from None
    if r.status_code != 200:
        try:
            err = answer["error"]
            reason, message = Reason(err["code"]), str(err.get("message", ""))
        except (KeyError, TypeError, ValueError):
            reason, message = Reason.INVALID_REQUEST, r.text[:200]
        raise CallerError(reason, f"the tracker assigned no layers: {message}")
    try:
        return LayerRange.parse(str(answer["layers"])), answer
    except (KeyError, TypeError, ValueError, CallerError):
        raise PeerError(Reason.NODE_ERROR, f"tracker {tracker} answered an assignment without layers") from None
