"""The Gateway: Route Sessions from request to done or failed.

Theory of operation:
- `open` runs in the request handler: admission (dgr.tracker.admission)
  chooses the route, tokenizes at the head, checks the limits and opens one
  node session per hop. Anything wrong there is raised to the handler before a
  response starts, so the client gets a plain 4xx/5xx. Then the session's
  driver starts in the gateway's own nursery and the handler only reads its
  output channel.
- The driver (`_drive`) is one loop whatever the route's shape: the prompt's
  prefill through the topology driver (dgr.tracker.ring, the `Driver`
  protocol), then, token by token, the text out to the client and the stop
  rule (dgr.fsm.stop `next_step`), asking the driver for the answer to the
  step whose number the last answer handed over. Every Route Session event
  goes to its telemetry and to the accounting (dgr.tracker.accounting).
- Failure: a node's transport error, a refused step, a missed deadline, a
  member's report (dgr.tracker.deliveries) or the registry declaring a node
  dead (its heartbeats stopped) fails the session with a structured reason
  naming node, phase and step. A deadline tells a slow node from a dead one
  (dgr.tracker.patience): only a node's silence to the tracker's own probe
  fails the session as `route_node_lost` and marks it dead, so new routes
  avoid it. A node that answers but holds a step past its deadline is blamed
  for it (a strike in the registry, dgr.tracker.blame); once the session's
  one budget of extensions is spent it fails `session_timeout` naming that
  node. Survivors are told to drop the session's KV (shielded, bounded).
- Repair (`--resume`): a `route_node_lost`, however it was noticed, or a
  node's drain (dgr.tracker.drain, at each sweep), moves the session to a
  replacement route where dgr.tracker.repair allows, and the loop runs that
  route from its rebuild on: the client's stream goes on.
- A client that goes away cancels its session: reason `cancelled`, KV freed.
  Limits (`_watch_sessions`, LiveSession.over_limit) fail a session past
  `max_session_s`, a stream whose reader stalled or never started; each
  frees the session's KV on every node.
- Authorization: with the tracker's key (`authority`), every call for a
  session carries a capability, relay plans carry STEP capabilities and each
  open a single-use ticket (dgr.tracker.credentials). Only the tail delivers
  answers, each checked against its token id (dgr.tracker.deliveries).
- Reconciliation (dgr.tracker.reconcile): a close that may not have reached a
  node (a node declared lost, an open whose reply never came, a close that
  failed) is owed; `reconcile` closes it as soon as the node's heartbeat lists
  the session again. Sessions this gateway never opened are left alone.
- Prefix reuse: a session that ends normally closes with the chain of its
  KV's whole blocks and the marks of its positions after them (its prompt,
  and by default its answer, see LiveSession.kv_keep), so its nodes may keep
  that KV for the next turn, and admission prefers that route for a prompt
  that extends it.
- Pruning: a node dead past the registry's `forget_after_s` loses its entry,
  pooled connections, hop stats and metric labels.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import attrs
import trio

from dgr.api.openai import GenerationRequest
from dgr.errors import DgrError, Failure, PeerError, Reason, first_dgr_error
from dgr.fsm.route import RouteEvent, RouteSession, RouteState
from dgr.fsm.stop import next_step
from dgr.metrics import device_gauges, gauge
from dgr.seam.frame import TokenResult
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.tls import TlsTrust
from dgr.tracker.accounting import Accounting
from dgr.tracker.admission import Admission
from dgr.tracker.clients import NodeClients
from dgr.tracker.credentials import Credentials
from dgr.tracker.deliveries import Deliveries
from dgr.tracker.drain import Drains
from dgr.tracker.entry import Role
from dgr.tracker.live import Delta, GatewayConfig, LiveSession
from dgr.tracker.patience import Patience
from dgr.tracker.pieces import Vocabularies
from dgr.tracker.reconcile import OwedCloses
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.repair import Repairer
from dgr.tracker.ring import Driver, Ring
from dgr.tracker.telemetry import Broadcast

__all__ = ["Gateway", "GatewayConfig", "LiveSession", "Delta"]  # the last three from dgr.tracker.live

log = logging.getLogger("dgr.gateway")


@attrs.define
class Gateway:
    registry: Registry
    config: GatewayConfig = attrs.field(factory=GatewayConfig)
    authority: CapabilityAuthority | None = None  # the tracker's key; None (in-process tests): no capabilities
    tls: TlsTrust = attrs.field(factory=TlsTrust)  # how https nodes are trusted: their registered cert, or a CA
    # each model's token bytes by digest (dgr.tracker.pieces): the tail's answers are checked against them
    vocabularies: Vocabularies = attrs.field(factory=Vocabularies.builtin)
    sessions: dict[str, LiveSession] = attrs.field(factory=dict)  # by the Route Session's id, the one clients hold
    # by the id of their node sessions, the one nodes deliver and report under: a repaired session's is fresh
    routes: dict[str, LiveSession] = attrs.field(factory=dict)
    accounting: Accounting = attrs.field(init=False)
    clients: NodeClients = attrs.field(init=False)
    patience: Patience = attrs.field(init=False)
    credentials: Credentials = attrs.field(init=False)  # what it signs a session's calls with
    admission: Admission = attrs.field(init=False)
    deliveries: Deliveries = attrs.field(init=False)
    driver: Driver = attrs.field(init=False)
    repairer: Repairer = attrs.field(init=False)
    drains: Drains = attrs.field(init=False)  # draining nodes' sessions handed over (dgr.tracker.drain)
    owed: OwedCloses = attrs.field(init=False)
    _nursery: trio.Nursery | None = None

    def __attrs_post_init__(self) -> None:
        cfg = self.config
        self.accounting = Accounting(keep_ended=cfg.keep_ended)
        self.accounting.metrics.watch(self._gauges)
        self.clients = NodeClients(self.registry, tls=self.tls)
        self.patience = Patience(self.clients.probe, cfg.slow_cap, strike=self._strike)
        self.owed = OwedCloses(cfg.unclosed_ttl_s)
        # a capability outlives the longest session by a margin, for the close after it
        self.credentials = Credentials(self.authority, (cfg.max_session_s or 24 * 3600.0) + cfg.capability_margin_s,
                                       self.registry.nodes)
        self.admission = Admission(self.registry, cfg, self.clients, self.patience, self.credentials, self.owe_close,
                                   self.accounting)
        self.deliveries = Deliveries(self.routes, self.clients, self.node_lost, self._strike, self.authority,
                                     self.vocabularies)
        self.driver = Ring(cfg, self.clients, self.patience, self.accounting)
        self.repairer = Repairer(self.registry, cfg, self.admission, self.clients, self.routes, self.owe_close,
                                 self.authority)
        self.drains = Drains(self.repairer, self.routes)

    # what tests and views read of the parts
    # in-process routes set it, to reach their nodes' apps
    connect = property(lambda self: self.clients.connect, lambda self, c: setattr(self.clients, "connect", c))

    metrics = property(lambda self: self.accounting.metrics)
    hop_stats = property(lambda self: self.accounting.hop_stats)
    ended = property(lambda self: self.accounting.ended)
    slow_waits = property(lambda self: self.patience.extended, doc="deadlines extended for slow nodes")

    def _strike(self, node_id: str, why: str = "held a step past its deadline") -> None:
        """A late step blamed on a node (dgr.tracker.blame), or a member caught sending what it may not
        (dgr.tracker.deliveries): its standing in the registry pays for it."""
        log.warning("node %s %s", node_id, why)
        self.registry.strike(node_id, trio.current_time())

    def _gauges(self):
        states = collections.Counter(live.rs.state for live in self.sessions.values())
        yield gauge("dgr_route_sessions_active", "Active Route Sessions by state", ["state"],
                    [([s.value], float(states.get(s, 0))) for s in RouteState
                     if s not in (RouteState.DONE, RouteState.FAILED)])
        nodes = list(self.registry.nodes.values())
        yield gauge("dgr_node_up", "1 while the node heartbeats, else 0", ["node", "layers"],
                    [([n.node_id, f"{n.start}:{n.stop}"], float(n.alive)) for n in nodes])
        yield gauge("dgr_node_sessions", "Sessions a node reported holding", ["node"],
                    [([n.node_id], float(n.sessions)) for n in nodes])
        yield gauge("dgr_node_kv_bytes", "Hot KV State bytes a node reported", ["node"],
                    [([n.node_id], float(n.kv_bytes)) for n in nodes])
        yield from device_gauges(["node"], [([n.node_id], d) for n in nodes for d in n.devices])

    # -- service --------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the drivers' nursery and watch node liveness until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self.clients.nursery = self.patience.nursery = self.deliveries.nursery = nursery
                nursery.start_soon(self._watch_nodes)
                nursery.start_soon(self._watch_sessions)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.clients.aclose()

    async def _watch_nodes(self) -> None:
        while True:
            await trio.sleep(self.config.sweep_s)
            now = trio.current_time()  # the registry's clock
            for node_id in self.registry.sweep(now):
                self.node_lost(node_id, f"heartbeats stopped for {self.registry.dead_after_s:g}s (node dead or hung)")
            self.drains.sweep()
            for entry in self.registry.forget(now):
                self.clients.forget(entry.node_id)
                self.accounting.forget_node(entry.node_id)
            self.reconcile()

    async def _watch_sessions(self) -> None:
        while True:
            await trio.sleep(self.config.sweep_s)
            self.enforce_limits(trio.current_time())

    def enforce_limits(self, now: float) -> list[str]:
        """Fail sessions past `max_session_s`, cancel streams stalled past `slow_client_s` (LiveSession.over_limit);
        return their ids."""
        hit = []
        for live in list(self.sessions.values()):
            failure = None if live.rs.ended else live.over_limit(self.config, now)
            if failure is not None:
                live.abort(failure)
                hit.append(live.rs.sid)
        return hit

    def node_lost(self, node_id: str, why: str) -> None:
        """Mark the node dead and fail its sessions, or have their drivers repair them (dgr.tracker.repair).
        Their KV there is closed once it heartbeats again."""
        drained = node_id in self.registry.nodes and self.registry.nodes[node_id].role is Role.DRAINING
        log.log(logging.INFO if drained else logging.WARNING, "node %s %s: %s", node_id,
                "drained, and gone" if drained else "lost", why)  # a drained node leaves as it said it would
        self.registry.mark_dead(node_id, trio.current_time())
        for live in list(self.sessions.values()):  # a replacement that opens is judged by its own hops
            hops = live.opening_route[1] if live.opening_route is not None else live.rs.route
            if any(h.node_id == node_id for h in hops):
                failure = Failure(Reason.ROUTE_NODE_LOST, f"lost node {node_id}: {why}", node=node_id,
                                  phase=live.rs.state.value)
                if self.repairer.refusal(live, failure) is None:
                    live.inbox[0].send_nowait(failure)  # the step its driver waits on fails, and it repairs
                else:
                    live.abort(failure)

    # -- owed closes (dgr.tracker.reconcile) ----------------------------------------
    def owe_close(self, node_id: str, sid: str) -> None:
        """Remember that `sid` may still hold KV on `node_id`: `reconcile` closes it there."""
        self.owed.owe(node_id, sid, trio.current_time())

    @property
    def unclosed(self) -> dict[tuple[str, str], float]:
        return self.owed.unclosed

    def reconcile(self) -> list[tuple[str, str]]:
        """Start the owed closes of sessions that live nodes report holding; returns the (node, session) closes
        started. Each runs in the gateway's nursery, at most one per pair at a time; a failed one is tried
        again after the node's next heartbeat."""
        if self._nursery is None:
            return []
        started = []
        for entry, sid in self.owed.due(trio.current_time(), self.registry.nodes):
            started.append((entry.node_id, sid))
            self._nursery.start_soon(self._close_orphan, entry, sid)
        return started

    async def _close_orphan(self, entry: NodeEntry, sid: str) -> None:
        try:
            cap = None
            if self.authority is not None:
                cap = self.authority.issue(sid, entry.node_id, entry.start, entry.stop, time.time(),
                                           ttl_s=self.config.capability_margin_s, scope=Scope.CONTROL, boot=entry.boot)
            failure = Failure(Reason.CANCELLED, "the tracker no longer runs this Route Session", node=entry.node_id)
            with trio.move_on_after(self.config.step_deadline_s):
                await self.clients.get(entry).close(sid, failure, cap)
                self.owed.closed(entry.node_id, sid)
                log.info("closed orphaned session %s on %s", sid, entry.node_id)
        except DgrError as exc:
            log.info("could not close orphaned session %s on %s: %s", sid, entry.node_id, exc.message)
        finally:
            self.owed.settled(entry, sid)

    # -- sessions ---------------------------------------------------------------
    async def open(self, req: GenerationRequest, scope: str = "") -> LiveSession:
        """Admit `req` (dgr.tracker.admission) and start its driver; with --resume, a node lost while the route
        opens is routed around (declared lost, the open tried again, `max_repairs` times). Raises what admission
        raises."""
        if self._nursery is None:
            raise PeerError(Reason.INTERNAL, "the gateway is not running")
        for again in range(self.config.max_repairs if self.config.resume else 0, -1, -1):
            try:
                live = await self.admission.open(req, scope)
                break
            except PeerError as exc:  # nothing was streamed yet: the client need not see a loss it can be spared
                if not again or exc.reason is not Reason.ROUTE_NODE_LOST or not exc.details.get("node"):
                    raise
                self.node_lost(exc.details["node"], f"while a route opened: {exc.message}")
        self.sessions[live.rs.sid] = live
        self.routes[live.node_sid] = live
        self._nursery.start_soon(self._drive, live)
        return live

    def cancel(self, sid: str, why: str) -> None:
        live = self.sessions.get(sid)
        if live is not None and not live.rs.ended:
            live.abort(Failure(Reason.CANCELLED, why, phase=live.rs.state.value))

    def lookup(self, sid: str) -> RouteSession | None:
        return self.sessions[sid].rs if sid in self.sessions else self.accounting.ended.get(sid)

    def telemetry(self, sid: str) -> Broadcast | None:
        return self.sessions[sid].telemetry if sid in self.sessions else None

    def models(self) -> dict[str, list[NodeEntry]]:
        out: dict[str, list[NodeEntry]] = {}
        for n in self.registry.alive():
            out.setdefault(n.model.name, []).append(n)
        return out

    # -- the driver: one loop --------------------------------------------------------
    async def _drive(self, live: LiveSession) -> None:
        """Run the session's route to its end; a lost node's route is repaired where dgr.tracker.repair allows."""
        rs = live.rs
        failure: Failure | None = None
        try:
            with live.scope:
                failure = await self._run(live)
                while failure is not None and (failure := await self.repairer.repair(live, failure)) is None:
                    failure = await self._run(live)  # the replacement route, from its rebuild on
            if failure is None and live.scope.cancelled_caught:
                # cancelled from outside: a node died (registry) or the client went away
                failure = rs.pending or Failure(Reason.CANCELLED, "cancelled", phase=rs.state.value)
        finally:
            with trio.CancelScope(shield=True):
                await self._end(live, failure)

    async def _run(self, live: LiveSession) -> Failure | None:
        """The session's route, from its prefill (a repair's rebuild) to its last token: None, or what stopped it."""
        rs = live.rs
        try:
            async with trio.open_nursery() as links:  # the link to the head and its watcher
                answer = await self.driver.prefill(live, links)
                while (answer := await self._token(live, answer)) is not None:
                    pass
                links.cancel_scope.cancel()
            return None
        except (DgrError, BaseExceptionGroup) as raised:
            exc = first_dgr_error(raised)
            if not isinstance(exc, DgrError):
                if isinstance(raised, BaseExceptionGroup) and raised.split(trio.Cancelled)[1] is None:
                    raise  # only cancellations: the scope records why (_drive)
                log.error("route session %s crashed", rs.sid, exc_info=raised)
                return Failure(Reason.INTERNAL, f"gateway error: {raised!r}"[:300], phase=rs.state.value)
            if exc.reason is Reason.ROUTE_NODE_LOST and exc.details.get("node") and not exc.details.get("reported"):
                self.node_lost(exc.details["node"], exc.message)
            return exc.failure(phase=exc.details.get("phase") or rs.state.value)
        except Exception as exc:
            log.exception("route session %s crashed", rs.sid)
            return Failure(Reason.INTERNAL, f"gateway error: {exc!r}"[:300], phase=rs.state.value)

    async def _token(self, live: LiveSession, answer) -> Any:
        """One token's answer: its text out, its event published, and, unless the stop rule ends the
        session here, the answer to the next step (whose number this one hands over); None at the end."""
        rs, token = live.rs, TokenResult.from_frame(answer.frame)
        if token.spec is not None and not token.more:  # a speculative step's last token: count the step once
            rs.speculated(token.spec[0], token.spec[1])
        eog = token.eog and not live.request.ignore_eos
        event = rs.token(trio.current_time(), completion=not eog, hop_ms=answer.hop_ms)
        if not eog:
            text = live.text.feed(token.piece)
            if text:
                live.send.send_nowait(Delta(text, rs.completion_tokens))
        verdict = next_step(eog=token.eog, ignore_eos=live.request.ignore_eos, generated=rs.completion_tokens,
                            max_tokens=live.max_tokens, stopped=live.text.stopped)
        live.publish(RouteEvent.TOKEN, event, hop_ms=answer.hop_ms)
        if not verdict.more:
            tail = live.text.finish()
            if tail:
                live.send.send_nowait(Delta(tail, rs.completion_tokens))
            live.publish(RouteEvent.FINISH, rs.finish(verdict.finish, trio.current_time()))
            return None
        # The tail has already sent this token's step to the head (it decides alike, bar stop strings:
        # those end the session here, and the steps it sent on are only compute its close discards).
        live.fed.append(token.token)  # from here it is in the KV (a failed step fails the session)
        # the next answer: another token of this speculative step, or the next step's
        return await self.driver.answer(live, answer.frame.seq if token.more else answer.frame.seq + 1)

    async def _end(self, live: LiveSession, failure: Failure | None) -> None:
        """Close the session's node sessions (keeping its prefix after a clean end), owe what did not close,
        free its slots and lane, and end its channels."""
        rs, sid = live.rs, live.node_sid  # sid None: a repair closed its route, and no replacement opened
        if failure is None and not rs.ended:
            failure = Failure(Reason.INTERNAL, "driver ended without finishing", phase=rs.state.value)
        if failure is not None:
            live.publish(RouteEvent.FAIL, rs.fail(failure, trio.current_time()))
        keep = live.kv_keep() if failure is None else None
        if live.head is not None:
            await live.head.drop()
        if sid is not None:
            for node_id in rs.lost:  # it may only have been slow: closed once it heartbeats again
                self.owe_close(node_id, sid)
            survivors = [h for h in rs.route if h.node_id not in rs.lost]
            for node_id in await self.clients.close(sid, survivors, failure, live.caps, keep=keep):
                log.info("could not close %s on %s", sid, node_id)
                self.owe_close(node_id, sid)
            self.admission.kept(rs.route, keep)
        if live.phases is not None:
            self.admission.leave(live.phases, sid)
        for n in live.nodes:  # what the session showed of its nodes' capacity (NodeEntry.limit)
            if n.node_id in rs.lost:
                n.faulted()
            elif failure is None:
                n.served()
        self.admission.release(live.nodes)
        live.send.close()
        live.telemetry.close()
        self.sessions.pop(rs.sid, None)
        self.routes.pop(sid, None)
        if self.authority is not None and sid is not None:
            self.authority.forget(sid)  # the capabilities its nodes' answers and reports carried
        self.accounting.retire(rs)

    # -- views --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.accounting.stats([l.rs for l in self.sessions.values()], self.patience.extended)
