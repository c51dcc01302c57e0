"""Admission: from a request to a Route Session whose node sessions are open.

`Admission.open` runs in the request handler, so anything wrong is raised to
it before a response starts and the client gets a plain 4xx/5xx:
- a route (dgr.tracker.routing), waiting up to `admission_wait_s` for a slot
  when every route is full; its nodes' slots are held from then on, so
  concurrent opens cannot overfill a node;
- the limits: a prompt past `max_prompt_bytes` is refused before the head
  tokenizes it (`prompt_too_large`), one past `max_prompt_tokens` or the
  route's context before any node session opens. The context is the smallest
  `max_positions` (`--ctx`) a node on the route advertised, so `max_tokens` is
  clamped to the positions every hop really has, and to `max_tokens_cap`;
- prefix reuse (dgr.node.prefix): the prompt (less its last two tokens: the
  last must be prefilled for a first token, and not alone, see
  LiveSession.chunks) hashed into a chain of whole-block keys and a mark per
  position, rooted in the model digest and the request's isolation scope. A
  route whose nodes kept the longest of those keys (`holders`, which this
  gateway saw closed, or which nodes name in their heartbeats) is preferred.
  Each node opens on the longest prefix it holds and says how many positions;
  the route reuses the smallest answer;
- one node session per hop, opened at once, each with its relay plan, its
  ticket and its lane in the route's phase groups (dgr.fsm.phases), and,
  where the session speculates (issue 42, dgr.node.speculation), the
  drafts a step may carry, and for the tail the prompt to draft from.
Any failure closes what was opened (what may have opened unseen is owed a
close), gives the slots back and ends the Route Session as failed.

Left out: driving the session (dgr.tracker.gateway, dgr.tracker.ring).
"""

from __future__ import annotations

import collections
import math
import uuid
from typing import Any, Callable

import attrs
import trio

from dgr.api.openai import GenerationRequest
from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason, first_dgr_error
from dgr.fsm.phases import RoutePhases
from dgr.fsm.route import Hop, RouteEvent, RouteSession
from dgr.seam.keys import MAX_MARKS, block_chain, encode_marks, prefix_root, token_marks
from dgr.tracker.accounting import Accounting
from dgr.tracker.clients import NodeClients
from dgr.tracker.credentials import Credentials
from dgr.tracker.live import PROMPT_BYTES_PER_TOKEN, GatewayConfig, LiveSession
from dgr.tracker.patience import Patience
from dgr.tracker.registry import NodeEntry, Registry
from dgr.tracker.routing import choose_route, prefer_holders
from dgr.tracker.telemetry import Broadcast

__all__ = ["Admission"]

SPEC_HISTORY = 8192  # prompt tokens a speculating tail indexes (its n-gram window)
_HOLDER_KEYS = 65536  # block keys the route hint remembers (32 hex digits and a node set each)


