"""The node's replies: a seam frame in, checked against its session; its computed result out.

Theory: a frame is parsed and checked (dgr.seam.frame, then `check_frame` against this shard), matched
against its `NodeSession` (dgr.fsm.node), which refuses anything out of order before any state
changes, then it becomes a job of the node's `StepScheduler` (dgr.node.scheduler), which batches it
with other sessions' steps. A step whose caller has gone still runs to its end: the session's
counters were advanced when it was accepted, so the KV and the counters agree either way.

Rules:
- Every session is on a ring: it takes its steps on its stream (`accept_streamed`), which carries the
  frames of its own session only, and its results go on through its relay.
- The result is built in the scheduler's thread (sampling and token text are backend work): the next
  hop's input (this shard's output as its hidden state, in the dtype it arrived in), an ACK, or the
  tail's sampled TOKEN.
- A ring's tail also builds the next decode step for the token it sampled, unless the route stops
  there (dgr.fsm.stop, counted in positions), and hands it to its phase group (dgr.node.links).
- Compute that fails fails the session (and frees it) and is reported on the session's relay.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import attrs
import numpy as np
import trio

from dgr.backends.base import COMPUTE_ERRORS, Compute, ShardBackend, Step
from dgr.errors import CallerError, DgrError, Failure, Reason
from dgr.fsm.node import NodeState, StepKind
from dgr.fsm.stop import next_step
from dgr.node import steptrace
from dgr.node.accounting import NodeAccounting
from dgr.node.links import NodeLinks, NodeSessionRecord
from dgr.node.relay import Loop, Outgoing, Report
from dgr.node.speculation import TailSpec
from dgr.speculative.step import SpecStep
from dgr.node.iteration import Job, JobKind
from dgr.node.journal import JournalBook
from dgr.node.scheduler import StepScheduler
from dgr.sampling import Sampler
from dgr.seam.frame import Frame, TokenResult, decode_frame, decode_head, encode_frame
from dgr.seam.stream import Record
from dgr.seam.wire import Flag, FrameKind
from dgr.sessions import SessionTable

__all__ = ["NodeReplies", "check_frame", "next_step_frame"]

_KIND_STEP = {FrameKind.PREFILL: StepKind.PREFILL, FrameKind.DECODE: StepKind.DECODE}


def check_frame(backend: Compute, frame: Frame) -> StepKind:
    """The step a frame asks of this shard, or its refusal: its kind, width and payload for these layers.

    Raises:
        CallerError(BAD_FRAME | WRONG_WIDTH): nothing changed.
    """
    info = backend.info
    step = _step_of(backend, frame.kind, frame.width)
    if backend.is_head or info.needs_token_ids:
        if frame.token_ids is None:
            raise CallerError(Reason.BAD_FRAME, f"layers {backend.layers} need token ids in the frame")
        if frame.token_ids.size and (frame.token_ids.min() < 0 or frame.token_ids.max() >= info.vocab_size):
            raise CallerError(Reason.BAD_FRAME, f"token id outside [0, {info.vocab_size})")
    if not backend.is_head:
        if frame.hidden is None:
            raise CallerError(Reason.BAD_FRAME, f"layers {backend.layers} need hidden states in the frame")
        if not np.isfinite(frame.hidden).all():
            raise CallerError(Reason.BAD_FRAME, "hidden states hold NaN or infinity")
    return step


def _step_of(backend: Compute, kind: FrameKind, width: int) -> StepKind:
    """The step a frame's kind asks of this shard, at its seam width (what its header alone says).

    Raises:
        CallerError(BAD_FRAME | WRONG_WIDTH)
    """
    step = _KIND_STEP.get(kind)
    if step is None:
        raise CallerError(Reason.BAD_FRAME, f"a node accepts PREFILL or DECODE frames, not {kind.name}")
    if width != backend.info.seam_width:
        raise CallerError(Reason.WRONG_WIDTH, f"seam width {width}, this model's is {backend.info.seam_width}")
    return step


def next_step_frame(frame: Frame, result: TokenResult, loop: Loop, max_positions: int) -> bytes | None:
    """A ring tail's next decode step for the token it sampled; None where the gateway stops
    (dgr.fsm.stop, counted in positions: the step's position plus one against the session's)."""
    pos = frame.pos0 + frame.n_tokens
    if not next_step(eog=result.eog, ignore_eos=loop.ignore_eos, generated=pos + 1, max_tokens=max_positions).more:
        return None
    return encode_frame(FrameKind.DECODE, frame.session, frame.seq + 1, pos, 1, frame.width, dtype=frame.dtype,
                        flags=Flag.SAMPLE, token_ids=[result.token])


def token_frame(frame: Frame, result: TokenResult) -> bytes:
    flags = (Flag.EOG if result.eog else Flag(0)) | (Flag.SPEC if result.spec is not None else Flag(0))
    return encode_frame(FrameKind.TOKEN, frame.session, frame.seq, frame.pos0, 1, frame.width, flags=flags,
                        extra=result.payload())


def ack_frame(frame: Frame) -> bytes:
    """A tail's answer to a step it samples nothing for (a prompt chunk before the last)."""
    return encode_frame(FrameKind.ACK, frame.session, frame.seq, frame.pos0, 0, frame.width)


