"""The node's step scheduler: one owner of the backend, batches across sessions, order per session.

Three tiers: the pure planner under hypothesis; the scheduler and NodeService
in process on trio, against a backend that notes every call's thread and any
overlap; and llama.cpp's batched decode against one-by-one decode, bit for bit.
"""

from __future__ import annotations

import threading
import time
import uuid

import attrs
import pytest
import numpy as np
import outcome
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr.backends.base import LayerRange, Step
from dgr.backends.stub import DEEPSEEK_LIKE, StubBackend, StubSpec
from dgr.errors import Reason
from dgr.node.iteration import Job, JobKind, may_gather, plan_iteration
from dgr.node.service import NodeService
from dgr.sampling import SamplingParams
from dgr.seam.stream import Record
from dgr.seam.frame import TokenResult, decode_frame, encode_frame
from dgr.seam.wire import Flag, FrameKind
from dgr.testing.nodes import running, settled
from dgr.testing.onering import OneNodeRing

SPEC = StubSpec(n_layers=6, hidden_size=32)
W = SPEC.seam_width


# -- the planner ------------------------------------------------------------------------------------

def _job(kind: str, sid: str | None, n: int = 1, max_rows: int | None = None) -> Job:
    if kind == "call":
        return Job(JobKind.CALL, None, fn=lambda: None)
    if kind == "session":
        return Job(JobKind.SESSION, sid, fn=lambda: None)
    step = Step(sid, 0, np.zeros(n, np.int32), None, False, decode=kind == "decode")
    return Job(JobKind.FORWARD, sid, step=step, max_rows=max_rows)


jobs = st.lists(st.tuples(st.sampled_from(["call", "session", "decode", "prefill"]), st.sampled_from("abcdef"),
                          st.integers(1, 300), st.sampled_from([None, None, 1, 2, 3])), max_size=30).map(
    lambda specs: [_job(k, None if k == "call" else sid, 1 if k == "decode" else n, rows)
                   for k, sid, n, rows in specs])


@settings(max_examples=300, deadline=None)
@given(jobs, st.integers(1, 600))
def test_plan_makes_progress_keeps_each_sessions_order_and_fills_the_budget(queue, budget) -> None:
    plan = plan_iteration(queue, budget)
    chosen = plan.controls + plan.batch
    assert sorted(chosen + plan.deferred) == list(range(len(queue)))  # every job placed once
    if queue:
        assert chosen, "a non-empty queue always makes progress"
    for i in chosen:  # a job runs only if it is the first of its session still queued
        sid = queue[i].sid
        assert sid is None or all(queue[j].sid != sid for j in range(i))
    assert all(queue[i].kind is JobKind.FORWARD for i in plan.batch)
    assert all(queue[i].kind is not JobKind.FORWARD for i in plan.controls)
    first = {}
    for i, job in enumerate(queue):
        first.setdefault(job.sid, i)
    eligible_decodes = [i for i, j in enumerate(queue)
                        if j.step is not None and j.step.decode and (j.sid is None or first[j.sid] == i)]
    taken: list[int] = []  # decode steps go first, in queue order, each into a batch smaller than its max_rows
    for i in eligible_decodes:
        if queue[i].max_rows is None or len(taken) < queue[i].max_rows:
            taken.append(i)
    assert [i for i in plan.batch if queue[i].step.decode] == taken
    prefills = [i for i in plan.batch if not queue[i].step.decode]
    if len(prefills) > 1:  # beyond the first chunk, prefill stays inside the budget
        assert sum(queue[i].step.n_tokens for i in plan.batch) <= budget
    decodes_in = [k for k, i in enumerate(plan.batch) if queue[i].step.decode]
    assert decodes_in == list(range(len(decodes_in))), "decodes lead the batch"


def test_two_phase_groups_that_reach_a_node_together_run_as_two_batches() -> None:
    """On a 2-node route 8 sessions decode in 2 groups of 4 (max_rows 4): released together by the
    ring's tail, they still go through each node as two batches, so the nodes compute at once."""
    queue = [_job("decode", f"s{k}", max_rows=4) for k in range(8)] + [_job("prefill", "p", 40)]
    first = plan_iteration(queue, 512)
    assert [queue[i].sid for i in first.batch] == ["s0", "s1", "s2", "s3", "p"]
    rest = [queue[i] for i in first.deferred]
    assert [rest[i].sid for i in plan_iteration(rest, 512).batch] == ["s4", "s5", "s6", "s7"]


