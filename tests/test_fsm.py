"""The pure state machines: every (state, event) pair, stateful models, no I/O imports."""

from __future__ import annotations

import copy
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dgr.errors import CallerError, Failure, IllegalTransition, Reason
from dgr.fsm.node import NODE_TABLE, NodeEvent, NodeSession, NodeState, StepKind
from dgr.fsm.proof import PROOF_TABLE, ProofEvent, ProofState, ProofStatus
from dgr.fsm.route import ROUTE_TABLE, Hop, RouteEvent, RouteSession, RouteState
from dgr.fsm.stop import Next, next_step

HOPS = (Hop("a", "http://a", 0, 10), Hop("b", "http://b", 10, 30))
SPARE = (Hop("a", "http://a", 0, 10), Hop("b2", "http://b2", 10, 30))  # b's range on a spare


# -- node session ----------------------------------------------------------------
def _node_in(state: NodeState) -> NodeSession:
    if state is NodeState.WAITING:  # opened before its KV may open
        return NodeSession(sid="s", max_positions=100, last_active=0.0, state=NodeState.WAITING)
    s = NodeSession(sid="s", max_positions=100, last_active=0.0)
    if state in (NodeState.PREFILL, NodeState.DECODE):
        s.accept(StepKind.PREFILL, 0, 0, 4, now=1.0)
    if state is NodeState.DECODE:
        s.accept(StepKind.DECODE, 1, 4, 1, now=2.0)
    if state is NodeState.DONE:
        s.close()
    if state is NodeState.FAILED:
        s.fail(Failure(Reason.ROUTE_NODE_LOST, "x"))
    if state is NodeState.MOVED:  # a repair resumed it under a fresh id
        s.move()
    return s


def _apply_node(s: NodeSession, event: NodeEvent) -> None:
    if event is NodeEvent.KV_OPEN:
        s.kv_opened()
    elif event is NodeEvent.PREFILL_CHUNK:
        s.accept(StepKind.PREFILL, s.next_seq, s.positions, 3, now=5.0)
    elif event is NodeEvent.DECODE_STEP:
        s.accept(StepKind.DECODE, s.next_seq, s.positions, 1, now=5.0)
    elif event is NodeEvent.CLOSE:
        s.close()
    elif event is NodeEvent.MOVE:
        s.move()
    else:
        s.fail(Failure(Reason.CANCELLED, "y"))


@pytest.mark.parametrize("state", list(NodeState))
@pytest.mark.parametrize("event", list(NodeEvent))
def test_node_every_state_event_pair(state: NodeState, event: NodeEvent) -> None:
    s = _node_in(state)
    before = copy.deepcopy(attrs.asdict(s, recurse=False))
    if NODE_TABLE.allows(state, event):
        _apply_node(s, event)
        assert s.state is NODE_TABLE.next(state, event)
    else:
        with pytest.raises(CallerError) as info:
            _apply_node(s, event)
        assert attrs.asdict(s, recurse=False) == before
        if state in (NodeState.DONE, NodeState.FAILED, NodeState.MOVED):
            assert info.value.reason is Reason.SESSION_ENDED
        else:
            assert isinstance(info.value, IllegalTransition)


def test_node_refusals_change_nothing() -> None:
    s = _node_in(NodeState.PREFILL)  # 4 positions, next seq 1
    before = attrs.asdict(s, recurse=False)
    cases = [
        ((StepKind.PREFILL, 0, 4, 2), Reason.STEP_OUT_OF_ORDER),  # replay
        ((StepKind.PREFILL, 2, 4, 2), Reason.STEP_OUT_OF_ORDER),  # skip
        ((StepKind.PREFILL, 1, 3, 2), Reason.POSITION_DISCONTINUITY),  # overlap
        ((StepKind.PREFILL, 1, 5, 2), Reason.POSITION_DISCONTINUITY),  # gap
        ((StepKind.DECODE, 1, 4, 2), Reason.WRONG_SIZE),  # decode carries one position
        ((StepKind.PREFILL, 1, 4, 0), Reason.WRONG_SIZE),
        ((StepKind.PREFILL, 1, 4, 97), Reason.CONTEXT_LENGTH_EXCEEDED),
    ]
    for args, reason in cases:
        with pytest.raises(CallerError) as info:
            s.accept(*args, now=9.0)
        assert info.value.reason is reason, args
        assert attrs.asdict(s, recurse=False) == before


