"""Adaptive k (dgr.speculative.adapt): speculation where it pays, none where it would slow a session."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from dgr.speculative.accept import accept_greedy
from dgr.speculative.adapt import Acceptance, RouteCost, Shadow, choose_k, expected_tokens, rate
from dgr.speculative.ngram import NgramDrafter
from dgr.speculative.step import plan_step, settle

POOR = Acceptance(rates=(0.2,))
GOOD = Acceptance(rates=(0.8,))
# A one-position step of a small model on two CPU nodes: 10 ms of compute, each extra position 2 ms more.
COMPUTE_S, POSITION_S = 0.010, 0.002


def test_no_rtt_and_a_poor_rate_drafts_nothing() -> None:
    assert choose_k(POOR, RouteCost(step_s=COMPUTE_S, position_s=POSITION_S)) == 0


def test_fifty_ms_and_a_good_rate_drafts_several() -> None:
    cost = RouteCost(step_s=COMPUTE_S + 0.050, position_s=POSITION_S)
    k = choose_k(GOOD, cost)
    assert k >= 4
    assert rate(GOOD, cost, k) > 2 * rate(GOOD, cost, 0)


def test_the_same_rate_pays_once_the_trip_is_long() -> None:
    middling = Acceptance(rates=(0.45,))
    assert choose_k(middling, RouteCost(COMPUTE_S, 0.004)) == 0
    assert choose_k(middling, RouteCost(COMPUTE_S + 0.050, 0.004)) > 0


def test_expected_tokens_follow_the_model() -> None:
    a = Acceptance(rates=(0.5, 0.25))
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 2) == pytest.approx(1 + 0.5 + 0.125)
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.5 + 0.125 + 0.125 * 0.25)  # unseen: the deepest seen


def test_steps_teach_the_estimate() -> None:
    a = Acceptance(prior=0.5)
    for _ in range(60):
        a = a.after_step(4, 4)
    assert all(r > 0.95 for r in a.rates) and len(a.rates) == 4
    for _ in range(60):
        a = a.after_step(4, 0)  # every first draft refused: deeper positions are not seen again
    assert a.rates[0] < 0.05 and a.rates[3] > 0.95
    assert choose_k(a, RouteCost(COMPUTE_S + 0.050, POSITION_S)) == 0
    with pytest.raises(ValueError):
        a.after_step(2, 3)
    with pytest.raises(ValueError):
        a.observe(0, 1.0)


def test_a_cost_with_no_time_is_refused() -> None:
    with pytest.raises(ValueError):
        RouteCost(step_s=0.0, position_s=0.001)


@given(
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
    step_s=st.floats(0.001, 0.5),
    position_s=st.floats(0.0, 0.05),
    draft_s=st.floats(0.0, 0.01),
)
def test_the_choice_is_never_slower_than_no_speculation(rates, step_s, position_s, draft_s) -> None:
    """Under the model, the chosen k's rate is at least R(0), and it is the best k when it is not 0."""
    a, cost = Acceptance(rates=tuple(rates)), RouteCost(step_s, position_s, draft_s)
    k = choose_k(a, cost)
    assert rate(a, cost, k) >= rate(a, cost, 0)
    if k:
        assert rate(a, cost, k) == max(rate(a, cost, j) for j in range(9))


def test_a_gain_inside_the_margin_is_not_taken() -> None:
    """At 0 ms a 0.25 rate would gain 4% under the model: too little to risk on an estimate."""
    a, cost = Acceptance(rates=(0.25,)), RouteCost(COMPUTE_S, POSITION_S)
    assert rate(a, cost, 1) > rate(a, cost, 0)
    assert choose_k(a, cost) == 0
    assert choose_k(a, cost, margin=0.0) == 1


# --- the shadow: a k = 0 session learns the rates real steps would have taught ------------------

_V = 6
_R = np.random.default_rng(99)
_T1, _T2 = _R.standard_normal((_V, _V)) * 2, _R.standard_normal((_V, _V))


def _row(seq: list[int], p: int) -> np.ndarray:
    return _T1[seq[p]] + _T2[seq[p - 1] if p else 0]


