"""Closes the gateway owes: sessions that may still hold KV on a node it could not close them on.

A close may not reach a node: the node was declared lost (it may only have
been slow), an open's reply never came, a close failed or timed out. The
gateway remembers each (node, session) here (`owe`). Each heartbeat lists the
sessions a node holds, and `due` says which remembered ones to close now: those
a live node still reports holding, one close per pair at a time. A pair is
forgotten once closed, or after `ttl_s` (nodes idle sessions out anyway).
Sessions the gateway never opened are never touched.

Pure bookkeeping with time passed in; the gateway runs the closes
(Gateway.reconcile).
"""

from __future__ import annotations

import attrs

from dgr.tracker.registry import NodeEntry

__all__ = ["OwedCloses"]


@attrs.define
class OwedCloses:
    ttl_s: float = 600.0
    unclosed: dict[tuple[str, str], float] = attrs.field(factory=dict)  # (node, session) -> since: a close owed
    closing: set[tuple[str, str]] = attrs.field(factory=set)  # (node, session) closes in flight

    def owe(self, node_id: str, sid: str, now: float) -> None:
        """`sid` may still hold KV on `node_id`."""
        self.unclosed.setdefault((node_id, sid), now)

    def due(self, now: float, nodes: dict[str, NodeEntry]) -> list[tuple[NodeEntry, str]]:
        """The closes to start now, each marked in flight; stale ones forgotten."""
        out = []
        for key, since in sorted(self.unclosed.items()):
            node_id, sid = key
            if now - since > self.ttl_s:
                del self.unclosed[key]
                continue
            entry = nodes.get(node_id)
            if entry is None or not entry.alive or sid not in entry.held or key in self.closing:
                continue
            self.closing.add(key)
            out.append((entry, sid))
        return out

    def closed(self, node_id: str, sid: str) -> None:
        self.unclosed.pop((node_id, sid), None)

    def settled(self, entry: NodeEntry, sid: str) -> None:
        """A close ended, done or not: until the node's next heartbeat says otherwise, take it as closed."""
        self.closing.discard((entry.node_id, sid))
        entry.held = entry.held - {sid}