def test_a_long_prompt_delays_decoding_by_one_chunk_at_most() -> None:
    queue = [_job("prefill", "p", 512), _job("prefill", "q", 512), _job("decode", "a"), _job("decode", "b")]
    plan = plan_iteration(queue, 512)
    assert [queue[i].sid for i in plan.batch] == ["a", "b", "p"]  # both decodes, then one chunk
    assert [queue[i].sid for i in plan.deferred] == ["q"]


# -- the scheduler, in process ----------------------------------------------------------------------

def _wrap(name: str):
    """StubBackend's method `name`, noting the call on the Watched backend."""
    base = getattr(StubBackend, name)

    def method(self, *args, **kwargs):
        self._enter(name, *args)
        try:
            return base(self, *args, **kwargs)
        finally:
            self._busy.release()

    return method


@attrs.define(eq=False)
class Watched(StubBackend):
    """A stub whose every call notes its thread and fails loudly if another call is running."""

    trio_thread: int = 0
    calls: int = 0
    inline_forwards: int = 0  # decode forwards that ran on the loop (StepScheduler.inline_below_s)
    violations: list[str] = attrs.Factory(list)
    batches: list[int] = attrs.Factory(list)
    threads: set[int] = attrs.Factory(set)  # the threads other than the loop's that made calls
    _busy: threading.Lock = attrs.Factory(threading.Lock)

    def _enter(self, name: str, *args) -> None:
        if not self._busy.acquire(blocking=False):
            self.violations.append(f"{name} overlapped another backend call")
            self._busy.acquire()
        if threading.get_ident() == self.trio_thread:
            if not self._may_run_inline(name, *args):
                self.violations.append(f"{name} ran on the trio thread")
            self.inline_forwards += name in ("forward", "forward_rows")
        else:
            self.threads.add(threading.get_ident())
        self.calls += 1

    @staticmethod
    def _may_run_inline(name: str, *args) -> bool:
        """What a short decode-only iteration may run on the loop: one-position forwards, the
        per-iteration accounting and the tail's token lookups. Never a prefill chunk, an open or a
        close, tokenizing or a chat template."""
        if name == "forward":
            _sid, _pos0, token_ids, hidden = args[:4]
            return (len(hidden) if hidden is not None else len(token_ids)) == 1
        if name == "forward_rows":  # one position of each session, by its contract
            return all(step.n_tokens == 1 for step in args[0])
        return name in ("kv_bytes", "session_count", "positions_computed", "token_bytes", "is_eog")

    open_session = _wrap("open_session")
    close_session = _wrap("close_session")
    forward = _wrap("forward")
    forward_rows = _wrap("forward_rows")
    kv_bytes = _wrap("kv_bytes")
    session_count = _wrap("session_count")
    positions_computed = _wrap("positions_computed")
    tokenize = _wrap("tokenize")
    render_chat = _wrap("render_chat")
    token_bytes = _wrap("token_bytes")
    is_eog = _wrap("is_eog")

    def forward_batch(self, steps):
        self.batches.append(len(steps))
        return super().forward_batch(steps)


def _frames(sid: str, prompt: list[int], pos0: int, seq: int, kind: FrameKind) -> bytes:
    return encode_frame(kind, sid, seq, pos0, len(prompt), W, token_ids=prompt, flags=Flag.SAMPLE)