def test_a_waiting_session_opens_its_kv_once_by_an_adopt_or_before_its_first_chunk() -> None:
    """Issue 57: waiting for KV is a state. An adopt opens it (to `created`, whose first chunk may start inside
    the prefix reused); a first chunk accepted while waiting goes to `prefill` (its KV opens empty before it);
    either way it waits no more, and a second open is refused, changing nothing."""
    adopted = _node_in(NodeState.WAITING)
    assert adopted.positions == 0
    adopted.kv_opened()
    assert adopted.state is NodeState.CREATED
    adopted.positions = 8  # the prefix it reused, as the driver sets it
    adopted.accept(StepKind.PREFILL, 0, 5, 4, now=1.0)  # the route reuses 5 of them
    assert (adopted.state, adopted.positions) == (NodeState.PREFILL, 9)

    empty = _node_in(NodeState.WAITING)
    with pytest.raises(CallerError) as info:
        empty.accept(StepKind.DECODE, 0, 0, 1, now=1.0)  # no decode before a prompt, waiting or not
    assert isinstance(info.value, IllegalTransition) and empty.state is NodeState.WAITING
    empty.accept(StepKind.PREFILL, 0, 0, 4, now=1.0)
    assert (empty.state, empty.positions, empty.next_seq) == (NodeState.PREFILL, 4, 1)
    for s in (adopted, empty):
        before = attrs.asdict(s, recurse=False)
        with pytest.raises(IllegalTransition):
            s.kv_opened()
        assert attrs.asdict(s, recurse=False) == before


def test_node_failure_is_sticky() -> None:
    s = _node_in(NodeState.DECODE)
    s.fail(Failure(Reason.ROUTE_NODE_LOST, "gone", node="n1"))
    for event in NodeEvent:
        with pytest.raises(CallerError) as info:
            _apply_node(s, event)
        assert info.value.reason is Reason.SESSION_ENDED
    assert s.failure.reason is Reason.ROUTE_NODE_LOST


# -- route session ---------------------------------------------------------------
def _route_in(state: RouteState) -> RouteSession:
    rs = RouteSession(sid="r", model="m", created_at=0.0)
    path = [RouteState.ROUTING, RouteState.PREFILL, RouteState.DECODE, RouteState.DONE]
    if state is RouteState.FAILED:
        rs.fail(Failure(Reason.NO_ROUTE, "none"), 0.1)
        return rs
    if state is RouteState.REPAIRING:  # b lost mid-answer; no replacement chosen yet
        rs = _route_in(RouteState.DECODE)
        rs.node_lost("b", 0.5)
        return rs
    for target in path[: path.index(state) + 1] if state in path else []:
        _apply_route(rs, {RouteState.ROUTING: RouteEvent.START_ROUTING, RouteState.PREFILL: RouteEvent.ROUTE_READY,
                          RouteState.DECODE: RouteEvent.TOKEN, RouteState.DONE: RouteEvent.FINISH}[target])
    return rs


