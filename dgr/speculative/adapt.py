"""How many tokens a session drafts per step: the k that maximises expected tokens per second.

The model. A step with k drafts costs

    T(k) = step_s + k * (position_s + draft_s)

where `step_s` is the measured wall time of a one-position step around the
route (every link's trip plus every node's compute: the time between two
tokens without speculation), `position_s` the measured extra compute of one
more position in a step, summed over the route's nodes, and `draft_s` what
drafting one token costs (about 0 for n-gram lookup; a draft model's
per-token time otherwise). It emits

    E(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i

tokens on average, where a_i is the probability that draft i is accepted
given drafts 1..i-1 were (the step always emits one token of its own: the
correction or the bonus). The rate is R(k) = E(k) / T(k) tokens a second,
and R(0) = 1 / step_s is decoding without speculation.

The choice is the k in 0..k_max with the highest R(k), and 0 unless that
beats R(0) by `margin` (5% by default), so estimates that are a little off
never make a session slower: at 0 ms RTT step_s is compute alone, and a
poor acceptance rate cannot pay for the extra positions.

The estimate. `Acceptance` keeps a_i per position as an exponentially
weighted mean of what steps that reached position i saw: 1 for an accepted
draft, 0 for the refused one, positions after it unseen. A position never
seen takes the rate of the deepest one seen (drafts inside a copied run
tend to be accepted alike); before anything is seen a_i is `prior`. A
session at k = 0 still learns: the tail drafts in the shadow (`Shadow`)
and observes whether (greedy) or with what probability (sampling: p(d),
the acceptance probability itself) each shadow draft would have been
accepted, as the real tokens arrive. With the coupled rule of
dgr.speculative.accept a draft is accepted exactly when the sampled token equals
it, so the shadow reaches position j exactly when a real step would, and
p(d_j) there is the real step's acceptance probability: the estimate it
feeds is the one real steps would feed (for greedy, the very same values).

Pure: values in, values out; no clock, no I/O. The trip and compute
figures come from the route's measurements (the ring's per-hop times).

Left out: what extra positions cost the other sessions batched with this
one on a node (a step of k + 1 positions widens the batch for everyone).
"""

from __future__ import annotations

import attrs

__all__ = ["Acceptance", "RouteCost", "Shadow", "expected_tokens", "rate", "choose_k", "K_MAX", "MARGIN"]

K_MAX = 8  # drafts in one step at most: beyond it E(k) barely grows for any rate seen in practice
MARGIN = 0.05  # speculation must beat no speculation by this fraction of R(0)
_WEIGHT = 0.1  # the newest observation's weight in a position's mean


@attrs.frozen
class RouteCost:
    """The measured time terms of the model above, in seconds.

    Raises:
        ValueError: a negative term, or a step that takes no time (no rate can be computed).
    """

    step_s: float  # one one-position step around the route: trips and compute
    position_s: float  # one more position in a step, every node's compute together
    draft_s: float = 0.0  # drafting one token

    def __attrs_post_init__(self) -> None:
        if not (self.step_s > 0.0 and self.position_s >= 0.0 and self.draft_s >= 0.0):
            raise ValueError(f"bad route cost {self}")

    def step_time(self, k: int) -> float:
        return self.step_s + k * (self.position_s + self.draft_s)


@attrs.frozen
class Acceptance:
    """Per-position acceptance estimates a_1, a_2, ... (index 0 is draft 1)."""

    rates: tuple[float, ...] = ()
    prior: float = 0.5
    weight: float = _WEIGHT

    def rate_at(self, i: int) -> float:
        """a_i for draft i (1-based)."""
        if i <= len(self.rates):
            return self.rates[i - 1]
        return self.rates[-1] if self.rates else self.prior

    def observe(self, position: int, value: float) -> Acceptance:
        """One observation at draft `position` (1-based): 1 accepted, 0 refused, or an acceptance probability."""
        if position < 1 or not 0.0 <= value <= 1.0:
            raise ValueError(f"observation {value} at position {position}")
        rates = list(self.rates)
        while len(rates) < position:  # a first sight starts from what the model assumed there
            rates.append(self.rate_at(len(rates) + 1))
        rates[position - 1] += self.weight * (value - rates[position - 1])
        return attrs.evolve(self, rates=tuple(rates))

    def after_step(self, k: int, accepted: int) -> Acceptance:
        """A verified step of k drafts of which the first `accepted` were accepted."""
        if not 0 <= accepted <= k:
            raise ValueError(f"{accepted} accepted of {k}")
        out = self
        for i in range(1, accepted + 1):
            out = out.observe(i, 1.0)
        if accepted < k:
            out = out.observe(accepted + 1, 0.0)
        return out


def expected_tokens(acceptance: Acceptance, k: int) -> float:
    """E(k): tokens a step of k drafts emits on average (at least 1)."""
    total, run = 1.0, 1.0
    for i in range(1, k + 1):
        run *= acceptance.rate_at(i)
        total += run
    return total


def rate(acceptance: Acceptance, cost: RouteCost, k: int) -> float:
    """R(k) = E(k) / T(k), tokens a second."""
    return expected_tokens(acceptance, k) / cost.step_time(k)


def choose_k(acceptance: Acceptance, cost: RouteCost, *, k_max: int = K_MAX, margin: float = MARGIN) -> int:
    """The k in 0..k_max with the highest R(k); 0 unless it beats R(0) by `margin`."""
    base = rate(acceptance, cost, 0)
    best_k, best = 0, base
    for k in range(1, k_max + 1):
        r = rate(acceptance, cost, k)
        if r > best:
            best_k, best = k, r
    return best_k if best >= base * (1.0 + margin) else 0


@attrs.frozen
class Shadow:
    """Drafts a k = 0 session would have verified, checked against the tokens it really samples.

    It mirrors a real step of len(drafts) drafts: draft j is judged by the j-th token after the
    drafts were made, while drafts 1..j-1 matched; the first mismatch ends it (that token was the
    correction), and after every draft matched the next token is the bonus, judged by nothing.
    `expecting` says whether the shadow still waits for tokens; once not, the tail drafts a new one
    after the next token it samples.
    """

    drafts: tuple[int, ...] = ()
    matched: int = 0
    bonus_due: bool = False

    @property
    def expecting(self) -> bool:
        return self.matched < len(self.drafts) or self.bonus_due

    def sampled(self, token: int, acceptance: Acceptance, p_draft: float | None = None) -> tuple[Shadow, Acceptance]:
        """The session sampled `token`. p_draft: the target's probability of the draft awaited (sampling);
        None for greedy, where the observation is whether the token is the draft."""
        if self.bonus_due:
            return Shadow(), acceptance
        if self.matched >= len(self.drafts):
            return self, acceptance
        want = self.drafts[self.matched]
        hit = int(token) == want
        value = (1.0 if hit else 0.0) if p_draft is None else p_draft
        acceptance = acceptance.observe(self.matched + 1, value)
        if not hit:
            return Shadow(), acceptance
        matched = self.matched + 1
        return Shadow(self.drafts, matched, bonus_due=matched == len(self.drafts)), acceptance
