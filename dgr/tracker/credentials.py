"""What the gateway signs a Route Session's calls with: capabilities, relay plans, open tickets.

Per hop, the gateway's own CONTROL capability (open, close with keep,
status, tokenize, steps), which never leaves the gateway; in each node's
relay plan, STEP capabilities for its next hop and, on the tail, for the head
(they let a node send the session's steps there and nothing else), and the
capability the node answers the tracker with, bound to its own id and
layers: DELIVER on the tail (the answers, and reports), REPORT on every
other hop (reports only), so only the tail speaks for the route; and for
each open, a single-use ticket over its exact body (dgr.security.tickets).
Every one issued for a node is bound to the boot nonce its registration
named (`NodeEntry.boot`), so a process of that node started later refuses
it. Without the tracker's key (in-process routes) there are none. Pure but
for two reads: the wall clock, because nodes check expiry against theirs,
and the registry's entries, for each node's boot and the certificate each
next hop registered.

Left out: who the route is (dgr.tracker.routing) and the calls themselves
(dgr.tracker.seam_client).
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from dgr.fsm.route import Hop
from dgr.seam.opening import Loop, NextHop, RelayOrder
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.tickets import issue_ticket
from dgr.tracker.registry import NodeEntry

__all__ = ["Credentials"]


@attrs.frozen
class Credentials:
    authority: CapabilityAuthority | None  # the tracker's key; None: no capabilities, no tickets
    life_s: float  # a capability's life: the session's longest plus a margin for the close after it
    # the registry's entries (shared, not copied): the TLS certificate a node registered is pinned by the node
    # before it on a route
    nodes: dict[str, NodeEntry]

    def boot(self, node_id: str) -> str:
        """The boot nonce `node_id` registered last ("" for a node the registry does not know)."""
        entry = self.nodes.get(node_id)
        return "" if entry is None else entry.boot

    def capabilities(self, sid: str, hops: tuple[Hop, ...]) -> dict[str, str]:
        """The gateway's CONTROL capability for `sid` on each hop; none without an authority."""
        if self.authority is None:
            return {}
        now = time.time()
        return {h.node_id: self.authority.issue(sid, h.node_id, h.start, h.stop, now, ttl_s=self.life_s,
                                                scope=Scope.CONTROL, boot=self.boot(h.node_id)) for h in hops}

    def relay_plans(self, sid: str, hops: tuple[Hop, ...], ignore_eos: bool = False) -> dict[str, RelayOrder]:
        """Each node's relay on the ring: the next hop (none for the tail), the capability it answers the
        tracker with, and on the tail the head to send each next decode step to.

        The capabilities for a next hop are STEP ones: a node may send the session's steps to its next hop
        (and the tail to its head), never open, close or name a prefix there with them. The one for the
        tracker names the node itself: DELIVER on the tail, REPORT elsewhere (dgr.tracker.deliveries).
        """
        now = time.time()
        tail = hops[-1]
        to: dict[str, NextHop] = {}  # node id -> how the node before it on the ring reaches it
        own: dict[str, str | None] = {}  # node id -> its capability for the tracker
        for hop in hops:
            cap = mine = None
            if self.authority is not None:
                boot = self.boot(hop.node_id)
                cap = self.authority.issue(sid, hop.node_id, hop.start, hop.stop, now, ttl_s=self.life_s,
                                           scope=Scope.STEP, boot=boot)
                mine = self.authority.issue(sid, hop.node_id, hop.start, hop.stop, now, ttl_s=self.life_s,
                                            scope=Scope.DELIVER if hop is tail else Scope.REPORT, boot=boot)
            entry = self.nodes.get(hop.node_id)
            to[hop.node_id] = NextHop(hop.node_id, hop.url, cap, None if entry is None else entry.tls_cert)
            own[hop.node_id] = mine
        route = ",".join(h.node_id for h in hops)
        # route and nodes: each node batches one phase group of the route at a time, and the tail holds each
        # next step for its group
        out = {hop.node_id: RelayOrder(to[nxt.node_id], own[hop.node_id], route, len(hops))
               for hop, nxt in zip(hops, hops[1:])}
        out[tail.node_id] = RelayOrder(None, own[tail.node_id], route, len(hops), Loop(to[hops[0].node_id], ignore_eos))
        return out

    def open_ticket(self, sid: str, hop: Hop, body: bytes) -> str | None:
        """The single-use ticket for opening `sid` on `hop` with exactly `body`; None without a key."""
        if self.authority is None or self.authority.identity is None:
            return None
        return issue_ticket(self.authority.identity, sid, hop.node_id, hop.start, hop.stop, body, time.time(),
                            boot=self.boot(hop.node_id))

    def ticketer(self, sid: str, hop: Hop) -> Callable[[bytes], str | None] | None:
        """What signs an open's body for `hop` (NodeClient.open calls it with the bytes it sends)."""
        return None if self.authority is None else lambda body: self.open_ticket(sid, hop, body)
