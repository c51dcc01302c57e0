"""Acceptance (dgr.speculative.accept): exact answers, greedy and sampled, against decoding one token at a time.

The "model" is a tiny deterministic table: the logits at a position are a fixed random row for the token
there plus another for the token before it, read from each node's own KV, so a node that kept a refused
position computes wrong logits from then on. The route is simulated with dgr.speculative.step's bookkeeping.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dgr.sampling import Sampler, SamplingParams
from dgr.speculative.accept import (
    Verdict,
    accept_drafts,
    accept_greedy,
    accept_sampled,
    accept_with_draft_model,
    accept_with_sampler,
    target,
)
from dgr.speculative.ngram import NgramDrafter
from dgr.speculative.step import KvWindow, plan_step, settle

V = 12
_R = np.random.default_rng(1234)
T1 = (_R.standard_normal((V, V)) * 2.0).astype(np.float32)
T2 = (_R.standard_normal((V, V)) * 1.0).astype(np.float32)
EOG = V - 1


def row(kv: list[int], p: int) -> np.ndarray:
    """The tiny model's logits at position p, from the tokens a node holds at p and p - 1."""
    prev = kv[p - 1] if p > 0 else 0
    return T1[kv[p]] + T2[prev]


class Node:
    """One node's KV (the token at each position) and its window bookkeeping."""

    def __init__(self, prompt: list[int]) -> None:
        self.kv = list(prompt[:-1])  # the prompt's last token rides in the first decode step
        self.window = type(self).w0(len(self.kv))

    @staticmethod
    def w0(n: int) -> KvWindow:
        return KvWindow(committed=n, held=n)

    def compute(self, step) -> np.ndarray:
        drop, self.window = self.window.advance(step.pos0)
        del self.kv[drop.start : drop.stop]
        assert len(self.kv) == step.pos0
        self.kv.extend(step.tokens)
        self.window = self.window.computed(step)
        return np.stack([row(self.kv, step.pos0 + i) for i in range(step.k + 1)])  # [k + 1, V]


def one_at_a_time(prompt: list[int], n: int, draw) -> list[int]:
    """The reference: one position per step, no speculation."""
    seq, out = list(prompt), []
    while len(out) < n:
        tok = draw(row(seq, len(seq) - 1))
        out.append(tok)
        seq.append(tok)
        if tok == EOG:
            break
    return out


def speculative(prompt: list[int], n: int, ks: list[int], verify, drafts_for) -> list[int]:
    """Decode n tokens with k = ks[step % len(ks)] drafts a step, on a 2-node route that only the tail's
    logits matter for (the head's KV is checked the same way)."""
    nodes = [Node(prompt), Node(prompt)]
    drafter = NgramDrafter(n_min=1, n_max=3)
    drafter.extend(prompt)
    out: list[int] = []
    pos0, last, seq = len(prompt) - 1, prompt[-1], 0
    while True:
        k = ks[seq % len(ks)]
        step = plan_step(seq, pos0, last, drafts_for(drafter, prompt + out, k), k=k, room=n - len(out) - 1)
        logits = [node.compute(step) for node in nodes][-1]
        verdict = verify(logits, step.drafts)
        done = settle(step, verdict, generated=len(out), max_tokens=n, is_eog=lambda t: t == EOG)
        out.extend(done.emitted)
        drafter.extend(done.emitted)
        for node in nodes:  # no node holds a position that was not accepted, once the next step trims
            drop, w = node.window.advance(done.keep)
            assert node.kv[: done.keep] == (prompt + out)[: done.keep]
        if not done.more:
            return out
        pos0, last, seq = done.keep, done.emitted[-1], seq + 1


def ngram_drafts(drafter: NgramDrafter, seq: list[int], k: int) -> list[int]:
    return drafter.draft(k)


def noisy_drafts(salt: int):
    """Drafts that are right for a while and then wrong: the oracle's greedy continuation, corrupted."""

    def drafts(drafter: NgramDrafter, seq: list[int], k: int) -> list[int]:
        s, out = list(seq), []
        rng = np.random.default_rng(salt + len(seq))
        for _ in range(k):
            tok = int(np.argmax(row(s, len(s) - 1)))
            if rng.random() < 0.3:
                tok = int(rng.integers(V))
            out.append(tok)
            s.append(tok)
        return out

    return drafts


@settings(max_examples=40)
@given(
    prompt=st.lists(st.integers(0, V - 2), min_size=1, max_size=12),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    n=st.integers(1, 30),
    source=st.sampled_from(["ngram", "noisy"]),
    salt=st.integers(0, 1000),
)
def test_greedy_speculation_equals_greedy_one_token_at_a_time(prompt, ks, n, source, salt) -> None:
    want = one_at_a_time(prompt, n, lambda z: int(np.argmax(z)))
    drafts = ngram_drafts if source == "ngram" else noisy_drafts(salt)
    assert speculative(prompt, n, ks, accept_greedy, drafts) == want


