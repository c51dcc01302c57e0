"""The node's driver: seam frames in, backend compute, seam frames out.

Theory: a frame is parsed and checked (dgr.seam.frame), matched against its
`NodeSession` (dgr.fsm.node), which refuses anything out of order before any
state changes, then it becomes a job of the node's `StepScheduler`
(dgr.node.scheduler), the one owner of the backend, which batches it with
other sessions' steps. Every other backend call (open, close, status, and
tokenize where the text is not apart from the compute) is a scheduler job
too, so nothing here touches the backend from the event loop, and llama.cpp
never sees two calls at once. A step whose caller
has gone still runs to its end: the session's counters were advanced when
it was accepted, so the KV and the counters agree either way.

Sessions end by `close` (the gateway is done), by failure (the gateway saw
the route break, or compute raised) or by idle expiry. Each frees its KV,
after any of its steps already queued. Ended session ids are remembered
(bounded) so a late frame is refused as `session_ended`, not
`unknown_session`.

Prefix cache (dgr.node.prefix): a session closed normally with the hash
chain of the tokens in its KV (`keep`) and the marks of its positions past
the last whole block (`tail`) leaves its KV behind as a kept prefix; an open
that offers a chain and marks (`prefix`, `marks`) starts from the longest
kept prefix matching it, to the token, cut to the positions shared: it
takes the kept KV over when it shares all its whole blocks (a
conversation's next turn) or no slot is free, else starts from a copy; a
memory that cannot drop the positions past them opens empty. The offered
marks are remembered with the session, to name its KV if it is kept. The
cache is touched only in the scheduler's thread, in the same job as the
backend calls it decides, so the two never disagree. A kept prefix
holds a sequence slot that no live session holds: an open that finds no
free slot evicts the least recently used prefix first, so the capacity
check (live sessions only) is the only refusal. `kv_bytes` and `sessions`
count live sessions only; kept prefixes are reported apart (`prefix`).

Authorization: a node with a tracker (`joining`) pins the tracker's public
key when it joins (`join`); from then on every call that names a session
(open, step, close, status, tokenize) must carry the capability the tracker
signed for that session, this node and these layers (dgr.security.auth).
Steps need any (a neighbour's `STEP` one will do); open, close, status and
tokenize need the gateway's `CONTROL` one. An open also needs the
tracker's single-use ticket for exactly its body (dgr.security.tickets):
`admit_open` checks it from the headers, `redeem_open` the body's bytes
before they are parsed, and each session id opens here once. Before it has
joined, such calls are refused. It is checked before anything else about
the session is looked at, so an unauthorized caller learns nothing and
changes nothing. A node without a tracker (loopback development) asks for
no capability and no ticket. The node holds no key that can make either:
its own key signs only its messages and proof answers.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from typing import Any, Callable

import attrs
import numpy as np
import trio

from dgr.backends.base import COMPUTE_ERRORS, ShardBackend, Step
from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason
from dgr.fsm.node import NodeSession, StepKind
from dgr.fsm.stop import next_step
from dgr.metrics import NodeMetrics, gauge
from dgr.node import steptrace
from dgr.node.prefix import BLOCK_TOKENS, MARK_BYTES, Kept, PrefixCache
from dgr.node.relay import Loop, Outgoing, Relay, RelayPlan, Report, SelfLoop
from dgr.node.ringphases import RingPhases
from dgr.node.scheduler import DEFAULT_ITERATION_TARGET_S, Job, JobKind, StepScheduler
from dgr.node.snapshot import SnapshotDir
from dgr.seam.transport import ConnectionPool
from dgr.sampling import Sampler, SamplingParams
from dgr.seam.stream import Record
from dgr.seam.frame import Frame, TokenResult, decode_frame, encode_frame
from dgr.seam.wire import MAX_FRAME_BYTES, STATUS_SCOPE, Flag, FrameKind
from dgr.security.auth import ANSWER_DOMAIN, CHALLENGE_DOMAIN, CapabilityAuthority, Scope, sign_json, verify_json
from dgr.security.tickets import OpenTicket, TicketBook
from dgr.security.identity import Identity
from dgr.security.tls import TlsTrust

__all__ = ["NodeService", "SeamStats"]

log = logging.getLogger("dgr.node")

_ENDED_MEMORY = 4096
_KIND_STEP = {FrameKind.PREFILL: StepKind.PREFILL, FrameKind.DECODE: StepKind.DECODE}


@attrs.define
class SeamStats:
    """Bytes and counts of frames received, by kind; the decode seam measured on the wire."""

    frames_in: collections.Counter = attrs.field(factory=collections.Counter)
    bytes_in: collections.Counter = attrs.field(factory=collections.Counter)
    bytes_out: collections.Counter = attrs.field(factory=collections.Counter)
    last_decode_frame_bytes: int = 0
    last_decode_hidden_bytes: int = 0
    refused: collections.Counter = attrs.field(factory=collections.Counter)
    compute_s: float = 0.0  # summed over steps, each counted with its whole batch's call (the busy time: scheduler.busy_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "frames_in": dict(self.frames_in),
            "bytes_in": dict(self.bytes_in),
            "bytes_out": dict(self.bytes_out),
            "last_decode_frame_bytes": self.last_decode_frame_bytes,
            "last_decode_hidden_bytes": self.last_decode_hidden_bytes,
            "refused": dict(self.refused),
            "compute_s": round(self.compute_s, 6),
        }


@attrs.define
class NodeService:
    backend: ShardBackend
    node_id: str
    idle_timeout_s: float = 120.0
    max_frame_bytes: int = MAX_FRAME_BYTES
    sessions: dict[str, NodeSession] = attrs.field(factory=dict)
    samplers: dict[str, Sampler] = attrs.field(factory=dict)
    ended: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # sid -> Failure | None
    stats: SeamStats = attrs.field(factory=SeamStats)
    started_at: float = attrs.field(factory=time.monotonic)
    metrics: NodeMetrics = attrs.field(factory=NodeMetrics)
    authority: CapabilityAuthority | None = None  # the pinned tracker key; None: not joined (or no tracker)
    tickets: TicketBook | None = None  # open tickets, checked with the pinned tracker key; None: as `authority`
    joining: bool = False  # has a tracker: session calls need its capabilities, refused until joined
    identity: Identity | None = None  # this node's key: signs its membership messages and proof answers
    tracker_key: bytes | None = None  # pinned at join
    advertised: str | None = None  # the URL the tracker recorded for this node
    joined: trio.Event = attrs.field(factory=trio.Event)  # set once the tracker key is pinned
    tls: TlsTrust = attrs.field(factory=TlsTrust)  # whom this node's own https calls trust
    scheduler: StepScheduler = attrs.field(init=False)
    # read once, before the scheduler owns the backend; fixed for the node's life
    capacity: int = attrs.field(init=False)
    max_positions: int = attrs.field(init=False)  # KV positions per session (the node's --ctx)
    described: dict[str, Any] = attrs.field(init=False)
    tracker_url: str | None = None  # where a chain session's answers and failure reports go
    relays: dict[str, Relay] = attrs.field(factory=dict)  # chain sessions: sid -> its relay
    loops: dict[str, Relay | SelfLoop] = attrs.field(factory=dict)  # a ring's tail: sid -> its way back to the head
    on_route: collections.Counter = attrs.field(factory=collections.Counter)  # route -> its chain sessions open here
    ring: RingPhases = attrs.field(init=False)  # a ring's tail: its steps to the head, held for their phase group
    pools: dict[str, ConnectionPool] = attrs.field(factory=dict)  # url -> keep-alive connections there
    # (url, TLS context) -> the pool to it: sockets; in-process routes pass an in-memory net's (dgr.testing)
    connect_pool: Callable[..., ConnectionPool] = ConnectionPool
    # kept prefixes; None where the backend cannot keep them or the node keeps none (--prefix-cache-mb 0)
    prefix: PrefixCache | None = attrs.field(factory=PrefixCache)
    prefix_bytes: int = 0  # kept prefixes' bytes as of the last job that changed them
    offered: dict[str, bytes] = attrs.field(factory=dict)  # session -> the marks its open offered (dgr.node.prefix)
    snapshots: SnapshotDir | None = None  # --snapshot-dir: kept prefixes written to disk, reloaded at start
    busy_poll_s: float = 0.0  # --busy-poll-ms: StepScheduler.busy_poll_s
    iteration_target_s: float = DEFAULT_ITERATION_TARGET_S  # --iteration-target-ms: StepScheduler's
    _nursery: trio.Nursery | None = None
    _text_calls: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(1), init=False)

    def __attrs_post_init__(self) -> None:
        self.scheduler = StepScheduler(self.backend, busy_poll_s=self.busy_poll_s,
                                       iteration_target_s=self.iteration_target_s)
        self.ring = RingPhases(self._loop_send)
        self.capacity = self.backend.max_sessions()
        self.max_positions = self.backend.max_positions()
        self.described = self.backend.describe()
        if self.prefix is not None and not self.backend.prefix_capable:
            self.prefix = None  # this backend holds no KV beyond a session's life
        if self.prefix is None or not self.backend.snapshot_capable:
            self.snapshots = None
        if self.authority is not None and self.tickets is None:  # given a tracker key: its tickets too
            self.tickets = TicketBook(self.authority.public)
        self.metrics.watch(self._gauges)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler that owns the backend, and the chain sessions' relays, until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.scheduler.run)
                if self.snapshots is not None:
                    await self.scheduler.call(self._load_snapshots)  # before any session can want them
                nursery.start_soon(self._expire_idle_forever)
                task_status.started()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                for pool in self.pools.values():
                    await pool.aclose()

    def pool(self, url: str, pinned: str | None = None) -> ConnectionPool:
        """Keep-alive connections to `url`; https trusts `pinned` (a registered certificate) or the CA file."""
        key = url if pinned is None else f"{url} {hash(pinned)}"
        p = self.pools.get(key)
        if p is None:
            ctx = self.tls.context(pinned) if url.startswith("https://") else None
            p = self.pools[key] = self.connect_pool(url, ctx)
        return p

    # -- trust ----------------------------------------------------------------
    def join(self, tracker_key: bytes) -> None:
        """Pin the tracker's public key: capabilities and challenges must be signed with it from now on.

        Raises:
            CallerError(FORBIDDEN): a different key than the one pinned (another tracker, or an impostor).
        """
        if self.tracker_key is not None and self.tracker_key != tracker_key:
            raise CallerError(Reason.FORBIDDEN, "the tracker answered with another key than the one this node "
                                                "pinned at join: restart the node to join a new tracker")
        if self.tracker_key is None:
            self.tickets = TicketBook(tracker_key)
        self.tracker_key = tracker_key
        self.authority = CapabilityAuthority.verifier(tracker_key)
        self.joined.set()

    async def wait_joined(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the tracker key: the tracker challenges a claim as soon as it registers it,
        which may be before its reply (carrying the key) has reached this node."""
        if self.joining and self.tracker_key is None:
            with trio.move_on_after(wait_s):
                await self.joined.wait()

    @property
    def guarded(self) -> bool:
        """True when session calls need a capability."""
        return self.joining or self.authority is not None

    def accept_challenge(self, body: dict[str, Any]) -> None:
        """Check that a layer-possession challenge comes from this node's tracker and is addressed to it.

        Raises:
            CallerError(FORBIDDEN): not joined, not signed by the pinned tracker key, or for another node.
        """
        if self.tracker_key is None:
            raise CallerError(Reason.FORBIDDEN, f"{self.node_id} answers challenges only from the tracker it joined")
        data = {k: v for k, v in body.items() if k != "tracker_signature"}
        if not verify_json(self.tracker_key, CHALLENGE_DOMAIN, data, body.get("tracker_signature")):
            raise CallerError(Reason.FORBIDDEN, "the challenge is not signed by this node's tracker")
        if data.get("node") != self.node_id:
            raise CallerError(Reason.FORBIDDEN, f"the challenge is addressed to {str(data.get('node'))[:100]!r}, "
                                                f"not {self.node_id}: a node answers only its own challenges")

    def sign_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        """The answer, signed with this node's key together with the challenge (and its nonce) it answers."""
        if self.identity is None:
            return answer
        challenge = {k: v for k, v in body.items() if k != "tracker_signature"}
        return {**answer, "signature": sign_json(self.identity, ANSWER_DOMAIN,
                                                 {"challenge": challenge, "answer": answer})}

    def _gauges(self):
        yield gauge("dgr_node_sessions", "Route Sessions holding KV on this node", [], [([], float(len(self.sessions)))])
        yield gauge("dgr_node_session_capacity", "Sessions this node's KV memory allows", [],
                    [([], float(self.capacity))])
        yield gauge("dgr_node_kv_bytes", "Hot KV State bytes held", [], [([], float(self.scheduler.kv_bytes))])
        if self.prefix is not None:
            p = self.prefix
            yield gauge("dgr_node_prefix_bytes", "KV bytes of kept prefixes (not in dgr_node_kv_bytes)", [],
                        [([], float(self.prefix_bytes))])
            yield gauge("dgr_node_prefix_entries", "Kept prefixes", [], [([], float(len(p.entries)))])
            yield gauge("dgr_node_prefix_events", "Prefix cache hits, misses, evictions, supersessions", ["event"],
                        [(["hit"], float(p.hits)), (["miss"], float(p.misses)),
                         (["eviction"], float(p.evictions)), (["superseded"], float(p.superseded))])

    def _refuse(self, exc: CallerError) -> None:
        self.stats.refused[exc.reason.value] += 1
        self.metrics.refused_total.labels(reason=exc.reason.value).inc()

    def authorize(self, capability: str | None, sid: str, need: Scope = Scope.STEP) -> None:
        """Check the caller's capability for session `sid` on this node and these layers, allowing `need`.

        Raises:
            CallerError(FORBIDDEN): missing, forged, expired, for another session, node or layer range, or a
                neighbour's (steps only) where `need` is CONTROL.
        """
        if self.authority is None:
            if self.joining:
                exc = CallerError(Reason.FORBIDDEN, f"{self.node_id} has not joined its tracker yet: "
                                                    "it has no tracker key to check capabilities with")
                self._refuse(exc)
                raise exc
            return
        layers = self.backend.layers
        try:
            # wall clock: the tracker that issued the token stamped its expiry with its own
            self.authority.check(capability, session=sid, node=self.node_id, start=layers.start, stop=layers.stop,
                                 now=time.time(), need=need)
        except CallerError as exc:
            self._refuse(exc)
            raise

    def admit_open(self, capability: str | None, ticket: str | None, sid: str) -> OpenTicket | None:
        """Check an open from its headers alone, before any of its body is read: the gateway's capability
        for `sid` and the tracker's unused ticket for it. None on a node without a tracker (nothing to check).

        Raises:
            CallerError(FORBIDDEN): as `authorize` (CONTROL), or the ticket is missing, forged, expired,
                for another open, or already used.
        """
        self.authorize(capability, sid, Scope.CONTROL)
        if self.tickets is None:
            return None
        layers = self.backend.layers
        try:
            return self.tickets.check(ticket, session=sid, node=self.node_id, start=layers.start, stop=layers.stop,
                                      now=time.time())
        except CallerError as exc:
            self._refuse(exc)
            raise

    def redeem_open(self, ticket: OpenTicket | None, body: bytes) -> None:
        """Take an admitted open's ticket for its body's bytes, before they are parsed (a no-op without one).

        Raises:
            CallerError(FORBIDDEN): the body is not the one the tracker signed, or the ticket was used meanwhile.
        """
        if ticket is None or self.tickets is None:
            return
        try:
            self.tickets.redeem(ticket, body, time.time())
        except CallerError as exc:
            self._refuse(exc)
            raise

    # -- session lifecycle ----------------------------------------------------
    async def open_session(self, sid: str, max_positions: int, sampling: SamplingParams,
                           relay: RelayPlan | None = None, prefix: list[str] | None = None,
                           lane: int | None = None, marks: bytes = b"") -> int:
        """Open a session; with a relay plan, its results go on along a chain instead of back to the caller.

        With `prefix` (a block hash chain, dgr.node.prefix) and `marks` (its positions' marks), the
        session starts from the longest kept prefix matching it, to the token; returns the positions it
        holds from there (0: none reused). The marks are remembered, to name the session's KV if it is
        kept. `lane` is the sequence slot to give it while that is free (dgr.fsm.phases).

        Raises: CallerError(SESSION_EXISTS | NODE_AT_CAPACITY | CONTEXT_LENGTH_EXCEEDED | INVALID_REQUEST).
        """
        if sid in self.sessions or sid in self.ended:
            raise CallerError(Reason.SESSION_EXISTS, f"session {sid} exists or existed on {self.node_id}")
        if len(self.sessions) >= self.capacity:
            raise CallerError(
                Reason.NODE_AT_CAPACITY,
                f"{self.node_id} holds {len(self.sessions)} sessions, its KV capacity",
                retry_after=1,
            )
        if not (1 <= max_positions <= self.max_positions):
            raise CallerError(
                Reason.CONTEXT_LENGTH_EXCEEDED,
                f"{max_positions} positions requested, {self.node_id} holds {self.max_positions} per session",
            )
        # Registered first, so a second open of the same id is refused while this one is queued,
        # and a step for it queues behind the open.
        self.sessions[sid] = NodeSession(sid=sid, max_positions=max_positions, created_at=trio.current_time())
        if self.backend.is_tail:
            self.samplers[sid] = Sampler(sampling)
        try:
            reused = await self.scheduler.session_call(sid, functools.partial(self._open_kv, sid, max_positions,
                                                                              prefix or [], lane, marks))
        except DgrError:
            self.sessions.pop(sid, None)
            self.samplers.pop(sid, None)
            raise
        if relay is not None and sid in self.sessions:
            if self._nursery is None:
                raise CallerError(Reason.INTERNAL, f"{self.node_id} is not running")
            # a ring of this node alone has no link to itself, and its answers give way to no step
            alone = relay.loop is not None and relay.loop.head.node == self.node_id
            r = self.relays[sid] = Relay(sid, self.node_id, relay, self.pool,
                                         defer=relay.loop is not None and not alone)
            self._nursery.start_soon(r.run)
            self.on_route[relay.route] += 1
            if relay.loop is not None:
                if alone:
                    self.loops[sid] = SelfLoop(sid, self.node_id, self.accept_streamed, r)
                else:
                    back = RelayPlan(relay.loop.head, relay.deliver_url, relay.deliver_capability)
                    loop = self.loops[sid] = Relay(sid, self.node_id, back, self.pool)
                    self._nursery.start_soon(loop.run)
                if relay.route:
                    self.ring.join(sid, relay.route, relay.nodes, lane)
        session = self.sessions.get(sid)
        if session is not None and reused:
            session.positions = reused  # before any step: the gateway waits for this answer to send one
        if session is not None and marks and self.prefix is not None:
            self.offered[sid] = marks
        return reused

    def _open_kv(self, sid: str, max_positions: int, chain: list[str], lane: int | None = None,
                 marks: bytes = b"") -> int:
        """In the scheduler's thread: open `sid` on the longest kept prefix of `chain` and `marks`, or empty;
        its positions.

        A prompt that shares every whole block of the kept prefix (the same conversation's next turn)
        takes the kept KV over, trimmed to the positions shared: no copy (llama.cpp copies a whole
        sequence's buffer, every --ctx position), and the session's close keeps the longer prefix.
        A prompt that shares less (a common system prompt) gets a copy trimmed to what it shares,
        and the prefix stays for others, while a slot is free; without one it takes the KV over too.
        Where the memory cannot drop positions (recurrent, SWA), a trim it refuses opens empty.
        An empty open without a free slot evicts least recently used prefixes until one is free.
        """
        backend, cache, reused = self.backend, self.prefix, 0
        try:
            kept, positions = cache.match(chain, marks) if cache is not None else (None, 0)
            if kept is not None:
                if self.snapshots is not None and kept.chain:
                    self.snapshots.touch(kept.chain[-1])  # used: the last of the folder to be evicted
                take = positions >= len(kept.chain) * BLOCK_TOKENS or backend.free_slots() <= 0
                if take:
                    cache.remove(kept.id)
                opened = False
                try:
                    backend.open_from_prefix(sid, max_positions, kept.id, positions, take, lane)
                    opened = True
                except CallerError as exc:
                    if exc.reason is not Reason.INVALID_REQUEST:
                        raise
                    # the memory cannot drop the kept positions past the shared blocks: open empty instead
                    log.debug("session %s: prefix not reused: %s", sid, exc.message)
                finally:
                    if take and not opened:
                        backend.drop_prefix(kept.id)  # the cache forgot it: its slot must not stay taken
                if opened:
                    return positions
            while cache is not None and backend.free_slots() <= 0 and cache.entries:
                backend.drop_prefix(cache.evict())
            backend.open_session(sid, max_positions, lane=lane)
            return reused
        finally:
            self.prefix_bytes = backend.prefix_bytes()

    def _load_snapshots(self) -> None:
        """In the scheduler's thread, at start: every matching snapshot into a free slot, as a kept prefix."""
        snaps, cache, backend = self.snapshots, self.prefix, self.backend
        for snap in snaps.scan():
            if backend.free_slots() <= 0:
                break
            if cache.holds(snap.chain):
                continue
            key = cache.new_id()
            try:
                nbytes = backend.import_prefix(key, snap.read(), snap.positions)
            except CallerError as exc:
                snaps.refused.append({"file": f"{snap.chain[-1]}.json", "code": exc.reason.value,
                                      "message": exc.message})
                if exc.reason is Reason.SNAPSHOT_MISMATCH:  # not the bytes, or positions, its manifest says
                    snaps.discard(snap.chain[-1])
                continue
            for d in cache.add(Kept(key, snap.chain, nbytes, tail=snap.tail)):
                backend.drop_prefix(d)
            snaps.loaded += 1
            snaps.touch(snap.chain[-1])
        self.prefix_bytes = backend.prefix_bytes()
        for r in snaps.refused:
            log.warning("prefix snapshot %s refused (%s): %s", r["file"], r["code"], r["message"])

    def _close_kv(self, sid: str, keep: list[str], tail: bytes = b"", head: bytes = b"") -> None:
        """In the scheduler's thread: close `sid`, keeping the positions of its KV that `keep` and `tail` name.

        `keep` names whole blocks and `tail` marks the positions after them; `head` is what its open
        was offered (the marks of its prompt's positions). Only positions the session holds are kept.
        """
        backend, cache = self.backend, self.prefix
        session = self.sessions.get(sid)
        have = session.positions if session is not None else 0
        blocks = min(len(keep), have // BLOCK_TOKENS)
        tail = tail[: (have - blocks * BLOCK_TOKENS) * MARK_BYTES] if blocks == len(keep) else b""
        positions = blocks * BLOCK_TOKENS + len(tail) // MARK_BYTES
        if cache is None or positions == 0:
            backend.close_session(sid)
            return
        try:
            key = cache.new_id()
            try:
                nbytes = backend.keep_prefix(sid, key, positions)
            except CallerError as exc:  # a memory that cannot drop positions (recurrent, DeepSeek-V4): keep nothing
                log.debug("session %s: no prefix kept: %s", sid, exc.message)
                return
            chain = tuple(keep[:blocks])
            dropped = cache.add(Kept(key, chain, nbytes, head=head[: positions * MARK_BYTES], tail=tail))
            for d in dropped:
                backend.drop_prefix(d)
            if self.snapshots is not None and chain and key not in dropped:
                try:
                    data = backend.export_prefix(key)
                    if not self.snapshots.write(chain, data, tail):
                        log.info("prefix snapshot of %d bytes not written: over --snapshot-max-mb", len(data))
                except OSError as exc:  # the prefix is kept in memory all the same
                    log.warning("could not write a prefix snapshot to %s: %s", self.snapshots.root, exc)
        finally:
            backend.close_session(sid)  # a no-op once kept; frees the slot if keeping failed
            self.prefix_bytes = backend.prefix_bytes()

    def _lookup(self, sid: str) -> NodeSession:
        session = self.sessions.get(sid)
        if session is not None and sid not in self.ended:
            return session
        if sid in self.ended:
            failure = self.ended[sid]
            why = f" ({failure.reason.value})" if failure else ""
            raise CallerError(Reason.SESSION_ENDED, f"session {sid} has ended on {self.node_id}{why}")
        raise CallerError(Reason.UNKNOWN_SESSION, f"no session {sid} on {self.node_id}")

    async def _forget(self, sid: str, failure: Failure | None, keep: list[str] | None = None,
                      tail: bytes = b"") -> None:
        """End `sid` here: refused from now on, and counted as held until its slot is free.

        Its close is queued behind its own steps, so the slot is freed once none is in flight; until
        then it still counts against capacity and in status, so `sessions` and `kv_bytes` agree.
        """
        self.samplers.pop(sid, None)
        chain = self.relays.get(sid)
        if chain is not None:
            self.on_route[chain.plan.route] -= 1
            if self.on_route[chain.plan.route] <= 0:
                del self.on_route[chain.plan.route]
        for relays in (self.relays, self.loops):
            relay = relays.pop(sid, None)
            if relay is not None:
                relay.close()
        self.ring.leave(sid)
        self.ended[sid] = failure
        while len(self.ended) > _ENDED_MEMORY:
            self.ended.popitem(last=False)
        head = self.offered.pop(sid, b"")
        try:
            keeps = bool(keep or tail) and failure is None
            close = (functools.partial(self._close_kv, sid, keep or [], tail, head) if keeps
                     else functools.partial(self.backend.close_session, sid))
            # a close that keeps nothing needs none of the session's queued compute: dropped, not waited for
            await self.scheduler.session_call(sid, close, ends=not keeps)
        finally:
            self.sessions.pop(sid, None)  # the job runs even if this caller is cancelled

    async def close_session(self, sid: str, keep: list[str] | None = None, tail: bytes = b"") -> None:
        """End `sid` normally; with `keep` (the hash chain of the tokens in its KV) and `tail` (the marks of
        its positions after the last whole block), keep it as a prefix."""
        session = self._lookup(sid)
        session.close()
        await self._forget(sid, None, keep, tail)

    async def fail_session(self, sid: str, failure: Failure) -> None:
        session = self.sessions.get(sid)
        if session is None or sid in self.ended:
            return
        session.fail(failure)
        await self._forget(sid, failure)

    async def _expire_idle_forever(self) -> None:
        """Every second, fail the sessions idle for over `idle_timeout_s` (on trio's clock, as they are stamped)."""
        while True:
            await trio.sleep(1.0)
            await self.expire_idle(trio.current_time())

    async def expire_idle(self, now: float) -> list[str]:
        expired = [sid for sid, s in self.sessions.items()
                   if sid not in self.ended and s.idle_for(now) > self.idle_timeout_s]
        for sid in expired:
            await self.fail_session(
                sid,
                Failure(Reason.SESSION_TIMEOUT, f"idle for over {self.idle_timeout_s:g}s", node=self.node_id),
            )
        return expired

    # -- head: text in ------------------------------------------------------------
    async def tokenize(self, *, messages: list[dict[str, Any]] | None = None, prompt: str | None = None
                       ) -> tuple[list[int], str]:
        """Render the chat template (or take the prompt) and tokenize it: in a thread of its own where the
        backend's text is apart from its compute (`text_apart`), else as a job of the scheduler.

        Raises:
            CallerError(INVALID_REQUEST): not a head shard, or neither messages nor a prompt.
        """
        backend = self.backend
        if not backend.is_head:
            raise CallerError(Reason.INVALID_REQUEST, f"{self.node_id} is not a head shard")
        if messages is None and not isinstance(prompt, str):
            raise CallerError(Reason.INVALID_REQUEST, "tokenize needs messages or a prompt string")

        def work() -> tuple[list[int], str]:
            if messages is not None:
                # message contents never yield control tokens; only the template's markup does
                return backend.tokenize_chat(messages)
            # a completions prompt has no template and no roles: its sender writes the whole
            # prompt, control tokens included, as llama.cpp's server and vLLM allow
            return backend.tokenize(prompt, add_special=True, parse_special=True), prompt

        if backend.text_apart and not self.scheduler.inline:
            # the text holds nothing the compute touches: not behind any queued iteration (one at a time).
            # An inline scheduler (tests on a MockClock) uses no thread: a thread's wait would let the clock jump.
            return await trio.to_thread.run_sync(work, limiter=self._text_calls)
        return await self.scheduler.call(work)

    # -- the seam ---------------------------------------------------------------
    def _check_frame(self, frame: Frame) -> StepKind:
        info = self.backend.info
        step = _KIND_STEP.get(frame.kind)
        if step is None:
            raise CallerError(Reason.BAD_FRAME, f"a node accepts PREFILL or DECODE frames, not {frame.kind.name}")
        if frame.width != info.seam_width:
            raise CallerError(Reason.WRONG_WIDTH, f"seam width {frame.width}, this model's is {info.seam_width}")
        if self.backend.is_head or info.needs_token_ids:
            if frame.token_ids is None:
                raise CallerError(Reason.BAD_FRAME, f"layers {self.backend.layers} need token ids in the frame")
            if frame.token_ids.size and (frame.token_ids.min() < 0 or frame.token_ids.max() >= info.vocab_size):
                raise CallerError(Reason.BAD_FRAME, f"token id outside [0, {info.vocab_size})")
        if not self.backend.is_head:
            if frame.hidden is None:
                raise CallerError(Reason.BAD_FRAME, f"layers {self.backend.layers} need hidden states in the frame")
            if not np.isfinite(frame.hidden).all():
                raise CallerError(Reason.BAD_FRAME, "hidden states hold NaN or infinity")
        return step

    async def step(self, body: bytes, capability: str | None = None) -> tuple[bytes, float]:
        """Apply one frame of a star session; return (response frame, compute seconds).

        Raises:
            CallerError: the frame was refused (FORBIDDEN without a valid capability; INVALID_REQUEST
                for a chain session, whose steps come on its stream); nothing changed.
            PeerError(NODE_ERROR): compute failed; the session is failed and freed.
        """
        frame = self._admit(body, capability)
        want = bool(frame.flags & Flag.SAMPLE)
        job = self._job(frame)
        # the tail samples in the scheduler's thread too, with this session's own sampler
        finish = functools.partial(self._reply, frame, want, self.samplers.get(frame.session))
        try:
            reply, compute = await self.scheduler.forward(job, finish)
        except DgrError as exc:
            await self.fail_session(frame.session, exc.failure(node=self.node_id))
            raise PeerError(Reason.NODE_ERROR, f"{self.node_id}: {exc.message}", node=self.node_id) from exc
        except COMPUTE_ERRORS as exc:
            await self.fail_session(frame.session, Failure(Reason.NODE_ERROR, str(exc), node=self.node_id))
            raise PeerError(Reason.NODE_ERROR, f"{self.node_id}: compute failed: {exc}", node=self.node_id) from exc
        self._count(frame, reply, compute)
        return reply, compute

    def accept_streamed(self, sid: str, record: Record) -> None:
        """A chain step from a stream record, for `sid` (whose capability the stream carried): accepted and
        queued; its result goes on through the session's relay, or its failure is reported.

        Raises:
            CallerError: refused (a session of the star takes no stream); nothing changed.
        """
        if sid in self.sessions and sid not in self.ended and sid not in self.relays:
            exc = CallerError(Reason.INVALID_REQUEST, f"session {sid} is not on a chain: it takes single steps")
            self._refuse(exc)
            raise exc
        if steptrace.ON:
            steptrace.mark_frame("read", sid, record.frame)
        frame = self._admit(record.frame, None, stream=sid)
        if steptrace.ON:
            steptrace.mark("admitted", sid, frame.pos0)
        self._relay_step(frame, self.relays[sid], record.compute_us)

    def _admit(self, body: bytes, capability: str | None, *, stream: str | None = None) -> Frame:
        """Decode a frame, authorize it and apply its bookkeeping to its session (queuing a rewind first if needed).

        `stream`: the frame came on a stream already authorized for this session, and must be of it.

        Raises:
            CallerError: refused; nothing changed.
        """
        try:
            frame = decode_frame(body, max_bytes=self.max_frame_bytes)
        except CallerError as exc:
            self._refuse(exc)
            raise
        if stream is None:
            self.authorize(capability, frame.session)
            if frame.session in self.relays:
                exc = CallerError(Reason.INVALID_REQUEST, f"session {frame.session} is on a chain: its steps come on its stream")
                self._refuse(exc)
                raise exc
        elif frame.session != stream:
            exc = CallerError(Reason.FORBIDDEN, f"a stream of session {stream} carried a frame of {frame.session}")
            self._refuse(exc)
            raise exc
        try:
            step = self._check_frame(frame)
            session = self._lookup(frame.session)
            rewind = session.rewinds(frame.pos0)
            session.accept(step, frame.seq, frame.pos0, frame.n_tokens, now=trio.current_time())
        except CallerError as exc:
            self._refuse(exc)
            raise
        if rewind:
            # the route reuses less of the prefix than this node holds: queued before the step, so it runs first
            self.scheduler.submit(Job(JobKind.SESSION, frame.session,
                                      fn=functools.partial(self.backend.trim_session, frame.session, frame.pos0)))
        self.stats.frames_in[frame.kind.name] += 1
        self.stats.bytes_in[frame.kind.name] += frame.size
        if frame.kind is FrameKind.DECODE:
            self.stats.last_decode_frame_bytes = frame.size
            self.stats.last_decode_hidden_bytes = 0 if frame.hidden is None else frame.hidden.nbytes
        return frame

    @staticmethod
    def _job(frame: Frame) -> Step:
        return Step(frame.session, frame.pos0, frame.token_ids, frame.hidden_f32(), bool(frame.flags & Flag.SAMPLE),
                    decode=frame.kind is FrameKind.DECODE)

    def _relay_step(self, frame: Frame, relay: Relay, compute_us: tuple[int, ...]) -> None:
        """Queue a chain step; when computed, its result goes to the relay (or its failure is reported).

        On a ring's tail, the step for the sampled token also goes to the loop relay, to the head.
        """
        sampler, want = self.samplers.get(frame.session), bool(frame.flags & Flag.SAMPLE)
        loop, plan = self.loops.get(frame.session), relay.plan.loop
        session = self.sessions[frame.session]

        def finish(out: np.ndarray | None) -> tuple[bytes, bytes | None]:  # in the scheduler's thread
            if self.backend.is_tail:
                if not (want and loop is not None):
                    return self._reply(frame, want, sampler, out), None  # the answer, for the gateway
                result = self._sample(frame, sampler, out)
                return self._token_frame(frame, result), self._next_step(frame, result, plan, session.max_positions)
            # the next hop's input: the same step, with this shard's output as its hidden state
            return encode_frame(frame.kind, frame.session, frame.seq, frame.pos0, frame.n_tokens, frame.width,
                                dtype=frame.dtype, flags=frame.flags & Flag.SAMPLE,
                                token_ids=frame.token_ids if self.backend.info.needs_token_ids else None,
                                hidden=out), None

        def done(j: Job) -> None:  # on the loop, after the iteration
            if steptrace.ON:
                steptrace.mark("done", frame.session, frame.pos0)
            try:
                out, step = j.result.unwrap()
            except COMPUTE_ERRORS as exc:
                why = exc.message if isinstance(exc, DgrError) else f"compute failed: {exc}"
                failure = Failure(Reason.NODE_ERROR, f"{self.node_id}: {why}"[:300], node=self.node_id)
                relay.put(Report(failure))
                if self._nursery is not None:
                    self._nursery.start_soon(self.fail_session, frame.session, failure)
                return
            if loop is not None and want and self._nursery is not None:  # first: the next token's path
                if step is not None:
                    self.ring.go(frame.session, step, self._nursery)
                else:
                    self.ring.stop(frame.session)
            self._count(frame, out, j.compute_s)
            relay.put(Outgoing(out, (*compute_us, int(j.compute_s * 1e6))))

        self.scheduler.submit(Job(JobKind.FORWARD, frame.session, step=self._job(frame), finish=finish, on_done=done,
                                  max_rows=self._group_rows(relay.plan)))

    def _group_rows(self, plan: RelayPlan) -> int | None:
        """The decode steps of one phase group of `plan`'s route: its sessions open here, cut into one group
        per node as the gateway and a ring's tail cut them (dgr.fsm.phases). None on a one-node route."""
        if plan.nodes < 2:
            return None
        return max(1, math.ceil(self.on_route[plan.route] / plan.nodes))

    def _loop_send(self, sid: str, step: bytes) -> None:
        loop = self.loops.get(sid)
        if loop is not None:
            loop.put(Outgoing(step, ()))  # the head is the first hop of the next step

    @staticmethod
    def _next_step(frame: Frame, result: TokenResult, loop: Loop, max_positions: int) -> bytes | None:
        """A ring tail's next decode step for the token it sampled; None where the gateway stops
        (dgr.fsm.stop, counted in positions: the step's position plus one against the session's)."""
        pos = frame.pos0 + frame.n_tokens
        if not next_step(eog=result.eog, ignore_eos=loop.ignore_eos, generated=pos + 1, max_tokens=max_positions).more:
            return None
        return encode_frame(FrameKind.DECODE, frame.session, frame.seq + 1, pos, 1, frame.width, dtype=frame.dtype,
                            flags=Flag.SAMPLE, token_ids=[result.token])

    def _count(self, frame: Frame, reply: bytes, compute: float) -> None:
        self.stats.compute_s += compute
        self.metrics.frames_total.labels(kind=frame.kind.name).inc()
        self.metrics.frame_bytes_total.labels(kind=frame.kind.name).inc(frame.size)
        self.metrics.compute_seconds.labels(kind=frame.kind.name).observe(compute)
        self.stats.bytes_out[FrameKind(reply[5]).name] += len(reply)

    def _reply(self, frame: Frame, want: bool, sampler: Sampler | None, out: np.ndarray | None) -> bytes:
        """The response frame; runs in the scheduler's thread (sampling and token text are backend work)."""
        common = dict(session=frame.session, seq=frame.seq, pos0=frame.pos0)
        if not self.backend.is_tail:
            # the hidden state leaves in the dtype it arrived in (f16 routes stay f16)
            return encode_frame(
                FrameKind.HIDDEN, n_tokens=frame.n_tokens, width=frame.width, dtype=frame.dtype, hidden=out, **common
            )
        if not want:
            return encode_frame(FrameKind.ACK, n_tokens=0, width=frame.width, **common)
        return self._token_frame(frame, self._sample(frame, sampler, out))

    def _sample(self, frame: Frame, sampler: Sampler | None, out: np.ndarray | None) -> TokenResult:
        """The tail's token for a step's logits, with the session's own sampler (in the scheduler's thread)."""
        if sampler is None:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no sampler for session {frame.session}")
        token, logprob = sampler.sample(out)
        return TokenResult(token, logprob, self.backend.token_bytes(token), self.backend.is_eog(token))

    @staticmethod
    def _token_frame(frame: Frame, result: TokenResult) -> bytes:
        return encode_frame(
            FrameKind.TOKEN, frame.session, frame.seq, frame.pos0, 1, frame.width,
            flags=Flag.EOG if result.eog else Flag(0), extra=result.payload(),
        )

    # -- status -----------------------------------------------------------------
    async def session_json(self, sid: str) -> dict[str, Any]:
        session = self._lookup(sid)
        computed = await self.scheduler.session_call(sid, functools.partial(self.backend.positions_computed, sid))
        return {
            "id": sid,
            "state": session.state.value,
            "positions": session.positions,
            "positions_computed": computed,
            "next_seq": session.next_seq,
        }

    def status_detail(self, capability: str | None) -> bool:
        """May this caller see the per-kind counters: the tracker's capability for STATUS_SCOPE, or no tracker.

        Polled, the counters split each request into its prompt (prefill bytes) and output (decode
        frames): not for anyone who can reach the port. A refusal here is no seam refusal (not counted).
        """
        if self.authority is None:
            return not self.joining
        layers = self.backend.layers
        try:
            self.authority.check(capability, session=STATUS_SCOPE, node=self.node_id, start=layers.start,
                                 stop=layers.stop, now=time.time())
        except CallerError:
            return False
        return True

    def status(self, detail: bool = True) -> dict[str, Any]:
        """What the node holds now; backend figures as of the scheduler's last iteration. Without `detail`,
        only what a load balancer needs (sessions, capacity, KV bytes), not the per-kind counters."""
        sched = self.scheduler
        aggregate = {
            "node": self.node_id,
            "backend": self.described,
            "model": self.backend.info.to_json(),
            "layers": str(self.backend.layers),
            "sessions": len(self.sessions),
            "capacity": self.capacity,
            "kv_bytes": sched.kv_bytes,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        if not detail:
            return aggregate
        return {
            **aggregate,
            "prefix": None if self.prefix is None else {**self.prefix.to_json(), "bytes": self.prefix_bytes},
            "snapshots": None if self.snapshots is None else self.snapshots.to_json(),
            "seam": self.stats.to_json(),
            "scheduler": {"iterations": sched.iterations, "batched_steps": sched.batched_steps,
                          "busy_s": round(sched.busy_s, 6), "backend_sessions": sched.session_count,
                          "polls_given_up": sched.polls_given_up, "cuts": sched.cuts, "dropped": sched.dropped,
                          "prefill_rate": None if sched.prefill_rate is None else round(sched.prefill_rate, 1)},
            "ring_phases": {"released": self.ring.released, "alone": self.ring.alone},
        }