async def _generate(node: NodeService, sid: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of a whole-model node, a ring of itself: prefill, then the n - 1 decode steps its loop
    makes (to the session's last position)."""
    ring = OneNodeRing.of(node)
    await ring.open(sid, len(prompt) + n, ignore_eos=True)
    ring.send(_frames(sid, prompt, 0, 0, FrameKind.PREFILL))
    out = [TokenResult.from_frame(decode_frame(await ring.answer(sid))).token for _ in range(n)]
    await node.lifecycle.close(sid)
    return out


async def test_concurrent_sessions_with_cancels_never_overlap_the_backend_and_match_sequential() -> None:
    prompts = {uuid.UUID(int=i + 1).hex: [3 + i, 14, 15, 92, 65 + i] for i in range(8)}
    ref_node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 6)), node_id="ref")
    node = NodeService(backend=Watched(spec=SPEC, layers=LayerRange(0, 6), trio_thread=threading.get_ident()),
                       node_id="n")
    async with running(ref_node, node):
        want = {sid: await _generate(ref_node, sid, p, 12) for sid, p in prompts.items()}
        got: dict[str, list[int]] = {}

        async def one(sid: str) -> None:
            got[sid] = await _generate(node, sid, prompts[sid], 12)

        async def abandoned(k: int) -> None:
            # a client that goes away mid-prefill or mid-decode: its caller is cancelled, the
            # job already submitted still runs, and the close that follows frees the slot
            sid = uuid.UUID(int=100 + k).hex
            ring = OneNodeRing.of(node)
            await ring.open(sid, 64)
            with trio.move_on_after(0):  # cancelled at its first checkpoint, after submitting
                await ring.step(_frames(sid, [5, 6, 7], 0, 0, FrameKind.PREFILL))
            await node.lifecycle.close(sid)

        async with trio.open_nursery() as nursery:
            for sid in prompts:
                nursery.start_soon(one, sid)
            for k in range(6):
                nursery.start_soon(abandoned, k)
        assert got == want
        watched = node.backend
        assert watched.violations == []
        assert watched.inline_forwards > 0, "short decode iterations ran on the loop"
        assert max(watched.batches) > 1, "concurrent decode steps were batched"
        assert node.scheduler.kv_bytes == 0 and node.scheduler.session_count == 0 and not node.sessions


async def test_a_slow_decode_goes_back_to_the_worker_thread() -> None:
    """Decodes run on the loop only while they are short: one that took longer than `inline_below_s`
    sends the next ones to the thread, so a big shard never stalls the loop."""
    node = NodeService(backend=Watched(spec=SPEC, layers=LayerRange(0, 6), trio_thread=threading.get_ident()),
                       node_id="n")
    async with running(node):
        node.scheduler.inline_below_s = 0.02
        await _generate(node, uuid.UUID(int=1).hex, [3, 14, 15], 6)
        fast = node.backend.inline_forwards
        node.backend.delay_s = 0.03  # every decode now takes longer than inline_below_s
        await _generate(node, uuid.UUID(int=2).hex, [3, 14, 15], 6)
        assert fast > 0 and node.backend.violations == []
        # the first slow decode ran where the fast ones did; none after it
        assert node.backend.inline_forwards - fast <= 1


async def test_a_backend_with_a_thread_pool_never_computes_on_the_loop() -> None:
    """llama.cpp with 2 threads decoded slower when called from the loop (44-53 against 67-72 tok/s):
    decodes on the loop and prefill chunks in a thread make two OpenMP teams (dgr.node.backend_thread),
    so only one-thread backends inline their decodes."""
    backend = Watched(spec=SPEC, layers=LayerRange(0, 6), trio_thread=threading.get_ident())
    backend.n_threads = 2
    node = NodeService(backend=backend, node_id="n")
    async with running(node):
        await _generate(node, uuid.UUID(int=1).hex, [3, 14, 15], 8)
    assert backend.inline_forwards == 0 and backend.violations == []


async def test_every_call_off_the_loop_comes_from_one_thread_whatever_else_uses_threads() -> None:
    """llama.cpp's OpenMP keeps a team of threads per calling thread, and a second team halved a
    2-thread node's decode (dgr.node.backend_thread). trio's thread cache hands a call to whichever
    worker is idle, so other `to_thread` calls on the node must not move the backend's."""
    backend = Watched(spec=SPEC, layers=LayerRange(0, 6), trio_thread=threading.get_ident())
    backend.n_threads = 2  # nothing inline: every iteration leaves the loop
    backend.delay_s = 0.002
    node = NodeService(backend=backend, node_id="n")
    async with running(node):
        async with trio.open_nursery() as nursery:
            for k in range(4):  # trio's cached workers come and go around the node's iterations
                nursery.start_soon(trio.to_thread.run_sync, time.sleep, 0.003 * (k + 1))
            await _generate(node, uuid.UUID(int=1).hex, [3, 14, 15], 12)
            nursery.start_soon(trio.to_thread.run_sync, time.sleep, 0.003)
            await _generate(node, uuid.UUID(int=2).hex, [3, 14, 15], 12)
    assert backend.violations == [] and backend.inline_forwards == 0
    assert len(backend.threads) == 1, f"backend calls came from {len(backend.threads)} threads"


