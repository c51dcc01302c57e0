"""Admission: from a request to a Route Session whose node sessions are open.

`Admission.open` runs in the request handler, so anything wrong is raised to
it before a response starts and the client gets a plain 4xx/5xx:
- a route (dgr.tracker.routing), waiting up to `admission_wait_s` for a slot
  when every route is full; its nodes' slots are held from then on, so
  concurrent opens cannot overfill a node; a node that refuses for room all
  the same is waited for within that time too (`waits_for_room`);
- the limits: a prompt past `max_prompt_bytes` is refused before the head
  tokenizes it (`prompt_too_large`); the head refuses one past
  `max_prompt_tokens` or the route's context inside its open (dgr.seam.opening).
  The context is the smallest `max_positions` (`--ctx`) a node on the route
  advertised, so `max_tokens` is clamped to the positions every hop really
  has, and to `max_tokens_cap`;
- the head tokenizes the prompt inside its open and answers its ids; without
  speculation the later hops open in the same round trip, their KV waiting
  for the prompt's prefix. Which trips run, and what each hop gets in each,
  is dgr.fsm.opening's table, planned from what is known (the client's ids,
  the head's answer, a route that kept the prefix); dgr.tracker.opening runs
  each trip;
- prefix reuse (dgr.node.prefix): the prompt (less its last two tokens,
  dgr.seam.keys.prompt_offer) hashed into a chain of whole-block keys and a
  mark per position, rooted in the model digest and the request's isolation
  scope under the tracker's secret (`prefix_secret`; no node is told the
  root). Where the prompt continues a conversation (dgr.tracker.affinity
  `candidates`: an end this gateway saw a session close with, or a key a
  node names), a route of the nodes that kept it is preferred if it ties on
  the spread: chosen before any open where the client sent ids, else once
  the head answered (what it opened is closed, and the session opens there
  under a fresh id, the one its client sees: a node opens each id once,
  dgr.security.tickets, and the two routes may share a node). Once the ids
  are known, the prefix is named to every hop where this gateway believes
  the head may hold one (`Affinity.may_hold`), and each says how many
  positions it holds; the route reuses the smallest. A node whose named key
  chose the route and that holds less than it named is barred from affinity
  (`Affinity.check`);
- each node session with its relay plan, its ticket and its lane in the
  route's phase groups (dgr.fsm.phases), and, where the session speculates
  (issue 42, dgr.node.speculation), the drafts a step may carry, and for the
  tail the prompt to draft from where its mode needs it (a draft model) or the
  operator allowed it (`--spec-allow prompt`). A mode the operator did not
  allow (`--spec-allow`: by default n-grams, neither `-exact` nor `draft`,
  which cost every node or the tail CPU) is refused before any open.
Any failure closes what was opened (what may have opened unseen is owed a
close), gives the slots back and ends the Route Session as failed.

Left out: driving the session (dgr.tracker.gateway, dgr.tracker.ring).
"""

from __future__ import annotations

import math
import os
import random
import uuid
from typing import Callable

import attrs
import trio

from dgr.api.openai import GenerationRequest
from dgr.api.textstream import TextAssembler
from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason, first_dgr_error
from dgr.fsm.phases import RoutePhases
from dgr.fsm.route import Hop, RouteEvent, RouteSession
from dgr.fsm.opening import Known, Then, plan
from dgr.seam.keys import prefix_root, prompt_offer
from dgr.seam.opening import AdoptRequest, SpecPlan
from dgr.tracker.accounting import Accounting
from dgr.tracker.affinity import Affinity
from dgr.tracker.clients import NodeClients
from dgr.tracker.credentials import Credentials
from dgr.tracker.live import PROMPT_BYTES_PER_TOKEN, GatewayConfig, LiveSession
from dgr.tracker.opening import Bounds, RouteOpening
from dgr.tracker.patience import Patience
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.routing import choose_route, prefer_holders
from dgr.tracker.telemetry import Broadcast

__all__ = ["Admission"]


