"""A speculative step's bookkeeping (dgr.speculative.step): no node keeps a refused position; counters add up."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from dgr.errors import CallerError, Reason
from dgr.speculative.accept import Verdict
from dgr.speculative.step import KvWindow, SpecCounters, SpecStep, plan_step, settle


def test_a_step_carries_the_last_token_and_its_drafts() -> None:
    step = plan_step(3, 10, 42, [1, 2, 3, 4], k=3, room=8)
    assert step == SpecStep(3, 10, (42, 1, 2, 3))
    assert (step.k, step.drafts, step.accepted_through, step.end) == (3, (1, 2, 3), 9, 14)
    assert plan_step(0, 10, 42, [1, 2, 3], k=5, room=1).k == 1  # the session can emit two more tokens
    assert plan_step(0, 10, 42, [], k=5, room=5).k == 0


def test_settle_keeps_the_accepted_positions_and_the_next_step_starts_after_them() -> None:
    step = SpecStep(0, 10, (42, 1, 2, 3))
    done = settle(step, Verdict(2, (1, 2, 9)), generated=0, max_tokens=100, is_eog=lambda t: False)
    assert (done.emitted, done.keep, done.more) == ((1, 2, 9), 13, True)
    # 42 at 10, drafts 1 and 2 at 11 and 12 stay; 3 at 13 is refused: the next step (token 9) computes 13


def test_a_stop_inside_the_accepted_drafts_cuts_the_rest() -> None:
    step = SpecStep(0, 10, (42, 1, 0, 3))
    done = settle(step, Verdict(3, (1, 0, 3, 5)), generated=0, max_tokens=100, is_eog=lambda t: t == 0)
    assert (done.emitted, done.keep, done.more, done.finish) == ((1, 0), 12, False, "stop")
    done = settle(step, Verdict(3, (1, 0, 3, 5)), generated=98, max_tokens=100, is_eog=lambda t: False)
    assert (done.emitted, done.keep, done.more, done.finish) == ((1, 0), 12, False, "length")


def test_a_verdict_of_another_step_is_refused() -> None:
    step = SpecStep(0, 10, (42, 1, 2))
    with pytest.raises(ValueError):
        settle(step, Verdict(3, (1, 2, 3, 4)), generated=0, max_tokens=9, is_eog=lambda t: False)
    with pytest.raises(ValueError):
        settle(step, Verdict(1, (7, 4)), generated=0, max_tokens=9, is_eog=lambda t: False)


def test_a_node_refuses_a_step_that_takes_back_or_skips_a_position() -> None:
    w = KvWindow(committed=10, held=10).computed(SpecStep(0, 10, (42, 1, 2, 3)))
    assert w == KvWindow(committed=11, held=14)
    for bad in (10, 15):
        with pytest.raises(CallerError) as err:
            w.advance(bad)
        assert err.value.reason is Reason.POSITION_DISCONTINUITY
    drop, after = w.advance(12)
    assert (drop, after) == (range(12, 14), KvWindow(committed=12, held=12))


@given(
    prompt=st.integers(1, 20),
    plan=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 50)), min_size=1, max_size=25),
)
def test_no_node_ever_keeps_a_refused_position(prompt, plan) -> None:
    """Any run of steps and verdicts: after each trim a node holds exactly the accepted tokens, in order."""
    kv = list(range(1000, 1000 + prompt - 1))  # the token at each position this node holds
    window = KvWindow(committed=len(kv), held=len(kv))
    accepted = list(kv) + [7]  # the tokens the route has accepted, the prompt's last included
    pos0, counters = prompt - 1, SpecCounters()
    for seq, (k, n, salt) in enumerate(plan):
        drafts = [2000 + salt + i for i in range(k)]
        step = plan_step(seq, pos0, accepted[-1], drafts, k=k, room=10)
        drop, window = window.advance(step.pos0)
        del kv[drop.start : drop.stop]
        kv.extend(step.tokens)
        window = window.computed(step)
        n = min(n, step.k)
        verdict = Verdict(n, step.drafts[:n] + (3000 + seq,))
        done = settle(step, verdict, generated=0, max_tokens=10**6, is_eog=lambda t: False)
        counters = counters.after(step, verdict)
        accepted.extend(done.emitted)
        drop, trimmed = window.advance(done.keep)
        assert kv[: drop.start] == accepted[: done.keep] and drop.stop == len(kv)
        pos0 = done.keep
    assert counters.accepted + counters.rejected == counters.drafted
    assert counters.steps == len(plan)


def test_counters_report_the_rate_and_k() -> None:
    c = SpecCounters().after(SpecStep(0, 5, (1, 2, 3, 4)), Verdict(1, (2, 9)))
    c = c.after(SpecStep(1, 7, (9, 5)), Verdict(1, (5, 6)))
    assert c.to_json() == {"steps": 2, "drafted": 4, "accepted": 2, "rejected": 2, "acceptance_rate": 0.5, "k": 1}
    assert SpecCounters().acceptance_rate is None


def test_the_spec_package_loads_no_io_or_compute_library() -> None:
    """dgr.speculative is pure: importing it loads neither trio nor torch nor llama.cpp, so the tail can call it anywhere."""
    import subprocess
    import sys

    code = (
        "import sys, dgr.speculative, dgr.speculative.ngram, dgr.speculative.accept, dgr.speculative.adapt, dgr.speculative.step\n"
        "print(sorted(m for m in ('trio', 'torch', 'llama_cpp', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
