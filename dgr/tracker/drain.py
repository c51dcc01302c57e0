"""A draining node's sessions handed over to spares (issue 54): a rolling restart costs a pause, not an answer.

A node stopped with SIGTERM says `draining` in its heartbeats (dgr.node.drain);
the registry makes it DRAINING (dgr.tracker.entry `Role`): nothing new is
routed to it, and a spare may become a member in its place
(dgr.tracker.spares). Then, for each live session on it (`Drains.handover`,
at each of its heartbeats and at each of the gateway's sweeps, so a session
whose open raced the drain is handed over too):
- with `--resume`, where the repair would be exact and allowed
  (dgr.tracker.repair `Repairer.refusal`) and a replacement for its layers
  exists now (dgr.tracker.routing `repair_route`, the draining node left
  out): its driver is told `node_draining` naming the node, and repairs the
  route as for a loss, through the same `Repairer`: the survivors and the
  draining node are closed (it still answers, so nothing is owed), the
  replacement opens and rebuilds, and the answer goes on. The repair records
  a drain (`Repair.drained`), and the node is not judged for it (no strike,
  no trust taken back: `NodeEntry.faulted` is for losses);
- otherwise it is left to end on the draining node, which waits for it up
  to its `--drain-s`.
A session is handed over once (by its node-session id); one in routing or
already repairing is looked at again at the next sweep.

Left out: the repair itself (dgr.tracker.repair), and the node's side.
"""

from __future__ import annotations

import logging

import attrs

from dgr.errors import Failure, PeerError, Reason
from dgr.fsm.route import RouteState
from dgr.tracker.entry import Role
from dgr.tracker.live import LiveSession
from dgr.tracker.repair import Repairer
from dgr.tracker.routing import repair_route

__all__ = ["Drains"]

log = logging.getLogger("dgr.gateway")

_HANDED_OVER_IN = (RouteState.PREFILL, RouteState.DECODE)  # the states whose driver waits on the route's answers


@attrs.define
class Drains:
    repairer: Repairer
    routes: dict[str, LiveSession]  # node-session id -> its live session (the gateway's: shared, not copied)
    handed: set[str] = attrs.field(factory=set)  # node-session ids told to move: each is told once

    def sweep(self) -> None:
        """Hand over what can be of every draining node's sessions."""
        for entry in list(self.repairer.registry.nodes.values()):
            if entry.alive and entry.role is Role.DRAINING:
                self.handover(entry.node_id)

    def handover(self, node_id: str) -> int:
        """Tell the driver of each of `node_id`'s sessions that can move now to repair it away (see the module);
        the sessions being handed over."""
        registry = self.repairer.registry
        entry = registry.nodes.get(node_id)
        self.handed &= set(self.routes)  # a repaired session runs under a fresh id: the old one is done with
        if entry is None or entry.role is not Role.DRAINING:
            return 0
        moving = 0
        for sid, live in list(self.routes.items()):
            rs = live.rs
            if rs.ended or not any(h.node_id == node_id for h in rs.route):
                continue
            if sid in self.handed:
                moving += 1
                continue
            failure = Failure(Reason.NODE_DRAINING, f"node {node_id} drains: the session moves to a spare",
                              node=node_id, phase=rs.state.value)
            if rs.state not in _HANDED_OVER_IN or self.repairer.refusal(live, failure) is not None:
                continue
            try:
                repair_route(registry.alive(), live.nodes, frozenset({node_id}),
                             trusted=registry.trusted_ends, rng=self.repairer.admission.rng)
            except PeerError as exc:  # no spare: it ends on the draining node
                log.info("route session %s stays on draining node %s: %s", rs.sid, node_id, exc.message)
                continue
            self.handed.add(sid)
            live.inbox[0].send_nowait(failure)  # the step its driver waits on fails, and it repairs
            log.info("route session %s handed over from draining node %s after %d token(s)", rs.sid, node_id,
                     rs.generated)
            moving += 1
        return moving
