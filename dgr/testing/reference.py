"""What a route must answer, computed in process from the same backends.

The distributed route is checked against this: the same prompt tokens, the
same greedy sampling and the same text assembly (stop strings, EOS), with no
network in between. `split_greedy` is the other side of the layer-range
checks: a model cut into llama_shard stages, chained in process.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from dgr.api.textstream import TextAssembler
from dgr.backends.base import LayerRange, ShardBackend
from dgr.pipeline import Greedy, Pipeline

__all__ = ["Expected", "expected_greedy", "split_greedy"]


@attrs.frozen
class Expected:
    tokens: list[int]
    text: str
    finish_reason: str
    completion_tokens: int


def expected_greedy(stages: list[ShardBackend], prompt: list[int], max_tokens: int,
                    stop: tuple[str, ...] = ()) -> Expected:
    """Greedy completion as the gateway would assemble it."""
    tail = stages[-1]
    tokens = Pipeline(stages).generate_greedy(prompt, max_tokens, sid="0" * 32).tokens
    text = TextAssembler(stop=stop)
    out, used = [], []
    reason = "length"
    for tok in tokens:
        if tail.is_eog(tok):
            reason = "stop"
            break
        used.append(tok)
        out.append(text.feed(tail.token_bytes(tok)))
        if text.stopped:
            reason = "stop"
            break
    out.append(text.finish())
    return Expected(tokens=used, text="".join(out), finish_reason=reason, completion_tokens=len(used))


def split_greedy(model: str | Path, sizes: list[int], prompt: list[int], n_new: int, **backend_kw) -> Greedy:
    """`n_new` greedy tokens, with each step's logits, of `model` cut into llama_shard stages of `sizes` layers.

    `backend_kw` go to each LlamaShardBackend (n_threads, n_ctx, max_sessions, ...); the stages are
    closed before this returns.
    """
    from dgr.backends.llama_shard import LlamaShardBackend

    stages, at = [], 0
    try:
        for n in sizes:
            stages.append(LlamaShardBackend(model, LayerRange(at, at + n), **backend_kw))
            at += n
        return Pipeline(stages).generate_greedy(prompt, n_new, keep_logits=True)
    finally:
        for s in stages:
            s.close()