def _apply_route(rs: RouteSession, event: RouteEvent) -> None:
    now = 1.0
    if event is RouteEvent.START_ROUTING:
        rs.start_routing(now)
    elif event is RouteEvent.ROUTE_READY:
        rs.route_ready(HOPS, 10, now)
    elif event is RouteEvent.PREFILL_PROGRESS:
        rs.prefill_progress(min(rs.prompt_tokens, rs.prefill_done + 1), now)
    elif event is RouteEvent.TOKEN:
        rs.token(now)
    elif event is RouteEvent.FINISH:
        rs.finish("stop", now)
    elif event is RouteEvent.NODE_LOST:
        rs.node_lost("b", now)
    elif event is RouteEvent.ROUTE_REPAIRED:
        rs.route_repaired(SPARE, 0, rs.prompt_tokens + rs.generated, now)
    elif event is RouteEvent.REPAIR_PROGRESS:
        if rs.state is RouteState.REPAIRING:  # progress is the replacement's: it must be open first
            rs.route_repaired(SPARE, 0, rs.prompt_tokens + rs.generated, now)
        rs.repair_progress(1, now)
    elif event is RouteEvent.ABORT:
        rs.abort(Failure(Reason.SLOW_CLIENT, "slow"), now)
    else:
        rs.fail(Failure(Reason.ROUTE_NODE_LOST, "lost", node="b"), now)


@pytest.mark.parametrize("state", list(RouteState))
@pytest.mark.parametrize("event", list(RouteEvent))
def test_route_every_state_event_pair(state: RouteState, event: RouteEvent) -> None:
    rs = _route_in(state)
    assert rs.state is state
    before = attrs.asdict(rs, recurse=False)
    if ROUTE_TABLE.allows(state, event):
        _apply_route(rs, event)
        assert rs.state is ROUTE_TABLE.next(state, event)
    else:
        with pytest.raises(CallerError):
            _apply_route(rs, event)
        assert attrs.asdict(rs, recurse=False) == before


def test_route_failure_records_phase_and_is_sticky() -> None:
    rs = _route_in(RouteState.DECODE)
    snap = rs.fail(Failure(Reason.ROUTE_NODE_LOST, "lost b", node="b"), 2.0)
    assert snap["failure"] == {"code": "route_node_lost", "message": "lost b", "node": "b", "phase": "decode",
                               "step": None}
    for event in RouteEvent:
        with pytest.raises(CallerError):
            _apply_route(rs, event)


def test_route_keeps_the_first_abort_and_every_lost_node_and_bills_only_completion_tokens() -> None:
    rs = _route_in(RouteState.DECODE)
    rs.token(2.0)
    rs.token(3.0, completion=False)  # the end-of-generation token: counted, not billed
    assert (rs.generated, rs.completion_tokens) == (3, 2)
    rs.abort(Failure(Reason.ROUTE_NODE_LOST, "lost a", node="a"), 4.0)
    rs.abort(Failure(Reason.SLOW_CLIENT, "slow"), 4.5)
    rs.abort(Failure(Reason.ROUTE_NODE_LOST, "lost c", node="c"), 5.0)
    assert rs.state is RouteState.DECODE and not rs.ended
    assert rs.pending == Failure(Reason.ROUTE_NODE_LOST, "lost a", node="a", phase="decode")
    assert rs.lost == {"a", "c"}
    rs.fail(Failure(Reason.ROUTE_NODE_LOST, "lost b", node="b"), 6.0)
    assert rs.lost == {"a", "b", "c"} and rs.failure.node == "b"
    with pytest.raises(CallerError):
        rs.abort(Failure(Reason.CANCELLED, "late"), 7.0)
    assert rs.pending.node == "a"


def test_a_repair_records_the_lost_node_its_replacement_and_the_pause() -> None:
    rs = _route_in(RouteState.DECODE)  # prompt of 10, one token at t=1
    rs.token(2.0)
    snap = rs.node_lost("b", 2.25)
    assert snap["phase"] == "repairing" and snap["health"] == "repairing"
    assert snap["repairs"][0] | {"route": [], "replacement": []} == snap["repairs"][0]
    with pytest.raises(CallerError):
        rs.repair_progress(3, 2.3)  # nothing to rebuild before the replacement is open: nothing changes
    with pytest.raises(CallerError):
        rs.finish("stop", 2.3)
    snap = rs.route_repaired(SPARE, 4, 12, 2.5)
    assert [h["node"] for h in snap["route"]] == ["a", "b2"] and snap["phase"] == "repairing"
    with pytest.raises(CallerError):
        rs.route_repaired(SPARE, 4, 12, 2.6)  # one replacement a loss
    rs.repair_progress(8, 2.75)
    snap = rs.token(3.0)
    assert snap["phase"] == "decode" and rs.generated == 3 and rs.first_token_at == 1.0
    assert snap["repairs"] == [{"lost": "b", "drained": False, "phase": "decode", "at_token": 2, "route": ["a", "b2"],
                                "replacement": ["b2"], "rebuild": {"reused": 4, "done": 12, "total": 12, "kept": {}},
                                "pause_ms": 1000.0, "detect_ms": 250.0, "reroute_ms": 250.0, "rebuild_ms": 500.0}]
    rs.finish("length", 4.0)
    assert rs.state is RouteState.DONE and len(rs.repairs) == 1 and rs.lost == frozenset()
    drained = _route_in(RouteState.DECODE)  # a node that drains (SIGTERM) hands the session over: recorded so
    assert drained.node_lost("b", 2.0, drained=True)["repairs"][0]["drained"] is True


