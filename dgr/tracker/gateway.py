"""The Gateway: Route Sessions from request to done or failed.

Theory of operation:
- `open` runs in the request handler: route choice, tokenizing at the head,
  the context check, and one node session per hop. Anything wrong there is
  raised to the handler before a response starts, so the client gets a plain
  4xx/5xx. Then the session's driver starts in the gateway's own nursery and
  the handler only reads its output channel.
- The driver (`_drive`) runs prefill and decode inside the session's cancel
  scope, in one of three topologies (dgr.seam.wire.Topology):
  - chain: each step goes to the head on the
    session's stream to it (dgr.seam.stream); every node sends its output
    on to the next, and the tail's answer comes back through `deliver_frame`
    into the session's inbox with each hop's compute. N + 1 one-way messages
    a token. A watcher reads the head's answer to the stream: one that comes
    while the session lives is a refusal or a lost head, and fails it.
  - ring (the default of `dgr tracker` and `dgr up`): a chain whose tail
    also sends each next decode step straight to the head
    (dgr.node.relay.Loop); the driver sends only the prompt's chunks, ends
    its stream to the head, and waits for the tokens. N one-way messages a
    token; a lost head is reported by the tail.
  - star: the gateway relays every hop, N round trips (2N messages) a token.
  Every way, one place sees every hop's latency and every failure, and
  failure handling stays here.
- Prefill is pipelined: hop i+1 works on chunk k while hop i works on chunk
  k+1 (star: one task per hop, joined by channels of one chunk; chain: at
  most one chunk a node in flight).
- Failure: a node's transport error, a refused step, a missed per-step
  deadline, or the registry declaring a node dead (its heartbeats stopped)
  fails the session with a structured reason naming node, phase and step.
- A deadline tells a slow node from a dead one (`_patient`, `_answer`):
  shortly before a step's (or an open's, or a tokenize's) deadline passes,
  the gateway asks each node it waits on for /healthz, which a node answers
  on its loop, never behind compute. A node that answers is slow, not lost:
  the deadline extends by its own length, up to `slow_cap` times it, and
  the session goes on. Only silence fails the session as `route_node_lost`
  (and marks the node dead); a route still busy at the cap fails it as
  `session_timeout`, and no node is marked.
  The dead node is marked so new routes avoid it. Survivors are told to drop
  the session's KV (shielded, bounded), and no repair is attempted.
- A client that goes away cancels its session: reason `cancelled`, KV freed.
- Authorization: with the tracker's key (`authority`), `open` issues one
  capability per hop, binding the session, the node and its layers, and every
  call for the session (tokenize, open, step, close) carries it. Nodes refuse
  calls without a matching one. These are CONTROL capabilities and never
  leave the gateway: the relay plans hand each node STEP capabilities for
  its next hop and a ring tail's head (`relay_plans`), which let it send the
  session's steps there and nothing else. Each open also carries a
  single-use ticket the tracker signs over its exact body (dgr.security.tickets),
  so a node runs only the plan, prefix offer and lane the tracker chose,
  once. dgr.tracker.credentials makes all three.
- Limits: a prompt past `max_prompt_bytes` is refused before the head
  tokenizes it (`prompt_too_large`); one past `max_prompt_tokens` before any
  node session opens. The context is the smallest `max_positions` (`--ctx`)
  a node on the route advertised, not the model's training context, so
  `max_tokens` is clamped to the positions every hop really has, and to
  `max_tokens_cap`. A watcher (`_watch_sessions`) fails a session that outlives
  `max_session_s` (`session_timeout`) and cancels a streaming one whose reader
  has not taken a chunk for `slow_client_s` (`slow_client`); both free the
  session's KV on every node like any other failure. A stream whose response
  body is never started (the client left between `open` and the first
  chunk) is cancelled after `unclaimed_stream_s`.
- Reconciliation (dgr.tracker.reconcile): a close that may not have reached a node is remembered
  (`unclosed`): the sessions of a node declared lost (it may only have been
  slow), an `open` whose reply never came, a close that failed or timed out.
  Each heartbeat lists the sessions a node holds; `reconcile` closes the
  remembered ones it lists, with a capability minted for the purpose, as
  soon as the node is reachable again. Sessions this gateway never opened
  are left alone.
- Prefix reuse (dgr.node.prefix): the gateway hashes the prompt (less its
  last two tokens: the last must be prefilled for a first token, and not
  alone, see LiveSession.chunks) into a chain of whole-block keys and a mark
  per position, rooted in the model digest and the request's isolation scope
  (the API key's hash, or one shared scope with `share_prefixes`). Each node
  opens on the longest prefix, to the token, it holds of that and says how
  many positions that is; the route reuses the smallest answer, and prefill
  starts there (a node holding more drops the rest before that first step).
  A session that ends normally closes with the chain of its KV's whole
  blocks and the marks of its positions after them (its prompt, and by
  default its answer: `prefix_keep_generated`, off with `--prefix-exact`),
  so its nodes may keep that KV for the next turn; the gateway remembers
  which route kept which keys (`holders`), learns the same from the prefixes
  nodes name in their heartbeats (so it survives a restart), and prefers
  that route for a prompt that extends them.
- Pruning: a node dead past the registry's `forget_after_s` loses its entry,
  its pooled connections, its hop stats and its metric labels.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
import uuid
from typing import Any, Callable, Iterator

import attrs
import trio

from dgr.api.openai import GenerationRequest
from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason, first_dgr_error
from dgr.fsm.route import Hop, RouteSession, RouteState
from dgr.metrics import TrackerMetrics, gauge
from dgr.node.prefix import MAX_MARKS, block_chain, encode_marks, prefix_root, token_marks
from dgr.api.http import parse_json
from dgr.seam.frame import Frame, TokenResult, decode_frame, encode_frame
from dgr.seam.wire import HEADER_SIZE, Flag, FrameKind, Topology, frame_kind
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.tls import TlsTrust
from dgr.fsm.stop import next_step
from dgr.fsm.phases import RoutePhases, hold_for
from dgr.tracker.registry import GATEWAY_ID, NodeEntry, Registry
from dgr.tracker.routing import choose_route, prefer_holders
from dgr.seam.transport import HttpResponse, OutStream, TransportError
from dgr.tracker.seam_client import NodeClient, StepReply
from dgr.tracker.telemetry import Broadcast
from dgr.tracker.credentials import Credentials
from dgr.tracker.patience import PROBE_S, Wait, keep_waiting, lead
from dgr.tracker.reconcile import OwedCloses
from dgr.tracker.live import PROMPT_BYTES_PER_TOKEN, Delta, GatewayConfig, HopStats, LiveSession

__all__ = ["Gateway", "GatewayConfig", "LiveSession", "Delta"]  # the last three from dgr.tracker.live

log = logging.getLogger("dgr.gateway")

# The capability a chain session's nodes deliver answers and reports with names this "node" (layers 0:1):
# one for the whole route, since any of its nodes may have to report.
_GATEWAY = GATEWAY_ID  # a node may not register it (dgr.tracker.registry)
_HOLDER_KEYS = 65536  # block keys the route hint remembers (32 hex digits and a node set each)
_END_S = 1.0  # how long ending a chain's stream to the head waits for its answer
_REFUSAL_S = 0.5  # how long a broken link to the head waits for the refusal that may have come just before


@attrs.define
class Gateway:
    registry: Registry
    config: GatewayConfig = attrs.field(factory=GatewayConfig)
    sessions: dict[str, LiveSession] = attrs.field(factory=dict)
    ended: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # sid -> RouteSession
    clients: dict[str, NodeClient] = attrs.field(factory=dict)
    hop_stats: dict[str, HopStats] = attrs.field(factory=lambda: collections.defaultdict(HopStats))
    recent_failures: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=50))
    metrics: TrackerMetrics = attrs.field(factory=TrackerMetrics)
    authority: CapabilityAuthority | None = None  # the tracker's key; None (in-process tests): no capabilities
    connect: Callable[..., NodeClient] = NodeClient  # (node id, url[, ssl_context]) -> client; tests connect in-process
    tls: TlsTrust = attrs.field(factory=TlsTrust)  # how https nodes are trusted: their registered cert, or a CA
    pins: dict[str, str | None] = attrs.field(factory=dict)  # node id -> the certificate its client pins
    owed: OwedCloses = attrs.field(default=attrs.Factory(lambda self: OwedCloses(self.config.unclosed_ttl_s),
                                                         takes_self=True))
    _nursery: trio.Nursery | None = None
    _probing: set[str] = attrs.field(factory=set)  # nodes a member reported lost, which the tracker is checking
    slow_waits: int = 0  # deadlines extended because every node waited on answered its liveness probe
    _freed: trio.Event = attrs.field(factory=trio.Event)  # set (and replaced) whenever a node slot is given back
    # block key -> the nodes of the route whose session closed with it: where a prompt's prefix is likely kept
    # (a hint for the route choice; the nodes' own answers decide what is reused). Bounded, oldest out.
    holders: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    # chain: each route's (node ids') phase groups
    phases: dict[tuple[str, ...], RoutePhases] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.metrics.watch(self._gauges)

    def _gauges(self):
        states = collections.Counter(l.rs.state.value for l in self.sessions.values())
        yield gauge("dgr_route_sessions_active", "Active Route Sessions by state", ["state"],
                    [([s.value], float(states.get(s.value, 0))) for s in RouteState if s not in (RouteState.DONE, RouteState.FAILED)])
        nodes = list(self.registry.nodes.values())
        yield gauge("dgr_node_up", "1 while the node heartbeats, else 0", ["node", "layers"],
                    [([n.node_id, f"{n.start}:{n.stop}"], float(n.alive)) for n in nodes])
        yield gauge("dgr_node_sessions", "Sessions a node reported holding", ["node"],
                    [([n.node_id], float(n.sessions)) for n in nodes])
        yield gauge("dgr_node_kv_bytes", "Hot KV State bytes a node reported", ["node"],
                    [([n.node_id], float(n.kv_bytes)) for n in nodes])

    # -- service --------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the drivers' nursery and watch node liveness until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_nodes)
                nursery.start_soon(self._watch_sessions)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                for c in self.clients.values():
                    await c.aclose()

    async def _watch_nodes(self) -> None:
        while True:
            await trio.sleep(self.config.sweep_s)
            now = trio.current_time()  # the registry's clock
            for node_id in self.registry.sweep(now):
                log.warning("node %s sent no heartbeat for %gs", node_id, self.registry.dead_after_s)
                self.node_lost(node_id, "heartbeats stopped (node dead or hung)")
            for entry in self.registry.forget(now):
                self.forget_node(entry.node_id)
            self.reconcile()

    def owe_close(self, node_id: str, sid: str) -> None:
        """Remember that `sid` may still hold KV on `node_id`: `reconcile` closes it there."""
        self.owed.owe(node_id, sid, trio.current_time())

    @property
    def unclosed(self) -> dict[tuple[str, str], float]:
        return self.owed.unclosed

    def reconcile(self) -> list[tuple[str, str]]:
        """Start the owed closes of sessions that live nodes report holding (dgr.tracker.reconcile).

        Returns the (node, session) closes started. Each runs in the gateway's
        nursery, at most one per pair at a time; a failed one is tried again
        after the node's next heartbeat.
        """
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
                                           ttl_s=self.config.capability_margin_s, scope=Scope.CONTROL)
            failure = Failure(Reason.CANCELLED, "the tracker no longer runs this Route Session", node=entry.node_id)
            with trio.move_on_after(self.config.step_deadline_s):
                await self.client(entry).close(sid, failure, cap)
                self.owed.closed(entry.node_id, sid)
                log.info("closed orphaned session %s on %s", sid, entry.node_id)
        except DgrError as exc:
            log.info("could not close orphaned session %s on %s: %s", sid, entry.node_id, exc.message)
        finally:
            self.owed.settled(entry, sid)

    def forget_node(self, node_id: str) -> None:
        """Drop what the gateway keeps per node: pooled connections, hop stats, metric labels."""
        client = self.clients.pop(node_id, None)
        self.pins.pop(node_id, None)
        if client is not None and self._nursery is not None:
            self._nursery.start_soon(client.aclose)
        self.hop_stats.pop(node_id, None)
        self.metrics.forget_node(node_id)

    async def _watch_sessions(self) -> None:
        while True:
            await trio.sleep(self.config.sweep_s)
            self.enforce_limits(trio.current_time())

    def enforce_limits(self, now: float) -> list[str]:
        """Fail sessions past `max_session_s`, cancel streams stalled past `slow_client_s`; return their ids."""
        cfg, hit = self.config, []
        for live in list(self.sessions.values()):
            rs = live.rs
            if rs.ended:
                continue
            if live.unclaimed_since is not None and now - live.unclaimed_since > cfg.unclaimed_stream_s:
                # Its response was made but its body never started: the client left in between.
                live.abort(Failure(Reason.CANCELLED, "the client went away before its stream started",
                                   phase=rs.state.value))
                hit.append(rs.sid)
            elif cfg.max_session_s is not None and now - rs.created_at > cfg.max_session_s:
                live.abort(Failure(Reason.SESSION_TIMEOUT,
                                   f"the Route Session ran past this gateway's limit of {cfg.max_session_s:g}s",
                                   phase=rs.state.value))
                hit.append(rs.sid)
            elif (cfg.slow_client_s is not None and live.writing_since is not None
                  and now - live.writing_since > cfg.slow_client_s):
                # The reader holds unread output: its socket is full. Its KV is freed
                # now rather than when it finally reads or hangs up.
                live.abort(Failure(Reason.SLOW_CLIENT,
                                   f"the client took no streamed output for over {cfg.slow_client_s:g}s",
                                   phase=rs.state.value))
                hit.append(rs.sid)
        return hit

    def node_lost(self, node_id: str, why: str) -> None:
        """Mark the node dead and fail its sessions. Their KV there is closed once it heartbeats again."""
        self.registry.mark_dead(node_id, trio.current_time())
        for live in list(self.sessions.values()):
            if any(h.node_id == node_id for h in live.rs.route):
                live.abort(Failure(Reason.ROUTE_NODE_LOST, f"lost node {node_id}: {why}", node=node_id,
                                   phase=live.rs.state.value))

    def client(self, hop: Hop | NodeEntry) -> NodeClient:
        node_id = hop.node_id
        url = hop.url
        entry = self.registry.nodes.get(node_id)
        pinned = entry.tls_cert if entry is not None and url.startswith("https://") else None
        c = self.clients.get(node_id)
        if c is None or c.url != url or self.pins.get(node_id) != pinned:
            if c is not None and self._nursery is not None:
                self._nursery.start_soon(c.aclose)  # the node moved, or has a new certificate: its old connections go
            if url.startswith("https://"):
                c = self.connect(node_id, url, ssl_context=self.tls.context(pinned))
            else:
                c = self.connect(node_id, url)
            self.clients[node_id] = c
            self.pins[node_id] = pinned
        return c

    def lookup(self, sid: str) -> RouteSession | None:
        live = self.sessions.get(sid)
        return live.rs if live is not None else self.ended.get(sid)

    def telemetry(self, sid: str) -> Broadcast | None:
        live = self.sessions.get(sid)
        return None if live is None else live.telemetry

    def models(self) -> dict[str, list[NodeEntry]]:
        out: dict[str, list[NodeEntry]] = {}
        for n in self.registry.alive():
            out.setdefault(n.model.name, []).append(n)
        return out

    # -- opening a session ------------------------------------------------------
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
        opened: list[NodeClient] = []
        reserved: tuple[NodeEntry, ...] = ()
        caps: dict[str, str] = {}
        cfg = self.config
        attempted: list[str] = []
        board: RoutePhases | None = None
        try:
            choice = await self._admit(req.model)
            for n in choice.nodes:  # held from now, so concurrent opens cannot overfill a node
                n.reserved += 1
                n.routed_at = now
            reserved = choice.nodes
            caps = self.credentials().capabilities(rs.sid, choice.hops)
            first = choice.hops[0]
            head = self.client(first)
            info = choice.nodes[0].model
            # The context is what every hop allocates per session (--ctx), not the training context.
            context = min([info.context_length, *(n.max_positions for n in choice.nodes)])
            token_limit = min(context - 1, cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else context)
            param = "messages" if req.kind == "chat" else "prompt"
            byte_limit = cfg.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max(token_limit, 1)
            if not req.prompt_ids and req.prompt_bytes() > byte_limit:
                raise CallerError(
                    Reason.PROMPT_TOO_LARGE,
                    f"the prompt has {req.prompt_bytes()} bytes; this gateway tokenizes at most {byte_limit} "
                    f"(the prompt may have at most {token_limit} tokens)",
                    param=param,
                )
            with self._patient([first.node_id], cfg.step_deadline_s) as wait:
                prompt = (list(req.prompt_ids) if req.prompt_ids
                          else await head.tokenize(req.tokenize_body(), rs.sid, caps.get(first.node_id),
                                                   vocab_size=info.vocab_size))
            if wait.scope.cancelled_caught:
                raise wait.failed("did not tokenize the prompt", first.node_id, phase=rs.state.value)
            if req.prompt_ids and max(prompt) >= info.vocab_size:
                raise CallerError(Reason.INVALID_REQUEST, f"token id {max(prompt)} is outside the vocabulary "
                                  f"of {info.vocab_size}", param="prompt")
            if not prompt:
                raise CallerError(Reason.INVALID_REQUEST, "the prompt is empty after tokenizing", param="prompt")
            if cfg.max_prompt_tokens is not None and len(prompt) > cfg.max_prompt_tokens:
                raise CallerError(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    f"the prompt has {len(prompt)} tokens; this gateway accepts at most {cfg.max_prompt_tokens}",
                    param=param,
                )
            if len(prompt) >= context:
                raise CallerError(
                    Reason.CONTEXT_LENGTH_EXCEEDED,
                    f"the prompt has {len(prompt)} tokens; this route's context is {context} "
                    "and at least one must remain for the answer",
                    param=param,
                )
            max_tokens = min(req.max_tokens, context - len(prompt))
            if cfg.max_tokens_cap is not None:
                max_tokens = min(max_tokens, cfg.max_tokens_cap)
            positions = len(prompt) + max_tokens

            root = (prefix_root(choice.digest, "" if cfg.share_prefixes else scope) if cfg.prefix_reuse else None)
            # Never the last token: its logits give the first answer token. Nor the one before: a lone
            # position would run on other kernels than a chunk (LiveSession.chunks), and giving it back
            # later would need a node to drop a position, which some memories cannot (recurrent, SWA).
            offered = prompt[: max(len(prompt) - 2, 0)]
            offer = [] if root is None else block_chain(offered, root)
            marks = "" if root is None else encode_marks(token_marks(offered[:MAX_MARKS], root))
            better = self._holding_route(offer, choice, context)
            if better is not None:
                self._release(reserved)
                for n in better.nodes:
                    n.reserved += 1
                    n.routed_at = now
                choice, reserved = better, better.nodes
                caps = self.credentials().capabilities(rs.sid, choice.hops)
            relays = self.relay_plans(rs.sid, choice.hops, req.ignore_eos)
            board = self._board(choice.hops)
            lane = None if board is None else board.join(rs.sid)
            held: dict[str, int] = {}

            async def _open(hop: Hop) -> None:
                c = self.client(hop)
                attempted.append(hop.node_id)
                try:
                    held[hop.node_id] = await c.open(rs.sid, positions, req.sampling.to_json(), caps.get(hop.node_id),
                                                     relay=relays.get(hop.node_id), prefix=offer, lane=lane,
                                                     ticket=self.credentials().ticketer(rs.sid, hop), marks=marks)
                except DgrError as refused:
                    if refused.reason is not Reason.ROUTE_NODE_LOST:
                        attempted.remove(hop.node_id)  # the node answered: it holds nothing
                    raise
                opened.append(c)

            with self._patient([h.node_id for h in choice.hops], cfg.step_deadline_s) as wait:
                async with trio.open_nursery() as nursery:
                    for hop in choice.hops:
                        nursery.start_soon(_open, hop)
            if wait.scope.cancelled_caught:
                silent = wait.silent or next((h.node_id for h in choice.hops if h.node_id not in held), None)
                raise wait.failed("did not answer while the route was being opened", silent, phase=rs.state.value)
        except BaseException as raised:
            exc = first_dgr_error(raised) if isinstance(raised, BaseExceptionGroup) else raised
            failure = _failure_of(exc, rs)
            with trio.CancelScope(shield=True):
                await self._close_nodes(rs.sid, opened, failure, caps)
            self._release(reserved)
            if board is not None:
                self._leave_phases(board, rs.sid)
            confirmed = {c.node_id for c in opened}
            for node_id in attempted:
                if node_id not in confirmed:  # no reply came (lost, cut, or late): it may hold the session anyway
                    self.owe_close(node_id, rs.sid)
            if failure is not None:
                rs.fail(failure, trio.current_time())
                self._count_end(rs)
                self._retire(rs)
            if isinstance(exc, trio.TooSlowError):
                raise PeerError(Reason.ROUTE_NODE_LOST, failure.message, node=failure.node) from None
            if exc is not raised and isinstance(exc, DgrError):
                raise exc from None
            raise
        send, recv = trio.open_memory_channel(math.inf)
        live = LiveSession(
            rs=rs, request=req, prompt=prompt, max_tokens=max_tokens, nodes=choice.nodes,
            model_width=info.seam_width, needs_token_ids=info.needs_token_ids, telemetry=Broadcast(),
            send=send, recv=recv, caps=caps, prefix_root=root, keep_generated=cfg.prefix_keep_generated,
            phases=board,
        )
        # every node must start from the same position: the shortest prefix any of them holds
        reused = min([len(offered), *held.values()]) if root is not None else 0
        live.telemetry.publish(rs.route_ready(choice.hops, len(prompt), trio.current_time(), prefix_reused=reused))
        self.metrics.prefix_reused_tokens_total.inc(reused)
        self.metrics.prompt_tokens_total.inc(len(prompt))
        self.sessions[rs.sid] = live
        if self._nursery is None:
            raise PeerError(Reason.INTERNAL, "the gateway is not running")
        self._nursery.start_soon(self._drive, live)
        return live

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

    def _note_holders(self, live: LiveSession, chain: list[str] | None) -> None:
        if not chain:
            return
        nodes = frozenset(h.node_id for h in live.rs.route)
        for key in chain:
            self.holders[key] = nodes
            self.holders.move_to_end(key)
        while len(self.holders) > _HOLDER_KEYS:
            self.holders.popitem(last=False)

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

    @staticmethod
    def _measure(nodes, rs: RouteSession, failure: Failure | None) -> None:
        """What the session showed of its nodes' capacity (dgr.tracker.registry, `NodeEntry.limit`)."""
        for n in nodes:
            if n.node_id in rs.lost:
                n.faulted()
            elif failure is None:
                n.served()

    def _release(self, nodes) -> None:
        """Give back one session's slot on each of `nodes` (its close is done) and wake waiting opens."""
        for n in nodes:
            n.reserved = max(0, n.reserved - 1)
        self._freed.set()
        self._freed = trio.Event()

    def cancel(self, sid: str, why: str) -> None:
        live = self.sessions.get(sid)
        if live is not None and not live.rs.ended:
            live.abort(Failure(Reason.CANCELLED, why, phase=live.rs.state.value))

    # -- the driver -------------------------------------------------------------
    async def _drive(self, live: LiveSession) -> None:
        rs = live.rs
        failure: Failure | None = None
        try:
            with live.scope:
                try:
                    async with trio.open_nursery() as links:  # a chain's watcher of its link to the head
                        live.links = links
                        first = await self._prefill(live)
                        if self.config.topology is Topology.RING:
                            # the tail feeds the head from here on: a lost head is the tail's to report
                            links.start_soon(self._end_head, live, True)
                        await self._decode(live, first)
                        links.cancel_scope.cancel()
                except (DgrError, BaseExceptionGroup) as raised:
                    exc = first_dgr_error(raised)
                    if not isinstance(exc, DgrError):
                        if isinstance(raised, BaseExceptionGroup) and raised.split(trio.Cancelled)[1] is None:
                            raise  # only cancellations: the scope records why, below
                        log.error("route session %s crashed", rs.sid, exc_info=raised)
                        failure = Failure(Reason.INTERNAL, f"gateway error: {raised!r}"[:300], phase=rs.state.value)
                    else:
                        failure = exc.failure(phase=exc.details.get("phase") or rs.state.value)
                        if exc.reason is Reason.ROUTE_NODE_LOST and exc.details.get("node") and not exc.details.get("reported"):
                            self.node_lost(exc.details["node"], exc.message)
                except Exception as exc:
                    log.exception("route session %s crashed", rs.sid)
                    failure = Failure(Reason.INTERNAL, f"gateway error: {exc!r}"[:300], phase=rs.state.value)
            if failure is None and live.scope.cancelled_caught:
                # cancelled from outside: a node died (registry) or the client went away
                failure = rs.pending or Failure(Reason.CANCELLED, "cancelled", phase=rs.state.value)
        finally:
            if live.phases is not None:  # its group must not wait for it while its nodes close
                self._wake(live.phases.stop(rs.sid))
            with trio.CancelScope(shield=True):
                if failure is None and not rs.ended:
                    failure = Failure(Reason.INTERNAL, "driver ended without finishing", phase=rs.state.value)
                if failure is not None:
                    live.telemetry.publish(rs.fail(failure, trio.current_time()))
                self._count_end(rs)
                survivors = [self.client(h) for h in rs.route if h.node_id not in rs.lost]
                for node_id in rs.lost:  # it may only have been slow: closed once it heartbeats again
                    self.owe_close(node_id, rs.sid)
                keep = live.kv_keep() if failure is None else None
                async with trio.open_nursery() as ending:
                    ending.start_soon(self._end_head, live)
                    await self._close_nodes(rs.sid, survivors, failure, live.caps, keep=keep)
                self._note_holders(live, keep[0] if keep else None)
                if live.phases is not None:
                    self._leave_phases(live.phases, rs.sid)
                self._measure(live.nodes, rs, failure)
                self._release(live.nodes)
                live.send.close()
                live.telemetry.close()
                self.sessions.pop(rs.sid, None)
                self._retire(rs)

    def credentials(self) -> Credentials:
        """What this gateway signs a session's calls with (dgr.tracker.credentials)."""
        return Credentials(self.authority, self.config.topology,
                           (self.config.max_session_s or 24 * 3600.0) + self.config.capability_margin_s,
                           self._pinned)

    def relay_plans(self, sid: str, hops: tuple[Hop, ...], ignore_eos: bool = False) -> dict[str, dict[str, Any]]:
        return self.credentials().relay_plans(sid, hops, ignore_eos)

    def _pinned(self, node_id: str) -> str | None:
        """The TLS certificate a node registered: a chain's previous node pins it to call this one."""
        entry = self.registry.nodes.get(node_id)
        return None if entry is None else entry.tls_cert

    async def _close_nodes(self, sid: str, clients: list[NodeClient], failure: Failure | None,
                           caps: dict[str, str], keep: tuple[list[str], str] | None = None) -> None:
        closed: set[str] = set()

        async def _one(c: NodeClient) -> None:
            try:
                await c.close(sid, failure, caps.get(c.node_id), keep=keep[0] if keep else None,
                              tail=keep[1] if keep else "")
                closed.add(c.node_id)
            except DgrError as exc:
                log.info("could not close %s on %s: %s", sid, c.node_id, exc.message)

        with trio.move_on_after(2.0):
            async with trio.open_nursery() as nursery:
                for c in clients:
                    nursery.start_soon(_one, c)
        for c in clients:
            if c.node_id not in closed:
                self.owe_close(c.node_id, sid)

    def _count_end(self, rs: RouteSession) -> None:
        self.metrics.sessions_total.labels(outcome=rs.state.value).inc()
        if rs.failure is not None:
            self.metrics.failures_total.labels(reason=rs.failure.reason.value).inc()
            self.recent_failures.append({"session": rs.sid, "model": rs.model, "at": time.time(), **rs.failure.to_json()})

    def _retire(self, rs: RouteSession) -> None:
        self.ended[rs.sid] = rs
        while len(self.ended) > self.config.keep_ended:
            self.ended.popitem(last=False)

    def _deadline(self, n_tokens: int) -> float:
        return self.config.step_deadline_s + self.config.per_token_deadline_s * n_tokens

    @contextlib.contextmanager
    def _patient(self, nodes: list[str], deadline_s: float) -> Iterator[Wait]:
        """A cancel scope for a wait on `nodes` that ends at `deadline_s` unless they all answer /healthz.

        A watcher (in the gateway's nursery, so the caller's exceptions stay its own) probes the nodes
        shortly before the deadline: while every one answers, the deadline moves on by `deadline_s`,
        up to `slow_cap` times it; a silent one ends the wait at once. The caller checks
        `wait.scope.cancelled_caught` and raises `wait.failed(...)`.
        """
        now = trio.current_time()
        wait = Wait(trio.CancelScope(deadline=now + deadline_s), now, now + deadline_s * max(1.0, self.config.slow_cap))
        watcher = trio.CancelScope()
        if self._nursery is not None and wait.cap > wait.scope.deadline:
            self._nursery.start_soon(keep_waiting, wait, list(nodes), deadline_s, watcher, self._silent,
                                     self._extended)
        try:
            with wait.scope:
                yield wait
        finally:
            watcher.cancel()

    def _extended(self) -> None:
        self.slow_waits += 1

    async def _silent(self, nodes: list[str], within_s: float) -> str | None:
        """The first of `nodes` that does not answer /healthz within `within_s` (asked all at once); None if
        all do. A node the registry no longer holds as alive is silent."""
        answered: set[str] = set()

        async def ask(node_id: str) -> None:
            entry = self.registry.nodes.get(node_id)
            if entry is None or not entry.alive:
                return
            try:
                await self.client(entry).alive()
            except PeerError:
                return
            answered.add(node_id)

        with trio.move_on_after(within_s):
            async with trio.open_nursery() as nursery:
                for node_id in nodes:
                    nursery.start_soon(ask, node_id)
        return next((n for n in nodes if n not in answered), None)

    async def _call(self, live: LiveSession, i: int, frame: bytes, n_tokens: int, step: int) -> StepReply:
        hop = live.rs.route[i]
        with self._patient([hop.node_id], self._deadline(n_tokens)) as wait:
            reply = await self.client(hop).step(frame, live.caps.get(hop.node_id))
        if wait.scope.cancelled_caught:
            raise wait.failed(f"did not answer step {step}", hop.node_id, step=step, phase=live.rs.state.value)
        self._note_hop(live, hop.node_id, max(0.0, reply.rtt_s - reply.compute_s))
        self.metrics.seam_bytes_total.labels(node=hop.node_id, kind=frame_kind(frame).name).inc(len(frame))
        return reply

    def _frame(self, live: LiveSession, i: int, kind: FrameKind, seq: int, pos0: int, ids: list[int],
               hidden: bytes | None, sample: bool) -> bytes:
        head = i == 0
        return encode_frame(
            kind, live.rs.sid, seq, pos0, len(ids), live.model_width,
            dtype=self.config.seam_dtype,
            flags=Flag.SAMPLE if sample else Flag(0),
            token_ids=ids if (head or live.needs_token_ids) else None,
            hidden=None if head else hidden,
        )

    async def _prefill(self, live: LiveSession) -> TokenResult:
        if self.config.topology.forwards:
            return await self._prefill_chain(live)
        rs, chunks = live.rs, live.chunks(self.config.prefill_chunk)
        last = len(chunks) - 1
        n_hops = len(rs.route)
        result: list[TokenResult] = []

        async def hop_task(i: int, recv: trio.MemoryReceiveChannel, send: trio.MemorySendChannel | None) -> None:
            async with recv:
                async for k, pos0, ids, hidden in recv:
                    tail = i == n_hops - 1
                    frame = self._frame(live, i, FrameKind.PREFILL, k, pos0, ids, hidden, tail and k == last)
                    reply = await self._call(live, i, frame, len(ids), k)
                    if not tail:
                        if reply.frame.kind is not FrameKind.HIDDEN:
                            raise PeerError(Reason.NODE_ERROR, f"{rs.route[i].node_id} sent {reply.frame.kind.name}",
                                            node=rs.route[i].node_id)
                        await send.send((k, pos0, ids, reply.raw[HEADER_SIZE:]))
                    elif k == last:
                        result.append(TokenResult.from_frame(reply.frame))
                    else:
                        live.telemetry.publish(rs.prefill_progress(pos0 + len(ids), trio.current_time()))
            if send is not None:
                await send.aclose()

        async with trio.open_nursery() as nursery:
            first_send, recv = trio.open_memory_channel(1)
            for i in range(n_hops):
                if i < n_hops - 1:
                    nxt_send, nxt_recv = trio.open_memory_channel(1)
                else:
                    nxt_send, nxt_recv = None, None
                nursery.start_soon(hop_task, i, recv, nxt_send)
                recv = nxt_recv
            async with first_send:
                for k, pos0, ids in chunks:
                    await first_send.send((k, pos0, ids, None))
        if not result:
            raise PeerError(Reason.NODE_ERROR, "the tail gave no token after prefill")
        return result[0]

    async def _decode(self, live: LiveSession, token: TokenResult) -> None:
        rs = live.rs
        pos = len(live.prompt)
        seq = len(live.chunks(self.config.prefill_chunk))  # after the prefill chunks
        n_hops = len(rs.route)
        topology = self.config.topology
        t_ring = time.perf_counter()
        last: float | None = None
        sent: float | None = None  # when the last decode step went out, after its phase hold (dgr.fsm.phases)
        hops: tuple[str, float] | None = None  # a chain answer's hops text and round trip, noted off the critical path
        while True:
            now = trio.current_time()
            eog = token.eog and not live.request.ignore_eos
            event = rs.token(now, completion=not eog)  # published below, off the next step's path
            if not eog:
                text = live.text.feed(token.piece)
                if text:
                    live.send.send_nowait(Delta(text, rs.completion_tokens))
            verdict = next_step(eog=token.eog, ignore_eos=live.request.ignore_eos, generated=rs.completion_tokens,
                                max_tokens=live.max_tokens, stopped=live.text.stopped)
            more = verdict.more
            chain = more and topology is Topology.CHAIN
            # On a ring the tail has already sent this token's step to the head when `more` holds for it
            # (it decides alike, bar stop strings: those end the session here, and the steps it sent on
            # are only compute its close discards). The gateway waits for the next answer.
            ring = more and topology is Topology.RING
            if more:
                live.fed.append(token.token)  # from here it is in the KV (a failed step fails the session)
            if chain:  # the next step goes out first: this token's bookkeeping runs while the route computes
                frame = self._frame(live, 0, FrameKind.DECODE, seq, pos, [token.token], None, True)
                if live.phases is not None:
                    await self._in_phase(live, hold_s=hold_for(now, sent))
                sent = trio.current_time()
                t0 = time.perf_counter()
                try:
                    await self._send_head(live, frame, 1, seq)
                finally:  # also when the send failed: the token came before the failure
                    self._note_token(live, event, now, last)
            else:
                self._note_token(live, event, now, last)
            last = now
            if hops is not None:
                self._note_hops(live, *hops)
            if not more:
                return self._finish(live, verdict.finish)
            if chain:
                answer, header = await self._answer(live, seq, 1)
                hops = (header, time.perf_counter() - t0)
                self.hop_stats[rs.route[0].node_id].decode_bytes = len(frame)
                token = TokenResult.from_frame(answer)
            elif ring:
                answer, header = await self._answer(live, seq, 1)
                arrived = time.perf_counter()  # a ring token's round trip: the time since the answer before
                hops = (header, arrived - t_ring)
                t_ring = arrived
                stats = self.hop_stats[rs.route[0].node_id]
                if not stats.decode_bytes:  # the tail's step to the head, as the gateway would have built it
                    stats.decode_bytes = len(self._frame(live, 0, FrameKind.DECODE, seq, pos, [token.token], None,
                                                         True))
                token = TokenResult.from_frame(answer)
            else:
                hidden: bytes | None = None
                for i in range(n_hops):
                    frame = self._frame(live, i, FrameKind.DECODE, seq, pos, [token.token], hidden, i == n_hops - 1)
                    reply = await self._call(live, i, frame, 1, seq)
                    self.hop_stats[rs.route[i].node_id].decode_bytes = len(frame)
                    if i < n_hops - 1:
                        hidden = reply.raw[HEADER_SIZE:]
                token = TokenResult.from_frame(reply.frame)
            pos += 1
            seq += 1

    def _note_token(self, live: LiveSession, event: dict[str, Any], now: float, last: float | None) -> None:
        """A token arrived at `now` (the one before at `last`): the Route Session's event and the metrics."""
        live.telemetry.publish(event)
        self.metrics.generated_tokens_total.inc()
        if last is None:
            self.metrics.ttft_seconds.observe(now - live.rs.created_at)
        else:
            self.metrics.token_latency_seconds.observe(now - last)

    # -- the chain: phase groups -----------------------------------------------------------
    def _board(self, hops: tuple[Hop, ...]) -> RoutePhases | None:
        """The phase board of a chain route through `hops` (made on first use); None on a star."""
        if not self.config.topology.forwards:
            return None
        key = tuple(h.node_id for h in hops)
        board = self.phases.get(key)
        if board is None:
            board = self.phases[key] = RoutePhases(len(hops))
        return board

    def _leave_phases(self, board: RoutePhases, sid: str) -> None:
        """`sid`'s node sessions are closed: its lane is free, and a board with no lanes goes."""
        self._wake(board.leave(sid))
        if not board.lanes:
            self.phases = {k: b for k, b in self.phases.items() if b is not board}

    def _wake(self, sids: list[str]) -> None:
        """Release sessions waiting for their phase group (the board only releases waiting ones)."""
        for sid in sids:
            live = self.sessions.get(sid)
            if live is not None:
                live.go.set()

    async def _in_phase(self, live: LiveSession, hold_s: float) -> None:
        """Wait (at most `hold_s`) until every decoding session of `live`'s phase group has its token."""
        board, sid = live.phases, live.rs.sid
        released = board.arrive(sid)
        if sid in released:
            self._wake([s for s in released if s != sid])
            return
        live.go = trio.Event()
        with trio.move_on_after(hold_s):
            await live.go.wait()
        alone = not live.go.is_set()  # (a session cancelled while waiting stops in the driver's `finally`)
        if alone:
            board.withdraw(sid)
        self.metrics.phase_waits_total.labels(outcome="alone" if alone else "released").inc()

    # -- the chain: the head gets each step, the tail delivers the answer ------------------
    async def _send_head(self, live: LiveSession, frame: bytes, n_tokens: int, step: int) -> None:
        """One step to the head, on the session's stream to it (opened with the first step)."""
        hop = live.rs.route[0]
        client = self.client(hop)
        with self._patient([hop.node_id], self._deadline(n_tokens)) as wait:
            try:
                if live.head is None:
                    live.head = await client.open_stream(live.rs.sid, live.caps.get(hop.node_id))
                    live.links.start_soon(self._watch_head, live, client, live.head)
                await client.stream_send(live.head, frame)
            except PeerError:
                # the head may have refused a step and hung up just before: its answer says so
                with trio.move_on_after(_REFUSAL_S):
                    await live.head_answered.wait()
                if live.head_failure is not None:
                    f = live.head_failure
                    raise PeerError(f.reason, f.message, node=f.node, step=step, phase=live.rs.state.value) from None
                raise
        if wait.scope.cancelled_caught:
            raise wait.failed(f"did not take step {step}", hop.node_id, step=step, phase=live.rs.state.value)
        self.metrics.seam_bytes_total.labels(node=hop.node_id, kind=frame_kind(frame).name).inc(len(frame))

    async def _watch_head(self, live: LiveSession, client: NodeClient, stream: OutStream) -> None:
        """The head answers its stream early only to refuse a step, and a broken link means it is lost:
        either fails the session through its inbox, whatever step the driver is waiting on."""
        try:
            answer: HttpResponse | TransportError = await stream.answer()
        except TransportError as exc:
            answer = exc
        if live.head_ending:
            live.head_answered.set()
            return
        live.head_failure = client.stream_failure(answer, phase=live.rs.state.value)
        live.head_answered.set()
        live.inbox[0].send_nowait(live.head_failure)

    async def _end_head(self, live: LiveSession, watched: bool = False) -> None:
        """End the stream to the head (it answers once it has read the end), then pool its connection.

        `watched`: `_watch_head` still reads the answer (a ring ends the stream after its prefill).
        """
        head, live.head = live.head, None  # ended once, by whoever comes first
        if head is None:
            return
        live.head_ending = True
        try:
            if live.head_failure is None:
                with trio.move_on_after(_END_S):
                    try:
                        await head.end()
                        await (live.head_answered.wait() if watched else head.answer())
                    except TransportError:
                        pass
        finally:
            with trio.CancelScope(shield=True):
                await head.release()

    async def _answer(self, live: LiveSession, seq: int, n_tokens: int) -> tuple[Frame, str]:
        """The tail's answer to step `seq`: (frame, hops text).

        Raises:
            PeerError: a node reported a failure, or no answer came within the route's deadline.
        """
        deadline = self._deadline(n_tokens) * len(live.rs.route)
        # Waited for here, not by a watcher task as `_patient` does: this is every token's path on a ring,
        # and an inbox wait can be cut and taken up again without losing anything.
        start = trio.current_time()
        until, cap = start + deadline, start + deadline * max(1.0, self.config.slow_cap)
        nodes = [h.node_id for h in live.rs.route]
        tail = live.rs.route[-1].node_id
        probed = False
        while True:
            last = until >= cap
            with trio.move_on_at(until if last else until - lead(deadline)):
                return await self._take(live, seq)
            wait = Wait(trio.CancelScope(), start, cap)
            if last:  # still alive when last asked (or never asked: no patience configured)
                wait.silent = None if probed else tail
            else:
                wait.silent = await self._silent(nodes, lead(deadline))
                probed = True
                if wait.silent is None:
                    until = min(cap, until + deadline)
                    self.slow_waits += 1
                    continue
            raise wait.failed(f"gave no answer to step {seq}", tail, route=True, step=seq, phase=live.rs.state.value)

    @staticmethod
    async def _take(live: LiveSession, seq: int) -> tuple[Frame, str]:
        """The next item of `live`'s inbox, which must be the answer to step `seq`.

        Raises:
            PeerError: a member's report (it fails this session, and marks no node dead), or another step's answer.
        """
        item = await live.inbox[1].receive()
        if isinstance(item, Failure):
            raise PeerError(item.reason, item.message, node=item.node, step=seq, phase=live.rs.state.value,
                            reported=True)
        frame, hops = item
        if frame.seq != seq:
            raise PeerError(Reason.NODE_ERROR, f"the route answered step {frame.seq}, not {seq}",
                            node=live.rs.route[-1].node_id, step=seq, phase=live.rs.state.value)
        return frame, hops

    def _note_hops(self, live: LiveSession, hops: str, round_trip_s: float) -> None:
        """Per-hop compute from the hops text; what is left of the round trip is the seam's, shared out."""
        compute: dict[str, float] = {}
        for part in hops.split(","):
            node, _, us = part.partition("=")
            if node and us.isdigit():
                compute[node] = int(us) / 1e6
        route = live.rs.route
        # a token crosses N + 1 links on a chain: the gateway's to the head, N - 1 between nodes, the tail's
        # back; on a ring N: N - 1 between nodes and the tail's to the head
        links = len(route) + (0 if self.config.topology is Topology.RING else 1)
        share = max(0.0, round_trip_s - sum(compute.values())) / links
        for hop in route:
            self._note_hop(live, hop.node_id, share)

    def _note_hop(self, live: LiveSession, node_id: str, overhead_s: float) -> None:
        """One hop's seam overhead (round trip less compute) into each view of it: the session's
        telemetry, /v1/stats percentiles and the /metrics histogram."""
        live.rs.hop_latency_ms[node_id] = round(overhead_s * 1e3, 4)
        self.hop_stats[node_id].overhead_ms.append(overhead_s * 1e3)
        self.metrics.hop_latency_seconds.labels(node=node_id).observe(overhead_s)

    async def _prefill_chain(self, live: LiveSession) -> TokenResult:
        rs, chunks = live.rs, live.chunks(self.config.prefill_chunk)
        last = len(chunks) - 1

        # At most one chunk a node in flight: enough for every node to compute at once, and no more, so
        # a node never queues a whole prompt (a session closed mid-prefill waits for what its head holds).
        window = trio.Semaphore(len(rs.route))

        async def feed() -> None:  # every chunk to the head, in order: the chain pipelines them
            for k, pos0, ids in chunks:
                await window.acquire()
                await self._send_head(live, self._frame(live, 0, FrameKind.PREFILL, k, pos0, ids, None, k == last),
                                      len(ids), k)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            for k, pos0, ids in chunks:
                answer, _ = await self._answer(live, k, len(ids))
                window.release()
                if k < last:
                    live.telemetry.publish(rs.prefill_progress(pos0 + len(ids), trio.current_time()))
        if answer.kind is not FrameKind.TOKEN:
            raise PeerError(Reason.NODE_ERROR, "the tail gave no token after prefill", node=rs.route[-1].node_id)
        return TokenResult.from_frame(answer)

    def report(self, body: bytes, capability: str | None) -> None:
        """A chain session's node reports a failure (JSON: session, reporter, code, message, node).

        A report is scoped to its session: the reporter and the node it names must be hops of that
        session's route, only that session fails, and no node is marked dead on a member's word (the
        registry's heartbeats decide). The client is told who reported what in the tracker's words;
        the reporter's own text goes to the tracker's log only.

        Raises:
            CallerError(BAD_FRAME | INVALID_REQUEST | UNKNOWN_SESSION | FORBIDDEN): refused; nothing changed.
        """
        data = parse_json(body)
        sid = data.get("session")
        try:
            failure = Failure.from_json(data)
        except (ValueError, KeyError, TypeError):
            raise CallerError(Reason.INVALID_REQUEST, "a failure report needs a code and a message") from None
        self.authorize_delivery(capability, sid if isinstance(sid, str) else "")
        live = self._live(sid)
        members = {h.node_id for h in live.rs.route}
        reporter = data.get("reporter")
        if reporter not in members or (failure.node is not None and failure.node not in members):
            raise CallerError(Reason.FORBIDDEN, "a report comes from a node of its session's route and names only one")
        log.warning("session %s: node %s reports %s for %s: %.200s", sid, reporter, failure.reason.value,
                    failure.node or "itself", failure.message)
        said = f"node {reporter} reported {failure.reason.value}" + (f" for node {failure.node}" if failure.node else "")
        live.inbox[0].send_nowait(Failure(failure.reason, said, node=failure.node, step=failure.step))
        if failure.reason is Reason.ROUTE_NODE_LOST and failure.node is not None:
            self._probe_soon(failure.node)

    def _probe_soon(self, node_id: str) -> None:
        """Check a node a member reported lost with the tracker's own request; only its silence marks it dead."""
        entry = self.registry.nodes.get(node_id)
        if entry is None or not entry.alive or self._nursery is None or node_id in self._probing:
            return
        self._probing.add(node_id)
        self._nursery.start_soon(self._probe, entry)

    async def _probe(self, entry: NodeEntry) -> None:
        try:
            with trio.move_on_after(PROBE_S) as scope:
                await self.client(entry).alive()
            if scope.cancelled_caught:
                self.node_lost(entry.node_id, f"no answer to the tracker's probe within {PROBE_S:g}s")
        except PeerError:
            self.node_lost(entry.node_id, "the tracker's probe could not reach it")
        finally:
            self._probing.discard(entry.node_id)

    def authorize_delivery(self, capability: str | None, sid: str) -> None:
        """Check a delivery capability for session `sid`. Raises CallerError(FORBIDDEN)."""
        if self.authority is not None:
            self.authority.check(capability, session=sid, node=_GATEWAY, start=0, stop=1, now=time.time(),
                                 need=Scope.STEP)

    def deliver_frame(self, sid: str, body: bytes, hops: str) -> None:
        """An answer from a delivery stream already authorized for `sid`.

        Raises:
            CallerError(BAD_FRAME | FORBIDDEN | UNKNOWN_SESSION): refused; nothing changed.
        """
        frame = self._answer_frame(body)
        if frame.session != sid:
            raise CallerError(Reason.FORBIDDEN, f"a delivery stream of session {sid} carried an answer of {frame.session}")
        self._live(sid).inbox[0].send_nowait((frame, hops))

    @staticmethod
    def _answer_frame(body: bytes) -> Frame:
        frame = decode_frame(body)
        if frame.kind not in (FrameKind.TOKEN, FrameKind.ACK):
            raise CallerError(Reason.BAD_FRAME, f"a chain delivers TOKEN or ACK frames, not {frame.kind.name}")
        return frame

    def _live(self, sid: Any) -> LiveSession:
        live = self.sessions.get(sid) if isinstance(sid, str) else None
        if live is None or live.rs.ended:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no live Route Session {str(sid)[:64]}")
        return live

    def _finish(self, live: LiveSession, reason: str) -> None:
        tail = live.text.finish()
        if tail:
            live.send.send_nowait(Delta(tail, live.rs.completion_tokens))
        live.telemetry.publish(live.rs.finish(reason, trio.current_time()))

    # -- views --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        states = collections.Counter(l.rs.state.value for l in self.sessions.values())
        states.update(rs.state.value for rs in self.ended.values())
        return {
            "sessions": dict(states),
            "active": len(self.sessions),
            "failures": self.metrics.failure_counts(),
            "recent_failures": list(self.recent_failures),
            "hops": {k: v.to_json() for k, v in self.hop_stats.items()},
            "slow_waits": self.slow_waits,
        }


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