async def test_steps_that_arrive_together_run_as_one_batch() -> None:
    """Frames read from several connections at once reach the scheduler over a few scheduling rounds
    (each reader hops from its socket to its handler): they join one iteration instead of the first
    of them running alone and the rest waiting a whole iteration. (A ring's head: its decode steps come
    from the tail's loop, here the test's.)"""
    backend = Watched(spec=SPEC, layers=LayerRange(0, 3), trio_thread=threading.get_ident())
    node = NodeService(backend=backend, node_id="n")
    sids = [uuid.UUID(int=10 + k).hex for k in range(4)]
    ring = OneNodeRing(node)
    async with running(node):
        for sid in sids:
            await ring.open(sid, 8)
            await ring.step(_frames(sid, [3, 14, 15], 0, 0, FrameKind.PREFILL))
        backend.batches.clear()
        busy, summed = node.scheduler.busy_s, node.stats.compute_s

        async def arrive(k: int, sid: str) -> None:
            for _ in range(k + 1):  # reader k needs k + 1 rounds to hand its frame over
                await trio.sleep(0)
            await ring.step(_frames(sid, [7], 3, 1, FrameKind.DECODE))  # from the tail's loop

        async with trio.open_nursery() as nursery:
            for k, sid in enumerate(sids):
                nursery.start_soon(arrive, k, sid)
    assert backend.batches == [4] and backend.violations == []
    # the batch's one call is the node's busy time once, and each of its 4 steps' compute
    batch_s = node.scheduler.busy_s - busy
    assert batch_s > 0 and node.stats.compute_s - summed == pytest.approx(4 * batch_s)
    assert node.status()["scheduler"]["busy_s"] == round(node.scheduler.busy_s, 6)