def test_a_node_lost_in_prefill_or_while_repairing_opens_another_repair() -> None:
    rs = _route_in(RouteState.PREFILL)
    rs.node_lost("b", 2.0)
    rs.node_lost("a", 2.5)  # before the first replacement opened
    assert [(r.lost, r.phase, r.since) for r in rs.repairs] == [("b", "prefill", 2.0), ("a", "repairing", 2.5)]
    rs.fail(Failure(Reason.NO_ROUTE, "no spare"), 3.0)
    assert rs.failure.phase == "repairing" and rs.ended


def test_every_state_appears_in_its_table() -> None:
    for table in (NODE_TABLE, ROUTE_TABLE, PROOF_TABLE):
        touched = {t.source for t in table.transitions} | {t.target for t in table.transitions}
        assert touched == set(table.states)
    for table in (NODE_TABLE, ROUTE_TABLE):  # a node session a repair resumed elsewhere ends `moved`, its KV kept
        assert table.terminal == {s for s in table.states if s.value in ("done", "failed", "moved")}
    assert PROOF_TABLE.terminal == {ProofState.PASSED, ProofState.FAILED}


# -- Proof Status ----------------------------------------------------------------


def _apply_proof(p: ProofStatus, event: ProofEvent) -> bool | None:
    if event is ProofEvent.CLAIM:
        return p.claim()
    if event is ProofEvent.PROOF_REQUIRED:
        return p.require("claims nothing", "proof_failed")
    return p.decide(event, "verdict", reason="proof_failed" if event is ProofEvent.REFUTED else None, challenges=3)


@pytest.mark.parametrize("state", list(ProofState))
@pytest.mark.parametrize("event", list(ProofEvent))
def test_proof_every_state_event_pair(state: ProofState, event: ProofEvent) -> None:
    p = ProofStatus(state, message="before")
    before = attrs.asdict(p)
    if PROOF_TABLE.allows(state, event):
        assert _apply_proof(p, event) in (None, True)
        assert p.state is PROOF_TABLE.next(state, event)
        assert p.routable is (p.state in (ProofState.UNCLAIMED, ProofState.PASSED))
    elif event in (ProofEvent.HELD, ProofEvent.REFUTED):
        assert _apply_proof(p, event) is False  # a late verdict is discarded
        assert attrs.asdict(p) == before
    else:
        with pytest.raises(IllegalTransition):
            _apply_proof(p, event)
        assert attrs.asdict(p) == before


def test_proof_verdicts_only_through_decide() -> None:
    p = ProofStatus()
    with pytest.raises(IllegalTransition):
        p.decide(ProofEvent.CLAIM, "not a verdict")
    assert p == ProofStatus()


