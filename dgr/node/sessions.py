"""The node's session lifecycle: open, close, fail, idle expiry, and what a session holds now.

Rules:
- The node's sessions live in one `SessionTable` (dgr.sessions), which answers "may this open?" and
  "which session is this id?" for every caller here; ended ids are remembered (bounded), so a late
  frame is refused as `session_ended`, not `unknown_session`.
- An open is registered before its KV is opened (a scheduler job, dgr.node.kv), so a second open of
  the same id is refused while this one is queued, and a step for it queues behind the open. Where
  the KV cannot open, the registration is undone.
- A session may open waiting for its KV (`waits`; dgr.fsm.node's `waiting` state): a later hop opened
  with the head, before the prompt is tokenized (`max_new`), and the head itself where it names its own
  prefix. The gateway names the prefix (`adopt`) where the head may hold one, or the KV opens empty as
  the job before the session's first step (`kv_job`), for the positions its open asked (the table's
  limit) on its lane (its record's). Until then it holds no slot of the backend's.
- Everything held for a session is its one record (dgr.node.links `NodeSessionRecord`), the table's
  value; ending it closes what the record owns, and drops the capabilities verified for it (`ended`:
  dgr.node.trust's `forget`), which would otherwise stay until thousands of later ones pushed them out.
- Sessions end by `close` (the gateway is done), by failure (the gateway saw the route break, or
  compute raised) or by idle expiry (on trio's clock, as sessions are stamped). Each frees its KV
  after any of its steps already queued: until then it still counts against capacity and in status,
  so `sessions` and `kv_bytes` agree. A close that keeps nothing needs none of the session's queued
  compute: it is dropped, not waited for.
- A repair resumes a live session under a fresh id (`resume`, issue 54): the old id ends `moved` at once
  (a late frame of it is refused), its queued steps run, and one job renames its KV to the new id,
  trimmed to what the gateway keeps; the new session takes over its record's facts and journal
  (dgr.node.journal) and sends on first the journal's steps the hop after it lacks.
- Every backend call is a scheduler job: nothing here touches the backend from the event loop.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import numpy as np
import outcome
import trio

from dgr.backends.base import Compute
from dgr.errors import CallerError, DgrError, Failure, Reason
from dgr.fsm.node import NodeSession, NodeState
from dgr.node.journal import JournalBook
from dgr.node.kv import NodeKV
from dgr.node.links import NodeLinks, NodeSessionRecord
from dgr.node.relay import Outgoing, RelayPlan
from dgr.node.speculation import SpecPlan
from dgr.node.iteration import Job, JobKind
from dgr.node.scheduler import StepScheduler
from dgr.sampling import Sampler, SamplingParams
from dgr.seam.opening import ResumeOrder
from dgr.sessions import SessionTable

__all__ = ["ENDED_MEMORY", "NodeSessions"]

ENDED_MEMORY = 4096  # ended ids remembered, to refuse a late frame as session_ended


@attrs.define
class NodeSessions:
    """Node Sessions, from open to their KV freed."""

    backend: Compute
    node_id: str
    table: SessionTable[NodeSessionRecord]
    scheduler: StepScheduler
    kv: NodeKV
    links: NodeLinks
    idle_timeout_s: float = 120.0
    ended: Callable[[str], None] = lambda sid: None  # told each session's end (NodeTrust.forget)
    journals: JournalBook = attrs.field(factory=lambda: JournalBook(0))  # non-tail sessions' frames sent on

    async def open(self, sid: str, max_positions: int, sampling: SamplingParams, relay: RelayPlan,
                   prefix: list[str] | None = None, lane: int | None = None, marks: bytes = b"",
                   spec: SpecPlan | None = None, max_new: int | None = None, waits: bool = False,
                   prompt: list[int] | None = None, sample_from: int = 0) -> int:
        """Open a ring session: its results go on through its `relay` (a tail's loops back to the head too).

        With `prefix` (a block hash chain, dgr.node.prefix) and `marks` (its positions' marks), the
        session starts from the longest kept prefix matching it, to the token; returns the positions it
        holds from there (0: none reused). The marks are remembered, to name the session's KV if it is
        kept. `lane` is the sequence slot to give it while that is free (dgr.fsm.phases). With `spec`, its
        decode steps may carry drafts (dgr.node.speculation; a ring's tail drafts them). With `max_new`, the
        prompt's length is not known yet: `max_positions` is a bound, and the KV waits (`adopt`, `kv_job`), as
        it does with `waits`. A head keeps its `prompt`'s ids: the prompt's chunks come without them
        (NodeReplies.admit). A tail answers no step that ends at or before position `sample_from` (a repaired
        route's rebuild: they were answered on the route it replaced).

        Raises: CallerError(SESSION_EXISTS | NODE_AT_CAPACITY | CONTEXT_LENGTH_EXCEEDED | INVALID_REQUEST).
        """
        waits = waits or max_new is not None
        session = NodeSession(sid=sid, max_positions=max_positions, last_active=trio.current_time(),
                              state=NodeState.WAITING if waits else NodeState.CREATED,
                              max_decode=1 if spec is None else spec.k_max + 1, max_new=max_new)
        tail = self.backend.is_tail
        rec = self.table.open(sid, max_positions, NodeSessionRecord(
            session, lane, Sampler(sampling) if tail else None,
            None if prompt is None else np.asarray(prompt, dtype=np.int32),
            journal=None if tail else self.journals.open(), sample_from=sample_from))
        reused = 0
        if not waits:
            try:
                reused = await self.scheduler.call(functools.partial(self.kv.open, sid, max_positions, prefix or [],
                                                                     lane, marks), sid=sid)
            except DgrError:
                self.table.pop(sid)
                raise
        # a close while the KV opened detached the record already (its record stays held until its close job
        # runs): relays started now would never be closed
        if self.table.live.get(sid) is rec and not session.ended:
            self.links.attach(rec, relay, spec)
            if rec.spec is not None and rec.spec.reads_prompt:  # while the route's first hops compute the prompt
                self.scheduler.submit(Job(JobKind.SESSION, sid, fn=rec.spec.warm))
            if reused:
                session.positions = reused  # before any step: the gateway waits for this answer to send one
            if marks and self.kv.prefix is not None:
                rec.offered = marks
        return reused

    async def resume(self, sid: str, max_positions: int, sampling: SamplingParams, relay: RelayPlan,
                     order: ResumeOrder, lane: int | None = None, sample_from: int = 0) -> tuple[int, int, int | None]:
        """Go on with live session `order.session` under `sid` (a repair, issue 54): its KV, prompt ids and
        journal, at most `order.steps` steps of it, its results on through `relay`; first the journal's steps
        from `order.replay_from` (those the hop after it lacks), where the journal holds them all. Returns the
        positions and steps it holds, and the journal's first step (None: it keeps none, or refused it).

        Raises:
            CallerError(SESSION_ENDED | UNKNOWN_SESSION): no live `order.session` here.
            CallerError(INVALID_REQUEST): it holds no KV yet, or fewer positions than the order names.
            CallerError(SESSION_EXISTS | CONTEXT_LENGTH_EXCEEDED | NODE_AT_CAPACITY): as an open.
            DgrError: its KV could not be moved (it is freed).
        """
        old_sid = order.session
        old = self.table.get(old_sid)
        if old.fsm.state is NodeState.WAITING:
            raise CallerError(Reason.INVALID_REQUEST, f"session {old_sid} holds no KV to resume", param="resume")
        self.table.check_open(sid, max_positions, in_use=len(self.table) - 1)  # its slot becomes the new one's
        fsm = old.fsm.resumed(sid, order.steps, order.positions, trio.current_time())  # checks before any change
        if fsm.positions > max_positions:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"session {old_sid} holds {fsm.positions} positions, "
                                                              f"more than the {max_positions} asked", param="resume")
        trim = fsm.positions if fsm.positions < old.fsm.positions else None
        old.fsm.move()  # from here a late frame of it is refused: nothing more joins its queue
        self.links.detach(old)
        self.table.end(old_sid, None)
        self.ended(old_sid)
        with trio.CancelScope(shield=True):  # the job runs whatever comes: what it moves must land in the table
            try:  # after its queued steps, which it keeps (they journal their frames as they finish)
                await self.scheduler.call(functools.partial(self._move_kv, old_sid, sid, trim), sid=old_sid)
            except BaseException:
                self.journals.release(old.journal)
                raise
            finally:
                self.table.pop(old_sid)
        journal, old.journal = old.journal, None
        fsm.max_positions = max_positions
        rec = self.table.add(sid, max_positions, NodeSessionRecord(
            fsm, lane, Sampler(sampling) if self.backend.is_tail else None, old.prompt, old.offered,
            journal=journal, sample_from=sample_from))
        self.journals.resumed += 1
        first = None
        replay: list[bytes] = []
        if journal is not None:
            self.journals.keep(journal, fsm.next_seq)
            # its first step, where it holds every step from there to the last it keeps: the gateway's check
            first = journal.first if journal.covers(journal.first, fsm.next_seq) else None
            if journal.covers(order.replay_from, fsm.next_seq):
                replay = self.journals.frames(journal, order.replay_from, fsm.next_seq, sid)
        self.links.attach(rec, relay)
        for frame in replay:  # before any step it computes from here: the hop after it takes them in order
            rec.relay.put(Outgoing(frame, ()))
        return fsm.positions, fsm.next_seq, first

    def _move_kv(self, sid: str, new: str, trim: int | None) -> None:
        """In the scheduler's thread: `sid`'s KV held as `new`'s, cut to `trim` positions; freed where it cannot be."""
        try:
            self.backend.rename_session(sid, new)
        except DgrError:
            self.backend.close_session(sid)
            raise
        if trim is not None:
            try:
                self.backend.trim_session(new, trim)
            except (DgrError, NotImplementedError) as exc:
                self.backend.close_session(new)
                raise CallerError(Reason.INVALID_REQUEST, f"cannot keep {trim} positions of a resumed session: "
                                                          f"{exc}") from None

    async def adopt(self, sid: str, prefix: list[str], marks: bytes) -> int:
        """Open a waiting session's KV on the longest kept prefix of `prefix` and `marks` (as `open` does);
        the positions it holds from there.

        Raises:
            CallerError(INVALID_REQUEST): the session's KV is open already (its prefix was its open's to name).
            CallerError(SESSION_ENDED | UNKNOWN_SESSION): no live session `sid`.
            DgrError: the KV could not open; the session is failed.
        """
        rec = self.table.get(sid)
        session = rec.fsm
        if session.state is not NodeState.WAITING:
            raise CallerError(Reason.INVALID_REQUEST, f"session {sid} holds its KV already: its open named its prefix")
        session.kv_opened()  # before the open's job runs: a step from here on queues behind it
        try:
            reused = await self.scheduler.call(functools.partial(
                self.kv.open, sid, self.table.limits[sid], prefix, rec.lane, marks), sid=sid)
        except DgrError as exc:
            await self.fail(sid, exc.failure(node=self.node_id))
            raise
        if reused and self.table.is_live(sid):
            session.positions = reused  # before any step: the gateway waits for this answer to send one
        if marks and self.kv.prefix is not None:
            rec.offered = marks
        return reused

    def kv_job(self, rec: NodeSessionRecord) -> Job:
        """The job that opens a waiting session's KV empty, queued before its first step (which the session
        accepted while waiting). Where it cannot open, the session fails (its step then finds no KV and is
        reported too)."""
        sid = rec.fsm.sid

        def done(job: Job) -> None:
            if isinstance(job.result, outcome.Error) and self.links.nursery is not None:
                exc = job.result.error
                failure = (exc.failure(node=self.node_id) if isinstance(exc, DgrError)
                           else Failure(Reason.NODE_ERROR, f"{self.node_id}: the KV did not open: {exc}"[:300],
                                        node=self.node_id))
                self.links.nursery.start_soon(self.fail, sid, failure)

        return Job(JobKind.SESSION, sid, fn=functools.partial(self.kv.open, sid, self.table.limits[sid], [],
                                                              rec.lane, b""), on_done=done)

    async def close(self, sid: str, keep: list[str] | None = None, tail: bytes = b"") -> None:
        """End `sid` normally; with `keep` (the hash chain of the tokens in its KV) and `tail` (the marks of
        its positions after the last whole block), keep it as a prefix.

        Raises:
            CallerError(SESSION_ENDED | UNKNOWN_SESSION): no live session `sid`.
        """
        rec = self.table.get(sid)
        opened = rec.fsm.state is not NodeState.WAITING
        rec.fsm.close()
        await self._forget(rec, None, opened, keep, tail)

    async def fail(self, sid: str, failure: Failure) -> None:
        """End `sid` with `failure` (a no-op where it is not live)."""
        if not self.table.is_live(sid):
            return
        rec = self.table.live[sid]
        opened = rec.fsm.state is not NodeState.WAITING
        rec.fsm.fail(failure)
        await self._forget(rec, failure, opened)

    async def _forget(self, rec: NodeSessionRecord, failure: Failure | None, opened: bool,
                      keep: list[str] | None = None, tail: bytes = b"") -> None:
        """End a session here: refused from now on, and counted as held until its slot is free. `opened`:
        its KV is open (it was not waiting), so there is one to free or keep."""
        sid, head = rec.fsm.sid, rec.offered
        spec = self.links.detach(rec)
        self.journals.release(rec.journal)
        rec.journal = None
        self.table.end(sid, failure)
        self.ended(sid)
        try:
            keeps = bool(keep or tail) and failure is None and opened
            close = (functools.partial(self._close_kv, sid, keep or [], tail, head) if keeps
                     else functools.partial(self.backend.close_session, sid) if opened else _nothing)
            if spec is not None:  # a draft model's sequence goes in the same job
                close = functools.partial(_both, spec.close, close)
            # a close that keeps nothing needs none of the session's queued compute: dropped, not waited for
            await self.scheduler.call(close, sid=sid, ends=not keeps)
        finally:
            self.table.pop(sid)  # the job runs even if this caller is cancelled

    def _close_kv(self, sid: str, keep: list[str], tail: bytes, head: bytes) -> None:
        """In the scheduler's thread: close `sid`, keeping what it holds (none, where its close was cancelled)."""
        rec = self.table.live.get(sid)
        self.kv.close(sid, rec.fsm.positions if rec is not None else 0, keep, tail, head)

    async def expire_idle_forever(self) -> None:
        """Every second, fail the sessions idle for over `idle_timeout_s` (on trio's clock, as they are stamped)."""
        while True:
            await trio.sleep(1.0)
            await self.expire_idle(trio.current_time())

    async def expire_idle(self, now: float) -> list[str]:
        expired = [sid for sid, rec in self.table.live.items()
                   if sid not in self.table.ended and rec.fsm.idle_for(now) > self.idle_timeout_s]
        for sid in expired:
            await self.fail(
                sid, Failure(Reason.SESSION_TIMEOUT, f"idle for over {self.idle_timeout_s:g}s", node=self.node_id))
        return expired

    async def json(self, sid: str) -> dict[str, Any]:
        """What `sid` holds now: its state, positions counted and computed, next step number.

        Raises:
            CallerError(SESSION_ENDED | UNKNOWN_SESSION): no live session `sid`.
        """
        session = self.table.get(sid).fsm
        computed = 0 if session.state is NodeState.WAITING else await self.scheduler.call(
            functools.partial(self.backend.positions_computed, sid), sid=sid)
        return {
            "id": sid,
            "state": session.state.value,
            "positions": session.positions,
            "positions_computed": computed,
            "next_seq": session.next_seq,
        }


def _nothing() -> None:
    """A waiting session's close: it holds no KV."""


def _both(first: Callable[[], None], then: Callable[[], None]) -> None:
    try:
        first()
    finally:
        then()
