"""Choose the next token from logits: greedy, temperature, top-p, seeded.

One sampler for every backend, run on the tail node, so the same logits give
the same token whatever produced them. Temperature 0 is argmax: greedy and
deterministic.

A seeded sampler draws exactly one uniform a token (a nucleus of one token
too), so its stream's position is the count of tokens it sampled. A route
repaired mid-answer (dgr.tracker.repair) opens its new tail with `drawn`,
the tokens already streamed, and the stream goes on from there, not from
its start: the repaired answer is the uninterrupted one.
"""

from __future__ import annotations

import attrs
import numpy as np

from dgr.errors import CallerError, Reason

__all__ = ["SEED_LIMIT", "SamplingParams", "Sampler", "distribution"]

# Seeds are non-negative int64 values (OpenAI's `seed` is an int64): one bound for the API and nodes.
SEED_LIMIT = 2**63


@attrs.frozen
class SamplingParams:
    """How the tail picks a token. The one validator of sampling parameters, on the gateway and on nodes (an
    open's `sampling`, which dgr.seam.opening writes and reads).

    Raises:
        CallerError(INVALID_REQUEST): a value out of range; `param` names it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # draws the session's seeded stream made already (a repaired route's tail goes on there); an open omits 0
    drawn: int = attrs.field(default=0, metadata={"omit": 0})

    def __attrs_post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 2.0):
            raise CallerError(Reason.INVALID_REQUEST, "temperature must be between 0 and 2", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise CallerError(Reason.INVALID_REQUEST, "top_p must be in (0, 1]", param="top_p")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
            raise CallerError(Reason.INVALID_REQUEST, "'seed' must be an integer in [0, 2^63)", param="seed")
        drawn = self.drawn
        if isinstance(drawn, bool) or not isinstance(drawn, int) or not 0 <= drawn < SEED_LIMIT:
            raise CallerError(Reason.INVALID_REQUEST, "'drawn' must be an integer in [0, 2^63)", param="drawn")


@attrs.define
class Sampler:
    params: SamplingParams
    _rng: np.random.Generator = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = np.random.default_rng(self.params.seed)
        if self.params.drawn:  # PCG64: one step a uniform draw, and `sample` makes one a token
            self._rng.bit_generator.advance(self.params.drawn)

    def sample(self, logits: np.ndarray) -> tuple[int, float]:
        """Return (token, log-probability under the model's distribution). logits: [vocab].

        The log-probability is the model's own (softmax of the raw logits), whatever temperature and top-p
        drew the token.
        """
        ids, probs = distribution(logits, self.params)
        # one draw a token whenever it samples, a nucleus of one too: the stream's position is its token count
        tok = int(ids[0]) if self.params.temperature == 0.0 else int(ids[self._rng.choice(ids.shape[0], p=probs)])
        z = logits.astype(np.float32, copy=False)
        top = float(z.max())
        return tok, float(z[tok]) - (top + float(np.log(np.exp(z - top, dtype=np.float32).sum(dtype=np.float64))))


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The distribution the tail samples a row's token from: (token ids int [m], probabilities float64 [m]).

    Temperature 0 is a point mass on the argmax. Else temperature over float64
    logits, then top-p's nucleus. `Sampler.sample` draws `ids[rng.choice(m, p=probs)]`
    from it; speculative acceptance (dgr.speculative.accept) needs the probabilities themselves.
    """
    z = logits.astype(np.float32, copy=False)
    best = int(np.argmax(z))
    if params.temperature == 0.0:
        return np.array([best]), np.ones(1)
    top = float(z[best])
    # In float64: a float32 division takes a temperature below ~1e-45 as 0, and 0 / 0 is NaN. A tiny
    # one still overflows to -inf for every token but the best, which is right: exp(-inf) is 0.
    with np.errstate(over="ignore"):
        probs = np.exp((z - top).astype(np.float64) / params.temperature)  # [vocab]
    probs /= probs.sum()
    if params.top_p >= 1.0:
        return np.arange(probs.shape[0]), probs
    return _nucleus(probs, params.top_p)


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely tokens whose mass reaches top_p, and their renormalised probabilities.

    Sorting 49k probabilities every token costs milliseconds; the nucleus
    almost always lies among the few tokens within 1e-6 of the best, and
    when those hold at least top_p of the mass the result is exactly what
    a full sort gives (every candidate outranks every other token).
    """
    candidates = np.flatnonzero(probs >= probs.max() * 1e-6)
    if probs[candidates].sum() < top_p:
        candidates = np.arange(probs.shape[0])
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    cum = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cum, top_p) + 1)]
    return keep, probs[keep] / probs[keep].sum()
