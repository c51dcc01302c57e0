"""Which drafted tokens the tail accepts, given the target's logits for every position of a step.

A step verifies k drafts d_1..d_k with k + 1 rows of target logits: row i is
the target's prediction after the last accepted token and d_1..d_i. The
tail emits the accepted drafts and then one more token of its own (the
correction where a draft was refused, or the bonus after row k when all
were accepted), so a step always emits at least one token.

Two rules, both exact (the emitted tokens have the distribution that
sampling one token at a time gives):

- **a deterministic draft** (n-gram lookup; greedy or sampling): draw each
  row's token with the session's own sampler (`dgr.sampling.Sampler`,
  unchanged), row by row, and accept while it equals the draft; the first
  token that differs is the correction, and after k matches row k's token
  is the bonus. This is the standard rule for q = a point mass on d: the
  draft is accepted with probability p(d) = min(1, p(d) / q(d)), and a
  refused row's token is distributed as p given that it is not d, which
  is norm(max(0, p - q)). More: the sampler is called exactly once per
  emitted token, in order, so its seeded stream gives the very tokens
  non-speculative decoding gives, whatever k each step used. At
  temperature 0 the sampler is argmax, which is greedy verification:
  the longest prefix of drafts equal to their rows' argmax, then the next
  row's argmax. Equal to greedy decoding one token at a time provided each
  row's logits equal what a one-position step computes (issue 42's
  `--spec-exact`).
- **a draft with a distribution q** (a draft model; Leviathan et al. 2023,
  Chen et al. 2023): accept d with probability min(1, p(d) / q(d)); on
  refusal, sample the correction from norm(max(0, p - q)) and stop. After k
  acceptances, sample the bonus from p of row k. This needs p itself:
  `target` is dgr.sampling's `distribution`, the one function `Sampler.sample`
  draws from too (temperature over float64 logits, then top-p by its
  nucleus rule). dgr.sampling has no top-k or min-p; when it gains them they
  belong in that one function. `accept_sampled` with q = None
  is this rule for a point mass, kept as the textbook form the tests check
  the coupled rule against.

Randomness comes only from the sampler or numpy Generator passed in (the
session's own, seeded by SamplingParams.seed), so a seeded request is
reproducible. Rows are drawn lazily: a step refused at its first draft
draws from two rows, not k + 1.

Left out: where drafts come from (dgr.speculative.ngram) and what the seam and the
KV keep (dgr.speculative.step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import numpy as np

from dgr.sampling import Sampler, SamplingParams, distribution

__all__ = [
    "Verdict",
    "target",
    "accept_drafts",
    "accept_greedy",
    "accept_with_sampler",
    "accept_sampled",
    "accept_with_draft_model",
]

# A draft's distribution at each position, [k, vocab] (None: a deterministic draft, a point mass on d_i).
DraftProbs = np.ndarray | None


@attrs.frozen
class Verdict:
    """A step's outcome at the tail: `tokens` is the accepted drafts then the one extra token."""

    accepted: int  # drafts accepted, 0..k
    tokens: tuple[int, ...]  # accepted + 1 tokens, in order

    @property
    def extra(self) -> int:
        """The correction (a draft was refused) or the bonus (all k accepted)."""
        return self.tokens[-1]


# The non-speculative sampler's distribution for one row: (token ids, their probabilities), the arrays
# `Sampler.sample` draws its token from.
target = distribution


def accept_drafts(draw: Callable[[int], int], drafts: Sequence[int]) -> Verdict:
    """The rule for a deterministic draft: draw row i's token with `draw(i)`, accept while it equals d_i.

    draw(i): the session's sampler on row i, i in 0..k (rows are drawn in order, each at most once).
    """
    n = 0
    for d in drafts:
        tok = int(draw(n))
        if tok != int(d):
            return Verdict(n, tuple(int(x) for x in drafts[:n]) + (tok,))
        n += 1
    return Verdict(n, tuple(int(x) for x in drafts) + (int(draw(n)),))


def accept_greedy(logits: np.ndarray, drafts: Sequence[int]) -> Verdict:
    """Greedy verification (the argmax sampler). logits: [k + 1, vocab] for k = len(drafts)."""
    _check_rows(logits, drafts)
    return accept_drafts(lambda i: int(np.argmax(logits[i].astype(np.float32, copy=False))), drafts)


def accept_with_sampler(logits: np.ndarray, drafts: Sequence[int], sampler: Sampler) -> tuple[Verdict, list[float]]:
    """A deterministic draft verified with the session's own sampler. logits: [k + 1, vocab].

    Returns the verdict and each emitted token's log-probability (as `Sampler.sample` reports it).
    """
    _check_rows(logits, drafts)
    logprobs: list[float] = []

    def draw(i: int) -> int:
        tok, lp = sampler.sample(logits[i])
        logprobs.append(lp)
        return tok

    return accept_drafts(draw, drafts), logprobs


def accept_sampled(
    rows: Callable[[int], tuple[np.ndarray, np.ndarray]],
    drafts: Sequence[int],
    rng: np.random.Generator,
    q: DraftProbs = None,
) -> Verdict:
    """The speculative sampling rule over target rows given lazily.

    rows(i): row i's target distribution as `target` returns it, for i in 0..k.
    q: the draft's distributions [k, vocab], or None for a deterministic draft.
    Draws one uniform per draft examined, then one choice for the extra token.
    """
    k = len(drafts)
    if q is not None and q.shape[0] != k:
        raise ValueError(f"{q.shape[0]} draft distributions for {k} drafts")
    for i, d in enumerate(drafts):
        d = int(d)
        ids, p = rows(i)
        p_d = _mass(ids, p, d)
        q_d = 1.0 if q is None else float(q[i, d])
        # min(1, p/q) without dividing: u < p/q  <=>  u * q < p  (q_d > 0 for any token the draft proposed)
        if rng.random() * q_d < p_d:
            continue
        if q is None:
            residual = np.where(ids == d, 0.0, p)
        else:
            residual = np.maximum(0.0, p - q[i, ids])
        total = residual.sum()
        if total <= 0.0:  # p <= q everywhere on its support: only rounding refuses, so fall back to p
            residual, total = p, p.sum()
        tok = int(ids[rng.choice(ids.shape[0], p=residual / total)])
        return Verdict(i, tuple(int(x) for x in drafts[:i]) + (tok,))
    ids, p = rows(k)
    return Verdict(k, tuple(int(x) for x in drafts) + (int(ids[rng.choice(ids.shape[0], p=p)]),))


def accept_with_draft_model(
    logits: np.ndarray, drafts: Sequence[int], q: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> Verdict:
    """Drafts from a draft model with distributions q [k, vocab], verified against logits [k + 1, vocab]."""
    _check_rows(logits, drafts)
    if params.temperature == 0.0:  # p is a point mass: min(1, p/q) accepts exactly the argmax
        return accept_greedy(logits, drafts)
    return accept_sampled(lambda i: target(logits[i], params), drafts, rng, q)


def _mass(ids: np.ndarray, p: np.ndarray, token: int) -> float:
    hit = np.flatnonzero(ids == token)
    return float(p[hit[0]]) if hit.size else 0.0


def _check_rows(logits: np.ndarray, drafts: Sequence[int]) -> None:
    if logits.ndim != 2 or logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"logits of shape {logits.shape} for {len(drafts)} drafts: need [{len(drafts) + 1}, vocab]")
