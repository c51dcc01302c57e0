"""The node registry: who serves which layers of which model, and who is alive.

Pure bookkeeping with time passed in. A node is alive while its last
heartbeat is younger than `dead_after_s`; past that it is dead and routes
through it fail (the gateway watches `sweep`). A node that registers again
(it restarted) replaces its old entry and is alive again.

A node may claim a Model Artifact (a manifest id and, optionally, the
address it seeds it on). Each registration starts the claim's proof afresh:
PENDING until the tracker's challenges (dgr.tracker.proofs) pass or fail.
A node without a claim is UNCLAIMED, routable unless the registry requires
proofs, in which case it is FAILED at once. Only `routable` nodes are routed.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dgr.backends.base import ModelInfo
from dgr.errors import CallerError, Reason

__all__ = ["NodeEntry", "Registry", "ProofState", "ProofStatus"]


class ProofState(enum.Enum):
    """Where a node's layer-possession proof stands. Values appear in GET /v1/nodes."""

    UNCLAIMED = "none"  # no manifest claimed: routable unless proofs are required
    PENDING = "pending"  # claimed, challenges not finished: not routable yet
    PASSED = "passed"  # every challenge held: routable
    FAILED = "failed"  # a challenge failed, or the claim cannot be checked: never routable


# The only moves: a claim's challenges end once, in PASSED or FAILED. A new
# registration makes a new entry (and a new claim) instead of moving back.
_PROOF_MOVES: dict[ProofState, frozenset[ProofState]] = {
    ProofState.UNCLAIMED: frozenset(),
    ProofState.PENDING: frozenset({ProofState.PASSED, ProofState.FAILED}),
    ProofState.PASSED: frozenset(),
    ProofState.FAILED: frozenset(),
}


@attrs.define
class ProofStatus:
    state: ProofState = ProofState.UNCLAIMED
    reason: str | None = None  # wire code of a failure: proof_failed, artifact_mismatch, ...
    message: str = ""
    verdict: str | None = None  # dgr.artifact.proof.Verdict value of the deciding challenge, if one decided
    challenges: int = 0  # challenges that passed
    seconds: float | None = None  # time the challenges took

    @property
    def routable(self) -> bool:
        return self.state in (ProofState.UNCLAIMED, ProofState.PASSED)

    def finish(self, state: ProofState, message: str, *, reason: str | None = None, verdict: str | None = None,
               challenges: int = 0, seconds: float | None = None) -> bool:
        """Record the claim's verdict; False (and nothing changes) if it already had one."""
        if state not in _PROOF_MOVES[self.state]:
            return False
        self.state, self.message, self.reason, self.verdict = state, message, reason, verdict
        self.challenges, self.seconds = challenges, seconds
        return True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value, "challenges": self.challenges}
        if self.message:
            out["message"] = self.message
        if self.reason is not None:
            out["reason"] = self.reason
        if self.verdict is not None:
            out["verdict"] = self.verdict
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 4)
        return out


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

    @property
    def routable(self) -> bool:
        return self.alive and self.proof.routable

    def load(self) -> float:
        return self.reserved / max(self.capacity, 1)

    def full(self) -> bool:
        return self.reserved >= self.capacity

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
            "sessions": self.sessions,
            "kv_bytes": self.kv_bytes,
            "alive": self.alive,
            "pid": self.pid,
            "heartbeat_age_s": round(now - self.last_seen, 3),
            "manifest_id": self.manifest_id,
            "seed": self.seed,
            "proof": self.proof.to_json(),
            "routable": self.routable,
            "describe": self.describe,
        }


@attrs.define
class Registry:
    dead_after_s: float = 1.0
    nodes: dict[str, NodeEntry] = attrs.field(factory=dict)
    require_proof: bool = False  # nodes without a Model Artifact claim are not routed

    def register(self, data: dict[str, Any], now: float) -> NodeEntry:
        """Raises: CallerError(INVALID_REQUEST) on a malformed registration."""
        try:
            model = ModelInfo.from_json(data["model"])
            start, stop = (int(x) for x in data["layers"])
            entry = NodeEntry(
                node_id=str(data["node"]),
                url=str(data["url"]),
                start=start,
                stop=stop,
                backend=str(data["backend"]),
                model=model,
                capacity=int(data["capacity"]),
                describe=dict(data.get("describe") or {}),
                registered_at=now,
                last_seen=now,
                pid=int(data["pid"]) if data.get("pid") is not None else None,
            )
            artifact = data.get("artifact")
            if artifact is not None:
                entry.manifest_id = str(artifact["manifest_id"])
                entry.seed = str(artifact["seed"]) if artifact.get("seed") else None
        except (KeyError, TypeError, ValueError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"bad registration: {exc}") from None
        if not (0 <= entry.start < entry.stop <= model.n_layers):
            raise CallerError(Reason.INVALID_REQUEST, f"layers {start}:{stop} outside [0, {model.n_layers})")
        if entry.manifest_id is not None:
            entry.proof = ProofStatus(ProofState.PENDING, message="challenges not finished")
        elif self.require_proof:
            entry.proof = ProofStatus(
                ProofState.FAILED,
                reason=Reason.PROOF_FAILED.value,
                message="this tracker routes only nodes that prove their layers: start the node with --manifest",
            )
        self.nodes[entry.node_id] = entry
        return entry

    def heartbeat(self, data: dict[str, Any], now: float) -> NodeEntry:
        """Raises: CallerError(NOT_FOUND) for a node that must register (again)."""
        entry = self.nodes.get(str(data.get("node")))
        if entry is None or not entry.alive:
            raise CallerError(Reason.NOT_FOUND, f"node {data.get('node')!r} is not registered")
        entry.last_seen = now
        entry.sessions = int(data.get("sessions", 0))
        entry.kv_bytes = int(data.get("kv_bytes", 0))
        return entry

    def mark_dead(self, node_id: str) -> None:
        entry = self.nodes.get(node_id)
        if entry is not None:
            entry.alive = False

    def sweep(self, now: float) -> list[str]:
        """Mark nodes whose heartbeats stopped; return the ids that just died."""
        died = []
        for entry in self.nodes.values():
            if entry.alive and now - entry.last_seen > self.dead_after_s:
                entry.alive = False
                died.append(entry.node_id)
        return died

    def alive(self) -> list[NodeEntry]:
        return [n for n in self.nodes.values() if n.alive]

    def seeders(self, manifest_id: str) -> list[NodeEntry]:
        """Live nodes that proved layers of the manifest and seed it, by node id."""
        return sorted(
            (n for n in self.alive() if n.manifest_id == manifest_id and n.seed and n.proof.state is ProofState.PASSED),
            key=lambda n: n.node_id,
        )
