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
   and the pause's start (dgr.fsm.route). The head's link is dropped.
2. The replacement: the survivors and the spares that hold the lost layers,
   else any route of the same files without the lost nodes
   (dgr.tracker.routing `repair_route`). Slots move with the session: new
   nodes are held, nodes it left are given back.
3. The plan (dgr.tracker.resume): each survivor on the replacement keeps its
   KV; the others' node sessions are closed, the lost node is owed its close
   (dgr.tracker.reconcile), the lane is given back and the old id's
   capabilities are forgotten (a late answer or report of it is refused).
4. The replacement opens under a fresh node-session id (a node opens each id
   once, dgr.security.tickets; the Route Session keeps the id its client
   holds), in waves: each survivor once the hop after it is open, resuming
   its session (its KV renamed, cut to the steps the plan keeps) and sending
   on from its seam journal (dgr.node.journal) what the hop after it lacks:
   everything to a spare after it (which so takes, bit for bit and in the
   same steps, what the lost node took, and computes every position), the
   step it holds past the next survivor's otherwise. A spare opens empty,
   the tail with `sample_from`, the sampler `drawn` tokens in, what is left
   of max_tokens as max_new. ROUTE_REPAIRED, with what each survivor kept.
5. The gateway's driver sends the head what it lacks (a lost head's spare:
   the prompt in chunks and each streamed token as its decode step, from the
   ids the gateway holds) and takes the answer of the step it waited on, the
   next token: the repair's end, and the answer goes on. No survivor computes
   a position again (the one exception: a step past the last token the
   gateway knows, which a lost tail sampled and sent to the head: the head
   drops it and computes it again).
