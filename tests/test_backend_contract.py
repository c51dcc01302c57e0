"""The backend contract in three parts (dgr.backends.base): every backend is all three, a GGUF's text is a
Vocabulary alone, and the step scheduler drives a backend that is nothing but Compute."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from dgr.backends.base import Compute, LayerRange, PrefixSlots, ShardBackend, Step, Vocabulary
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Reason
from dgr.node.scheduler import StepScheduler


def test_every_backend_is_all_three_parts_and_a_gguf_vocabulary_is_one() -> None:
    from dgr.backends.gguf_text import GgufText
    from dgr.backends.llama import LlamaBackend
    from dgr.backends.llama_shard import LlamaShardBackend

    for cls in (StubBackend, LlamaBackend, LlamaShardBackend):
        assert issubclass(cls, ShardBackend) and all(issubclass(cls, p) for p in (Compute, PrefixSlots, Vocabulary))
    assert issubclass(GgufText, Vocabulary) and not issubclass(GgufText, (Compute, PrefixSlots))


def test_a_vocabulary_must_say_what_a_token_is() -> None:
    class Half(Vocabulary):  # tokenizes, but names no token's bytes and no end of generation
        def tokenize(self, text, *, add_special, parse_special):
            return [1]

        def render_chat(self, messages):
            return ""

    with pytest.raises(TypeError, match="is_eog"):
        Half()


class _OnlyCompute(Compute):
    """Layers 0:2 that sum their inputs: no vocabulary, no prefix slots."""

    def __init__(self) -> None:
        self.info, self.layers, self.name = StubSpec().info(), LayerRange(0, 2), "only-compute"
        self.held: dict[str, int] = {}

    def open_session(self, sid, max_positions, lane=None):
        self.held[sid] = 0

    def close_session(self, sid):
        self.held.pop(sid, None)

    def forward(self, sid, pos0, token_ids, hidden, want_logits):
        if sid not in self.held:
            raise CallerError(Reason.UNKNOWN_SESSION, sid)
        self.held[sid] += len(token_ids)
        return np.full((len(token_ids), self.info.seam_width), float(sum(token_ids)), np.float32)

    def positions_computed(self, sid):
        return self.held[sid]

    def kv_bytes(self):
        return sum(self.held.values())

    def session_count(self):
        return len(self.held)


async def test_the_step_scheduler_needs_nothing_but_compute(nursery) -> None:
    backend = _OnlyCompute()
    sched = StepScheduler(backend)
    await nursery.start(sched.run)
    await sched.call(functools.partial(backend.open_session, "s", 8), sid="s")
    out, compute_s = await sched.forward(Step("s", 0, np.array([3, 4], np.int32), None, False), lambda out: out)
    assert out.shape == (2, backend.info.seam_width) and float(out[0, 0]) == 7.0 and compute_s >= 0
    assert await sched.call(functools.partial(backend.positions_computed, "s"), sid="s") == 2
    await sched.call(functools.partial(backend.close_session, "s"), sid="s")
    assert sched.session_count == 0
