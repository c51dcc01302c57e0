"""The step scheduler: the one owner of a node's backend, and the trio driver of its iterations.

Contract:
- Every backend call (open, close, forward, KV accounting, tokenizing,
  chat-template rendering, status) is a job run by this scheduler's single
  task, one iteration at a time: in the node's one backend thread
  (dgr.node.backend_thread), or on the loop for a short decode-only
  iteration of a one-thread backend (`inline_below_s`).
  Nothing else on the node touches the backend, so llama.cpp's contexts
  (not thread-safe) never see two calls at once, and the trio loop never
  blocks on a long one. The one exception is text a backend keeps apart
  from its compute (`ShardBackend.text_apart`: a vocabulary-only model, as
  llama-server tokenizes in its HTTP threads while its loop decodes), which
  the node tokenizes in a thread of its own (dgr.node.service).
- What runs in an iteration is planned by `plan_iteration`
  (dgr.node.iteration: session order, controls first, batching, the time
  bound and its cuts). Because only the first queued job of a session is
  eligible, a sequence slot is freed only when no compute on it is in
  flight, and a late forward finds its session gone (UNKNOWN_SESSION)
  instead of writing into a slot that now belongs to someone else.
- A submitted job always runs, even when its caller has gone (cancelled):
  the node session's counters were advanced when the step was accepted, so
  the KV must follow. The result is then dropped. The one exception: a
  session's forwards queued before a job that ends it and keeps none of its
  KV (`Job.ends`: a failure, a cancel, a close that keeps no prefix) are
  dropped unrun, their callers answered `session_ended`, so a client that
  leaves mid-prefill frees its slot at once instead of after its chunks
  (a chunk cut part-way is dropped too: the close frees whatever it wrote).
- Controls are answered before the iteration's batch of forwards starts, so
  an open, close, tokenize or status that arrives while prefill is queued
  waits for the iteration in flight at most, and that iteration is bounded
  in time (`iteration_target_s`, at the measured `prefill_rate`: an EWMA of
  positions per second of the iterations that held prefill).
- Before an iteration, every task that can run does (for at most
  `gather_s`), so steps already read from other connections join it; not
  when every session open on the backend already has a job queued
  (`may_gather`).
- Busy polling (`busy_poll_s`): after an iteration that computed steps,
  while sessions are open, the driver waits for the next job on a hot loop
  (trio polls the sockets without sleeping) and, each round that leaves this
  loop with nothing to run, gives the core to any other runnable thread,
  instead of letting the core sleep. When one
  such round gives the core away for longer than `contended_s`, another
  process wants it: the driver sleeps until its next computed batch.

Theory: `plan_iteration` is pure (which jobs run now, which wait) and is
tested on its own; `StepScheduler.run` is the thin trio driver around it.

Left out: what a step means (dgr.node.replies builds the jobs and their
replies), transport, and any notion of time beyond an iteration's target
(deadlines are the gateway's).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import attrs
import numpy as np
import outcome
import trio
# trio.testing's function, from where trio defines it: importing trio.testing imports pytest, about
# 0.2 s of CPU at every node's start (tests/test_cli.py checks it is the same function)
from trio._core import wait_all_tasks_blocked

from dgr.backends.base import Compute, Step
from dgr.errors import CallerError, Reason
from dgr.node import steptrace
from dgr.node.backend_thread import BackendThread
from dgr.node.iteration import (DEFAULT_TOKEN_BUDGET, MIN_CUT, Job, JobKind, first_part, joined, may_gather,
                                plan_iteration, rest)

__all__ = ["StepScheduler", "DEFAULT_ITERATION_TARGET_S"]

# How long an iteration may hold other sessions' waiting steps (--iteration-target-ms). At 1 thread a
# 512-position chunk of the default model took seconds under contention (issue 43), and every decode
# step and control call of the node waited behind it.
DEFAULT_ITERATION_TARGET_S = 0.25
_RATE_WEIGHT = 0.3  # the weight of the newest sample in the prefill rate's EWMA
_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def _timed_yield() -> float:
    """Let another runnable thread have this core (Linux's sched_yield; nothing where there is none).

    Returns the seconds until this thread ran again: how long something else held the core.
    """
    t = time.perf_counter()
    _sched_yield()
    return time.perf_counter() - t


def _mark(stage: str, batch: list[Job]) -> None:
    for job in batch:
        steptrace.mark(stage, job.step.sid, job.step.pos0)


@attrs.define(eq=False)
class StepScheduler:
    """Runs every backend call of a node, one iteration at a time, in its backend thread or (short decodes) inline."""

    backend: Compute  # compute only: text apart and prefix slots reach it as plain calls (`call`)
    token_budget: int = DEFAULT_TOKEN_BUDGET
    # The longest an iteration should hold other sessions' waiting steps (--iteration-target-ms); 0: no cap
    iteration_target_s: float = DEFAULT_ITERATION_TARGET_S
    # Positions per second of this node's iterations that held prefill (an EWMA over them, contention
    # included: a core taken by another process halves it and the chunks shrink); None until measured
    prefill_rate: float | None = None
    cuts: int = 0  # prefill chunks cut to keep an iteration within its target
    dropped: int = 0  # forwards dropped unrun because their session ended (`Job.ends`)
    # What the backend last reported, refreshed after every iteration: status and metrics read
    # these instead of calling the backend from the loop.
    kv_bytes: int = 0
    session_count: int = 0
    iterations: int = 0
    batched_steps: int = 0  # forwards that ran in a batch of two or more
    # Seconds in forward calls, each batch once: how busy the node's compute is. (A step's compute_s is
    # its whole batch's call, so a sum over steps counts a batch of 4 four times.)
    busy_s: float = 0.0
    # Run iterations on the loop instead of the backend thread: only for trio-level tests on a MockClock,
    # where a thread would count as blocked and let the clock jump past every deadline.
    inline: bool = False
    # A decode-only iteration of a one-thread backend runs on the loop while the last one took less
    # than this: handing a step to the backend thread and back costs 0.1 to 0.4 ms on these VMs (a
    # sleeping core must wake), and a short block of the loop delays nothing that would not wait for
    # this iteration anyway. Prefill chunks, control calls and slow decodes stay in the thread, so the
    # loop never stalls for long (heartbeats, status, new frames). So do backends with a thread pool:
    # llama.cpp with 2 threads decoded at 44-53 tok/s from the loop against 67-72 from the worker
    # thread (SmolLM2, one node, paired runs), though the 1-thread shards gained: its decodes on the
    # loop and its prefill in a thread made two OpenMP teams (dgr.node.backend_thread).
    inline_below_s: float = 0.025
    gather_s: float = 0.002  # at most this long to let steps that have already arrived join an iteration
    # For this long after an iteration that computed steps, while sessions are open, wait for the next job
    # without sleeping. On a route each node idles while the others compute, and on these VMs a core that
    # slept costs 0.3 to 1.5 ms to wake per link (a loopback ping after 10 ms of idle: 299 us p50 and
    # 794 us p90, against 27 us when the receiver polls). In paired rounds (1 thread a node, a 50 ms
    # window) a 2-node SmolLM2 chain decoded 1.21x faster with it while the VM was slow and 0.99x while
    # it was calm, a 3-node chain 1.14x, 8 sessions 0.99x. Each round yields the core (sched_yield), so
    # a busy machine's other work still runs; idle, the core stays awake. 0: off.
    busy_poll_s: float = 0.0
    # A yield that kept this thread off its core for longer than this says another process wants the
    # core for more than a moment (other work on the machine, a second test beside the route): the
    # loop stops polling and sleeps until a computed batch opens the next window. Yielding alone did
    # not give the core back. Beside one CPU-bound process (2-node SmolLM2 route, 1 thread a node,
    # five paired rounds), one session decoded at 31.1 tok/s with this rule against 26.7 with plain
    # polling (35.6 with none); 8 sessions at 38.5 against 41.0, inside the VM's noise. Idle, the
    # rule ended 5 to 65 windows a node per 27 s run and changed no rate beyond that noise.
    contended_s: float = 0.002
    yield_core: Callable[[], float] = _timed_yield  # seconds the core was given away (tests pass their own)
    polls_given_up: int = 0  # busy-poll windows ended early because the core was wanted
    _hot_until: float = -math.inf  # trio clock: the busy-poll window's end
    _last_decode_s: float = math.inf  # seconds the last decode-only iteration's backend call took
    # Unbounded on purpose: every job was admitted by a session state machine (or is a control
    # call of one request), and a submitted job must never be lost to a full buffer.
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _recv: trio.MemoryReceiveChannel = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel(math.inf)

    @property
    def queued(self) -> int:
        """Jobs submitted and not yet taken by the driver."""
        return self._recv.statistics().current_buffer_used

    # -- submitting ---------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue `job` now; it will run, in order after the jobs of its session queued before it."""
        self._send.send_nowait(job)  # never blocks, so never cancelled half-way
        return job

    async def call(self, fn: Callable[[], Any], *, sid: str | None = None, ends: bool = False) -> Any:
        """Run `fn` (a backend call) in the scheduler's thread: outside any session's order, or with `sid`,
        after every job of `sid` submitted before it; with `ends` (`fn` frees the session and keeps none of
        its KV), the session's forwards still queued are dropped instead."""
        job = self.submit(Job(JobKind.CALL if sid is None else JobKind.SESSION, sid, fn=fn, ends=ends))
        await job.done.wait()
        return job.result.unwrap()

    async def forward(self, step: Step, finish: Callable[[np.ndarray | None], Any]) -> tuple[Any, float]:
        """Compute `step` (batched with other sessions' steps); return (finish(output), compute seconds).

        Raises: whatever the backend raised for this step.
        """
        job = self.submit(Job(JobKind.FORWARD, step.sid, step=step, finish=finish))
        await job.done.wait()
        return job.result.unwrap(), job.compute_s

    # -- the driver ---------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the backend until cancelled. A cancel waits for the iteration in its thread to end.

        Every iteration that leaves the loop runs in one thread for the driver's life
        (dgr.node.backend_thread says why it is always the same one).
        """
        pending: list[Job] = []
        with BackendThread() as thread:
            task_status.started()
            while True:
                await self._take(pending)
                plan = plan_iteration(pending, self.token_budget, prefill_rate=self.prefill_rate,
                                      target_s=self.iteration_target_s, open_sessions=self.session_count)
                controls, batch = [pending[i] for i in plan.controls], [pending[i] for i in plan.batch]
                if plan.dropped:
                    self._drop([pending[i] for i in plan.dropped])
                if controls:
                    # answered before the batch starts: an open or a status never waits for a prefill chunk
                    if self.inline:
                        self._iterate(controls, [])
                    else:
                        await thread.run_sync(self._iterate, controls, [])
                    self._done(controls)
                cut: Job | None = None
                if plan.cut:
                    k = next(k for k, job in enumerate(batch) if not job.step.decode)
                    cut, batch[k] = batch[k], first_part(batch[k], plan.cut)
                decode_only = bool(batch) and all(job.step.decode for job in batch)
                if batch and (self.inline or (decode_only and self._may_inline
                                              and self._last_decode_s < self.inline_below_s)):
                    self._iterate([], batch)
                elif batch:
                    await thread.run_sync(self._iterate, [], batch)
                if batch and self.busy_poll_s > 0:
                    self._hot_until = trio.current_time() + self.busy_poll_s
                keep = set(plan.deferred)
                if cut is not None:
                    if self._rejoin(cut, batch[k], plan.cut):
                        keep.add(plan.batch[k])  # its rest waits for a later iteration
                        batch.pop(k)
                    else:
                        batch[k] = cut  # the chunk failed part-way: its caller hears it now
                self._done(batch)
                pending = [pending[i] for i in sorted(keep)]
                # The results' relays and replies go out before anything else that could block the loop: a
                # one-thread backend's next iteration may run on it. After control jobs (an open, a close)
                # the accounting is already fresh for whoever they wake; after forwards alone it only feeds
                # status and metrics, and waits for this: it cost 60 us of a route's token. A backend whose
                # iterations always leave the loop has its next one (a step its results queued here: a ring
                # of this node alone) start first, and the relays run while it computes: waiting for them
                # held that step 0.4 to 0.5 ms (the answer to the gateway, its encoding and send).
                if batch and (self.inline or self._may_inline):
                    await trio.lowlevel.checkpoint()
                if batch:
                    self._account()

    @staticmethod
    def _done(jobs: list[Job]) -> None:
        """Wake the callers of jobs that have run (on the loop)."""
        for job in jobs:
            job.done.set()
            if job.on_done is not None:
                job.on_done(job)

    def _drop(self, jobs: list[Job]) -> None:
        """Answer, unrun, the forwards of a session that a job queued behind them ends (`Job.ends`)."""
        for job in jobs:
            job.result = outcome.Error(CallerError(Reason.SESSION_ENDED,
                                                   f"session {job.sid} ended before this step ran"))
        self.dropped += len(jobs)
        self._done(jobs)

    def _rejoin(self, chunk: Job, part: Job, cut: int) -> bool:
        """A cut chunk's first `cut` positions have run (`part`): True when its rest waits for a later
        iteration (the chunk keeps the part's output and steps on to its rest); False when the part failed,
        which the chunk's caller hears as its result."""
        chunk.compute_s += part.compute_s
        if part.result is not None and isinstance(part.result, outcome.Error):
            chunk.result = part.result
            return False
        chunk.parts.append(part.result.unwrap() if part.result is not None else None)
        chunk.step = rest(chunk.step, cut)
        self.cuts += 1
        return True

    @property
    def _may_inline(self) -> bool:
        """Whether a short decode-only iteration may run on the loop: only a one-thread backend's (a thread
        pool called from two threads makes two OpenMP teams, dgr.node.backend_thread)."""
        return self.backend.n_threads == 1

    async def _take(self, pending: list[Job]) -> None:
        """The jobs for the next iteration, onto the end of `pending` in order: every job submitted so far; with
        none pending and none submitted, the next one first, waited for (inside the busy-poll window, without
        sleeping); then, where another session's step could still join them (`may_gather`), what the tasks
        that can run bring within `gather_s`."""
        recv = self._recv
        while (not pending and not recv.statistics().current_buffer_used and self.session_count
               and trio.current_time() < self._hot_until):
            # A round of the loop (sockets polled with no timeout, readers run) that ends only once every
            # other task is blocked: the core is offered to other processes only when this loop has
            # nothing left to do. After a plain checkpoint, a relay woken by the last results could
            # wait a whole time slice of another process before it sent them on.
            await wait_all_tasks_blocked()
            # a step that round's readers brought is taken before any yield
            if not recv.statistics().current_buffer_used and self.yield_core() > self.contended_s:
                self._hot_until = -math.inf
                self.polls_given_up += 1
        if not pending and not recv.statistics().current_buffer_used:
            pending.append(await recv.receive())
        gathered = False
        while True:
            try:
                pending.append(recv.receive_nowait())
                continue
            except trio.WouldBlock:
                pass
            if gathered or not may_gather(pending, self.session_count):
                return
            # Steps of other sessions may have arrived with these, still unread in their
            # connections: let every runnable task (those readers) run first, so they join this
            # batch instead of waiting a whole iteration for the next. Bounded, for a busy loop.
            with trio.move_on_after(self.gather_s):
                await wait_all_tasks_blocked()
            gathered = True

    def _iterate(self, controls: list[Job], batch: list[Job]) -> None:
        """One iteration (in the backend thread, or inline): controls, the batch, and after controls the accounting.

        A decode-only batch's compute is what the next decides inlining by; one with prefill goes into the
        prefill rate's EWMA, unless it holds fewer than MIN_CUT positions (a few positions say more about the
        call's fixed cost than about the rate).
        """
        trace = steptrace.ON and bool(batch)
        if trace:
            _mark("iterate", batch)
        for job in controls:
            job.result = outcome.capture(job.fn)
        if batch:
            if trace:
                _mark("compute", batch)
            t0 = time.perf_counter()
            outs = self.backend.forward_batch([job.step for job in batch])
            compute = time.perf_counter() - t0
            if trace:
                _mark("computed", batch)
            self.busy_s += compute
            for job, out in zip(batch, outs):
                job.compute_s += compute
                if isinstance(out, outcome.Error) or job.finish is None:  # a cut chunk's first part: no reply yet
                    job.result = out
                else:
                    job.result = outcome.capture(job.finish, joined(job.parts, out.unwrap()))
            if trace:
                _mark("finished", batch)
            self.batched_steps += len(batch) if len(batch) > 1 else 0
            positions = sum(job.step.n_tokens for job in batch)
            if all(job.step.decode for job in batch):
                self._last_decode_s = compute
            elif positions >= MIN_CUT and compute > 0:
                r, sample = self.prefill_rate, positions / compute
                self.prefill_rate = sample if r is None else r + _RATE_WEIGHT * (sample - r)
        self.iterations += 1
        if controls:
            self._account()

    def _account(self) -> None:
        """What the backend holds now, for status and metrics (between iterations: nothing else calls it)."""
        self.kv_bytes = self.backend.kv_bytes()
        self.session_count = self.backend.session_count()