@attrs.define
class Admission:
    registry: Registry
    config: GatewayConfig
    clients: NodeClients
    patience: Patience
    credentials: Callable[[], Credentials]
    owe_close: Callable[[str, str], None]  # (node id, sid): it may hold the session; close it when it is back
    accounting: Accounting  # hears every Route Session's events
    # block key -> the nodes of the route whose session closed with it: where a prompt's prefix is likely kept
    # (a hint for the route choice; the nodes' own answers decide what is reused). Bounded, oldest out.
    holders: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    phases: dict[tuple[str, ...], RoutePhases] = attrs.field(factory=dict)  # each route's phase board
    _freed: trio.Event = attrs.field(factory=trio.Event)  # set (and replaced) whenever a node slot is given back

    async def open(self, req: GenerationRequest, scope: str = "") -> LiveSession:
        """Route, tokenize, check the context and open node sessions.

        `scope` isolates kept prefixes: only requests of the same scope (the API key's hash) reuse
        each other's, unless the gateway shares prefixes.

        Raises:
            CallerError: bad model, prompt too long, nodes at capacity.
            PeerError: no route, a node lost while opening.
        """
        now = trio.current_time()
        rs = RouteSession(sid=uuid.uuid4().hex, model=req.model, created_at=now)
        rs.start_routing(now)
        opened: list[Hop] = []
        attempted: list[str] = []
        reserved: tuple[NodeEntry, ...] = ()
        caps: dict[str, str] = {}
        board: RoutePhases | None = None
        cfg = self.config
        try:
            choice = await self._admit(req.model)
            reserved = self._hold(choice.nodes, now)
            caps = self.credentials().capabilities(rs.sid, choice.hops)
            info = choice.nodes[0].model
            # The context is what every hop allocates per session (--ctx), not the training context.
            context = min([info.context_length, *(n.max_positions for n in choice.nodes)])
            prompt = await self._tokenize(req, rs, choice.hops[0], caps, context)
            max_tokens = min(req.max_tokens, context - len(prompt))
            if cfg.max_tokens_cap is not None:
                max_tokens = min(max_tokens, cfg.max_tokens_cap)
            positions = len(prompt) + max_tokens

            root = prefix_root(choice.digest, "" if cfg.share_prefixes else scope) if cfg.prefix_reuse else None
            # Never the last token: its logits give the first answer token. Nor the one before: a lone
            # position would run on other kernels than a chunk (LiveSession.chunks), and giving it back
            # later would need a node to drop a position, which some memories cannot (recurrent, SWA).
            offered = prompt[: max(len(prompt) - 2, 0)]
            offer = [] if root is None else block_chain(offered, root)
            marks = "" if root is None else encode_marks(token_marks(offered[:MAX_MARKS], root))
            better = self._holding_route(offer, choice, context)
            if better is not None:
                self.release(reserved)
                choice, reserved = better, self._hold(better.nodes, now)
                caps = self.credentials().capabilities(rs.sid, choice.hops)
            relays = self.credentials().relay_plans(rs.sid, choice.hops, req.ignore_eos)
            specs = self._speculation(req, choice.nodes, prompt)
            board = self._board(choice.hops)
            lane = board.join(rs.sid)
            held: dict[str, int] = {}

            async def open_one(hop: Hop) -> None:
                attempted.append(hop.node_id)
                try:
                    held[hop.node_id] = await self.clients.get(hop).open(
                        rs.sid, positions, req.sampling.to_json(), caps.get(hop.node_id),
                        relay=relays.get(hop.node_id), prefix=offer, lane=lane,
                        ticket=self.credentials().ticketer(rs.sid, hop), marks=marks, spec=specs[hop.node_id])
                except DgrError as refused:
                    if refused.reason is not Reason.ROUTE_NODE_LOST:
                        attempted.remove(hop.node_id)  # the node answered: it holds nothing
                    raise
                opened.append(hop)

            with self.patience.patient([h.node_id for h in choice.hops], cfg.step_deadline_s) as wait:
                async with trio.open_nursery() as nursery:
                    for hop in choice.hops:
                        nursery.start_soon(open_one, hop)
            if wait.scope.cancelled_caught:
                silent = wait.silent or next((h.node_id for h in choice.hops if h.node_id not in held), None)
                raise wait.failed("did not answer while the route was being opened", silent, phase=rs.state.value)
        except BaseException as raised:
            await self._undo(raised, rs, opened, attempted, reserved, caps, board)
            raise AssertionError("unreachable")  # _undo always raises
        send, recv = trio.open_memory_channel(math.inf)
        live = LiveSession(
            rs=rs, request=req, prompt=prompt, max_tokens=max_tokens, nodes=choice.nodes,
            model_width=info.seam_width, needs_token_ids=info.needs_token_ids, telemetry=Broadcast(),
            send=send, recv=recv, caps=caps, prefix_root=root, keep_generated=cfg.prefix_keep_generated,
            phases=board, listener=self.accounting.observe,
        )
        # every node must start from the same position: the shortest prefix any of them holds
        reused = min([len(offered), *held.values()]) if root is not None else 0
        live.publish(RouteEvent.ROUTE_READY,
                     rs.route_ready(choice.hops, len(prompt), trio.current_time(), prefix_reused=reused))
        return live

    async def _tokenize(self, req: GenerationRequest, rs: RouteSession, first: Hop, caps: dict[str, str],
                        context: int) -> list[int]:
        """The prompt's token ids (the request's own, or the head's for its text), within the limits."""
        cfg = self.config
        info = self.registry.nodes[first.node_id].model
        token_limit = min(context - 1, cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else context)
        param = "messages" if req.kind == "chat" else "prompt"
        byte_limit = cfg.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max(token_limit, 1)
        if not req.prompt_ids and req.prompt_bytes() > byte_limit:
            raise CallerError(Reason.PROMPT_TOO_LARGE,
                              f"the prompt has {req.prompt_bytes()} bytes; this gateway tokenizes at most {byte_limit} "
                              f"(the prompt may have at most {token_limit} tokens)", param=param)
        with self.patience.patient([first.node_id], cfg.step_deadline_s) as wait:
            prompt = (list(req.prompt_ids) if req.prompt_ids
                      else await self.clients.get(first).tokenize(req.tokenize_body(), rs.sid, caps.get(first.node_id),
                                                                  vocab_size=info.vocab_size))
        if wait.scope.cancelled_caught:
            raise wait.failed("did not tokenize the prompt", first.node_id, phase=rs.state.value)
        if req.prompt_ids and max(prompt) >= info.vocab_size:
            raise CallerError(Reason.INVALID_REQUEST, f"token id {max(prompt)} is outside the vocabulary "
                              f"of {info.vocab_size}", param="prompt")
        if not prompt:
            raise CallerError(Reason.INVALID_REQUEST, "the prompt is empty after tokenizing", param="prompt")
        if cfg.max_prompt_tokens is not None and len(prompt) > cfg.max_prompt_tokens:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"the prompt has {len(prompt)} tokens; this gateway "
                              f"accepts at most {cfg.max_prompt_tokens}", param=param)
        if len(prompt) >= context:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"the prompt has {len(prompt)} tokens; this route's "
                              f"context is {context} and at least one must remain for the answer", param=param)
        return prompt

    async def _undo(self, raised: BaseException, rs: RouteSession, opened: list[Hop], attempted: list[str],
                    reserved: tuple[NodeEntry, ...], caps: dict[str, str], board: RoutePhases | None) -> None:
        """Take back a failed open (close what opened, owe closes, free slots and lane), then raise."""
        exc = first_dgr_error(raised) if isinstance(raised, BaseExceptionGroup) else raised
        failure = _failure_of(exc, rs)
        with trio.CancelScope(shield=True):
            for node_id in await self.clients.close(rs.sid, opened, failure, caps):
                self.owe_close(node_id, rs.sid)
        self.release(reserved)
        if board is not None:
            self.leave(board, rs.sid)
        confirmed = {h.node_id for h in opened}
        for node_id in attempted:
            if node_id not in confirmed:  # no reply came (lost, cut, or late): it may hold the session anyway
                self.owe_close(node_id, rs.sid)
        if failure is not None:
            rs.fail(failure, trio.current_time())
            self.accounting.observe(rs, RouteEvent.FAIL, rs.updated_at)
            self.accounting.retire(rs)
        if isinstance(exc, trio.TooSlowError):
            raise PeerError(Reason.ROUTE_NODE_LOST, failure.message, node=failure.node) from None
        if exc is not raised and isinstance(exc, DgrError):
            raise exc from None
        raise raised

    def _speculation(self, req: GenerationRequest, nodes: tuple[NodeEntry, ...], prompt: list[int]
                     ) -> dict[str, dict[str, Any] | None]:
        """Each node's "spec" open field: None where the session does not speculate (asked off, or a node's
        memory cannot drop positions); the tail also gets the prompt's last tokens to draft from.

        Raises:
            CallerError(INVALID_REQUEST): `draft` speculation on a route whose tail has no draft model.
        """
        cfg = self.config
        mode = req.speculation or cfg.speculation
        if mode == "off" or not all(n.model.drops_positions for n in nodes):
            return {n.node_id: None for n in nodes}
        source = mode.removesuffix("-exact")
        if source == "draft" and not nodes[-1].describe.get("draft_model"):
            raise CallerError(Reason.INVALID_REQUEST, f"speculation {mode!r} needs a route whose tail has a draft "
                                                      f"model (dgr node --draft-model); {nodes[-1].node_id} has none")
        spec: dict[str, Any] = {"k_max": cfg.spec_k_max, "exact": cfg.spec_exact or mode.endswith("-exact"),
                                "source": source}
        if cfg.spec_k is not None:
            spec["fixed_k"] = cfg.spec_k
        out: dict[str, dict[str, Any] | None] = {n.node_id: spec for n in nodes}
        out[nodes[-1].node_id] = {**spec, "history": prompt[-SPEC_HISTORY:]}
        return out

    def _hold(self, nodes: tuple[NodeEntry, ...], now: float) -> tuple[NodeEntry, ...]:
        for n in nodes:
            n.reserved += 1
            n.routed_at = now
        return nodes

    def release(self, nodes) -> None:
        """Give back one session's slot on each of `nodes` (its close is done) and wake waiting opens."""
        for n in nodes:
            n.reserved = max(0, n.reserved - 1)
        self._freed.set()
        self._freed = trio.Event()

    async def _admit(self, model: str):
        """A route for `model`, waiting up to `admission_wait_s` for a slot when every route is full.

        Raises:
            CallerError(NODE_AT_CAPACITY): still full after the wait.
            PeerError(NO_ROUTE) and the other refusals of `choose_route`, at once.
        """
        deadline = trio.current_time() + self.config.admission_wait_s
        while True:
            try:
                return choose_route(self.registry.alive(), model, trusted=self.registry.trusted_ends)
            except CallerError as exc:
                if exc.reason is not Reason.NODE_AT_CAPACITY or trio.current_time() >= deadline:
                    raise
            with trio.move_on_at(deadline):
                await self._freed.wait()

    def _holding_route(self, offer: list[str], choice, context: int):
        """A route whose nodes all kept the longest prefix of `offer` that this gateway saw closed or its nodes
        name in their heartbeats (what survives a restart), when it is not `choice` and has room and the
        context `choice` has; else None."""
        named = self.registry.holding(offer) if offer else {}
        for i in range(len(offer) - 1, -1, -1):
            nodes = self.holders.get(offer[i], frozenset()) | {n for n, at in named.items() if at >= i}
            if nodes:
                better = prefer_holders(self.registry.alive(), choice, frozenset(nodes),
                                        trusted=self.registry.trusted_ends)
                if better is not None and min(n.max_positions for n in better.nodes) < context:
                    return None
                return better
        return None

    def kept(self, route: tuple[Hop, ...], chain: list[str] | None) -> None:
        """A session on `route` closed keeping the blocks of `chain`: prefer that route for prompts that extend them."""
        if not chain:
            return
        nodes = frozenset(h.node_id for h in route)
        for key in chain:
            self.holders[key] = nodes
            self.holders.move_to_end(key)
        while len(self.holders) > _HOLDER_KEYS:
            self.holders.popitem(last=False)

    def _board(self, hops: tuple[Hop, ...]) -> RoutePhases:
        """The phase board of the route through `hops` (made on first use)."""
        key = tuple(h.node_id for h in hops)
        board = self.phases.get(key)
        if board is None:
            board = self.phases[key] = RoutePhases(len(hops))
        return board

    def leave(self, board: RoutePhases, sid: str) -> None:
        """`sid`'s node sessions are closed: its lane is free, and a board with no lanes goes."""
        board.leave(sid)
        if not board.lanes:
            self.phases = {k: b for k, b in self.phases.items() if b is not board}


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