class _Recorder:
    """Stands in for Acceptance where a test needs the observations themselves, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def observe(self, position: int, value: float) -> "_Recorder":
        self.seen.append((position, value))
        return self


@given(prompt=st.lists(st.integers(0, _V - 1), min_size=2, max_size=10), k=st.integers(1, 6), n=st.integers(1, 40))
def test_a_greedy_shadow_observes_what_real_steps_observe(prompt, k, n) -> None:
    """Decoding one token at a time with a shadow of k drafts sees the observations that real steps of k
    drafts feed the estimate, in the same order; only the last real step may see further than n tokens."""
    seq, real = list(prompt), _Recorder()
    drafter = NgramDrafter(n_min=1, n_max=3)
    drafter.extend(prompt)
    pos0, seqno, emitted = len(prompt) - 1, 0, 0
    while True:
        step = plan_step(seqno, pos0, seq[-1], drafter.draft(k), k=k, room=10**6)
        s = seq + list(step.drafts)
        verdict = accept_greedy(np.stack([_row(s, step.pos0 + i) for i in range(step.k + 1)]), step.drafts)
        Acceptance.after_step(real, step.k, verdict.accepted)
        done = settle(step, verdict, generated=emitted, max_tokens=n, is_eog=lambda t: False)
        emitted += len(done.emitted)
        seq.extend(done.emitted)
        drafter.extend(done.emitted)
        if not done.more:
            break
        pos0, seqno = done.keep, seqno + 1
    seq2, shadow, learned = list(prompt), Shadow(), _Recorder()
    drafter2 = NgramDrafter(n_min=1, n_max=3)
    drafter2.extend(prompt)
    for _ in range(n):
        if not shadow.expecting:
            shadow = Shadow(tuple(drafter2.draft(k)))
        tok = int(np.argmax(_row(seq2, len(seq2) - 1)))
        shadow, learned = shadow.sampled(tok, learned)
        seq2.append(tok)
        drafter2.append(tok)
    assert seq2 == seq
    assert learned.seen == real.seen[: len(learned.seen)]
    assert len(real.seen) - len(learned.seen) <= k


def test_the_shadow_observes_the_acceptance_probability_when_sampling() -> None:
    shadow, a = Shadow((3, 4)), Acceptance(prior=0.5, weight=1.0)
    shadow, a = shadow.sampled(3, a, p_draft=0.9)
    assert a.rates == (0.9,) and shadow.expecting
    shadow, a = shadow.sampled(1, a, p_draft=0.2)
    assert a.rates == pytest.approx((0.9, 0.2)) and not shadow.expecting
    full = Shadow((3,))
    full, a = full.sampled(3, a)
    assert full.expecting and full.bonus_due  # the bonus is judged by nothing
    full, b = full.sampled(5, a)
    assert b == a and not full.expecting


class _Scripted:
    """An n-gram-like drafter whose next draft's class the test sets; its drafts are 1, 2, ..."""

    free = True
    draft_s = 0.0

    def __init__(self) -> None:
        self.now = "short"

    def extend(self, tokens) -> None:
        pass

    def append(self, token: int) -> None:
        pass

    def draft(self, k: int) -> list[int]:
        return list(range(1, k + 1))

    def kind(self) -> str:
        return self.now

    def warm(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_each_class_of_drafts_keeps_its_own_estimate() -> None:
    """Drafts resting on little context refused at once, drafts resting on more all taken, in turn: the tail
    then drafts several after a long context and none after a short one. (One estimate for both drafted the
    same k after each: on the bench's copy task, long after a copied run ended.)"""
    from dgr.node.speculation import SpecPlan, TailSpec
    from dgr.sampling import Sampler, SamplingParams

    drafter = _Scripted()
    spec = TailSpec(SpecPlan(), drafter=drafter)
    spec.step_s, spec.position_s, spec.compute_1 = 0.07, 0.008, 0.02  # 50 ms RTT on 2 nodes, as measured there
    greedy = Sampler(SamplingParams(temperature=0.0))
    spec.first(7, 0.0)
    pos = 10
    for i in range(40):
        drafter.now = "long" if i % 2 else "short"
        step = spec.next_step(i, pos, 7, 10_000)
        rows = np.full((step.k + 1, 32), -10.0, np.float32)
        taken = step.k if drafter.now == "long" else 0
        for j in range(taken):
            rows[j, j + 1] = 10.0
        rows[taken, 9] = 10.0  # the correction, or the bonus after every draft
        _, verdict, _, _ = spec.verify(i, rows, greedy, is_eog=lambda t: False, ignore_eos=True, max_positions=10_000)
        assert verdict.accepted == taken
        pos += taken + 1
    assert spec._k("short") == 0
    assert spec._k("long") >= 4
    assert spec.estimate("short").rate_at(1) < 0.1 < 0.9 < spec.estimate("long").rate_at(1)