class _IoWaits(trio.abc.Instrument):
    """The timeout of each of the loop's waits for I/O: 0 while a task is runnable, more when it may sleep."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def before_io_wait(self, timeout: float) -> None:
        self.timeouts.append(timeout)


async def _io_waits_during(seconds: float) -> list[float]:
    rec = _IoWaits()
    trio.lowlevel.add_instrument(rec)
    try:
        await trio.sleep(seconds)
    finally:
        trio.lowlevel.remove_instrument(rec)
    return rec.timeouts


async def test_after_a_step_the_scheduler_busy_polls_for_its_window_then_sleeps() -> None:
    """Within `busy_poll_s` of computing a step, the loop never sleeps while a session is open (every wait
    for I/O has no timeout), and the next step is picked up from it; past the window, or with every session
    closed, or with busy polling off, the loop sleeps again."""
    sid, other = uuid.UUID(int=1).hex, uuid.UUID(int=2).hex
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 3)), node_id="n", busy_poll_s=0.4)
    node.scheduler.yield_core = lambda: 0.0  # an idle machine: every yield comes straight back
    off = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 3)), node_id="off")
    ring, off_ring = OneNodeRing(node), OneNodeRing(off)  # a ring's head: its decode steps come from the tail
    async with running(node, off):
        await ring.open(sid, 16)
        await ring.step(_frames(sid, [3, 14, 15], 0, 0, FrameKind.PREFILL))
        hot = await _io_waits_during(0.05)
        assert len(hot) > 10 and max(hot) == 0, "polled, never slept"
        reply = await ring.step(_frames(sid, [7], 3, 1, FrameKind.DECODE))  # taken off the hot loop
        assert decode_frame(reply).kind is FrameKind.DECODE  # on to the next hop
        await trio.sleep(0.45)  # past the window the decode opened
        assert max(await _io_waits_during(0.05)) > 0, "slept once the window was over"

        await ring.step(_frames(sid, [8], 4, 2, FrameKind.DECODE))
        await node.lifecycle.close(sid)  # a new window, but no session left to wait for
        assert max(await _io_waits_during(0.05)) > 0

        await off_ring.open(other, 16)
        await off_ring.step(_frames(other, [3, 14, 15], 0, 0, FrameKind.PREFILL))
        assert max(await _io_waits_during(0.05)) > 0, "busy polling is off by default"
        await off.lifecycle.close(other)


async def test_a_busy_poll_that_loses_its_core_for_long_sleeps_until_the_next_batch() -> None:
    """A yield that kept the loop off its core for longer than `contended_s` ends the window: the loop
    sleeps at once instead of polling on, and the next computed step opens a new window."""
    sid = uuid.UUID(int=1).hex
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 3)), node_id="n", busy_poll_s=10.0)
    away = [0.0] * 5 + [0.003]  # five yields come straight back, then another process holds the core 3 ms
    node.scheduler.yield_core = lambda: away.pop(0) if away else 0.0
    ring = OneNodeRing(node)  # a ring's head: its decode steps come from the tail
    async with running(node):
        await ring.open(sid, 16)
        await ring.step(_frames(sid, [3, 14, 15], 0, 0, FrameKind.PREFILL))
        assert max(await _io_waits_during(0.05)) > 0, "slept after the long yield, well inside the window"
        assert not away and node.scheduler.polls_given_up == 1
        assert node.status()["scheduler"]["polls_given_up"] == 1

        reply = await ring.step(_frames(sid, [7], 3, 1, FrameKind.DECODE))
        assert decode_frame(reply).kind is FrameKind.DECODE  # on to the next hop
        hot = await _io_waits_during(0.05)
        assert len(hot) > 10 and max(hot) == 0, "a computed step opened a new window"
        assert node.scheduler.polls_given_up == 1
        await node.lifecycle.close(sid)


async def test_a_busy_poll_offers_the_core_only_when_the_loop_has_nothing_else_to_run() -> None:
    """While other tasks of the loop can run (a relay woken by the last results, a reader), or a step is
    waiting for it, the busy poll never yields the core: another process could then hold it for a time
    slice before the step was computed or its results sent."""
    sid = uuid.UUID(int=1).hex
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 3)), node_id="n", busy_poll_s=10.0)
    loop_busy = False
    offered: list[bool] = []  # at each yield: did the loop still have work?

    def yield_core() -> float:
        offered.append(loop_busy or node.scheduler.queued > 0)
        return 0.0

    node.scheduler.yield_core = yield_core
    ring = OneNodeRing(node)  # a ring's head: its decode steps come from the tail
    async with running(node):
        await ring.open(sid, 32)
        await ring.step(_frames(sid, [3, 14, 15], 0, 0, FrameKind.PREFILL))  # opens the window
        offered.clear()
        loop_busy = True
        for _ in range(50):  # work of this loop, runnable at every round
            await trio.lowlevel.checkpoint()
        loop_busy = False
        await trio.sleep(0.01)
        assert offered, "the hot loop went on polling"
        assert not any(offered), f"yielded the core {sum(offered)} times while this loop had work"
        for k in range(20):  # steps arriving while the loop polls
            await ring.step(_frames(sid, [7 + k], 3 + k, 1 + k, FrameKind.DECODE))
        assert not any(offered), f"yielded the core {sum(offered)} times with a step waiting"
        await node.lifecycle.close(sid)


async def test_a_step_queued_behind_its_close_finds_the_session_gone_not_a_reused_slot() -> None:
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 6)), node_id="n")
    a, b = uuid.UUID(int=1).hex, uuid.UUID(int=2).hex
    async with running(node):
        await OneNodeRing(node).open(a, 32)
        sched = node.scheduler
        # Queued in this order at once: a's step, a's close, b's open (which may get a's freed
        # slot), then a late step for a. The late step must not compute into b.
        backend = node.backend
        jobs = [sched.submit(Job(JobKind.FORWARD, a, step=Step(a, 0, np.array([1, 2, 3], np.int32), None, False),
                                 finish=lambda o: o)),
                sched.submit(Job(JobKind.SESSION, a, fn=lambda: backend.close_session(a))),
                sched.submit(Job(JobKind.SESSION, b, fn=lambda: backend.open_session(b, 32))),
                sched.submit(Job(JobKind.FORWARD, a, step=Step(a, 3, np.array([9], np.int32), None, False),
                                 finish=lambda o: o))]
        for job in jobs:
            await job.done.wait()
        assert all(isinstance(j.result, outcome.Value) for j in jobs[:3])
        assert isinstance(jobs[3].result, outcome.Error) and jobs[3].result.error.reason is Reason.UNKNOWN_SESSION
        assert backend.positions_computed(b) == 0


async def test_node_ops_wait_for_the_scheduler_and_a_cancelled_caller_leaves_consistent_state() -> None:
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 6), delay_s=0.001), node_id="n")
    sid = uuid.uuid4().hex
    ring = OneNodeRing(node)
    async with running(node):
        # the prompt's 4 positions, then the one its loop's decode step computes, whose token is the last
        await ring.open(sid, 6, ignore_eos=True)
        with trio.move_on_after(0):
            await ring.step(_frames(sid, [1, 2, 3, 4], 0, 0, FrameKind.PREFILL))
        # the cancelled wait's step still ran: the KV and the session's counters agree, and the loop's next
        # step fits
        with trio.fail_after(30):
            assert decode_frame(await ring.answer(sid)).kind is FrameKind.TOKEN
            assert decode_frame(await ring.answer(sid)).kind is FrameKind.TOKEN
        assert (await node.session_json(sid))["positions_computed"] == 5


# -- the stub: one array op per layer over several sessions' positions ------------------------------

@pytest.mark.parametrize("spec", [StubSpec(), DEEPSEEK_LIKE], ids=["stub", "stub-dsv4"])
def test_stub_batched_rows_are_bit_identical_to_one_by_one(spec) -> None:
    """`StubBackend.forward_batch` computes the one-position steps of several sessions at once: outputs,
    KV, block marks, inputs and ids as forward gives them one by one, across a block's end, with sessions
    leaving and joining the batch; a step forward would refuse fails alone."""
    n = spec.n_layers
    cuts = [LayerRange(0, n // 3), LayerRange(n // 3, 2 * n // 3), LayerRange(2 * n // 3, n)]
    batched, single = [StubBackend(spec, r) for r in cuts], [StubBackend(spec, r) for r in cuts]
    sids = [f"s{i}" for i in range(5)]
    token, pos = {}, {}
    for k, sid in enumerate(sids):
        prompt = np.array([3, 4, 5 + k, 6 + k][: 2 + k % 3], np.int32)
        for chain in (batched, single):
            h = None
            for be in chain:
                be.open_session(sid, 512)
                h = be.forward(sid, 0, prompt, h, True)
        token[sid], pos[sid] = int(np.argmax(h)), len(prompt)
    for t in range(70):
        live = sids[: 5 - (t % 3 == 0)]
        outs: list = [None] * len(live)
        for j, be in enumerate(batched):
            outs = be.forward_batch([Step(sid, pos[sid], np.array([token[sid]], np.int32),
                                          None if j == 0 else outs[i].unwrap(), True, True)
                                     for i, sid in enumerate(live)])
        for sid, got in zip(live, outs):
            h = None
            for be in single:
                h = be.forward(sid, pos[sid], np.array([token[sid]], np.int32), h, True)
            assert np.array_equal(got.unwrap(), h)
            token[sid], pos[sid] = int(np.argmax(h)), pos[sid] + 1
    for a, b in zip(batched, single):
        for sid in sids:
            x, y = a._table.live[sid], b._table.live[sid]
            assert (x.positions, x.computed, x.ids) == (y.positions, y.computed, y.ids)
            assert np.array_equal(x.kv_sum, y.kv_sum) and sorted(x.marks) == sorted(y.marks)
            assert all(np.array_equal(x.marks[p], y.marks[p]) for p in x.marks)
            assert np.array_equal(np.stack(x.inputs), np.stack(y.inputs))
    assert 64 in single[0]._table.live["s0"].marks  # the batches crossed a block's end
    head = batched[0]
    late = Step("s0", 0, np.array([1], np.int32), None, False, True)  # a position the session is past
    ok = Step("s1", pos["s1"], np.array([1], np.int32), None, False, True)
    bad, good = head.forward_batch([late, ok])
    assert isinstance(bad, outcome.Error) and bad.error.reason is Reason.POSITION_DISCONTINUITY
    assert isinstance(good, outcome.Value)


# -- llama.cpp: one llama_decode over several sequences ----------------------------------------------

def test_llama_batched_decode_is_bit_identical_to_one_by_one(model_path) -> None:
    from dgr.backends.llama_shard import LlamaShardBackend

    def make(a: int, b: int) -> LlamaShardBackend:
        return LlamaShardBackend(model_path, LayerRange(a, b), n_threads=1, n_ctx=256, max_sessions=8)

    batched, single = (make(0, 15), make(15, 30)), (make(0, 15), make(15, 30))
    try:
        sids = [f"s{i}" for i in range(6)]
        prompts = {s: [1, 504, 3458, 314, 260, 1100 + 7 * i, 30] for i, s in enumerate(sids)}
        for be in (*batched, *single):
            for s in sids:
                be.open_session(s, 128)
            be.close_session("s2")  # a gap in the seq ids: the batch splits into two ubatches
        live = [s for s in sids if s != "s2"]
        token, pos = {}, {}
        for s in live:
            for head, tail in (batched, single):
                h = head.forward(s, 0, np.array(prompts[s], np.int32), None, False)
                logits = tail.forward(s, 0, None, h, True)
            token[s], pos[s] = int(np.argmax(logits)), len(prompts[s])
        worst = 0.0
        for _ in range(12):
            head, tail = batched
            hs = head.forward_batch([Step(s, pos[s], np.array([token[s]], np.int32), None, False, True) for s in live])
            got = tail.forward_batch([Step(s, pos[s], None, h.unwrap(), True, True) for s, h in zip(live, hs)])
            for s, g in zip(live, got):
                h = single[0].forward(s, pos[s], np.array([token[s]], np.int32), None, False)
                want = single[1].forward(s, pos[s], None, h, True)
                worst = max(worst, float(np.max(np.abs(g.unwrap() - want))))
                token[s], pos[s] = int(np.argmax(want)), pos[s] + 1
        assert worst == 0.0
    finally:
        for be in (*batched, *single):
            be.close()


def test_only_a_session_that_could_still_send_is_waited_for() -> None:
    """The scheduler gathers (lets other readers run) only while some open session has nothing queued:
    a lone session's step never waits for company that cannot come."""
    def fwd(sid: str) -> Job:
        return Job(JobKind.FORWARD, sid, step=Step(sid, 0, np.array([1], np.int32), None, True, decode=True))
    assert not may_gather([fwd("a")], 1)
    assert may_gather([fwd("a")], 2)
    assert not may_gather([fwd("a"), fwd("b")], 2)
    assert not may_gather([fwd("a"), fwd("a")], 1)
    assert may_gather([Job(JobKind.CALL, None, fn=lambda: None)], 1)  # a control call is no session's step
    assert not may_gather([], 0)