@settings(max_examples=40)
@given(
    prompt=st.lists(st.integers(0, V - 2), min_size=1, max_size=12),
    ks=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    n=st.integers(1, 30),
    seed=st.integers(0, 2**32),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    source=st.sampled_from(["ngram", "noisy"]),
)
def test_a_seeded_sampler_gives_the_same_tokens_whatever_k(prompt, ks, n, seed, temperature, top_p, source) -> None:
    """The coupled rule draws once per emitted token, in order: the seeded stream is the non-speculative one."""
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    reference = Sampler(params)
    want = one_at_a_time(prompt, n, lambda z: reference.sample(z)[0])
    sampler = Sampler(params)
    drafts = ngram_drafts if source == "ngram" else noisy_drafts(seed % 1000)
    got = speculative(prompt, n, ks, lambda logits, d: accept_with_sampler(logits, d, sampler)[0], drafts)
    assert got == want


def test_the_sampler_reports_each_emitted_tokens_logprob() -> None:
    logits = np.stack([T1[0], T1[3], T1[5]])
    want = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
    verdict, logprobs = accept_with_sampler(logits, want, Sampler(SamplingParams(temperature=0.0)))
    assert verdict == Verdict(2, (*want, int(np.argmax(logits[2]))))
    assert len(logprobs) == 3 and all(lp <= 0 for lp in logprobs)


def test_rows_are_drawn_lazily_and_in_order() -> None:
    seen: list[int] = []

    def draw(i: int) -> int:
        seen.append(i)
        return 7

    assert accept_drafts(draw, [7, 2, 7]) == Verdict(1, (7, 7))
    assert seen == [0, 1]


