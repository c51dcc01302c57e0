"""One iteration of a node's step scheduler, planned: which queued jobs run now, which wait. Pure.

Contract:
- Jobs of one Route Session run in the order they were submitted. Only the
  first queued job of each session is eligible in an iteration, so a close
  can never overtake a forward of its session, nor a forward its open.
- A session's forwards queued before a job that ends it and keeps none of its
  KV (`Job.ends`) are dropped unrun (`Plan.dropped`).
- Control jobs are never queued behind compute: every eligible control job
  runs first, as a backend call of its own (`Plan.controls`).
- Batching: after the controls, one batch of forwards runs as one backend
  call (`Plan.batch`). Decode steps go first, in queue order, each only into a
  batch that holds fewer decode steps than its `max_rows` (a pipeline route's
  phase group: see `Job`); prefill chunks fill the rest of the token budget,
  and at least one prefill chunk runs whenever one waits, so a long prompt
  delays other sessions' decoding by at most one chunk and is never starved.
- An iteration is bounded in time, not only in positions: while other
  sessions wait (decode steps queued, or sessions open that have no prefill
  in this batch), the prefill positions are capped at what the node computes
  in the target time at its measured prefill rate (`prefill_room`), and the
  first prefill chunk is cut there (`Plan.cut`): its first positions run now
  (`first_part`), the rest in a later iteration (`rest`), and its caller gets
  the whole chunk's output (`joined`). With nobody waiting the chunk runs
  whole. A cut leaves at least `MIN_CUT` positions on each side (a lone
  position runs on other kernels).

Theory: every non-empty queue makes progress; the plan is a function of the
queue and a few numbers, tested on its own (tests/test_control.py,
tests/test_batching.py). The trio driver that runs it is dgr.node.scheduler.

Left out: running anything, time (the rate and target are passed in).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import outcome
import trio

from dgr.backends.base import Step

__all__ = ["JobKind", "Job", "Plan", "plan_iteration", "prefill_room", "may_gather", "first_part", "rest", "joined",
           "DEFAULT_TOKEN_BUDGET", "MIN_CUT"]

DEFAULT_TOKEN_BUDGET = 512  # positions per iteration; one llama.cpp ubatch
# The fewest positions a cut prefill chunk runs on either side of the cut, and the cut's alignment:
# a 1-position remainder would run on llama.cpp's matrix-vector kernels, not its matrix-matrix ones.
MIN_CUT = 32


class JobKind(enum.Enum):
    CALL = "call"  # a backend call tied to no session's order (tokenize, render, status)
    SESSION = "session"  # a session's control call: open, close, fail, status of it
    FORWARD = "forward"  # a seam step


@attrs.define(eq=False)
class Job:
    kind: JobKind
    sid: str | None
    fn: Callable[[], Any] | None = None  # CALL and SESSION: runs in the backend thread
    step: Step | None = None  # FORWARD
    finish: Callable[[np.ndarray | None], Any] | None = None  # FORWARD: turns the output into the reply, in the thread
    result: outcome.Outcome | None = None
    compute_s: float = 0.0  # FORWARD: seconds of the backend calls this step was part of (each part's, summed)
    on_done: Callable[["Job"], None] | None = None  # called on the loop once the job has run; must not block
    # A decode step joins only a batch of fewer decode steps than this (None: any). On a route of N
    # nodes the sessions decode in N phase groups, one on each node; two groups that reach a node
    # together (released at once by the ring's tail) would stay one batch for good, every node idle
    # while another computes it: 8 sessions on a 2-node ring then ran about 80 batches of 8 rows for
    # 64 tokens instead of 140 of 4, at 58 to 63 tok/s instead of 82 to 85.
    max_rows: int | None = None
    # SESSION: this job ends the session and keeps none of its KV, so its forwards queued before it are moot
    ends: bool = False
    done: trio.Event = attrs.field(factory=trio.Event)
    # FORWARD cut across iterations (`Plan.cut`): the outputs of its parts that have run, in order
    parts: list = attrs.field(factory=list)


@attrs.frozen
class Plan:
    controls: tuple[int, ...]  # indices into the queue, run first, in queue order
    batch: tuple[int, ...]  # forwards, run as one backend call: decodes first, then prefill chunks
    deferred: tuple[int, ...]  # wait for a later iteration, in queue order
    dropped: tuple[int, ...] = ()  # forwards of a session an `ends` job behind them ends: answered unrun
    # > 0: the batch's first prefill chunk runs only its first `cut` positions now; the rest stays queued
    cut: int = 0


def prefill_room(rate: float | None, target_s: float, token_budget: int) -> int:
    """The prefill positions an iteration may hold while other sessions wait: what the node computes in
    `target_s` at `rate` positions/s, aligned down to MIN_CUT, within [MIN_CUT, token_budget]. Without a
    measured rate (or a target) nothing is known, so the whole budget."""
    if rate is None or rate <= 0 or target_s <= 0:
        return token_budget
    return max(MIN_CUT, min(token_budget, int(rate * target_s) // MIN_CUT * MIN_CUT))


def _cut_at(n: int, room: int) -> int:
    """Where to cut a chunk of `n` positions that has `room` left: 0 (whole) when it fits, or when a cut
    would leave fewer than MIN_CUT positions on either side."""
    if n <= room:
        return 0
    cut = min(max(MIN_CUT, room // MIN_CUT * MIN_CUT), n - MIN_CUT)
    return cut if cut >= MIN_CUT else 0


def plan_iteration(queue: Sequence[Job], token_budget: int, *, prefill_rate: float | None = None,
                   target_s: float = 0.0, open_sessions: int = 0) -> Plan:
    """Choose what runs in this iteration. Pure; every non-empty queue makes progress.

    A session's forwards queued before a job that `ends` it are dropped, and
    the first of its other queued jobs is eligible; its later ones wait. Eligible
    control jobs all run. Eligible decode steps run in queue order, each if the
    batch holds fewer decode steps than its `max_rows`; prefill chunks follow
    in arrival order while the positions fit `token_budget`, but the first one
    runs even if it alone exceeds the budget.

    While other sessions wait (a decode step is queued, or more sessions are
    open than have prefill eligible here), the prefill positions are also capped
    at `prefill_room(prefill_rate, target_s, ...)`, less the decode steps'
    positions: the first prefill chunk is cut to fit (`Plan.cut`), and no other
    chunk joins it.
    """
    ending = {job.sid for job in queue if job.ends and job.sid is not None}
    last_end = {job.sid: i for i, job in enumerate(queue) if job.ends}
    dropped = [i for i, job in enumerate(queue)
               if job.kind is JobKind.FORWARD and job.sid in ending and i < last_end[job.sid]]
    gone = set(dropped)
    seen: set[str] = set()
    controls: list[int] = []
    decodes: list[int] = []
    prefills: list[int] = []
    deferred: set[int] = set()
    for i, job in enumerate(queue):
        if i in gone:
            continue
        if job.sid is not None:
            if job.sid in seen:
                deferred.add(i)
                continue
            seen.add(job.sid)
        if job.kind is JobKind.FORWARD:
            (decodes if job.step.decode else prefills).append(i)
        else:
            controls.append(i)
    batch: list[int] = []
    for i in decodes:
        cap = queue[i].max_rows
        if cap is not None and len(batch) >= cap:
            deferred.add(i)
        else:
            batch.append(i)
    used = sum(queue[i].step.n_tokens for i in batch)
    budget, cut = token_budget, 0
    waiting = bool(decodes) or open_sessions > len({queue[i].sid for i in prefills})
    if waiting and prefills and prefill_rate and target_s > 0:  # else nothing to size a cut by
        budget = min(token_budget, prefill_room(prefill_rate, target_s, token_budget))
        cut = _cut_at(queue[prefills[0]].step.n_tokens, max(0, budget - used))
    for k, i in enumerate(prefills):
        n = queue[i].step.n_tokens
        if k == 0 or (not cut and used + n <= budget):
            batch.append(i)
            used += cut or n
        else:
            deferred.add(i)
    return Plan(tuple(controls), tuple(batch), tuple(sorted(deferred)), tuple(dropped), cut)


def may_gather(pending: Sequence[Job], open_sessions: int) -> bool:
    """Whether another session's step could still join this iteration: some session open on the
    backend has no job here yet. A lone session's step never waits for company that cannot come."""
    return open_sessions > len({job.sid for job in pending if job.sid is not None})


def first_part(job: Job, cut: int) -> Job:
    """A stand-in for `job`'s first `cut` positions: no logits, no reply (the driver keeps its output)."""
    s = job.step
    part = Step(s.sid, s.pos0, None if s.token_ids is None else s.token_ids[:cut],
                None if s.hidden is None else s.hidden[:cut], False, decode=False)
    return Job(JobKind.FORWARD, job.sid, step=part)


def rest(step: Step, cut: int) -> Step:
    """`step` past its first `cut` positions (computed already)."""
    return Step(step.sid, step.pos0 + cut, None if step.token_ids is None else step.token_ids[cut:],
                None if step.hidden is None else step.hidden[cut:], step.want_logits, decode=False)


def joined(parts: list, out: Any) -> Any:
    """A chunk's whole output from its parts': hidden states [n, W] joined in order; a tail's logits (or
    nothing) come from the last part alone."""
    if not parts or out is None or getattr(out, "ndim", 0) != 2:
        return out
    return np.concatenate([*parts, out], axis=0)