# -- stateful models -------------------------------------------------------------
class NodeSessionMachine(RuleBasedStateMachine):
    """Drive a NodeSession and a tiny model side by side with random, often wrong, steps."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = 0
        self.seq = 0

    @initialize(waits=st.booleans())
    def open(self, waits: bool) -> None:
        state = NodeState.WAITING if waits else NodeState.CREATED
        self.s = NodeSession(sid="s", max_positions=64, last_active=0.0, state=state)
        self.state = state.value

    @rule(kind=st.sampled_from(list(StepKind)), dseq=st.integers(-2, 2), dpos=st.integers(-2, 2),
          n=st.integers(0, 20))
    def step(self, kind: StepKind, dseq: int, dpos: int, n: int) -> None:
        seq, pos0 = self.seq + dseq, self.positions + dpos
        ok = (
            self.state in ("waiting", "created", "prefill", "decode")
            and not (kind is StepKind.DECODE and self.state in ("waiting", "created"))
            and not (kind is StepKind.PREFILL and self.state == "decode")
            and dseq == 0 and dpos == 0 and n >= 1
            and not (kind is StepKind.DECODE and n != 1)
            and pos0 + n <= 64
        )
        if ok:
            self.s.accept(kind, seq, pos0, n, now=1.0)
            self.positions += n
            self.seq += 1
            self.state = kind.value
        else:
            with pytest.raises(CallerError):
                self.s.accept(kind, seq, pos0, n, now=1.0)

    @rule()
    def kv_open(self) -> None:
        if self.state == "waiting":
            self.s.kv_opened()
            self.state = "created"
        else:
            with pytest.raises(CallerError):
                self.s.kv_opened()

    @rule()
    def close(self) -> None:
        if self.state in ("done", "failed"):
            with pytest.raises(CallerError):
                self.s.close()
        else:
            self.s.close()
            self.state = "done"

    @rule()
    def fail(self) -> None:
        if self.state in ("done", "failed"):
            with pytest.raises(CallerError):
                self.s.fail(Failure(Reason.CANCELLED, "z"))
        else:
            self.s.fail(Failure(Reason.CANCELLED, "z"))
            self.state = "failed"

    @invariant()
    def agrees(self) -> None:
        assert self.s.state.value == self.state
        assert self.s.positions == self.positions
        assert self.s.next_seq == self.seq


class RouteSessionMachine(RuleBasedStateMachine):
    """Drive a RouteSession and a hand-written model side by side; the model never reads ROUTE_TABLE.

    The model is the contract in the module docstring, written out: which
    calls are legal in which state, and what they do to the counters.
    """

    LIVE = ("created", "routing", "prefill", "decode", "repairing")

    def __init__(self) -> None:
        super().__init__()
        self.rs = RouteSession(sid="r", model="m", created_at=0.0)
        self.state = "created"
        self.tokens = 0
        self.billed = 0
        self.pending: str | None = None  # the first abort's reason code
        self.lost: set[str] = set()
        self.prompt = 0
        self.done = 0
        self.phase: str | None = None
        self.now = 0.0
        self.repairs: list[tuple[str, str]] = []  # (node lost, the phase it was lost in)
        self.routed = False  # the open repair's replacement is open
        self.rebuild = (0, 0)  # its (done, total) positions
        self.resumed = 0  # repairs closed by a token

    def _expect(self, ok: bool, call) -> bool:
        """Call the real session; a call the model calls illegal must raise and change nothing."""
        self.now += 1.0
        before = attrs.asdict(self.rs, recurse=False)
        if ok:
            call(self.now)
        else:
            with pytest.raises(CallerError):
                call(self.now)
            assert attrs.asdict(self.rs, recurse=False) == before
        return ok

    @rule()
    def start_routing(self) -> None:
        if self._expect(self.state == "created", self.rs.start_routing):
            self.state = "routing"

    @rule(prompt=st.integers(-1, 12), with_hops=st.booleans())
    def route_ready(self, prompt: int, with_hops: bool) -> None:
        ok = self.state == "routing" and prompt >= 1 and with_hops
        if self._expect(ok, lambda now: self.rs.route_ready(HOPS if with_hops else (), prompt, now)):
            self.state, self.prompt = "prefill", prompt

    @rule(delta=st.integers(-2, 6))
    def prefill_progress(self, delta: int) -> None:
        done = self.done + delta
        ok = self.state == "prefill" and self.done <= done <= self.prompt
        if self._expect(ok, lambda now: self.rs.prefill_progress(done, now)):
            self.done = done

    @rule(completion=st.booleans())
    def token(self, completion: bool) -> None:
        if self._expect(self.state in ("prefill", "decode", "repairing"), lambda now: self.rs.token(now, completion)):
            if self.state != "decode":
                self.done = self.prompt  # the first token means the whole prompt went through
            if self.state == "repairing":
                self.resumed += 1
            self.state = "decode"
            self.tokens += 1
            self.billed += completion

    @rule(node=st.sampled_from([None, "a", "b"]))
    def abort(self, node: str | None) -> None:
        failure = (Failure(Reason.CANCELLED, "gone") if node is None
                   else Failure(Reason.ROUTE_NODE_LOST, "lost", node=node))
        if self._expect(self.state in self.LIVE, lambda now: self.rs.abort(failure, now)):
            self.pending = self.pending or failure.reason.value
            if node is not None:
                self.lost.add(node)

    @rule()
    def finish(self) -> None:
        if self._expect(self.state == "decode", lambda now: self.rs.finish("stop", now)):
            self.state = "done"

    @rule(node=st.sampled_from(["a", "b"]))
    def node_lost(self, node: str) -> None:
        if self._expect(self.state in ("prefill", "decode", "repairing"), lambda now: self.rs.node_lost(node, now)):
            self.repairs.append((node, self.state))
            self.state, self.routed = "repairing", False

    @rule(reused=st.integers(-1, 6), extra=st.integers(-1, 6))
    def route_repaired(self, reused: int, extra: int) -> None:
        total = reused + extra
        ok = self.state == "repairing" and not self.routed and 0 <= reused < total
        if self._expect(ok, lambda now: self.rs.route_repaired(SPARE, reused, total, now)):
            self.routed, self.rebuild = True, (reused, total)

    @rule(delta=st.integers(-2, 6))
    def repair_progress(self, delta: int) -> None:
        done, total = self.rebuild[0] + delta, self.rebuild[1]
        ok = self.state == "repairing" and self.routed and self.rebuild[0] <= done <= total
        if self._expect(ok, lambda now: self.rs.repair_progress(done, now)):
            self.rebuild = (done, total)

    @rule()
    def fail(self) -> None:
        failure = Failure(Reason.ROUTE_NODE_LOST, "lost", node="b")
        if self._expect(self.state in self.LIVE, lambda now: self.rs.fail(failure, now)):
            self.phase, self.state = self.state, "failed"
            self.lost.add("b")

    @invariant()
    def agrees(self) -> None:
        assert self.rs.state.value == self.state
        assert self.rs.generated == self.tokens
        assert self.rs.completion_tokens == self.billed
        assert (self.rs.pending and self.rs.pending.reason.value) == self.pending
        assert self.rs.lost == self.lost
        assert self.rs.prefill_done == self.done
        assert self.rs.ended == (self.state in ("done", "failed"))
        assert (self.rs.failure is not None) == (self.state == "failed")
        if self.rs.failure is not None:
            assert self.rs.failure.phase == self.phase
        assert [(r.lost, r.phase) for r in self.rs.repairs] == self.repairs
        assert sum(r.resumed_at is not None for r in self.rs.repairs) == self.resumed
        if self.state == "repairing":
            last = self.rs.repairs[-1]
            assert (last.routed_at is not None) == self.routed and last.resumed_at is None
            if self.routed:
                assert (last.rebuilt, last.total) == self.rebuild


TestNodeSessionMachine = NodeSessionMachine.TestCase
TestRouteSessionMachine = RouteSessionMachine.TestCase


def test_fsm_core_imports_no_io_libraries() -> None:
    code = (
        "import sys, dgr.fsm, dgr.fsm.node, dgr.fsm.route, dgr.fsm.proof, dgr.fsm.machine, dgr.fsm.phases, "
        "dgr.fsm.stop, dgr.fsm.opening, dgr.errors\n"
        "bad = [m for m in ('trio', 'torch', 'llama_cpp', 'httpx', 'quart', 'numpy') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# -- the stop rule ------------------------------------------------------------------------------------------


def test_the_stop_rule_says_why() -> None:
    assert next_step(eog=False, ignore_eos=False, generated=3, max_tokens=4) == Next(True)
    assert next_step(eog=True, ignore_eos=False, generated=1, max_tokens=4) == Next(False, "stop")
    assert next_step(eog=True, ignore_eos=True, generated=1, max_tokens=4) == Next(True)
    assert next_step(eog=False, ignore_eos=False, generated=4, max_tokens=4) == Next(False, "length")
    assert next_step(eog=False, ignore_eos=False, generated=1, max_tokens=4, stopped=True) == Next(False, "stop")
    # an end of generation on the last allowed token is a stop, not a length
    assert next_step(eog=True, ignore_eos=False, generated=4, max_tokens=4) == Next(False, "stop")


@given(st.integers(1, 5000), st.integers(1, 5000), st.booleans(), st.booleans())
def test_a_ring_tail_counting_positions_stops_where_the_gateway_counting_tokens_does(
        prompt: int, max_tokens: int, eog: bool, ignore_eos: bool) -> None:
    """The gateway counts the k-th completion token against max_tokens; the tail counts the next step's
    position (prompt + k - 1) plus one against the positions the session was opened on (prompt + max_tokens)."""
    for k in (1, max_tokens - 1, max_tokens, max_tokens + 1):
        if k < 1:
            continue
        gateway = next_step(eog=eog, ignore_eos=ignore_eos, generated=k, max_tokens=max_tokens)
        tail = next_step(eog=eog, ignore_eos=ignore_eos, generated=prompt + k - 1 + 1, max_tokens=prompt + max_tokens)
        assert gateway.more == tail.more


def test_a_speculative_session_takes_drafts_and_drops_only_refused_ones() -> None:
    """Issue 42: a decode step of a session opened for speculation carries the last accepted token and its
    drafts; the next may start anywhere from that token's next position to what the KV holds (the tail
    refused the drafts from there on), never before (an accepted token is never taken back) or past it."""
    from dgr.fsm.node import NodeSession, StepKind

    s = NodeSession("s", max_positions=64, last_active=0.0, max_decode=4)
    s.accept(StepKind.PREFILL, 0, 0, 5, now=0.0)
    s.accept(StepKind.DECODE, 1, 5, 4, now=0.0)  # token at 5, drafts at 6, 7, 8
    assert (s.positions, s.committed) == (9, 6)
    for seq, pos0, n, why in ((2, 5, 1, Reason.POSITION_DISCONTINUITY),  # takes back the accepted token
                              (2, 10, 1, Reason.POSITION_DISCONTINUITY),  # skips a position
                              (2, 7, 5, Reason.WRONG_SIZE)):  # more drafts than the session takes
        with pytest.raises(CallerError) as err:
            s.check_step(StepKind.DECODE, seq, pos0, n)
        assert err.value.reason is why
    # one draft accepted: the drafts at 7 and 8 go (it rewinds), 7 and 8 anew
    assert s.accept(StepKind.DECODE, 2, 7, 2, now=0.0)
    assert (s.positions, s.committed, s.next_seq) == (9, 8, 3)
    assert not s.accept(StepKind.DECODE, 3, 9, 1, now=0.0)  # every draft accepted: on from the end
    assert (s.positions, s.committed) == (10, 10)

    plain = NodeSession("p", max_positions=64, last_active=0.0)
    plain.accept(StepKind.PREFILL, 0, 0, 5, now=0.0)
    plain.accept(StepKind.DECODE, 1, 5, 1, now=0.0)
    for pos0, n, why in ((5, 1, Reason.POSITION_DISCONTINUITY), (6, 2, Reason.WRONG_SIZE)):
        with pytest.raises(CallerError) as err:
            plain.check_step(StepKind.DECODE, 2, pos0, n)
        assert err.value.reason is why
