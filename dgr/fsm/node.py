"""Node Session: one Route Session's life on one shard.

Contract:
- States: created -> prefill -> decode -> done | failed. done and failed are
  terminal; failure is sticky and records a `Failure`.
- A session opened before its KV may open (a later hop opened with the head,
  before the prompt is known; a head whose KV waits for the prefix the gateway
  names) starts `waiting`: it holds no KV. `kv_opened` (the driver opened its
  KV on a kept prefix: an adopt) takes it to `created`; or its first prompt
  chunk is accepted in `waiting`, the driver queuing the KV's empty open
  before that step. Close and fail are legal while it waits; the driver then
  has no KV to free.
- A prefill step carries a chunk of n >= 1 positions; a decode step carries
  one, or, on a session opened for speculation (`max_decode` > 1), up to
  `max_decode`: the last accepted token and its drafts (issue 42). Decode
  needs at least one prefilled position before it.
- Steps are numbered 0, 1, 2, ... in the order the node must apply them
  (`seq`). Each starts at the first position not yet in the Hot KV State
  (`pos0 == positions`), or, after a speculative step, anywhere from that
  step's first position + 1 (`committed`: its last accepted token is never
  taken back) to `positions`: the drafts the tail refused are the positions
  from pos0 on, and the driver drops them before computing the step (`accept`
  says so), so no node keeps a refused position. A replayed, skipped or
  reordered step, or a position gap, is refused with a typed `CallerError`
  and changes nothing.
- A session opened on a reused prefix (dgr.node.prefix) starts with that
  prefix's positions held; its first step may start at or before them (the
  route reuses the shortest prefix any of its nodes holds), and the driver
  drops the KV past that step's pos0 before computing it.
- A later hop opened together with the head, before the prompt is tokenized,
  does not know the prompt's length: it is opened with `max_new` (the most
  positions the answer may take), holds the route's context as its bound
  until the prompt's last chunk is accepted (`last_chunk`), and from then on the
  prompt's positions plus `max_new`, as a session opened with the length does.
- A repair (issue 54, dgr.tracker.repair) moves a live session onto a fresh
  id: `move` ends it (`moved`: its KV and journal go on under the new id, so
  nothing is freed) and `resumed` is the session that goes on, in the state
  this one was in, holding the steps it took (at most `keep`: the gateway's
  cap, past which the KV is trimmed) and numbering its steps on from them.
  The repaired route sends every step again from where the hop before it
  resumed; a step the session took before its move (`repeats`: a seq below
  `held_steps`) is dropped unread, not refused.
- The check is complete before anything is assigned; `accept` then moves the
  session as if the step was applied. If computing the step fails after that,
  the driver calls `fail`: the KV no longer matches the counters, so the
  session cannot go on.

Theory: the node's trio driver parses a frame (dgr.seam), calls `accept`,
runs the backend, and answers. This module never touches the backend or the
network; it only decides.

Left out: the payload itself (width, dtype, checksum are checked by
dgr.seam.frame before a frame reaches here) and time (the driver passes `now`
for idle expiry).
"""

from __future__ import annotations

import enum

import attrs

from dgr.errors import CallerError, Failure, Reason
from dgr.fsm.machine import Transition, TransitionTable

__all__ = ["NodeState", "NodeEvent", "NODE_TABLE", "NodeSession", "StepKind"]


class NodeState(enum.Enum):
    WAITING = "waiting"
    CREATED = "created"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    FAILED = "failed"
    MOVED = "moved"


class NodeEvent(enum.Enum):
    KV_OPEN = "kv_open"
    PREFILL_CHUNK = "prefill_chunk"
    DECODE_STEP = "decode_step"
    CLOSE = "close"
    FAIL = "fail"
    MOVE = "move"


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


_LIVE = (NodeState.WAITING, NodeState.CREATED, NodeState.PREFILL, NodeState.DECODE)

