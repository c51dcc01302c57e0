"""The sampler: every temperature the API accepts gives a token and a finite log-probability.

Found by the long schemathesis campaign: `temperature: 1.7e-77` became 0 in a
float32 division, the best token's probability 0 / 0, and the route answered
502 "Probabilities contain NaN".
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from dgr.sampling import Sampler, SamplingParams


def _logits(seed: int, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32) * 5


@pytest.mark.parametrize("temperature", [1.7201083409616485e-77, 5e-324, 1e-45, 1e-30])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_tiny_temperature_samples_the_best_token(temperature: float, top_p: float) -> None:
    z = _logits(1)
    tok, logprob = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=3)).sample(z)
    assert tok == int(np.argmax(z)) and math.isfinite(logprob) and logprob <= 0


@given(temperature=st.floats(min_value=0.0, max_value=2.0), top_p=st.floats(min_value=0.01, max_value=1.0),
       seed=st.integers(0, 2**16))
def test_every_accepted_temperature_gives_a_token_and_a_finite_logprob(temperature, top_p, seed) -> None:
    z = _logits(seed, 64)
    tok, logprob = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed)).sample(z)
    assert 0 <= tok < z.shape[0] and math.isfinite(logprob) and logprob <= 0


@given(seed=st.integers(0, 2**32), cut=st.integers(0, 24), top_p=st.sampled_from([1.0, 0.5, 0.01]),
       temperature=st.sampled_from([0.0, 0.3, 1.0]))
def test_a_seeded_sampler_opened_with_drawn_goes_on_where_the_stream_was(seed, cut, top_p, temperature) -> None:
    """A repaired route's tail (dgr.tracker.repair) samples the tokens the uninterrupted one would: its sampler
    starts `drawn` tokens into the stream, a nucleus of one token counting as a draw too (top_p 0.01)."""
    rows = [_logits(seed + i, 64) for i in range(32)]
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    whole = Sampler(params)
    want = [whole.sample(z)[0] for z in rows]
    resumed = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed, drawn=cut))
    assert [resumed.sample(z)[0] for z in rows[cut:]] == want[cut:]