async def test_a_ring_node_computes_one_phase_group_of_its_route_at_a_time() -> None:
    """8 sessions of a 2-node route open on a node: decode steps of all 8 that arrive together (two
    groups released at once) run as two batches of 4, not one of 8 that would leave the next node idle."""
    from dgr.node.relay import NextHop, RelayPlan
    from dgr.testing.streams import FakePool

    backend = Watched(spec=SPEC, layers=LayerRange(0, 3), trio_thread=threading.get_ident())
    node = NodeService(backend=backend, node_id="n0")
    node.pools["http://n1"] = FakePool()  # the next node, which takes every step
    plan = RelayPlan(NextHop("n1", "http://n1", None), "http://gateway", None, route="n0,n1", nodes=2)
    sids = [uuid.UUID(int=40 + k).hex for k in range(8)]
    async with running(node):
        for lane, sid in enumerate(sids):
            await node.open_session(sid, 16, SamplingParams(temperature=0.0), relay=plan, lane=lane)
            node.replies.accept_streamed(sid, Record(encode_frame(FrameKind.PREFILL, sid, 0, 0, 3, W, token_ids=[3, 14, 15])))
        await settled(node)
        backend.batches.clear()
        for sid in sids:  # both groups at once
            node.replies.accept_streamed(sid, Record(encode_frame(FrameKind.DECODE, sid, 1, 3, 1, W, token_ids=[7])))
        await settled(node)
        assert backend.batches == [4, 4] and backend.violations == []
        for sid in sids:
            await node.lifecycle.close(sid)
    assert not node.on_route