Where the plan cannot be made or its answers break it (a route that started
on a kept prefix, whose positions no journal holds; a journal refused for the
node's budget; a loss in the middle of a repair), every hop of the
replacement opens empty (the survivors' KV freed) and computes every position
(`_reopen`), the answer still exact. A repair waits for room up to
--admission-wait-s, as an open does: for a replacement while its nodes are
full by the gateway's count, then for a hop that refuses its open for room
all the same (dgr.tracker.admission `waits_for_room`). A repair that cannot
finish (no replacement, a refused open, a context too small) fails the
session with the loss's failure; a replacement node lost while it opens is
another loss, repaired in turn while repairs are left.

The pause, as Generation Telemetry splits it: `detect_ms` (the last token to
the loss noticed), `reroute_ms` (the replacement chosen and open: the waves'
round trips, the survivors' queued steps and KV renames), `rebuild_ms` (the
spare computing every position from the journal, while the survivors wait,
to the next token).

A drain (dgr.tracker.drain) is repaired the same way: its failure is
`node_draining` naming the node, the Repair records `drained`, and the
draining node, which still answers, is closed with the survivors rather
than owed its close, and not judged for it.

Left out: noticing the loss (a member's report, the tracker's probe, missed
heartbeats: dgr.tracker.deliveries, dgr.tracker.gateway); driving the
replacement (dgr.tracker.ring); what the nodes do with a resume (dgr.node.sessions).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Callable

import attrs
import trio

from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason
from dgr.seam.opening import AdoptRequest
from dgr.fsm.opening import Known, plan as plan_trip
from dgr.fsm.route import RouteEvent, RouteState
from dgr.security.auth import CapabilityAuthority
from dgr.tracker.admission import Admission
from dgr.tracker.clients import NodeClients
from dgr.tracker.live import GatewayConfig, LiveSession
from dgr.tracker.opening import Bounds
from dgr.tracker.registry import Registry
from dgr.tracker.resume import Rebuild, ResumePlan, check_resumed, plan_resume
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
            try:
                failure, again = await self._replace(live, failure)
            except Exception as exc:  # a fault in one session's repair ends that session, not the gateway (as _run)
                log.error("route session %s: its repair crashed", live.rs.sid, exc_info=exc)
                return Failure(Reason.INTERNAL, f"repair error: {exc!r}"[:300], node=failure.node,
                               phase=live.rs.state.value)
            if failure is None or not again:
                return failure
        return self.unrepaired(failure, why)

    async def _replace(self, live: LiveSession, failure: Failure) -> tuple[Failure | None, bool]:
        """Move `live` onto a replacement for the node `failure` names: (None, False) once it is open; (the
        failure that ends the session, False); or (a replacement node's loss, True)."""
        rs, lost, drained = live.rs, failure.node, failure.reason is Reason.NODE_DRAINING
        phase, answered, old_sid, old_caps, old_route = rs.state.value, live.answered(), live.node_sid, live.caps, rs.route
        live.publish(RouteEvent.NODE_LOST, rs.node_lost(lost, trio.current_time(), drained))
        log.log(logging.INFO if drained else logging.WARNING, "route session %s %s node %s in %s after %d token(s): "
                "repairing", rs.sid, "drained from" if drained else "lost", lost, rs.repairs[-1].phase, rs.generated)
        deadline = trio.current_time() + self.config.admission_wait_s
        while True:
            try:
                # the node lost now; one lost before is avoided while dead, and may serve again once it is back
                # (a restarted node registers under its id): excluding every id ever lost left a range with none
                choice = repair_route(self.registry.alive(), live.nodes, frozenset({lost}),
                                      trusted=self.registry.trusted_ends, rng=self.admission.rng)
                break
            except CallerError as exc:  # the nodes that hold its layers are full: wait for a slot, as an open does
                if trio.current_time() >= deadline:
                    await self._leave(live, lost, drained)
                    return self.unrepaired(failure, exc.message), False
                await self.admission.until_freed(deadline)
            except PeerError as exc:
                await self._leave(live, lost, drained)
                return self.unrepaired(failure, exc.message), False
        ends = [pos0 + len(ids) for _, pos0, ids, _ in live.steps(live.chunk_size(self.config))]
        start = rs.prefix_reused if live.steps_from is None else live.steps_from
        plan = (plan_resume(old_route, choice.hops, frozenset({lost}), old_sid, ends, answered, start, phase)
                if old_sid is not None else "its route's sessions are closed already")
        await self._leave(live, lost, drained, keep=plan.orders if isinstance(plan, ResumePlan) else {})
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
        bounds = Bounds(sampling, context, left, info.vocab_size, None)
        if isinstance(plan, ResumePlan):
            why = await self._resume(live, choice, plan, bounds, ids, old_sid, old_caps)
            if why is None:
                return None, False
            if isinstance(why, Failure):
                return why, True
            plan = why
        log.warning("route session %s: every hop of its replacement computes every position (%s)", rs.sid, plan)
        return await self._reopen(live, failure, choice, bounds, ids, deadline)

    async def _resume(self, live: LiveSession, choice, plan: ResumePlan, bounds: Bounds, ids: list[int],
                      old_sid: str, old_caps: dict[str, str]) -> Failure | str | None:
        """Open the replacement keeping the survivors' KV (dgr.tracker.resume): None once it is open; a
        replacement node's loss; or why it did not go on (what opened is closed, the survivors' KV with it)."""
        rs, sid = live.rs, uuid.uuid4().hex
        opening = self.admission.opening(live.request, rs, choice, bounds, sid=sid, speculate=False)
        opening.resume, opening.sample_from = plan.orders, plan.sample_from
        why: str | Failure | None = None
        self._expect(live, sid, choice.hops)
        try:
            await opening.trip(plan_trip(Known.IDS, False, len(choice.hops) == 1), live.request.prompt_body(), ids,
                               AdoptRequest(), plan.waves)
        except DgrError as exc:
            why = exc.failure(phase=rs.state.value) if exc.reason is Reason.ROUTE_NODE_LOST and exc.details.get(
                "node") else f"a survivor did not resume: {exc.message}"
        rebuild = check_resumed(plan, choice.hops, opening.resumed) if why is None else why
        if not isinstance(rebuild, Rebuild):
            self.routes.pop(sid, None)
            live.opening_route = None
            await self.admission.abandon(opening, Failure(Reason.CANCELLED, "the repair rebuilds every position"))
            with trio.CancelScope(shield=True):  # survivors whose session did not move: it goes, as if left
                await self.clients.close(old_sid, [h for h in choice.hops if h.node_id in plan.orders
                                                   and h.node_id not in opening.resumed], None, old_caps)
            return rebuild
        self._opened(live, opening, sid, rebuild)
        kept = tuple((n, a.positions) for n, a in opening.resumed.items())
        total = len(ids)
        live.publish(RouteEvent.ROUTE_REPAIRED, live.rs.route_repaired(choice.hops, 0, total, trio.current_time(),
                                                                        kept=kept))
        log.info("route session %s repaired onto %s (node session %s), its survivors' KV kept (%s): %d positions, "
                 "the head sent steps from %d, answers from step %d", rs.sid, ", ".join(h.node_id for h in choice.hops),
                 sid, ", ".join(f"{n} {p}" for n, p in kept), total, rebuild.feed_from, rebuild.answer_from)
        return None

    async def _reopen(self, live: LiveSession, failure: Failure, choice, bounds: Bounds, ids: list[int],
                      deadline: float) -> tuple[Failure | None, bool]:
        """Open the replacement with every hop empty: it computes every position the route needs. A hop that
        refuses for room is waited for until `deadline` (trio's clock), as an open waits (Admission
        `waits_for_room`)."""
        rs = live.rs
        while True:
            sid = uuid.uuid4().hex  # each try under a fresh id: a node opens each id once (dgr.security.tickets)
            offered, offer = self.admission.offer(ids, live.prefix_root)
            opening = self.admission.opening(live.request, rs, choice, bounds, sid=sid, speculate=False)
            # in decode the tail answers the last token's step alone: the steps before were answered on the lost
            # route
            opening.sample_from = len(ids) - 1 if live.fed else 0
            self._expect(live, sid, choice.hops)
            try:
                await opening.trip(plan_trip(Known.IDS, False, len(choice.hops) == 1), live.request.prompt_body(),
                                   ids, offer)
                break
            except DgrError as exc:
                self.routes.pop(sid, None)
                live.opening_route = None
                await self.admission.abandon(opening, exc.failure(phase=rs.state.value))
                if exc.reason is Reason.ROUTE_NODE_LOST and exc.details.get("node"):
                    return exc.failure(phase=rs.state.value), True
                if (until := self.admission.waits_for_room(exc, deadline)) is None:
                    return self.unrepaired(failure, f"the replacement route did not open: {exc.message}"), False
                log.info("route session %s: %s; its repair waits for room", rs.sid, exc.message)
            await self.admission.until_freed(until)
        # the route starts at what every hop holds; its steps from there, the answers from the last token's
        reused = min([offered, *opening.held.values()]) if live.prefix_root is not None else 0
        live.steps_from = reused
        steps = live.steps(live.chunk_size(self.config))
        self._opened(live, opening, sid, Rebuild(0, len(steps) - 1 if live.fed else 0))
        live.publish(RouteEvent.ROUTE_REPAIRED, rs.route_repaired(choice.hops, reused, len(ids), trio.current_time()))
        log.info("route session %s repaired onto %s (node session %s): %d of %d positions to compute", rs.sid,
                 ", ".join(h.node_id for h in choice.hops), sid, len(ids) - reused, len(ids))
        return None, False

    def _expect(self, live: LiveSession, sid: str, hops: tuple) -> None:
        """Take the replacement's answers under its id from before its opens: a fresh hop computes what a
        survivor's journal sends it while the later waves still open, and its tail delivered them into a 404
        (an unknown session) before, which ended its answers' link: the route then stalled until its deadline."""
        live.inbox = trio.open_memory_channel(math.inf)  # nothing of the lost route's may reach the new one
        live.opening_route = (sid, hops)
        self.routes[sid] = live

    def _opened(self, live: LiveSession, opening, sid: str, rebuild: Rebuild) -> None:
        """`live` goes on on `opening`'s node sessions, driven from `rebuild` (its answers since `_expect`)."""
        live.node_sid, live.caps, live.phases, live.rebuild = sid, opening.caps, opening.board, rebuild
        live.answered_at = live.allowance = live.opening_route = None
        live.answered_seq = rebuild.answer_from - 1 if rebuild.answer_from else None
        self.routes[sid] = live

    async def _leave(self, live: LiveSession, lost: str, drained: bool = False,
                     keep: dict[str, object] | None = None) -> None:
        """End the lost route's node sessions: close the survivors' (but those in `keep`, which a repair resumes),
        owe the lost node's (close a `drained` one's: it still answers), give the lane back."""
        sid, rs = live.node_sid, live.rs
        if sid is None:  # a repair closed them already, and its replacement never opened
            return
        if live.head is not None:
            await live.head.drop()
            live.head = None
        survivors = [h for h in rs.route if (h.node_id != lost or drained) and h.node_id not in (keep or {})]
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
