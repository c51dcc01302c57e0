"""Choose the next token from logits: greedy, temperature, top-p, seeded.

One sampler for every backend, run on the tail node, so the same logits give
the same token whatever produced them. Temperature 0 is argmax: greedy and
deterministic.
"""

from __future__ import annotations

import attrs
import numpy as np

from dgr.errors import CallerError, Reason

__all__ = ["SamplingParams", "Sampler"]


@attrs.frozen
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 2.0):
            raise CallerError(Reason.INVALID_REQUEST, "temperature must be between 0 and 2")
        if not (0.0 < self.top_p <= 1.0):
            raise CallerError(Reason.INVALID_REQUEST, "top_p must be in (0, 1]")

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.define
class Sampler:
    params: SamplingParams
    _rng: np.random.Generator = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = np.random.default_rng(self.params.seed)

    def sample(self, logits: np.ndarray) -> tuple[int, float]:
        """Return (token, log-probability under the model's distribution). logits: [vocab]."""
        z = logits.astype(np.float64)
        logp = z - z.max()
        logp -= np.log(np.exp(logp).sum())
        if self.params.temperature == 0.0:
            tok = int(np.argmax(z))
            return tok, float(logp[tok])
        scaled = (z - z.max()) / self.params.temperature
        probs = np.exp(scaled)
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.params.top_p) + 1)]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        tok = int(self._rng.choice(probs.shape[0], p=probs))
        return tok, float(logp[tok])
