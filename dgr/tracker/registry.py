"""The node registry: who serves which layers of which model, and who is alive.

Pure bookkeeping with time passed in. A node is alive while its last
heartbeat is younger than `dead_after_s`; past that it is dead and routes
through it fail (the gateway watches `sweep`). A node that registers again
(it restarted) replaces its old entry and is alive again.
"""

from __future__ import annotations

from typing import Any

import attrs

from dgr.backends.base import ModelInfo
from dgr.errors import CallerError, Reason

__all__ = ["NodeEntry", "Registry"]


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
    reserved: int = 0  # sessions the gateway has placed but the node has not reported yet
    alive: bool = True
    pid: int | None = None  # for local tooling (dgr up, the test harness); never trusted for routing

    def load(self) -> float:
        return (max(self.sessions, self.reserved)) / max(self.capacity, 1)

    def full(self) -> bool:
        return max(self.sessions, self.reserved) >= self.capacity

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
            "describe": self.describe,
        }


@attrs.define
class Registry:
    dead_after_s: float = 1.0
    nodes: dict[str, NodeEntry] = attrs.field(factory=dict)

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
        except (KeyError, TypeError, ValueError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"bad registration: {exc}") from None
        if not (0 <= entry.start < entry.stop <= model.n_layers):
            raise CallerError(Reason.INVALID_REQUEST, f"layers {start}:{stop} outside [0, {model.n_layers})")
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
        entry.reserved = min(entry.reserved, entry.sessions)
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
