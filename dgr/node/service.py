"""The node's service: one seam endpoint composed of parts that each do one job.

A node serves one Shard: seam frames in, backend compute, seam frames out. `NodeService` builds and
wires its parts, runs them, and is what the HTTP routes (dgr.node.app), membership
(dgr.node.membership) and tests are given; a session's own calls (its capability and ticket checked, a
prefix adopted, a close, its steps) go straight to the part that owns them (`service.trust`,
`service.lifecycle`, `service.replies`). It holds no rule of its own; each part states its rules:

- trust (dgr.node.trust): the pinned tracker key, capabilities and open tickets;
- the session table (dgr.sessions) and the sessions' lifecycle (dgr.node.sessions): open, close,
  fail, idle expiry;
- KV operations (dgr.node.kv): a session's KV opened from a kept prefix or empty, closed kept or
  freed, Prefix Snapshots loaded;
- replies (dgr.node.replies): a frame checked against its session, queued, answered or relayed;
- links (dgr.node.links): a ring session's relays and a ring tail's phase groups;
- accounting (dgr.node.accounting): the seam's counters, gauges and status.

One rule binds them: the node's `StepScheduler` (dgr.node.scheduler) is the one owner of the
backend. Every backend call (open, close, status, steps, and tokenize where the text is not apart
from the compute) is a scheduler job, so nothing touches the backend from the event loop, and
llama.cpp never sees two calls at once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import trio

from dgr.backends.base import ShardBackend
from dgr.errors import CallerError, Failure, Reason
from dgr.metrics import NodeMetrics
from dgr.node.accounting import NodeAccounting, SeamStats
from dgr.node.journal import JournalBook
from dgr.node.kv import NodeKV
from dgr.node.links import NodeLinks, NodeSessionRecord
from dgr.node.prefix import PrefixCache
from dgr.seam.opening import PromptPlan, ResumeOrder
from dgr.node.draft import DraftModel
from dgr.node.speculation import SpecPlan
from dgr.node.relay import RelayPlan
from dgr.node.replies import NodeReplies
from dgr.node.scheduler import DEFAULT_ITERATION_TARGET_S, StepScheduler
from dgr.node.sessions import ENDED_MEMORY, NodeSessions
from dgr.node.snapshot import SnapshotDir
from dgr.node.trust import NodeTrust
from dgr.sampling import SamplingParams
from dgr.seam.transport import ConnectionPool
from dgr.seam.wire import MAX_FRAME_BYTES
from dgr.security.auth import CapabilityAuthority
from dgr.security.identity import Identity
from dgr.security.tickets import TicketBook
from dgr.security.tls import TlsTrust
from dgr.sessions import SessionTable
from dgr.speculative.ngram import WINDOW

__all__ = ["NodeService", "Opened", "SeamStats", "DEFAULT_JOURNAL_BYTES"]


@attrs.frozen
class Opened:
    """What an open answers: the positions reused; a head given the prompt, its ids; a resumed session the steps
    it holds and its journal's first step."""

    reused: int
    tokens: list[int] | None = None
    steps: int | None = None
    journal_from: int | None = None

_KEEP = object()  # `prefix` not given: a default PrefixCache
# What a node's seam journals hold at most (dgr.node.journal): 2,000 positions of a 4,096-wide model in f32 are
# 33 MB, of the default model's 576 under 5 MB
DEFAULT_JOURNAL_BYTES = 256 * 1024 * 1024


