"""Ask the tracker which layers to serve (`dgr node --tracker URL --manifest M` without `--layers`).

Before a node loads or fetches anything it needs its layer range; the
tracker knows what the route already covers (dgr.tracker.assign). One
request, before the node's trio services start, signed with the node's key
(and its join token's proof) as its registration will be; a refusal is the
tracker's typed error, passed on.

The node states its memory budget: `--memory SIZE`, or by default
`MEMORY_SHARE` of what Linux reports available (MemAvailable in
/proc/meminfo: free memory plus the caches it can drop). The planner's cost
model already counts the node process itself (LLAMA_CPU_RUNTIME_BYTES); the
rest is headroom for the model's error, libtorrent's buffers and whatever
else the machine runs. `memory_budget` is pure, so it is tested on given
meminfo text; other systems have no /proc/meminfo and must give `--memory`.
"""

from __future__ import annotations

import json
import time

import httpx

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, PeerError, Reason
from dgr.security.auth import JOIN_HEADER, Signer, join_proof
from dgr.security.identity import Identity
from dgr.security.tls import TlsTrust

__all__ = ["ASSIGN_PATH", "MEMINFO", "MEMORY_SHARE", "ask_layers", "memory_budget", "read_memory_budget"]

ASSIGN_PATH = "/v1/assign"
MEMINFO = "/proc/meminfo"
MEMORY_SHARE = 0.8  # of MemAvailable, the default --memory


def memory_budget(meminfo: str) -> tuple[int, int]:
    """The default memory budget from /proc/meminfo's text, and the MemAvailable it is a share of, in bytes.

    Raises:
        CallerError(INVALID_REQUEST): no MemAvailable line (not Linux, or a kernel before 3.14).
    """
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() != "MemAvailable":
            continue
        fields = rest.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1] == "kB":
            available = int(fields[0]) * 1024
            return int(available * MEMORY_SHARE), available
        break
    raise CallerError(Reason.INVALID_REQUEST, "cannot tell this machine's available memory (no MemAvailable in "
                                              f"{MEMINFO}): give --memory SIZE")


def read_memory_budget(path: str | None = None) -> tuple[int, int]:
    """`memory_budget` of this machine (`path`, by default `MEMINFO`).

    Raises:
        CallerError(INVALID_REQUEST): the file cannot be read or has no MemAvailable.
    """
    path = MEMINFO if path is None else path
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot tell this machine's available memory ({exc.strerror}: "
                                                  f"{path}): give --memory SIZE") from None
    return memory_budget(text)


def ask_layers(tracker: str, manifest_id: str, memory_bytes: int, *, context: int, sessions: int,
               gpu_memory_bytes: int = 0, cpu_moe: bool = False, tls: TlsTrust = TlsTrust(),
               identity: Identity | None = None, join_token: bytes | None = None,
               timeout_s: float = 30.0) -> tuple[LayerRange, dict]:
    """The layer range the tracker assigns this node, and its whole answer (with a GPU, its `gpu_layers`).

    Signed with `identity` (and the join token's proof, given `join_token`), as a registration is: a tracker
    with an admission rule answers only a node it would admit.

    Raises:
        CallerError: the tracker refused (an unknown manifest, memory that holds no layer, a node it would not
            admit), with its reason.
        PeerError(NODE_ERROR): the tracker could not be reached or answered nonsense.
    """
    body = {"manifest_id": manifest_id, "memory_bytes": memory_bytes, "context": context, "sessions": sessions}
    if gpu_memory_bytes:
        body |= {"gpu_memory_bytes": gpu_memory_bytes, "cpu_moe": cpu_moe}
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if identity is not None:
        headers |= Signer(identity).headers("POST", ASSIGN_PATH, raw, time.time())
        if join_token is not None:
            headers[JOIN_HEADER] = join_proof(join_token, identity.public, headers["X-Dgr-Signature"])
    try:
        r = httpx.post(tracker.rstrip("/") + ASSIGN_PATH, content=raw, headers=headers, timeout=timeout_s,
                       verify=tls.tracker_verify(tracker))
        answer = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PeerError(Reason.NODE_ERROR, f"cannot ask tracker {tracker} for layers: {exc}") from None
    if r.status_code != 200:
        try:
            err = answer["error"]
            reason, message = Reason(err["code"]), str(err.get("message", ""))
        except (KeyError, TypeError, ValueError):
            reason, message = Reason.INVALID_REQUEST, r.text[:200]
        raise CallerError(reason, f"the tracker assigned no layers: {message} (or give this node --layers A:B)")
    try:
        return LayerRange.parse(str(answer["layers"])), answer
    except (KeyError, TypeError, ValueError, CallerError):
        raise PeerError(Reason.NODE_ERROR, f"tracker {tracker} answered an assignment without layers") from None