@attrs.define
class Admission:
    registry: Registry
    config: GatewayConfig
    clients: NodeClients
    patience: Patience
    credentials: Credentials
    owe_close: Callable[[str, str], None]  # (node id, sid): it may hold the session; close it when it is back
    accounting: Accounting  # hears every Route Session's events
    # keys the prefix roots (HMAC, dgr.seam.keys): the tracker's, derived from its identity (dgr.tracker.run)
    prefix_secret: bytes = attrs.field(factory=lambda: os.urandom(32))
    rng: random.Random = attrs.field(factory=random.Random)  # breaks routing's last ties; tests seed it
    affinity: Affinity = attrs.field()  # where prompts' prefixes are kept, and what nodes' claims are believed
    phases: dict[tuple[str, ...], RoutePhases] = attrs.field(factory=dict)  # each route's phase board
    _freed: trio.Event = attrs.field(factory=trio.Event)  # set (and replaced) whenever a node slot is given back

    @affinity.default
    def _affinity(self) -> Affinity:
        return Affinity(self.registry)

    async def open(self, req: GenerationRequest, scope: str = "") -> LiveSession:
        """Route, open node sessions (the head tokenizing the prompt inside its open), check the context.

        `scope` isolates kept prefixes: only requests of the same scope (the API key's hash) reuse
        each other's, unless the gateway shares prefixes; it owns the Route Session (only it sees its telemetry).
        A node's refusal for room is waited for (`waits_for_room`), then the open is tried again under a fresh id.

        Raises:
            CallerError: bad model, prompt too long, nodes at capacity (after `admission_wait_s`).
            PeerError: no route, a node lost while opening.
        """
        deadline = trio.current_time() + self.config.admission_wait_s
        while True:
            try:
                return await self._open(req, scope, deadline)
            except CallerError as exc:
                if (until := self.waits_for_room(exc, deadline)) is None:
                    raise
            await self.until_freed(until)

    def waits_for_room(self, exc: DgrError, deadline: float) -> float | None:
        """Until when (trio's clock) an open that `exc` refused waits to be tried again (None: it is not): a node
        refused for room the gateway counted free. It holds a session the gateway is done with (an ended one until
        its running step is done, dgr.node.sessions; an owed close, dgr.tracker.reconcile), freed unannounced."""
        now = trio.current_time()
        if exc.reason is not Reason.NODE_AT_CAPACITY or exc.details.get("node") is None or now >= deadline:
            return None
        return min(deadline, now + (exc.details.get("retry_after") or 1))

    async def _open(self, req: GenerationRequest, scope: str, deadline: float) -> LiveSession:  # one try of `open`
        now = trio.current_time()
        rs = RouteSession(sid=uuid.uuid4().hex, model=req.model, created_at=now, owner=scope)
        rs.start_routing(now)
        reserved: tuple[NodeEntry, ...] = ()
        opening: RouteOpening | None = None
        cfg = self.config
        try:
            choice = await self._admit(req.model, deadline)
            before = {n.node_id: n.routed_at for n in choice.nodes}  # its turn, given back if affinity replaces it
            reserved = self.hold(choice.nodes, now)
            info = choice.nodes[0].model
            # The context is what every hop allocates per session (--ctx), not the training context.
            context = min([info.context_length, *(n.max_positions for n in choice.nodes)])
            token_limit, prompt = self._client_prompt(req, context, info.vocab_size)
            root = (prefix_root(choice.digest, "" if cfg.share_prefixes else scope, self.prefix_secret)
                    if cfg.prefix_reuse else None)
            max_new = req.max_tokens if cfg.max_tokens_cap is None else min(req.max_tokens, cfg.max_tokens_cap)
            bounds = Bounds(req.sampling, context, max_new, info.vocab_size, cfg.max_prompt_tokens)
            offered, offer = self.offer(prompt, root)
            expect: dict[str, int] = {}  # node id -> the positions its named key said it holds (Affinity.take)
            if prompt is not None:  # the ids are known: choose the route by its kept prefix before any open
                choice, reserved, expect = self._rechoose(choice, reserved, offer, context, now, before)
            known = Known.IDS if prompt is not None else Known.TEXT
            opening = self.opening(req, rs, choice, bounds)
            while True:  # the trips dgr.fsm.opening plans, from what is known
                trip = plan(known, opening.spec is not None, len(opening.hops) == 1)
                if not trip.empty:
                    await opening.trip(trip, req.prompt_body(), prompt, offer)
                if trip.then is Then.READY:
                    break
                if trip.then is Then.REOPEN:  # its nodes kept this prompt's prefix: open there instead
                    await self.abandon(opening)
                    # under a fresh id: a node opens each id once (dgr.security.tickets), and the holders' route
                    # may share a node with this one; no client or listener has seen the old id
                    rs.sid = uuid.uuid4().hex
                    self.accounting.metrics.reopens_total.inc()
                    choice, opening, known = better, self.opening(req, rs, better, bounds), Known.IDS
                    continue
                prompt = self._head_ids(opening.tokens, choice.hops[0], context, token_limit)
                offered, offer = self.offer(prompt, root)
                better, reserved, expect = self._rechoose(choice, reserved, offer, context, now, before)
                known = (Known.HELD_ELSEWHERE if better is not choice
                         else Known.REUSABLE if root is not None and self.affinity.may_hold(
                             choice.nodes[0], offer, trio.current_time()) else Known.ANSWERED)
            self.affinity.check(expect, opening.held, trio.current_time())
        except BaseException as raised:
            await self._undo(raised, rs, opening, reserved)
            raise AssertionError("unreachable")  # _undo always raises
        send, recv = trio.open_memory_channel(math.inf)
        live = LiveSession(
            rs=rs, request=req, prompt=prompt, max_tokens=min(max_new, context - len(prompt)), nodes=choice.nodes,
            model_width=info.seam_width, needs_token_ids=info.needs_token_ids, telemetry=Broadcast(),
            send=send, recv=recv, text=TextAssembler(stop=req.stop), caps=opening.caps, prefix_root=root,
            keep_generated=cfg.prefix_keep_generated, phases=opening.board, listener=self.accounting.observe,
            speculates=opening.spec is not None, node_sid=rs.sid,
        )
        # every node must start from the same position: the shortest prefix any of them holds
        reused = min([offered, *opening.held.values()]) if root is not None else 0
        live.publish(RouteEvent.ROUTE_READY,
                     rs.route_ready(choice.hops, len(prompt), trio.current_time(), prefix_reused=reused))
        return live

    def opening(self, req: GenerationRequest, rs: RouteSession, choice, bounds: Bounds, sid: str | None = None,
                speculate: bool = True) -> RouteOpening:
        """The opening of `choice`'s node sessions under `sid` (default: the Route Session's id; a repair's is
        fresh): its relay plans, speculation (none unless `speculate`), capabilities and lane on the route's
        phase board (one a route, made on first use)."""
        sid = sid or rs.sid
        relays = self.credentials.relay_plans(sid, choice.hops, req.ignore_eos)
        spec = self._speculation(req, choice.nodes) if speculate else None
        key = tuple(h.node_id for h in choice.hops)
        board = self.phases.get(key)
        if board is None:
            board = self.phases[key] = RoutePhases(len(choice.hops))
        return RouteOpening(sid, choice.hops, self.clients, self.credentials, self.patience,
                            self.config.step_deadline_s, lambda: rs.state.value, bounds, relays, spec, board,
                            board.join(sid), self.credentials.capabilities(sid, choice.hops),
                            prompt_to_tail=self.config.prompt_to_tail(req.speculation or self.config.speculation))

    def _rechoose(self, choice, reserved: tuple[NodeEntry, ...], offer: AdoptRequest, context: int, now: float,
                  before: dict[str, float]):
        """(route, its held slots, what its claimers must show they hold): the route of the nodes that may hold
        the longest prefix of `offer` the prompt continues (dgr.tracker.affinity `candidates`), when it ties with
        `choice` on the spread and has room and the context `choice` has; else `choice`, `reserved` and nothing.
        The hint that chose a route is spent (`Affinity.take`), as it is where `choice` is that route already; the
        turn `choice` took is given back (`before`: its nodes' `routed_at` before it was held)."""
        at = trio.current_time()
        for _, nodes in self.affinity.candidates(offer, at)[:1]:  # the longest only: a shorter one is not the turn
            if all(n.node_id in nodes for n in choice.nodes):
                return choice, reserved, self.affinity.take(offer, choice.nodes, at)
            self._unhold(reserved, before, now)  # judged as if this session were on neither route
            better = prefer_holders(self.registry.alive(), choice, nodes, trusted=self.registry.trusted_ends,
                                    rng=self.rng)
            if better is None or min(n.max_positions for n in better.nodes) < context:
                return choice, self.hold(reserved, now), {}
            self.release(())  # slots were given back: wake the opens waiting for one
            return better, self.hold(better.nodes, now), self.affinity.take(offer, better.nodes, at)
        return choice, reserved, {}

    @staticmethod
    def offer(prompt: list[int] | None, root: str | None) -> tuple[int, AdoptRequest]:
        """(positions, the prefix: their block keys and marks) the prompt offers to reuse; none without ids or a
        root."""
        if prompt is None or root is None:
            return 0, AdoptRequest()
        offered, chain, marks = prompt_offer(prompt, root)
        return offered, AdoptRequest(tuple(chain), marks)

    def _client_prompt(self, req: GenerationRequest, context: int, vocab_size: int) -> tuple[int, list[int] | None]:
        """(the prompt's token limit, the client's own ids or None for a prompt the head must tokenize): the
        prompt as the client sent it, checked before any node sees it (its text's bytes against the limit,
        its ids against the vocabulary).

        Raises: CallerError(PROMPT_TOO_LARGE | INVALID_REQUEST).
        """
        cfg = self.config
        token_limit = min(context - 1, cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else context)
        if req.prompt_ids:
            prompt = list(req.prompt_ids)
            if max(prompt) >= vocab_size:
                raise CallerError(Reason.INVALID_REQUEST, f"token id {max(prompt)} is outside the vocabulary "
                                  f"of {vocab_size}", param="prompt")
            return token_limit, prompt
        byte_limit = cfg.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max(token_limit, 1)
        if req.prompt_bytes() > byte_limit:
            raise CallerError(Reason.PROMPT_TOO_LARGE,
                              f"the prompt has {req.prompt_bytes()} bytes; this gateway tokenizes at most {byte_limit} "
                              f"(the prompt may have at most {token_limit} tokens)", param=_param(req))
        return token_limit, None

    @staticmethod
    def _head_ids(tokens: list[int] | None, head: Hop, context: int, token_limit: int) -> list[int]:
        """The head's ids for the prompt, which it was told to hold within `token_limit`: a head that opened
        more, or none, is at fault, not the client.

        Raises: PeerError(NODE_ERROR).
        """
        if not tokens or len(tokens) > token_limit:
            got = f"{len(tokens)} tokens" if tokens else "no tokens"
            raise PeerError(Reason.NODE_ERROR, f"{head.node_id} opened a prompt of {got}; it may hold 1 to "
                                               f"{token_limit} in a context of {context}", node=head.node_id)
        return tokens

    async def abandon(self, opening: RouteOpening, failure: Failure | None = None) -> None:
        """Close what `opening` opened under its id (owing closes where no answer came) and give its lane back."""
        sid = opening.sid
        with trio.CancelScope(shield=True):
            for node_id in await self.clients.close(sid, opening.opened, failure, opening.caps):
                self.owe_close(node_id, sid)
        self.leave(opening.board, sid)
        confirmed = {h.node_id for h in opening.opened}
        for node_id in opening.attempted:
            if node_id not in confirmed:  # no reply came (lost, cut, or late): it may hold the session anyway
                self.owe_close(node_id, sid)

    async def _undo(self, raised: BaseException, rs: RouteSession, opening: RouteOpening | None,
                    reserved: tuple[NodeEntry, ...]) -> None:
        """Take back a failed open (close what opened, owe closes, free slots and lane), then raise."""
        exc = first_dgr_error(raised) if isinstance(raised, BaseExceptionGroup) else raised
        failure = _failure_of(exc, rs)
        if opening is not None:
            await self.abandon(opening, failure)
        self.release(reserved)
        if failure is not None:
            rs.fail(failure, trio.current_time())
            self.accounting.observe(rs, RouteEvent.FAIL, rs.updated_at)
            self.accounting.retire(rs)
        if isinstance(exc, trio.TooSlowError):
            raise PeerError(Reason.ROUTE_NODE_LOST, failure.message, node=failure.node) from None
        if exc is not raised and isinstance(exc, DgrError):
            raise exc from None
        raise raised

    def _speculation(self, req: GenerationRequest, nodes: tuple[NodeEntry, ...]) -> SpecPlan | None:
        """The session's speculation on every node (the tail's also gets the prompt's last tokens to draft
        from, dgr.tracker.opening): None where it does not speculate (asked off, or a node's memory cannot
        drop positions).

        Raises:
            CallerError(FORBIDDEN): a mode the operator did not allow (`--spec-allow`), before any open.
            CallerError(INVALID_REQUEST): `draft` speculation on a route whose tail has no draft model.
        """
        cfg = self.config
        mode = req.speculation or cfg.speculation
        if not cfg.spec_allowed(mode):
            raise CallerError(Reason.FORBIDDEN, f"speculation {mode!r} is not allowed by this tracker (it allows "
                                                f"{', '.join(sorted({'off', cfg.speculation, *cfg.spec_allow}))}; "
                                                "dgr tracker --spec-allow)", param="speculation")
        if mode == "off" or not all(n.model.drops_positions for n in nodes):
            return None
        source = mode.removesuffix("-exact")
        if source == "draft" and not nodes[-1].describe.get("draft_model"):
            raise CallerError(Reason.INVALID_REQUEST, f"speculation {mode!r} needs a route whose tail has a draft "
                                                      f"model (dgr node --draft-model); {nodes[-1].node_id} has none")
        return SpecPlan(k_max=cfg.spec_k_max, fixed_k=cfg.spec_k, exact=cfg.spec_exact or mode.endswith("-exact"),
                        source=source)

    def hold(self, nodes: tuple[NodeEntry, ...], now: float) -> tuple[NodeEntry, ...]:
        for n in nodes:
            n.reserved += 1
            n.turns += 1
            n.routed_at = now
        return nodes

    @staticmethod
    def _unhold(nodes: tuple[NodeEntry, ...], before: dict[str, float], now: float) -> None:
        """Take back `_hold(nodes, now)`: its slots and its turn (`before`: their `routed_at` until then)."""
        for n in nodes:
            n.reserved = max(0, n.reserved - 1)
            n.turns -= 1
            if n.routed_at == now:  # no other session took it since
                n.routed_at = before.get(n.node_id, n.routed_at)

    def release(self, nodes) -> None:
        """Give back one session's slot on each of `nodes` (its close is done) and wake waiting opens."""
        for n in nodes:
            n.reserved = max(0, n.reserved - 1)
        self._freed.set()
        self._freed = trio.Event()

    async def _admit(self, model: str, deadline: float):
        """A route for `model`, waiting until `deadline` for a slot when every route is full.

        Raises:
            CallerError(NODE_AT_CAPACITY): still full after the wait.
            PeerError(NO_ROUTE) and the other refusals of `choose_route`, at once.
        """
        while True:
            try:
                return choose_route(self.registry.alive(), model, trusted=self.registry.trusted_ends, rng=self.rng)
            except CallerError as exc:
                if exc.reason is not Reason.NODE_AT_CAPACITY or trio.current_time() >= deadline:
                    raise
            await self.until_freed(deadline)

    async def until_freed(self, deadline: float) -> None:
        """Wait until a node slot is given back, or `deadline` (trio's clock)."""
        with trio.move_on_at(deadline):
            await self._freed.wait()

    def kept(self, route: tuple[Hop, ...], keep: tuple[list[str], str] | None) -> None:
        """A session on `route` closed keeping the KV `keep` names (its chain and its tail's marks,
        LiveSession.kv_keep): prefer that route for the prompt that continues it."""
        if keep is not None:
            self.affinity.kept(frozenset(h.node_id for h in route), *keep)

    def leave(self, board: RoutePhases, sid: str) -> None:
        """`sid`'s node sessions are closed: its lane is free, and a board with no lanes goes."""
        board.leave(sid)
        if not board.lanes:
            self.phases = {k: b for k, b in self.phases.items() if b is not board}


def _param(req: GenerationRequest) -> str:
    return "messages" if req.kind == "chat" else "prompt"


def _failure_of(exc: BaseException, rs: RouteSession) -> Failure | None:
    if isinstance(exc, DgrError):
        return exc.failure(phase=rs.state.value)
    if isinstance(exc, trio.TooSlowError):
        return Failure(Reason.ROUTE_NODE_LOST, "a node did not answer while the route was being opened",
                       phase=rs.state.value)
    # a bare Cancelled, or the per-hop opens' nursery passing on only cancellations
    if isinstance(exc, trio.Cancelled) or (isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None):
        return Failure(Reason.CANCELLED, "the client went away while the route was being opened",
                       phase=rs.state.value)
    return Failure(Reason.INTERNAL, f"{type(exc).__name__}: {exc}", phase=rs.state.value)