@attrs.define(init=False)
class NodeService:
    """A node's seam endpoint: its parts, wired; see the module docstring for which does what."""

    backend: ShardBackend
    node_id: str
    tls: TlsTrust  # whom its https calls trust, and what they present (the member certificate, from its join)
    tracker_url: str | None  # where a ring session's answers and failure reports go
    described: dict[str, Any]  # read once, before the scheduler owns the backend
    scheduler: StepScheduler
    table: SessionTable[NodeSessionRecord]
    accounting: NodeAccounting
    trust: NodeTrust
    kv: NodeKV
    links: NodeLinks
    lifecycle: NodeSessions
    replies: NodeReplies
    pools: dict[str, ConnectionPool]  # url -> keep-alive connections there
    # (url, TLS context) -> the pool to it: sockets; in-process routes pass an in-memory net's (dgr.testing)
    connect_pool: Callable[..., ConnectionPool]
    _text_calls: trio.CapacityLimiter

    def __init__(self, backend: ShardBackend, node_id: str, *, idle_timeout_s: float = 120.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, metrics: NodeMetrics | None = None,
                 authority: CapabilityAuthority | None = None, tickets: TicketBook | None = None,
                 joining: bool = False, identity: Identity | None = None, tls: TlsTrust | None = None,
                 tracker_url: str | None = None, prefix: PrefixCache | None | object = _KEEP,
                 snapshots: SnapshotDir | None = None, busy_poll_s: float = 0.0,
                 iteration_target_s: float = DEFAULT_ITERATION_TARGET_S,
                 connect_pool: Callable[..., ConnectionPool] = ConnectionPool, draft: DraftModel | None = None,
                 journal_bytes: int = DEFAULT_JOURNAL_BYTES) -> None:
        """`joining`: the node has a tracker (session calls need its capabilities, refused until it joins);
        `authority`: a tracker key pinned already. `prefix`: the kept prefixes (None: keep none, as
        --prefix-cache-mb 0); `snapshots`: --snapshot-dir. `busy_poll_s`, `iteration_target_s`: the
        StepScheduler's. `draft`: the tail's draft model (`--draft-model`, dgr.node.draft). `journal_bytes`: what
        its sessions' seam journals may hold (`--journal-mb`, dgr.node.journal; 0: none)."""
        self.backend, self.node_id = backend, node_id
        self.tls = TlsTrust() if tls is None else tls
        self.tracker_url = tracker_url
        self.pools, self.connect_pool = {}, connect_pool
        self._text_calls = trio.CapacityLimiter(1)
        self.scheduler = StepScheduler(backend, busy_poll_s=busy_poll_s, iteration_target_s=iteration_target_s)
        # read once, before the scheduler owns the backend; fixed for the node's life
        self.table = SessionTable(node_id, backend.max_sessions(), backend.max_positions(), remember=ENDED_MEMORY)
        self.described = backend.describe()
        if draft is not None:
            self.described["draft_model"] = draft.describe()  # the tracker routes `draft` speculation by it
        self.kv = NodeKV(backend, PrefixCache() if prefix is _KEEP else prefix, snapshots)
        # links and replies need each other: replies send on through links, and on a ring of this node alone
        # links hand its own steps back to replies; the reader is tied in once replies exists, below
        self.links = NodeLinks(node_id, self.pool, None, self.table.live.get, draft=draft)
        self.accounting = NodeAccounting(node_id, backend, self.described, self.table, self.scheduler, self.kv,
                                         self.links.ring, metrics=NodeMetrics() if metrics is None else metrics,
                                         draft=draft, devices=tuple(backend.device_memory()))
        self.trust = NodeTrust(node_id, backend.layers, self.accounting.refuse, authority=authority,
                               tickets=tickets, joining=joining, identity=identity)
        journals = self.accounting.journals = JournalBook(0 if backend.is_tail else journal_bytes)
        self.lifecycle = NodeSessions(backend, node_id, self.table, self.scheduler, self.kv, self.links,
                                      idle_timeout_s=idle_timeout_s, ended=self.trust.forget, journals=journals)
        self.replies = NodeReplies(backend, node_id, max_frame_bytes, self.table, self.scheduler, self.links,
                                   self.accounting, self.fail_session, self.lifecycle.kv_job, journals)
        self.links.accept_streamed = self.replies.accept_streamed

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler that owns the backend, and the ring sessions' relays, until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self.links.nursery = nursery
                await nursery.start(self.scheduler.run)
                if self.kv.snapshots is not None:
                    await self.scheduler.call(self.kv.load_snapshots)  # before any session can want them
                nursery.start_soon(self.lifecycle.expire_idle_forever)
                nursery.start_soon(self.accounting.watch_devices)
                task_status.started()
        finally:
            self.links.nursery = None
            with trio.CancelScope(shield=True):
                for pool in self.pools.values():
                    await pool.aclose()

    def pool(self, url: str, pinned: str | None = None) -> ConnectionPool:
        """Keep-alive connections to `url`; https trusts `pinned` (a registered certificate), the tracker's
        certificate (learned at join) at the tracker, or the CA file."""
        if pinned is None and url == self.tracker_url:
            pinned = self.tls.tracker_pem
        key = url if pinned is None else f"{url} {hash(pinned)}"
        p = self.pools.get(key)
        if p is None:
            ctx = self.tls.context(pinned) if url.startswith("https://") else None
            p = self.pools[key] = self.connect_pool(url, ctx)
        return p

    # -- trust (dgr.node.trust) --------------------------------------------------------------------
    def join(self, tracker_key: bytes) -> None:
        self.trust.join(tracker_key)

    async def wait_joined(self, wait_s: float) -> None:
        await self.trust.wait_joined(wait_s)

    def sign_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return self.trust.sign_answer(body, answer)

    def status_detail(self, capability: str | None) -> bool:
        return self.trust.status_detail(capability)

    # -- sessions (dgr.node.sessions) and the seam (dgr.node.replies) --------------------------------
    async def open_session(self, sid: str, max_positions: int, sampling: SamplingParams,
                           relay: RelayPlan, prefix: list[str] | None = None,
                           lane: int | None = None, marks: bytes = b"", spec: SpecPlan | None = None, *,
                           prompt: PromptPlan | None = None, max_new: int | None = None,
                           resume: ResumeOrder | None = None, sample_from: int = 0) -> Opened:
        """Open a session (dgr.node.sessions); a head given `prompt` tokenizes it first (dgr.seam.opening.PromptPlan).

        Given a `prefix` or `marks` (the gateway had the ids), it opens on them now. Else its KV waits (for
        an adopt, or the first step), so it answers as soon as it has the ids: only the gateway can name
        their prefix, whose root no node is told (dgr.seam.keys).

        Raises: CallerError (as NodeSessions.open, and PromptPlan.positions); INVALID_REQUEST: a prompt
        for a shard that is not a head.
        """
        if resume is not None:  # a repair's survivor: it goes on with the session it holds (issue 54)
            positions, steps, first = await self.lifecycle.resume(sid, max_positions, sampling, relay, resume, lane,
                                                                  sample_from)
            return Opened(positions, steps=steps, journal_from=first)
        if prompt is None:
            return Opened(await self.lifecycle.open(sid, max_positions, sampling, relay, prefix, lane, marks,
                                                    spec, max_new, sample_from=sample_from))
        if not self.backend.is_head:
            raise CallerError(Reason.INVALID_REQUEST, f"{self.node_id} is not a head shard: it takes no prompt")
        self.table.check_open(sid, 1)  # before the tokenizing: an open refused anyway costs none
        if prompt.ids is not None:
            ids = list(prompt.ids)
        else:
            ids, _ = await self.tokenize(messages=None if prompt.messages is None else list(prompt.messages),
                                         prompt=prompt.text)
        positions = prompt.positions(ids, max_positions)
        if spec is not None and self.backend.is_tail and not spec.history:  # a route of one: it drafts from its own ids
            spec = attrs.evolve(spec, history=tuple(ids[-WINDOW:]))
        if prefix or marks:
            reused = await self.lifecycle.open(sid, positions, sampling, relay, prefix, lane, marks, spec, prompt=ids,
                                               sample_from=sample_from)
            return Opened(reused, ids)
        await self.lifecycle.open(sid, positions, sampling, relay, None, lane, b"", spec, waits=True, prompt=ids,
                                  sample_from=sample_from)
        return Opened(0, ids)

    async def fail_session(self, sid: str, failure: Failure) -> None:
        await self.lifecycle.fail(sid, failure)

    async def expire_idle(self, now: float) -> list[str]:
        return await self.lifecycle.expire_idle(now)

    async def session_json(self, sid: str) -> dict[str, Any]:
        return await self.lifecycle.json(sid)

    def status(self, detail: bool = True) -> dict[str, Any]:
        return self.accounting.status(detail)

    def health(self, sid: str | None = None) -> dict[str, Any]:
        """The answer to the tracker's probe (/healthz): this node's id and, for a session (whose capability the
        caller showed), how far it got: the last step it took and computed, and the scheduler's iteration. A
        node that answers but makes no progress on a session is told from one that is computing it."""
        out: dict[str, Any] = {"ok": True, "node": self.node_id}
        if sid is not None:
            rec = self.table.live.get(sid)
            out["iteration"] = self.scheduler.iterations
            out["session"] = None if rec is None else {"id": sid, "taken": rec.fsm.next_seq - 1, "done": rec.done}
        return out

    # -- head: text in -----------------------------------------------------------------------------
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
        if messages is not None:
            # message contents never yield control tokens; only the template's markup does
            work = functools.partial(backend.tokenize_chat, messages)
        else:
            # a completions prompt has no template and no roles: its sender writes the whole
            # prompt, control tokens included, as llama.cpp's server and vLLM allow
            work = functools.partial(backend.tokenize, prompt, add_special=True, parse_special=True)
        if backend.text_apart and not self.scheduler.inline:
            # the text holds nothing the compute touches: not behind any queued iteration (one at a time).
            # An inline scheduler (tests on a MockClock) uses no thread: a thread's wait would let the clock jump.
            done = await trio.to_thread.run_sync(work, limiter=self._text_calls)
        else:
            done = await self.scheduler.call(work)
        return done if messages is not None else (done, prompt)  # tokenize_chat gives its rendered text too

    # -- what callers read: each part's own state ---------------------------------------------------
    sessions = property(lambda self: self.table.live, doc="sid -> its NodeSessionRecord, held until its KV is freed")
    ended = property(lambda self: self.table.ended, doc="ended ids remembered -> their failure or None")
    max_positions = property(lambda self: self.table.max_positions, doc="KV positions per session (--ctx)")
    devices = property(lambda self: self.accounting.devices, doc="its accelerators' memory as last read; () on the CPU")
    stats = property(lambda self: self.accounting.stats)
    metrics = property(lambda self: self.accounting.metrics)
    prefix = property(lambda self: self.kv.prefix)
    prefix_bytes = property(lambda self: self.kv.prefix_bytes)
    on_route = property(lambda self: self.links.on_route)
    ring = property(lambda self: self.links.ring)
    authority = property(lambda self: self.trust.authority)
    tracker_key = property(lambda self: self.trust.tracker_key)
    identity = property(lambda self: self.trust.identity)
    joined = property(lambda self: self.trust.joined)
    guarded = property(lambda self: self.trust.guarded, doc="True when session calls need a capability")

    @property
    def capacity(self) -> int:
        """Sessions this node's KV memory allows (the session table's limit)."""
        return self.table.capacity

    @capacity.setter
    def capacity(self, sessions: int) -> None:  # a test's smaller node; the backend keeps its own slots
        self.table.capacity = sessions

    @property
    def snapshots(self) -> SnapshotDir | None:
        return self.kv.snapshots

    @snapshots.setter
    def snapshots(self, value: SnapshotDir | None) -> None:  # before `run`: loaded at start
        self.kv.snapshots = value

    @property
    def advertised(self) -> str | None:
        return self.trust.advertised

    @advertised.setter
    def advertised(self, url: str | None) -> None:  # what the tracker recorded (dgr.node.membership)
        self.trust.advertised = url

    @property
    def idle_timeout_s(self) -> float:
        return self.lifecycle.idle_timeout_s

    @idle_timeout_s.setter
    def idle_timeout_s(self, seconds: float) -> None:
        self.lifecycle.idle_timeout_s = seconds