def spec_step_frame(frame: Frame, step: SpecStep) -> bytes:
    """A ring tail's next decode step: the last accepted token at pos0, then its drafts."""
    return encode_frame(FrameKind.DECODE, frame.session, step.seq, step.pos0, len(step.tokens), frame.width,
                        dtype=frame.dtype, flags=Flag.SAMPLE, token_ids=list(step.tokens))


@attrs.define
class NodeReplies:
    """Frames admitted to their sessions, queued on the scheduler, and answered or relayed."""

    backend: ShardBackend
    node_id: str
    max_frame_bytes: int
    table: SessionTable[NodeSessionRecord]
    scheduler: StepScheduler
    links: NodeLinks
    accounting: NodeAccounting
    fail_session: Callable[[str, Failure], Awaitable[None]]
    kv_job: Callable[[NodeSessionRecord], Job]  # a waiting session's KV open, before its first step (dgr.node.sessions)
    journals: JournalBook  # the frames non-tail sessions sent on, for a repair (dgr.node.journal)

    def _refused(self, exc: CallerError) -> CallerError:
        self.accounting.refuse(exc)
        return exc

    def check_head(self, stream: str, header: bytes) -> None:
        """A step's frame header, as soon as it has come on `stream` (a session's, whose capability held):
        refused here, before its payload (up to a 64 MiB prompt chunk) is waited for, where the whole step
        would be: another session's, a session this node does not hold or has ended, a kind or width this
        shard does not take, or a size its header contradicts.

        Raises:
            CallerError: refused (and counted); nothing changed.
        """
        try:
            head = decode_head(header)
            if head.session != stream:
                raise CallerError(Reason.FORBIDDEN, f"a stream of session {stream} carried a frame of {head.session}")
            _step_of(self.backend, head.kind, head.width)
            self.table.get(stream)  # SESSION_ENDED, else UNKNOWN_SESSION
        except CallerError as exc:
            raise self._refused(exc)

    def accept_streamed(self, sid: str, record: Record) -> None:
        """A step from a stream record, for `sid` (whose capability the stream carried): accepted and
        queued as the backend's step; when computed, its result goes on through the session's relay (on a
        ring's tail, the step for the sampled token also goes to the head, through its loop), or its failure
        is reported.

        Raises:
            CallerError: refused (a session whose open has not finished has no relay yet); nothing changed.
        """
        rec = self.table.live.get(sid)
        if rec is not None and rec.relay is None and sid not in self.table.ended:
            raise self._refused(CallerError(Reason.INVALID_REQUEST, f"session {sid} is still opening"))
        if rec is not None and rec.fsm.held_steps:
            try:
                seq = decode_head(record.frame).seq
            except CallerError as exc:
                raise self._refused(exc)
            if rec.fsm.repeats(seq):  # a step it took before a repair resumed it: the hop before sends from its own
                self.journals.repeats += 1
                return
        if steptrace.ON:
            steptrace.mark_frame("read", sid, record.frame)
        frame, rec = self.admit(record.frame, sid, rec)
        if steptrace.ON:
            steptrace.mark("admitted", sid, frame.pos0)
        # a decode step that samples wants every row's logits (its last accepted token's and its drafts',
        # dgr.node.speculation); an `exact` session's decode steps compute one position at a time (a prompt's
        # chunks compute as they do without speculation)
        decode = frame.kind is FrameKind.DECODE
        rows = (frame.n_tokens if decode else 1) if frame.flags & Flag.SAMPLE else 0
        step = Step(frame.session, frame.pos0, frame.token_ids, frame.hidden_f32(), rows, decode=decode,
                    one_row=rec.exact and decode)
        # its speculation as the step was accepted: the record lets it go at detach, before its close job runs
        self.scheduler.submit(Job(JobKind.FORWARD, frame.session, step=step,
                                  finish=functools.partial(self._finish, frame, rec, rec.spec),
                                  on_done=functools.partial(self._send_on, frame, rec, rec.spec, record.compute_us),
                                  max_rows=self.links.group_rows(rec.relay.plan)))

    def admit(self, body: bytes, stream: str, rec: NodeSessionRecord | None) -> tuple[Frame, NodeSessionRecord]:
        """Decode a frame and apply its bookkeeping to its session (queuing its KV's open or a rewind first if
        needed); the frame and the session's record.

        `stream`: the session whose stream (authorized for it already) carried the frame: it must be of it;
        `rec`: its record, if the node holds it (the table refuses it here if it has ended).

        Raises:
            CallerError: refused; nothing changed.
        """
        try:
            frame = decode_frame(body, max_bytes=self.max_frame_bytes)
        except CallerError as exc:
            raise self._refused(exc)
        if frame.session != stream:
            raise self._refused(CallerError(Reason.FORBIDDEN,
                                            f"a stream of session {stream} carried a frame of {frame.session}"))
        kept = None if rec is None else rec.prompt
        if kept is not None and frame.token_ids is None and frame.kind is FrameKind.PREFILL:
            # a head that tokenized the prompt at open takes its chunks without ids (it has them), and passes
            # them on with its output where the next layers need them too
            ids = kept[frame.pos0 : frame.pos0 + frame.n_tokens]
            if len(ids) == frame.n_tokens:
                frame = attrs.evolve(frame, token_ids=ids, flags=frame.flags | Flag.TOKENS)
        try:
            step = check_frame(self.backend, frame)
            rec = self.table.get(frame.session)  # SESSION_ENDED before its record goes, else UNKNOWN_SESSION
            session = rec.fsm
            opening = session.state is NodeState.WAITING
            # a prompt chunk that samples is the prompt's last: its length is known
            rewind = session.accept(step, frame.seq, frame.pos0, frame.n_tokens, now=trio.current_time(),
                                    last_chunk=step is StepKind.PREFILL and bool(frame.flags & Flag.SAMPLE))
        except CallerError as exc:
            raise self._refused(exc)
        if opening:  # opened with the head, its KV waited for a prefix: none came, so it opens empty, first
            self.scheduler.submit(self.kv_job(rec))
        if rewind:
            # the route reuses less of the prefix than this node holds: queued before the step, so it runs first
            self.scheduler.submit(Job(JobKind.SESSION, frame.session,
                                      fn=functools.partial(self.backend.trim_session, frame.session, frame.pos0)))
        self.accounting.admitted(frame)
        return frame, rec

    def _finish(self, frame: Frame, rec: NodeSessionRecord, spec: TailSpec | None, out: np.ndarray | None
                ) -> tuple[bytes | list[bytes], bytes | None]:
        """A computed step's replies and, on a ring's tail, the next step for its token (or None). Runs in the
        scheduler's thread."""
        backend = self.backend
        if backend.is_tail:  # every tail has its loop back to the head
            if frame.pos0 + frame.n_tokens <= rec.sample_from:  # answered on the route a repair replaced: its KV only
                return [], None
            if not frame.flags & Flag.SAMPLE:
                return ack_frame(frame), None  # a prompt chunk's answer, for the gateway
            loop, max_positions = rec.relay.plan.loop, rec.fsm.max_positions
            if spec is not None:
                return self._speculate(frame, out, rec.sampler, spec, loop, max_positions)
            result = self.sample(frame, rec.sampler, out)
            return token_frame(frame, result), next_step_frame(frame, result, loop, max_positions)
        # the next hop's input: the same step, with this shard's output as its hidden state
        return encode_frame(frame.kind, frame.session, frame.seq, frame.pos0, frame.n_tokens, frame.width,
                            dtype=frame.dtype, flags=frame.flags & Flag.SAMPLE,
                            token_ids=frame.token_ids if backend.info.needs_token_ids else None,
                            hidden=out), None

    def _send_on(self, frame: Frame, rec: NodeSessionRecord, spec: TailSpec | None, compute_us: tuple[int, ...],
                 job: Job) -> None:
        """On the loop, after the iteration: a computed step's replies go to the session's relay, and a ring
        tail's next step to its phase group (first: the next token's path); a failure is reported."""
        if steptrace.ON:
            steptrace.mark("done", frame.session, frame.pos0)
        relay, links = rec.relay, self.links
        try:
            out, step = job.result.unwrap()
        except COMPUTE_ERRORS as exc:
            why = exc.message if isinstance(exc, DgrError) else f"compute failed: {exc}"
            failure = Failure(Reason.NODE_ERROR, f"{self.node_id}: {why}"[:300], node=self.node_id)
            relay.put(Report(failure))
            if links.nursery is not None:
                links.nursery.start_soon(self.fail_session, frame.session, failure)
            return
        rec.done = frame.seq
        if rec.loop is not None and frame.flags & Flag.SAMPLE and links.nursery is not None:
            links.ring.go(rec, step, links.nursery)
        if spec is not None:  # the route's cost of the step just verified
            spec.measured((sum(compute_us) + job.compute_s * 1e6) / 1e6)
        times = (*compute_us, int(job.compute_s * 1e6))
        replies = out if isinstance(out, list) else [out]  # a speculative step's tokens, one a frame
        self.accounting.count(frame, replies[0] if replies else b"", job.compute_s)
        if rec.journal is not None:
            self.journals.add(rec.journal, frame.seq, replies[0])
        for i, reply in enumerate(replies):
            if i:
                self.accounting.sent(reply)
            relay.put(Outgoing(reply, times))

    def _speculate(self, frame: Frame, out: np.ndarray | None, sampler: Sampler | None, spec: TailSpec, loop: Loop,
                   max_positions: int) -> tuple[list[bytes], bytes | None]:
        """A speculating tail's answer to a step: its tokens (one TOKEN frame each) and the next step, with
        drafts where they pay (dgr.node.speculation). Runs in the scheduler's thread."""
        if sampler is None:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no sampler for session {frame.session}")
        backend = self.backend
        if frame.kind is FrameKind.PREFILL:  # the prompt's last chunk: its token, alone
            result = self.sample(frame, sampler, out)
            spec.first(result.token, result.logprob)
            replies = [token_frame(frame, result)]
            pos = frame.pos0 + frame.n_tokens
            more = next_step(eog=result.eog, ignore_eos=loop.ignore_eos, generated=pos + 1,
                             max_tokens=max_positions).more
            keep, last = pos, result.token
        else:
            step, verdict, done, emitted = spec.verify(frame.seq, out, sampler, is_eog=backend.is_eog,
                                                       ignore_eos=loop.ignore_eos, max_positions=max_positions)
            replies = [token_frame(frame, TokenResult(e.token, e.logprob, backend.token_bytes(e.token),
                                                      backend.is_eog(e.token), (step.k, verdict.accepted, e.left)))
                       for e in emitted]
            more, keep, last = done.more, done.keep, done.emitted[-1]
        if not more:
            return replies, None
        return replies, spec_step_frame(frame, spec.next_step(frame.seq + 1, keep, last, max_positions))

    def sample(self, frame: Frame, sampler: Sampler | None, out: np.ndarray | None) -> TokenResult:
        """The tail's token for a step's logits, with the session's own sampler (in the scheduler's thread)."""
        if sampler is None:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no sampler for session {frame.session}")
        token, logprob = sampler.sample(out)
        return TokenResult(token, logprob, self.backend.token_bytes(token), self.backend.is_eog(token))
