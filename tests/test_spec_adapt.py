"""Adaptive k (dgr.spec.adapt): speculation where it pays, none where it would slow a session."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from dgr.spec.adapt import Acceptance, RouteCost, choose_k, expected_tokens, rate

POOR = Acceptance(rates=(0.2,))
GOOD = Acceptance(rates=(0.8,))
# A one-position step of a small model on two CPU nodes: 10 ms of compute, each extra position 2 ms more.
COMPUTE_S, POSITION_S = 0.010, 0.002


def test_no_rtt_and_a_poor_rate_drafts_nothing() -> None:
    assert choose_k(POOR, RouteCost(step_s=COMPUTE_S, position_s=POSITION_S)) == 0


def test_fifty_ms_and_a_good_rate_drafts_several() -> None:
    k = choose_k(GOOD, RouteCost(step_s=COMPUTE_S + 0.050, position_s=POSITION_S))
    assert k >= 4
    assert rate(GOOD, RouteCost(COMPUTE_S + 0.050, POSITION_S), k) > 2 * rate(GOOD, RouteCost(COMPUTE_S + 0.050, POSITION_S), 0)


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
