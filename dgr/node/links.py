"""The node's links: the relays a ring session's results leave by, and a ring tail's phase groups.

Rules:
- A session opened with a relay plan sends its results on along its route (dgr.node.relay) instead of
  back to the caller; a ring's tail also holds a loop relay back to the head, or a `SelfLoop` where
  the ring is this node alone (no link to itself).
- A ring tail holds its next steps for their phase group (dgr.node.ringphases) and sends them to the
  head through the session's loop relay.
- `detach` closes a session's relays and leaves its phase group; it is safe to call for any id.
- The route's count of sessions open here (`on_route`) sizes one phase group's decode rows
  (`group_rows`), as the gateway and a ring's tail cut them (dgr.fsm.phases).

Left out: the stream itself (dgr.node.relay, dgr.seam) and the connection pools (the node's `pool`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import attrs
import trio

from dgr.errors import CallerError, Reason
from dgr.node.relay import Outgoing, Relay, RelayPlan, SelfLoop
from dgr.node.ringphases import RingPhases
from dgr.node.draft import DraftModel
from dgr.node.speculation import SpecPlan, TailSpec
from dgr.seam.stream import Record
from dgr.seam.transport import ConnectionPool

__all__ = ["NodeLinks"]


@attrs.define
class NodeLinks:
    """Ring sessions' relays, their tails' loops back to the head, and their phase groups."""

    node_id: str
    pool: Callable[..., ConnectionPool]  # (url[, pinned cert]) -> the node's pooled connections to it
    accept_streamed: Callable[[str, Record], None]  # the node's reader of stream records (a ring of one)
    relays: dict[str, Relay] = attrs.field(factory=dict)  # sid -> its relay on (every session has one)
    loops: dict[str, Relay | SelfLoop] = attrs.field(factory=dict)  # a ring's tail: sid -> its way back to the head
    on_route: collections.Counter = attrs.field(factory=collections.Counter)  # route -> its sessions open here
    ring: RingPhases = attrs.field(init=False)  # a ring's tail: its steps to the head, held for their phase group
    spec: dict[str, TailSpec] = attrs.field(factory=dict)  # a ring's tail: sid -> its drafts and verdicts
    exact: set[str] = attrs.field(factory=set)  # sessions whose steps compute one position at a time
    draft: DraftModel | None = None  # the tail's draft model (`--draft-model`), for sessions that ask for it
    nursery: trio.Nursery | None = None  # the node's, while it runs: relays run in it

    def __attrs_post_init__(self) -> None:
        self.ring = RingPhases(self._loop_send)

    def attach(self, sid: str, relay: RelayPlan, lane: int | None, spec: SpecPlan | None = None) -> None:
        """Start `sid`'s relay (and a ring tail's loop back to the head) in the node's nursery; with `spec`,
        its steps may carry drafts, which a ring's tail makes and verifies (dgr.node.speculation).

        Raises:
            CallerError(INTERNAL): the node is not running.
        """
        if self.nursery is None:
            raise CallerError(Reason.INTERNAL, f"{self.node_id} is not running")
        # a ring of this node alone has no link to itself, and its answers give way to no step
        alone = relay.loop is not None and relay.loop.head.node == self.node_id
        r = self.relays[sid] = Relay(sid, self.node_id, relay, self.pool, defer=relay.loop is not None and not alone)
        self.nursery.start_soon(r.run)
        self.on_route[relay.route] += 1
        if spec is not None and spec.exact:
            self.exact.add(sid)
        if relay.loop is None:
            return
        if spec is not None:
            self.spec[sid] = TailSpec.for_plan(sid, spec, self.draft)
        if alone:
            self.loops[sid] = SelfLoop(sid, self.node_id, self.accept_streamed, r)
        else:
            back = RelayPlan(relay.loop.head, relay.deliver_url, relay.deliver_capability)
            loop = self.loops[sid] = Relay(sid, self.node_id, back, self.pool)
            self.nursery.start_soon(loop.run)
        if relay.route:
            self.ring.join(sid, relay.route, relay.nodes, lane)

    def detach(self, sid: str) -> TailSpec | None:
        """Close `sid`'s relays and leave its phase group (nothing where it had none); its speculation, if it
        had one, for the caller to close in the scheduler's thread."""
        relay = self.relays.get(sid)
        if relay is not None:
            self.on_route[relay.plan.route] -= 1
            if self.on_route[relay.plan.route] <= 0:
                del self.on_route[relay.plan.route]
        for relays in (self.relays, self.loops):
            relay = relays.pop(sid, None)
            if relay is not None:
                relay.close()
        spec = self.spec.pop(sid, None)
        self.exact.discard(sid)
        self.ring.leave(sid)
        return spec

    def group_rows(self, plan: RelayPlan) -> int | None:
        """The decode steps of one phase group of `plan`'s route: its sessions open here, cut into one group
        per node as the gateway and a ring's tail cut them (dgr.fsm.phases). None on a one-node route."""
        if plan.nodes < 2:
            return None
        return max(1, math.ceil(self.on_route[plan.route] / plan.nodes))

    def _loop_send(self, sid: str, step: bytes) -> None:
        loop = self.loops.get(sid)
        if loop is not None:
            loop.put(Outgoing(step, ()))  # the head is the first hop of the next step