@settings(max_examples=60)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.floats(0.05, 2.0),
    top_p=st.floats(0.05, 1.0),
    vocab=st.integers(2, 300),
)
def test_target_is_the_distribution_the_sampler_draws_from(seed, temperature, top_p, vocab) -> None:
    """Same generator, same draws: `target` mirrors dgr.sampling exactly (nucleus shortcut included)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    z = (np.random.default_rng(seed).standard_normal(vocab) * 4).astype(np.float32)
    sampler, rng = Sampler(params), np.random.default_rng(seed)
    ids, p = target(z, params)
    assert math.isclose(p.sum(), 1.0, rel_tol=1e-9)
    for _ in range(5):
        assert sampler.sample(z)[0] == int(ids[rng.choice(ids.shape[0], p=p)])


# --- the sampling rule is exact: chi-square on the first emitted token ---------------------------

P = np.array([0.30, 0.25, 0.18, 0.12, 0.08, 0.05, 0.02, 0.0, 0.0])  # tokens 7 and 8 impossible
P2 = np.array([0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.0])  # the row after an accepted draft
IDS = np.arange(P.shape[0])
TRIALS = 20_000
ALPHA = 1e-3


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x): the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, y = df / 2.0, x / 2.0
    if y <= 0:
        return 1.0
    log_front = -y + a * math.log(y) - math.lgamma(a)
    if y < a + 1:  # series for P(a, y)
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= y / n
            total += term
        return 1.0 - math.exp(log_front) * total
    # continued fraction for Q(a, y) (modified Lentz)
    tiny = 1e-300
    b = y + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """The counts fit probs: nothing where probs is 0, and a chi-square p-value at least ALPHA elsewhere."""
    support = probs > 0
    if counts[~support].any():
        return False
    expected = probs[support] * counts.sum()
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1) >= ALPHA


def test_the_chi_square_tail_is_right() -> None:
    assert math.isclose(chi2_sf(3.841458820694124, 1), 0.05, rel_tol=1e-6)
    assert math.isclose(chi2_sf(18.307038053275146, 10), 0.05, rel_tol=1e-6)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0), rel_tol=1e-9)


Q_SPREAD = np.array([0.05, 0.3, 0.05, 0.3, 0.05, 0.05, 0.1, 0.05, 0.05])
Q_DISJOINT = np.array([0, 0, 0, 0, 0, 0, 0, 0.5, 0.5])  # only where P is 0
Q_NEAR = P * 0.5 + 0.5 / P.shape[0]


def first_tokens(rule, *, q: np.ndarray | None, draft: int | None, seed: int) -> np.ndarray:
    """Counts of the first emitted token over TRIALS steps of one draft: drawn from q, or the fixed `draft`."""
    rng = np.random.default_rng(seed)
    rows = [(IDS, P), (IDS, P2)]
    qs = None if q is None else q[None, :]
    if q is None:
        drafts = [draft] * TRIALS
    else:  # drawn for every trial at once, by inverse CDF
        drafts = np.minimum((rng.random(TRIALS)[:, None] > np.cumsum(q)).sum(axis=1), q.shape[0] - 1).tolist()
    counts = np.zeros(P.shape[0], dtype=np.int64)
    for d in drafts:
        counts[rule(rows.__getitem__, [d], rng, qs).tokens[0]] += 1
    return counts


def coupled(rows, drafts, rng, q):
    """accept_drafts with a sampler that draws from each row (what accept_with_sampler does with logits)."""
    return accept_drafts(lambda i: int(rows(i)[0][rng.choice(rows(i)[0].shape[0], p=rows(i)[1])]), drafts)


@pytest.mark.parametrize(
    "rule, draft",
    [(accept_sampled, 0), (accept_sampled, 6), (accept_sampled, 7), (coupled, 4)],
    ids=["textbook-likely", "textbook-rare", "textbook-impossible", "coupled-unlikely"],
)
def test_a_point_mass_draft_leaves_the_first_token_distributed_as_p(rule, draft) -> None:
    assert fits(first_tokens(rule, q=None, draft=draft, seed=draft), P)


@pytest.mark.parametrize("q", [Q_SPREAD, Q_DISJOINT, Q_NEAR], ids=["spread", "disjoint", "near"])
def test_a_draft_distribution_leaves_the_first_token_distributed_as_p(q) -> None:
    assert fits(first_tokens(accept_sampled, q=q, draft=None, seed=7), P)


def always_accept(rows, drafts, rng, q):
    ids, p = rows(len(drafts))
    return Verdict(len(drafts), tuple(drafts) + (int(ids[rng.choice(ids.shape[0], p=p)]),))


def refuse_then_sample_p(rows, drafts, rng, q):
    """The right acceptance test, but a refused row samples from p instead of the residual."""
    ids, p = rows(0)
    q_d = 1.0 if q is None else float(q[0, drafts[0]])
    if rng.random() * q_d < p[drafts[0]]:
        return Verdict(1, (drafts[0], int(rng.choice(ids.shape[0], p=rows(1)[1]))))
    return Verdict(0, (int(ids[rng.choice(ids.shape[0], p=p)]),))


@pytest.mark.parametrize(
    "rule, q, draft",
    [(always_accept, None, 0), (refuse_then_sample_p, None, 2), (refuse_then_sample_p, Q_SPREAD, None)],
    ids=["always-accept", "p-not-residual-point", "p-not-residual-q"],
)
def test_a_wrong_rule_fails_the_same_test(rule, q, draft) -> None:
    assert not fits(first_tokens(rule, q=q, draft=draft, seed=3), P)


def test_two_positions_are_jointly_exact_with_a_draft_model() -> None:
    """k = 2 drafts from a draft model on a tiny table: the first two emitted tokens' joint law is the target's."""
    params = SamplingParams(temperature=1.0)
    vocab, start = 5, 2
    t1 = T1[:vocab, :vocab] * 0.6
    rows = [target(t1[a], params) for a in range(vocab)]  # the target after token a
    draft_table = np.exp(T2[:vocab, :vocab]) / np.exp(T2[:vocab, :vocab]).sum(axis=1, keepdims=True)
    # the drafts, drawn for every trial at once by inverse CDF
    rng = np.random.default_rng(11)
    cdf = np.cumsum(draft_table, axis=1)
    d1s = np.minimum((rng.random(TRIALS)[:, None] > cdf[start]).sum(axis=1), vocab - 1)
    d2s = np.minimum((rng.random(TRIALS)[:, None] > cdf[d1s]).sum(axis=1), vocab - 1)
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for d1, d2 in zip(d1s.tolist(), d2s.tolist()):
        q = draft_table[[start, d1]]
        v = accept_sampled([rows[start], rows[d1], rows[d2]].__getitem__, [d1, d2], rng, q)
        if v.accepted == 0:  # the second token comes from the next step, which has no drafts to verify
            second = int(rng.choice(vocab, p=rows[v.tokens[0]][1]))
        else:
            second = v.tokens[1]
        counts[v.tokens[0], second] += 1
    joint = rows[start][1][:, None] * np.stack([rows[a][1] for a in range(vocab)])
    assert fits(counts.reshape(-1), joint.reshape(-1))


def test_a_draft_model_step_samples_from_the_target_distribution() -> None:
    """accept_with_draft_model is accept_sampled over `target`'s rows, with the same generator."""
    params = SamplingParams(temperature=0.8, top_p=0.9)
    logits = np.stack([T1[1], T1[2], T1[3]])
    q = np.full((2, V), 1.0 / V)
    for seed in range(20):
        got = accept_with_draft_model(logits, [4, 5], q, params, np.random.default_rng(seed))
        want = accept_sampled(lambda i: target(logits[i], params), [4, 5], np.random.default_rng(seed), q)
        assert got == want


def test_greedy_with_a_draft_model_is_argmax() -> None:
    logits = np.stack([T1[1], T1[2]])
    best = int(np.argmax(T1[1]))
    q = np.full((1, V), 1.0 / V)
    v = accept_with_draft_model(logits, [best], q, SamplingParams(temperature=0.0), np.random.default_rng(0))
    assert v == Verdict(1, (best, int(np.argmax(T1[2]))))


def test_logits_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError):
        accept_greedy(np.zeros((2, V), np.float32), [1, 2])
