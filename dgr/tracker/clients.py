"""The gateway's clients of its nodes: one pooled `NodeClient` a node, and the calls made to many at once.

Rules:
- One client per node id, made on first use and kept while the node keeps its
  URL and certificate; a node that moved or has a new certificate gets a new
  client, and its old connections are closed in the background.
- `probe` asks nodes whether they live (`/healthz`, answered on a node's event
  loop, never behind compute), all at once, and, given a session, how far
  each got with it (dgr.tracker.blame `Progress`): a node that does not
  answer in time, one the registry no longer holds as alive, and one whose
  answer names another node are silent (left out of the answers). A refused
  or broken connection is asked again within the window: a server at its
  connection cap under a flood turns newcomers away for moments, and the
  inside soak most likely failed an honest session as `route_node_lost`
  that way (once in 3,480).
- `close` closes a session on several nodes at once, bounded in time, and
  says which did not confirm it: the caller owes those a close.

Left out: what a call means for a session (dgr.tracker.admission,
dgr.tracker.gateway) and the wire (dgr.tracker.seam_client).
"""

from __future__ import annotations

from typing import Callable

import attrs
import trio

from dgr.errors import DgrError, Failure, PeerError
from dgr.fsm.route import Hop
from dgr.security.tls import TlsTrust
from dgr.tracker.blame import Progress
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.seam_client import NodeClient

__all__ = ["NodeClients", "CLOSE_S"]

PROBE_RETRY_S = 0.05  # a probe refused at the door tries again this soon, backing off to 8 times it
CLOSE_S = 2.0  # how long closing a session's node sessions may take before the rest are owed


@attrs.define
class NodeClients:
    registry: Registry
    connect: Callable[..., NodeClient] = NodeClient  # (node id, url[, ssl_context]) -> client; tests connect in-process
    tls: TlsTrust = attrs.field(factory=TlsTrust)  # how https nodes are trusted: their registered cert, or a CA
    clients: dict[str, NodeClient] = attrs.field(factory=dict)
    pins: dict[str, str | None] = attrs.field(factory=dict)  # node id -> the certificate its client pins
    nursery: trio.Nursery | None = None  # where replaced clients are closed

    def get(self, hop: Hop | NodeEntry) -> NodeClient:
        node_id, url = hop.node_id, hop.url
        entry = self.registry.nodes.get(node_id)
        pinned = entry.tls_cert if entry is not None and url.startswith("https://") else None
        c = self.clients.get(node_id)
        if c is None or c.url != url or self.pins.get(node_id) != pinned:
            if c is not None and self.nursery is not None:
                self.nursery.start_soon(c.aclose)  # the node moved, or has a new certificate: its old connections go
            if url.startswith("https://"):
                c = self.connect(node_id, url, ssl_context=self.tls.context(pinned))
            else:
                c = self.connect(node_id, url)
            self.clients[node_id] = c
            self.pins[node_id] = pinned
        return c

    def forget(self, node_id: str) -> None:
        client = self.clients.pop(node_id, None)
        self.pins.pop(node_id, None)
        if client is not None and self.nursery is not None:
            self.nursery.start_soon(client.aclose)

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()

    async def probe(self, nodes: list[str], within_s: float, sid: str | None = None,
                    caps: dict[str, str] | None = None) -> dict[str, Progress]:
        """The nodes of `nodes` that answer /healthz within `within_s` (asked all at once, each again after a
        refused or broken connection while the window lasts), each with its progress on session `sid` (asked
        with the session's capability there, from `caps`)."""
        answered: dict[str, Progress] = {}

        async def ask(node_id: str) -> None:
            pause = PROBE_RETRY_S
            while (entry := self.registry.nodes.get(node_id)) is not None and entry.alive:
                try:
                    data = await self.get(entry).probe(sid, (caps or {}).get(node_id))
                except PeerError:
                    # Not silence yet: a server at its connection cap closes a newcomer unread while none of
                    # its guests is idle (dgr.api.gate), which a flood makes for moments at a time, and a
                    # pooled connection idle past its expiry is a newcomer. Silence is no answer in the window.
                    await trio.sleep(pause)
                    pause = min(2 * pause, 8 * PROBE_RETRY_S)
                    continue
                progress = Progress.read(data, node_id)
                if progress is not None:  # else another node answered at its address
                    answered[node_id] = progress
                return

        with trio.move_on_after(within_s):
            async with trio.open_nursery() as nursery:
                for node_id in nodes:
                    nursery.start_soon(ask, node_id)
        return answered

    async def close(self, sid: str, hops: list[Hop | NodeEntry], failure: Failure | None, caps: dict[str, str],
                    keep: tuple[list[str], str] | None = None) -> list[str]:
        """Close `sid` on every one of `hops` at once (keeping `keep`'s prefix where given); the node ids
        that did not confirm it within CLOSE_S."""
        closed: set[str] = set()

        async def one(hop: Hop | NodeEntry) -> None:
            try:
                await self.get(hop).close(sid, failure, caps.get(hop.node_id), keep=keep[0] if keep else None,
                                          tail=keep[1] if keep else "")
                closed.add(hop.node_id)
            except DgrError:
                pass  # owed: reconciliation closes it once the node lists it again

        with trio.move_on_after(CLOSE_S):
            async with trio.open_nursery() as nursery:
                for hop in hops:
                    nursery.start_soon(one, hop)
        return [h.node_id for h in hops if h.node_id not in closed]