NODE_TABLE: TransitionTable[NodeState, NodeEvent] = TransitionTable(
    machine="node_session",
    states=NodeState,
    events=NodeEvent,
    initial=NodeState.CREATED,
    # waiting: opened before its KV may open; prefill and decode: resumed by a repair in its predecessor's state
    also_initial=(NodeState.WAITING, NodeState.PREFILL, NodeState.DECODE),
    transitions=(
        Transition(NodeState.WAITING, NodeEvent.KV_OPEN, NodeState.CREATED, "its KV opened on a kept prefix (adopt)"),
        Transition(NodeState.WAITING, NodeEvent.PREFILL_CHUNK, NodeState.PREFILL,
                   "first prompt chunk; its KV opens empty before it"),
        Transition(NodeState.CREATED, NodeEvent.PREFILL_CHUNK, NodeState.PREFILL, "first prompt chunk"),
        Transition(NodeState.PREFILL, NodeEvent.PREFILL_CHUNK, NodeState.PREFILL, "next prompt chunk"),
        Transition(NodeState.PREFILL, NodeEvent.DECODE_STEP, NodeState.DECODE, "first generated token's step"),
        Transition(NodeState.DECODE, NodeEvent.DECODE_STEP, NodeState.DECODE, "one more token"),
        *(Transition(s, NodeEvent.CLOSE, NodeState.DONE, "session ended normally") for s in _LIVE),
        *(Transition(s, NodeEvent.FAIL, NodeState.FAILED, "route failed, expired or compute error") for s in _LIVE),
        *(Transition(s, NodeEvent.MOVE, NodeState.MOVED, "a repair resumed it under a fresh id, its KV kept")
          for s in _LIVE if s is not NodeState.WAITING),
    ),
)

_STEP_EVENT = {StepKind.PREFILL: NodeEvent.PREFILL_CHUNK, StepKind.DECODE: NodeEvent.DECODE_STEP}


