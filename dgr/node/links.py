"""The node's links: the relays a ring session's results leave by, a ring tail's phase groups, and the one
record a node session's facts live in.

Rules:
- Everything the node holds for one session is one `NodeSessionRecord`, the value of the node's one
  session table (dgr.sessions): its state machine (dgr.fsm.node), sampler, prompt ids, offered marks,
  lane, relays, speculation and phase-group hold. A step's path looks the session up once and reads it
  all there; `detach` closes what it owns, so nothing of a session outlives it in a table of its own.
- Every session sends its results on along its ring (dgr.node.relay); a ring's tail also holds a loop
  relay back to the head, or a `SelfLoop` where the ring is this node alone (no link to itself).
- A ring tail holds its next steps for their phase group (`RingPhases`, below) and sends them to the
  head through the session's loop relay.
- `detach` closes a session's relays and leaves its phase group; it is safe to call once for any record.
- The route's count of sessions open here (`on_route`) sizes one phase group's decode rows
  (`group_rows`), as the gateway and a ring's tail cut them (dgr.fsm.phases).

Phase groups (`RingPhases`, `Hold`): a ring tail's decode steps go back to the head in groups of
consecutive lanes.

Why: on a chain the gateway holds each session's next decode step until every
decoding session of its phase group has its token (dgr.fsm.phases), so a
group reaches every node as one pass over consecutive sequence ids. On a ring
the steps never pass the gateway: the tail sends them to the head. Without a
hold, 8 sessions on a 2-node SmolLM2 ring decoded at 0.924x the chain's rate
(paired rounds, 0.79x to 1.01x); with it, at 0.977x (0.91x to 1.14x). So the
tail holds them instead, by the same rules and the same pure board
(`RoutePhases`, from the tracker's module: it is pure and shared), keyed by
the route the gateway names in the session's relay plan; lanes are the ones the
gateway gave at open.

Phase-group rules:
- A session's step waits until its group is complete, or at most `hold_for`
  its round trip since its last step went out, after which it goes alone (it
  only costs speed); a later step waits again.
- A session that sends no next step (its last token, end of generation), or
  that ends here, stops counting for its group, which may then go.
- Steps go out through the session's loop relay, in the order they are released.

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
from dgr.fsm.phases import RoutePhases, hold_for
from dgr.fsm.node import NodeSession
from dgr.node.relay import Outgoing, Relay, RelayPlan, SelfLoop
from dgr.node.draft import DraftModel
from dgr.node.journal import Journal
from dgr.node.speculation import SpecPlan, TailSpec
from dgr.sampling import Sampler
from dgr.seam.stream import Record
from dgr.seam.transport import ConnectionPool

__all__ = ["Hold", "NodeLinks", "NodeSessionRecord", "RingPhases"]


@attrs.define(eq=False)
class Hold:
    """One session's place in its phase groups: on its node session record (dgr.node.sessions), not in a
    table of the ring's keyed by session, so it goes when the session does (`RingPhases` finds a released
    session's record in the node's session table)."""

    route: str | None = None  # its route's board; None: it holds nothing back (not a ring's tail)
    step: bytes | None = None  # its next step, waiting for its group
    wake: trio.Event | None = None  # what ends its hold early
    last: float | None = None  # when its last step went out (trio clock)


@attrs.define(eq=False)
class RingPhases:
    """A ring tail's phase groups: each route's board, and its sessions' steps held on their records (their
    `Hold`), found through the node's one session table, and sent to the head through their loop relays."""

    find: Callable[[str], NodeSessionRecord | None]  # sid -> its record, while the node holds it
    boards: dict[str, RoutePhases] = attrs.field(factory=dict)  # route -> its board
    released: int = 0  # steps sent with their group
    alone: int = 0  # steps sent alone, after their hold

    def join(self, rec: NodeSessionRecord, route: str, nodes: int) -> None:
        """A ring tail's session of `route` (of `nodes` nodes) joins its board, in the lane the gateway gave it."""
        board = self.boards.get(route)
        if board is None:
            board = self.boards[route] = RoutePhases(max(1, nodes))
        board.join(rec.fsm.sid, rec.lane)
        rec.hold.route = route

    def go(self, rec: NodeSessionRecord, step: bytes | None, nursery: trio.Nursery) -> None:
        """`rec`'s session has its token: its next `step` is sent now with its group, or held (a bounded wait in
        `nursery`); None: it sends no more steps (its last token), and its group may go without it."""
        sid, hold = rec.fsm.sid, rec.hold
        board = self.boards.get(hold.route) if hold.route is not None else None
        if board is None:
            if step is not None:
                rec.loop.put(Outgoing(step, ()))  # the head is the first hop of the next step
        elif step is None:
            self._release(board.stop(sid))
        else:
            hold.step = step
            out = board.arrive(sid)
            if sid in out:
                self._release(out)
                return
            wake = hold.wake = trio.Event()
            nursery.start_soon(self._hold, rec, wake, hold_for(trio.current_time(), hold.last))

    def leave(self, rec: NodeSessionRecord) -> None:
        """`rec`'s session ended here: its lane is free, a step it held is dropped."""
        hold = rec.hold
        route, hold.route, hold.step, hold.last = hold.route, None, None, None
        wake, hold.wake = hold.wake, None
        if wake is not None:
            wake.set()
        board = self.boards.get(route) if route is not None else None
        if board is None:
            return
        self._release(board.leave(rec.fsm.sid))
        if not board.lanes:
            del self.boards[route]

    def _release(self, sids: list[str]) -> None:
        for sid in sids:
            rec = self.find(sid)
            if rec is None:
                continue
            hold = rec.hold
            step, hold.step = hold.step, None
            wake, hold.wake = hold.wake, None
            if wake is not None:
                wake.set()
            if step is not None:
                self.released += 1
                hold.last = trio.current_time()  # its session's next hold counts from here
                rec.loop.put(Outgoing(step, ()))

    async def _hold(self, rec: NodeSessionRecord, wake: trio.Event, hold_s: float) -> None:
        hold = rec.hold
        with trio.move_on_after(hold_s):
            await wake.wait()
        if hold.wake is not wake:
            return  # released with its group, or ended
        hold.wake = None
        board = self.boards.get(hold.route) if hold.route is not None else None
        if board is not None:
            board.withdraw(rec.fsm.sid)
        step, hold.step = hold.step, None
        if step is not None:
            self.alone += 1
            hold.last = trio.current_time()  # its session's next hold counts from here
            rec.loop.put(Outgoing(step, ()))


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
    done: int = -1  # the last step it computed and sent on (the tracker's probe asks: dgr.tracker.blame)
    journal: Journal | None = None  # a non-tail's frames sent on, for a repair (dgr.node.journal); None: none kept
    # a ring tail's: a repaired route's steps that end at or before this position were answered on the lost
    # route, so the tail computes them (its KV) but samples, answers and loops none of them
    sample_from: int = 0


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
        self.ring = RingPhases(self.find)

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
            self.ring.join(rec, relay.route, relay.nodes)

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
        self.ring.leave(rec)
        spec, rec.spec = rec.spec, None
        return spec

    def group_rows(self, plan: RelayPlan) -> int | None:
        """The decode steps of one phase group of `plan`'s route: its sessions open here, cut into one group
        per node as the gateway and a ring's tail cut them (dgr.fsm.phases). None on a one-node route."""
        if plan.nodes < 2:
            return None
        return max(1, math.ceil(self.on_route[plan.route] / plan.nodes))
