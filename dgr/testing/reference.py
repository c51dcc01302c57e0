"""What a route must answer, computed in process from the same backends.

The distributed route is checked against this: the same prompt tokens, the
same greedy sampling and the same text assembly (stop strings, EOS), with no
network in between.
"""

from __future__ import annotations

import attrs

from dgr.api.textstream import TextAssembler
from dgr.backends.base import ShardBackend
from dgr.pipeline import Pipeline

__all__ = ["Expected", "expected_greedy"]


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
