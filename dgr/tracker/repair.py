"""Repair: a Route Session that loses a node goes on, on a replacement route (issue 54, `--resume`).

Whether (`Repairer.refusal`): only with `--resume`; only a node loss
(`route_node_lost` naming the node); only while the session prefills,
decodes or is being repaired; at most `max_repairs` times a session; and only
where the continuation is exact: greedy, or sampling with a seed (the new
tail's sampler goes on `drawn` tokens into the seeded stream, dgr.sampling),
and no speculation (a speculating tail's drafts are its own state, which is
not carried). Anything else fails as before, with the loss's structured
failure, which then says why it was not repaired: the founding rule stays
the default.

How (`Repairer.repair`), driven by dgr.tracker.gateway:
1. NODE_LOST: the Route Session is repairing; its `Repair` records the node
   and the pause's start (dgr.fsm.route).
2. The lost route's node sessions end: the link to its head is dropped, the
   survivors are closed (their KV freed, see below), the lost node is owed its
   close (dgr.tracker.reconcile), the lane is given back, and the old id's
   capabilities are forgotten (a late answer or report of it is refused).
3. The replacement: the survivors and the spares that hold the lost layers,
   else any route of the same files without the lost nodes
   (dgr.tracker.routing `repair_route`). Slots move with the session: new
   nodes are held, nodes it left are given back.
4. It opens in one trip (dgr.fsm.opening: the ids are known) under a fresh
   node-session id (a node opens each id once, dgr.security.tickets; the
   Route Session keeps the id its client holds), with the prompt and every
   token streamed as its ids, what is left of max_tokens as max_new (so every
   hop stops where the lost route would have), the sampler `drawn` tokens in,
   and the prompt's prefix offered to every hop: the route starts at what all
   its hops hold. ROUTE_REPAIRED.
5. The gateway's driver then runs the replacement's prefill from there
   (dgr.tracker.live `LiveSession.chunks`: the prompt in chunks, each token
   already fed one a step, as decode computed them), whose answer is the next
   token: the repair's end, and the answer goes on.
A repair that cannot finish (no replacement, a refused open, a context too
small) fails the session with the loss's failure; a replacement node lost
while it opens is another loss, repaired in turn while repairs are left.

A drain (dgr.tracker.drain) is repaired the same way: its failure is
`node_draining` naming the node, the Repair records `drained`, and the
draining node, which still answers, is closed with the survivors rather
than owed its close, and not judged for it.

Left out: noticing the loss (a member's report, the tracker's probe, missed
heartbeats: dgr.tracker.deliveries, dgr.tracker.gateway); driving the
replacement (dgr.tracker.ring); and any KV for the replacement but computing
it again. A survivor's KV would be reused only where every hop of the
replacement held as much (a route starts at the smallest prefix any hop
holds), and a spare holds none of a live session's, so the survivors' KV is
freed, not kept, and every hop of the replacement computes every position.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Callable

import attrs
import trio

from dgr.errors import DgrError, Failure, PeerError, Reason
from dgr.fsm.opening import Known, plan
from dgr.fsm.route import RouteEvent, RouteState
from dgr.security.auth import CapabilityAuthority
from dgr.tracker.admission import Admission
from dgr.tracker.clients import NodeClients
from dgr.tracker.live import GatewayConfig, LiveSession
from dgr.tracker.opening import Bounds
from dgr.tracker.registry import Registry
from dgr.tracker.routing import repair_route

__all__ = ["Repairer"]

log = logging.getLogger("dgr.gateway")

_REPAIRABLE = (RouteState.PREFILL, RouteState.DECODE, RouteState.REPAIRING)
_CAUSES = (Reason.ROUTE_NODE_LOST, Reason.NODE_DRAINING)  # a node lost, or draining (dgr.tracker.drain)


@attrs.define
class Repairer:
    registry: Registry
    config: GatewayConfig
    admission: Admission
    clients: NodeClients
    routes: dict[str, LiveSession]  # node-session id -> its live session (the gateway's: shared, not copied)
    owe_close: Callable[[str, str], None]  # (node id, node-session id): it may hold it; close it when it is back
    authority: CapabilityAuthority | None = None

    def refusal(self, live: LiveSession, failure: Failure) -> str | None:
        """Why `failure` ends `live` rather than being repaired; None: it is repaired."""
        rs, sampling = live.rs, live.request.sampling
        if not self.config.resume:
            return "the tracker does not repair routes (dgr tracker --resume)"
        if failure.reason not in _CAUSES or failure.node is None:
            return "not a node loss"
        if rs.state not in _REPAIRABLE:
            return f"lost in {rs.state.value}"
        if len(rs.repairs) >= self.config.max_repairs:
            return f"its {len(rs.repairs)} repair(s) reached --max-repairs {self.config.max_repairs}"
        if sampling.temperature != 0.0 and sampling.seed is None:
            return "sampled without a seed, its answer cannot be continued exactly"
        if live.speculates:
            return "a speculating session's drafts are not carried, its answer cannot be continued exactly"
        return None

    def unrepaired(self, failure: Failure, why: str) -> Failure:
        """`failure` as it ends the session: where repair is on and it is a loss, saying why it was not repaired."""
        if not self.config.resume or failure.reason not in _CAUSES:
            return failure
        return attrs.evolve(failure, message=f"{failure.message}; not repaired: {why}"[:500])

    async def repair(self, live: LiveSession, failure: Failure) -> Failure | None:
        """`failure` stopped `live`'s route: None once a replacement route is open and the driver may run it;
        else the failure that ends the session (`unrepaired`). A replacement node lost while it opens is a
        loss of its own, repaired in turn while `refusal` allows."""
        while (why := self.refusal(live, failure)) is None:
            failure, again = await self._replace(live, failure)
            if failure is None or not again:
                return failure
        return self.unrepaired(failure, why)

    async def _replace(self, live: LiveSession, failure: Failure) -> tuple[Failure | None, bool]:
        """Move `live` onto a replacement for the node `failure` names: (None, False) once it is open; (the
        failure that ends the session, False); or (a replacement node's loss, True)."""
        rs, lost, drained = live.rs, failure.node, failure.reason is Reason.NODE_DRAINING
        live.publish(RouteEvent.NODE_LOST, rs.node_lost(lost, trio.current_time(), drained))
        log.log(logging.INFO if drained else logging.WARNING, "route session %s %s node %s in %s after %d token(s): "
                "repairing", rs.sid, "drained from" if drained else "lost", lost, rs.repairs[-1].phase, rs.generated)
        await self._leave(live, lost, drained)
        try:
            # the node lost now; one lost before is avoided while dead, and may serve again once it is back (a
            # restarted node registers under its id): excluding every id ever lost left a range with no node
            choice = repair_route(self.registry.alive(), live.nodes, frozenset({lost}),
                                  trusted=self.registry.trusted_ends, rng=self.admission.rng)
        except PeerError as exc:
            return self.unrepaired(failure, exc.message), False
        self._move_slots(live, choice.nodes)
        info = choice.nodes[0].model
        context = min([info.context_length, *(n.max_positions for n in choice.nodes)])
        ids, left = live.prompt + live.fed, live.max_tokens - len(live.fed)
        if len(ids) + left > context:
            return self.unrepaired(failure, f"the replacement route has {context} positions a session, "
                                            f"{len(ids) + left} needed"), False
        sampling = live.request.sampling
        if sampling.temperature != 0.0:  # the seeded stream goes on where the lost tail's was
            sampling = attrs.evolve(sampling, drawn=rs.generated)
        sid = uuid.uuid4().hex
        opening = self.admission.opening(live.request, rs, choice, Bounds(sampling, context, left, info.vocab_size,
                                                                          None), sid=sid, speculate=False)
        offered, offer = self.admission.offer(ids, live.prefix_root)
        try:
            await opening.trip(plan(Known.IDS, False, len(choice.hops) == 1), live.request.prompt_body(), ids,
                               offer)
        except DgrError as exc:
            await self.admission.abandon(opening, exc.failure(phase=rs.state.value))
            if exc.reason is Reason.ROUTE_NODE_LOST and exc.details.get("node"):
                return exc.failure(phase=rs.state.value), True
            return self.unrepaired(failure, f"the replacement route did not open: {exc.message}"), False
        reused = min([offered, *opening.held.values()]) if live.prefix_root is not None else 0
        live.node_sid, live.caps, live.phases, live.rebuild_from = sid, opening.caps, opening.board, reused
        live.inbox = trio.open_memory_channel(math.inf)  # nothing of the lost route's may reach the new one
        live.answered_at = live.answered_seq = live.allowance = None
        self.routes[sid] = live
        live.publish(RouteEvent.ROUTE_REPAIRED, rs.route_repaired(choice.hops, reused, len(ids), trio.current_time()))
        log.info("route session %s repaired onto %s (node session %s): %d of %d positions to compute", rs.sid,
                 ", ".join(h.node_id for h in choice.hops), sid, len(ids) - reused, len(ids))
        return None, False

    async def _leave(self, live: LiveSession, lost: str, drained: bool = False) -> None:
        """End the lost route's node sessions: close the survivors', owe the lost node's (close a `drained` one's:
        it still answers), give the lane back."""
        sid, rs = live.node_sid, live.rs
        if sid is None:  # a repair closed them already, and its replacement never opened
            return
        if live.head is not None:
            await live.head.drop()
            live.head = None
        survivors = [h for h in rs.route if h.node_id != lost or drained]
        moved = Failure(Reason.CANCELLED, f"the route lost node {lost}: the session goes on on a repaired route")
        with trio.CancelScope(shield=True):  # closed whatever comes: a close cut short would hold their KV
            for node_id in [*([] if drained else [lost]), *await self.clients.close(sid, survivors, moved, live.caps)]:
                self.owe_close(node_id, sid)
        if live.phases is not None:
            self.admission.leave(live.phases, sid)
            live.phases = None
        entry = self.registry.nodes.get(lost)
        if entry is not None and not drained:  # a drain is no fault
            entry.faulted()
        self.routes.pop(sid, None)
        if self.authority is not None:
            self.authority.forget(sid)
        live.node_sid = None

    def _move_slots(self, live: LiveSession, nodes: tuple) -> None:
        """The session's slots move to `nodes`: held on the nodes new to it, given back on those it left."""
        before, after = {id(n) for n in live.nodes}, {id(n) for n in nodes}
        self.admission.hold(tuple(n for n in nodes if id(n) not in before), trio.current_time())
        self.admission.release(tuple(n for n in live.nodes if id(n) not in after))
        live.nodes = nodes