@attrs.define
class NodeSession:
    """The per-shard state of one Route Session. Pure: no I/O, no clock."""

    sid: str
    max_positions: int
    last_active: float  # when it last took a step, or opened (the driver's clock: idle expiry reads it)
    state: NodeState = NODE_TABLE.initial
    positions: int = 0  # positions held in Hot KV State
    committed: int = 0  # of them, those no later step may drop (all but a speculative step's drafts)
    max_decode: int = 1  # positions a decode step may carry: 1, or the last accepted token and its drafts
    next_seq: int = 0  # seq number the next step must carry
    max_new: int | None = None  # opened before its prompt's length was known: the answer's positions at most
    failure: Failure | None = None
    decode_from: int | None = None  # the seq of its first decode step, once it took one
    held_steps: int = 0  # resumed by a repair: the steps it took before; a frame of one of them is a repeat

    def _check_live(self) -> None:
        if self.state is NodeState.FAILED:
            # sticky failure: say why it failed, not merely that it is over
            raise CallerError(
                Reason.SESSION_ENDED,
                f"session {self.sid} failed earlier: {self.failure.reason.value if self.failure else '?'}",
                failure=self.failure,
            )
        if self.state in (NodeState.DONE, NodeState.MOVED):
            raise CallerError(Reason.SESSION_ENDED, f"session {self.sid} has ended")

    def check_step(self, kind: StepKind, seq: int, pos0: int, n_tokens: int) -> NodeState:
        """Validate a step without changing anything; return the state it leads to.

        Raises:
            CallerError(SESSION_ENDED | STEP_OUT_OF_ORDER | POSITION_DISCONTINUITY |
                        WRONG_SIZE | ILLEGAL_TRANSITION)
        """
        self._check_live()
        target = NODE_TABLE.next(self.state, _STEP_EVENT[kind])
        if seq != self.next_seq:
            what = "replayed" if seq < self.next_seq else "skips ahead"
            raise CallerError(
                Reason.STEP_OUT_OF_ORDER,
                f"step {seq} {what}: session {self.sid} expects step {self.next_seq}",
                expected=self.next_seq,
                got=seq,
            )
        if n_tokens < 1 or (kind is StepKind.DECODE and n_tokens > self.max_decode):
            raise CallerError(
                Reason.WRONG_SIZE,
                f"a {kind.value} step cannot carry {n_tokens} positions"
                + (f" (decode carries at most {self.max_decode})" if kind is StepKind.DECODE else ""),
            )
        reused = self.state is NodeState.CREATED and 0 <= pos0 < self.positions
        if not (self.committed <= pos0 <= self.positions) and not reused:
            raise CallerError(
                Reason.POSITION_DISCONTINUITY,
                f"step starts at position {pos0} but the KV holds {self.positions} positions",
                expected=self.positions,
                got=pos0,
            )
        if pos0 + n_tokens > self.max_positions:
            raise CallerError(
                Reason.CONTEXT_LENGTH_EXCEEDED,
                f"positions up to {pos0 + n_tokens} exceed this session's {self.max_positions}",
            )
        return target

    def accept(self, kind: StepKind, seq: int, pos0: int, n_tokens: int, now: float, *,
               last_chunk: bool = False) -> bool:
        """Apply a step's bookkeeping. Validates first; on refusal nothing changes.

        `last_chunk`: the step is the prompt's last chunk, so the prompt's length is known: a session
        opened without it (`max_new`) holds at most the prompt's positions plus `max_new` from here.

        Returns True when the step starts inside what the KV holds (a reused prefix, or refused drafts):
        the driver drops the KV from pos0 on before computing it.
        """
        target = self.check_step(kind, seq, pos0, n_tokens)
        rewinds = pos0 < self.positions
        self.state = target
        self.positions = pos0 + n_tokens
        # a decode step's first position is the last accepted token; the rest are drafts until the next step
        self.committed = pos0 + 1 if kind is StepKind.DECODE else self.positions
        self.next_seq = seq + 1
        self.last_active = now
        if kind is StepKind.DECODE and self.decode_from is None:
            self.decode_from = seq
        if last_chunk and self.max_new is not None:
            self.max_positions = min(self.max_positions, self.positions + self.max_new)
            self.max_new = None
        return rewinds

    def repeats(self, seq: int) -> bool:
        """Step `seq` is one this session took before a repair resumed it: its frame is dropped unread (the
        repaired route sends each hop every step from where the hop before it resumed)."""
        return seq < self.held_steps

    def move(self) -> None:
        """A repair resumes this session under a fresh id (`resumed`): it ends here, its KV kept.

        Raises:
            CallerError(SESSION_ENDED): ended. IllegalTransition: waiting (no KV to keep).
        """
        self._check_live()
        self.state = NODE_TABLE.next(self.state, NodeEvent.MOVE)

    def resumed(self, sid: str, keep: int, positions_at_keep: int, now: float) -> NodeSession:
        """The session that goes on under `sid` once this one `move`d: the steps it took, at most `keep`
        (`positions_at_keep`: the positions those `keep` hold, the gateway's count), numbered on from there.
        Pure: the caller trims the KV where it held more (`positions` then drops).

        Raises:
            CallerError(INVALID_REQUEST): `positions_at_keep` is not within what it holds.
        """
        steps = min(self.next_seq, keep)
        positions = self.positions if steps == self.next_seq else positions_at_keep
        if not 0 <= positions <= self.positions or (steps == 0) != (positions == 0):
            raise CallerError(Reason.INVALID_REQUEST, f"session {self.sid} holds {self.positions} positions in "
                                                      f"{self.next_seq} steps: it cannot keep {positions_at_keep} "
                                                      f"in {keep}")
        decoding = self.decode_from is not None and steps > self.decode_from
        state = NodeState.DECODE if decoding else NodeState.PREFILL if steps else NodeState.CREATED
        return NodeSession(sid=sid, max_positions=self.max_positions, last_active=now, state=state,
                           positions=positions, committed=positions, next_seq=steps,
                           decode_from=self.decode_from if decoding else None, held_steps=steps,
                           max_new=self.max_new)

    def kv_opened(self) -> None:
        """A waiting session's KV opened (on a kept prefix): it may take its first step from `created`.

        Raises:
            CallerError(SESSION_ENDED): ended. IllegalTransition: not waiting (its KV is open already).
        """
        self._check_live()
        self.state = NODE_TABLE.next(self.state, NodeEvent.KV_OPEN)

    def close(self) -> None:
        """End normally. Raises IllegalTransition when already ended."""
        self._check_live()
        self.state = NODE_TABLE.next(self.state, NodeEvent.CLOSE)

    def fail(self, failure: Failure) -> None:
        """Fail for good. Raises when already ended (failure stays the first one)."""
        self._check_live()
        self.state = NODE_TABLE.next(self.state, NodeEvent.FAIL)
        self.failure = failure

    @property
    def ended(self) -> bool:
        return self.state in NODE_TABLE.terminal

    def idle_for(self, now: float) -> float:
        return now - self.last_active
