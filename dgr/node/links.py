"""The node's links: the relays a ring session's results leave by, a ring tail's phase groups, and the one
record a node session's facts live in.

Rules:
- Everything the node holds for one session is one `NodeSessionRecord`, the value of the node's one
  session table (dgr.sessions): its state machine (dgr.fsm.node), sampler, prompt ids, offered marks,
  lane, relays, speculation and phase-group hold. A step's path looks the session up once and reads it
  all there; `detach` closes what it owns, so nothing of a session outlives it in a table of its own.
- A session opened with a relay plan sends its results on along its route (dgr.node.relay) instead of
  back to the caller; a ring's tail also holds a loop relay back to the head, or a `SelfLoop` where
  the ring is this node alone (no link to itself).
- A ring tail holds its next steps for their phase group (dgr.node.ringphases) and sends them to the
  head through the session's loop relay.
- `detach` closes a session's relays and leaves its phase group; it is safe to call once for any record.
- The route's count of sessions open here (`on_route`) sizes one phase group's decode rows
  (`group_rows`), as the gateway and a ring's tail cut them (dgr.fsm.phases).

Left out: the stream itself (dgr.node.relay, dgr.seam) and the connection pools (the node's `pool`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import attrs
import numpy as np
import trio

from dgr.errors import CallerError, Reason
from dgr.fsm.node import NodeSession
from dgr.node.relay import Outgoing, Relay, RelayPlan, SelfLoop
from dgr.node.ringphases import Hold, RingPhases
from dgr.node.draft import DraftModel
from dgr.node.speculation import SpecPlan, TailSpec
from dgr.sampling import Sampler
from dgr.seam.stream import Record
from dgr.seam.transport import ConnectionPool

__all__ = ["NodeLinks", "NodeSessionRecord"]


@attrs.define(eq=False)
class NodeSessionRecord:
    """One node session: its state machine and everything the node holds for it, from open to its KV freed."""

    fsm: NodeSession
    lane: int | None = None  # the sequence slot the gateway gave it (dgr.fsm.phases); its KV opens on it
    sampler: Sampler | None = None  # the tail's
    prompt: np.ndarray | None = None  # a head's: the ids it tokenized the prompt into at open
    offered: bytes = b""  # the marks its open (or adopt) offered, to name its KV if it is kept (dgr.node.prefix)
    relay: Relay | None = None  # its results' way on; None while its open has not finished
    loop: Relay | SelfLoop | None = None  # a ring's tail: its way back to the head
    spec: TailSpec | None = None  # a ring's tail: its drafts and verdicts
    exact: bool = False  # its steps compute one position at a time
    hold: Hold = attrs.field(factory=Hold)  # a ring's tail: its next step, held for its phase group


@attrs.define
class NodeLinks:
    """Ring sessions' relays, their tails' loops back to the head, and their phase groups."""

    node_id: str
    pool: Callable[..., ConnectionPool]  # (url[, pinned cert]) -> the node's pooled connections to it
    accept_streamed: Callable[[str, Record], None]  # the node's reader of stream records (a ring of one)
    find: Callable[[str], NodeSessionRecord | None]  # sid -> its record, while the node holds it
    on_route: collections.Counter = attrs.field(factory=collections.Counter)  # route -> its sessions open here
    ring: RingPhases = attrs.field(init=False)  # a ring's tail: its steps to the head, held for their phase group
    draft: DraftModel | None = None  # the tail's draft model (`--draft-model`), for sessions that ask for it
    nursery: trio.Nursery | None = None  # the node's, while it runs: relays run in it

    def __attrs_post_init__(self) -> None:
        self.ring = RingPhases(self._loop_send)

    def attach(self, rec: NodeSessionRecord, relay: RelayPlan, spec: SpecPlan | None = None) -> None:
        """Start a session's relay (and a ring tail's loop back to the head) in the node's nursery; with `spec`,
        its steps may carry drafts, which a ring's tail makes and verifies (dgr.node.speculation).

        Raises:
            CallerError(INTERNAL): the node is not running.
        """
        if self.nursery is None:
            raise CallerError(Reason.INTERNAL, f"{self.node_id} is not running")
        sid = rec.fsm.sid
        # a ring of this node alone has no link to itself, and its answers give way to no step
        alone = relay.loop is not None and relay.loop.head.node == self.node_id
        r = rec.relay = Relay(sid, self.node_id, relay, self.pool, defer=relay.loop is not None and not alone)
        self.nursery.start_soon(r.run)
        self.on_route[relay.route] += 1
        rec.exact = spec is not None and spec.exact
        if relay.loop is None:
            return
        if spec is not None:
            rec.spec = TailSpec.for_plan(sid, spec, self.draft)
        if alone:
            rec.loop = SelfLoop(sid, self.node_id, self.accept_streamed, r)
        else:
            back = RelayPlan(relay.loop.head, relay.deliver_url, relay.deliver_capability)
            loop = rec.loop = Relay(sid, self.node_id, back, self.pool)
            self.nursery.start_soon(loop.run)
        if relay.route:
            self.ring.join(sid, rec.hold, relay.route, relay.nodes, rec.lane)

    def detach(self, rec: NodeSessionRecord) -> TailSpec | None:
        """Close what a session's record holds open: its relays, its place in its route's count and phase group
        (nothing where it had none); its speculation, if it had one, for the caller to close in the scheduler's
        thread (with its KV)."""
        if rec.relay is not None:
            route = rec.relay.plan.route
            self.on_route[route] -= 1
            if self.on_route[route] <= 0:
                del self.on_route[route]
            rec.relay.close()
        if rec.loop is not None:
            rec.loop.close()
        self.ring.leave(rec.fsm.sid, rec.hold)
        spec, rec.spec = rec.spec, None
        return spec

    def group_rows(self, plan: RelayPlan) -> int | None:
        """The decode steps of one phase group of `plan`'s route: its sessions open here, cut into one group
        per node as the gateway and a ring's tail cut them (dgr.fsm.phases). None on a one-node route."""
        if plan.nodes < 2:
            return None
        return max(1, math.ceil(self.on_route[plan.route] / plan.nodes))

    def _loop_send(self, sid: str, step: bytes) -> None:
        rec = self.find(sid)
        if rec is not None and rec.loop is not None:
            rec.loop.put(Outgoing(step, ()))  # the head is the first hop of the next step
