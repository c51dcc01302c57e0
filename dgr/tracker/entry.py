"""One node's entry in the registry: what it registered, what it last reported, and what the tracker trusts it with.

Pure bookkeeping, no I/O and no clock: the registry (dgr.tracker.registry)
makes and updates entries, routing (dgr.tracker.routing) reads them.

What it is trusted with: a declared capacity is a claim, so the tracker
routes to a node at once only as many sessions as it has been seen to carry
(`limit`, from PROVEN_START), halved for each strike (dgr.tracker.blame);
routing weighs its sessions by its strikes (`load`).

Its `role` (issue 54): a MEMBER is routed first; a SPARE holds layers that
members already cover and is kept idle while members have room, for a
repair to move a session onto (dgr.tracker.spares decides which, by layers
alone); a DRAINING node is stopping (SIGTERM): no new session is routed to
it, and its live ones are handed over (dgr.tracker.drain). A node that
registers again starts over as what its layers make it.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dgr.fsm.proof import ProofStatus
from dgr.seam.types import DeviceMemory, ModelInfo
from dgr.security.identity import key_text
from dgr.tracker.blame import Standing

__all__ = ["NodeEntry", "Role", "PROVEN_START"]

# Sessions a node is trusted with at once before it has carried that many: a declared capacity is a
# claim, so the tracker starts here and doubles it each time the node ends a session well while
# holding that many (halves it when the node is lost mid-session). A real node's slots (llama.cpp's
# n_seq_max, 4 by default) are usually below it, so only a claim above 16 is ever held back.
PROVEN_START = 16


class Role(enum.Enum):
    MEMBER = "member"  # routed to
    SPARE = "spare"  # its layers are covered by members: kept idle while they have room, taken first by a repair
    DRAINING = "draining"  # stopping: routed nothing new, its live sessions handed over (terminal for the entry)


@attrs.define
class NodeEntry:
    node_id: str
    url: str
    start: int
    stop: int
    backend: str
    model: ModelInfo
    capacity: int
    describe: dict[str, Any]
    registered_at: float
    last_seen: float
    sessions: int = 0  # as the node last reported
    kv_bytes: int = 0
    # Sessions this gateway holds on the node: taken before its opens, given back once its close
    # is done. Capacity is judged by it, not by heartbeats, which lag a closed session by a beat
    # and would refuse the next client a slot the node has already freed.
    reserved: int = 0
    alive: bool = True
    pid: int | None = None  # for local tooling (dgr up, the test harness); never trusted for routing
    manifest_id: str | None = None  # the Model Artifact the node claims to hold layers [start, stop) of
    seed: str | None = None  # HOST:PORT where it seeds that artifact over BitTorrent
    proof: ProofStatus = attrs.field(factory=ProofStatus)
    max_positions: int = 0  # positions per session the node allocates (--ctx); 0 until set from the model
    held: frozenset[str] = frozenset()  # session ids the node held at its last heartbeat
    # the last block keys of the prefixes it kept (dgr.node.prefix), as of its last registration or heartbeat
    prefixes: frozenset[str] = frozenset()
    # its accelerators' memory as of its last heartbeat (none: a CPU node), or why that heartbeat's were dropped
    devices: tuple[DeviceMemory, ...] = ()
    devices_dropped: str | None = None
    dead_since: float | None = None
    key: bytes = b""  # the Ed25519 public key that signed its registration: only it may speak for the node
    tls_cert: str | None = None  # PEM of the node's TLS certificate, pinned for https calls to it
    proven: int = PROVEN_START  # sessions at once the tracker has seen it carry (see PROVEN_START)
    routed_at: float = 0.0  # when a route last took it (its registration until then): routes take turns
    # its process's boot nonce (signed registration): what its capabilities and tickets are bound to
    boot: str = ""
    standing: Standing = attrs.field(factory=Standing)  # its timeouts (the registry's, shared across registrations)
    turns: int = 0  # sessions routed to it (from the busiest peer's count at registration): routes take turns
    wants_spare: bool = False  # it asked to be a spare (`dgr node --spare`): a member only where no other covers
    role: Role = Role.MEMBER  # set by dgr.tracker.spares `settle` from the live entries' layers

    def __attrs_post_init__(self) -> None:
        self.routed_at = max(self.routed_at, self.registered_at)
        if self.max_positions <= 0:
            self.max_positions = self.model.context_length

    @property
    def routable(self) -> bool:
        return self.alive and self.proof.routable and not self.standing.banned and self.role is not Role.DRAINING

    def limit(self) -> int:
        """Sessions the tracker routes to it at once: its capacity (bounded at registration), as far as proven,
        halved for each strike it holds (at least one)."""
        return max(1, min(self.capacity, self.proven) >> len(self.standing.strikes))

    @property
    def load(self) -> int:
        """Its sessions as routing weighs them: doubled, plus one, for each strike it holds, so a node with
        one strike is chosen as if it held 2n + 1 (an idle one as if it held one)."""
        return ((self.reserved + 1) << len(self.standing.strikes)) - 1

    def full(self) -> bool:
        return self.reserved >= self.limit()

    def served(self) -> None:
        """A session it carried ended well, while `reserved` sessions (this one too) were on it."""
        if self.reserved >= self.proven:
            self.proven = min(2 * self.proven, max(self.capacity, PROVEN_START))

    def faulted(self) -> None:
        """It was lost in the middle of a session: trust it with fewer at once."""
        self.proven = max(PROVEN_START, self.proven // 2)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "node": self.node_id,
            "url": self.url,
            "layers": f"{self.start}:{self.stop}",
            "backend": self.backend,
            "model": self.model.name,
            "digest": self.model.digest,
            "n_layers": self.model.n_layers,
            "capacity": self.capacity,
            "limit": self.limit(),
            "sessions": self.sessions,
            "kv_bytes": self.kv_bytes,
            "devices": [d.to_json() for d in self.devices],
            "devices_dropped": self.devices_dropped,
            "prefixes": len(self.prefixes),
            "alive": self.alive,
            "pid": self.pid,
            "heartbeat_age_s": round(now - self.last_seen, 3),
            "max_positions": self.max_positions,
            "manifest_id": self.manifest_id,
            "seed": self.seed,
            "proof": self.proof.to_json(),
            "routable": self.routable,
            "role": self.role.value,
            "strikes": len(self.standing.strikes),
            "banned_s": None if self.standing.banned_until is None else round(self.standing.banned_until - now, 1),
            "key": key_text(self.key) if self.key else None,
            "tls": self.tls_cert is not None,
            "boot": self.boot,
            "describe": self.describe,
        }
