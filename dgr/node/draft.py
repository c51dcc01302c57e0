"""A ring tail's draft model (issue 42, `--draft-model`): drafts from a smaller GGUF sharing the target's vocabulary.

The tail runs it beside its shard, in the scheduler's thread (the one that
owns every llama.cpp context of the node): one sequence per speculating
session, holding the KV of the session's tokens as the draft model saw them.
A step's drafts are the draft model's greedy continuation of the tokens
accepted so far. That is a deterministic function of them, so the tail's
acceptance (the session's own sampler draws each row and a draft stands
while it equals the draw, dgr.speculative.accept) leaves the answer's distribution
the target's, greedy or sampled.

KV: after a step, a session's sequence holds the tokens it was fed, the
accepted ones and the drafts the model fed itself. The next draft drops
them from the first that differs from the session's tokens (a refused
draft), then feeds what is new (the correction or the bonus token) in one
call. The sequence goes when the session ends (`close`, in the same
scheduler job as the shard's own close), so a node ends at 0 KV here too.

Cost: what drafting one token takes, a running mean over single-token
calls, which the tail's choice of k weighs against the trip it saves
(dgr.speculative.adapt `RouteCost.draft_s`).

Left out: draft models run by the tracker, and the model's own MTP layers.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence

import attrs
import numpy as np

from dgr.errors import CallerError, Reason

__all__ = ["DraftModel", "ModelDrafter", "vocabulary_digest"]

_WEIGHT = 0.2  # the newest call's weight in the cost's running mean


class _Model(Protocol):  # what a draft needs of a whole-model backend (dgr.backends.llama.LlamaBackend)
    info: object

    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None: ...
    def close_session(self, sid: str) -> None: ...
    def trim_session(self, sid: str, positions: int) -> None: ...
    def forward(self, sid: str, pos0: int, token_ids: np.ndarray | None, hidden: np.ndarray | None,
                want_logits: int) -> np.ndarray | None: ...
    def max_positions(self) -> int: ...
    def token_bytes(self, token: int) -> bytes: ...
    def close(self) -> None: ...


def vocabulary_digest(vocab_size: int, token_bytes: Callable[[int], bytes]) -> str:
    """A digest of every token's bytes, in id order: two models draft for each other only where it is equal."""
    h = hashlib.sha256(str(vocab_size).encode())
    for t in range(vocab_size):
        piece = token_bytes(t)
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    return h.hexdigest()


@attrs.define
class DraftModel:
    """The node's draft model and its sessions' sequences (every call in the scheduler's thread)."""

    model: _Model
    path: Path
    vocabulary: str  # vocabulary_digest of the model, equal to the target's
    bytes_per_position: int = 0  # KV a position takes, for the node's status
    fed: dict[str, list[int]] = attrs.field(factory=dict)  # session -> the tokens its sequence holds, in order
    # session -> how many of its fed tokens are known to be the session's: the session's tokens at the last
    # draft (they only grow), so each draft compares only what came since
    agreed: dict[str, int] = attrs.field(factory=dict)
    cost_s: float | None = None  # one drafted token, measured
    clock: Callable[[], float] = time.perf_counter

    @classmethod
    def load(cls, path: str | Path, target_vocabulary: str, *, threads: int, n_ctx: int, max_sessions: int
             ) -> DraftModel:
        """Load `path` whole, with llama.cpp.

        Raises:
            CallerError(MODEL_LOAD_FAILED): not a GGUF llama.cpp loads.
            CallerError(INVALID_REQUEST): its vocabulary is not the target's.
        """
        from dgr.backends.llama import LlamaBackend
        from dgr.models import check_gguf_file

        path = check_gguf_file(str(path))
        model = LlamaBackend(path, n_threads=threads, n_ctx=n_ctx, max_sessions=max_sessions)
        mine = vocabulary_digest(model.info.vocab_size, model.token_bytes)
        if mine != target_vocabulary:
            model.close()
            raise CallerError(Reason.INVALID_REQUEST, f"draft model {path.name}: its vocabulary is not the served "
                                                      "model's (a draft must share every token id)")
        return cls(model, path, mine, bytes_per_position=model.engine.kv_bytes_per_position())

    def describe(self) -> dict[str, object]:
        return {"file": self.path.name, "vocabulary": self.vocabulary[:16]}

    def warm(self, sid: str, tokens: Sequence[int]) -> None:
        """Feed a session's prompt before its first draft: at its open, while the route's first hops compute
        the prompt, not on the first decode step's way. Nothing where it drafted already or would not fit."""
        if sid in self.fed or not tokens or len(tokens) >= self.model.max_positions():
            return
        self.model.open_session(sid, self.model.max_positions())
        self.fed[sid] = []
        self.model.forward(sid, 0, np.asarray(tokens, np.int32), None, 0)
        self.fed[sid] = list(tokens)
        self.agreed[sid] = len(tokens)

    def draft(self, sid: str, tokens: Sequence[int], k: int) -> list[int]:
        """The model's k greedy tokens after `tokens` (the session's, prompt and answer); none where they
        would not fit its context."""
        if k <= 0 or not tokens or len(tokens) + k > self.model.max_positions():
            return []
        fed = self.fed.get(sid)
        if fed is None:
            self.model.open_session(sid, self.model.max_positions())
            fed = self.fed[sid] = []
        same = _common_prefix(fed, tokens, self.agreed.get(sid, 0))
        same = min(same, len(tokens) - 1)  # the last token is always fed again: its row drafts the first
        if same < len(fed):
            self.model.trim_session(sid, same)
            del fed[same:]
        new = list(tokens[same:])
        out: list[int] = []
        for i in range(k):
            feed = new if i == 0 else [out[-1]]
            started = self.clock()
            logits = self.model.forward(sid, len(fed), np.asarray(feed, np.int32), None, 1)  # [vocab]
            if len(feed) <= 2:  # a step's usual call; a prompt's first feed is no draft's cost
                took = self.clock() - started
                self.cost_s = took if self.cost_s is None else self.cost_s + _WEIGHT * (took - self.cost_s)
            fed.extend(feed)
            out.append(int(np.argmax(logits)))
        self.agreed[sid] = len(tokens)
        return out

    def close(self, sid: str) -> None:
        """Free `sid`'s sequence (nothing where it never drafted)."""
        self.agreed.pop(sid, None)
        if self.fed.pop(sid, None) is not None:
            self.model.close_session(sid)

    def sessions(self) -> int:
        return len(self.fed)

    def kv_bytes(self) -> int:
        return sum(len(f) for f in list(self.fed.values())) * self.bytes_per_position  # read from the loop too

    def unload(self) -> None:
        self.model.close()


@attrs.define
class ModelDrafter:
    """One session's drafts from the node's draft model, behind the n-gram drafter's calls
    (`extend`, `append`, `draft`), with what a drafted token costs."""

    model: DraftModel
    sid: str
    tokens: list[int] = attrs.field(factory=list)
    free = False  # a draft costs the model's compute: none is made in the shadow

    @property
    def draft_s(self) -> float:
        return self.model.cost_s or 0.0

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def draft(self, k: int) -> list[int]:
        return self.model.draft(self.sid, self.tokens, k)

    def kind(self) -> str:
        return "model"  # one class: the model's guesses, whatever the context

    def warm(self) -> None:
        self.model.warm(self.sid, self.tokens)

    def close(self) -> None:
        self.model.close(self.sid)


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """The length of a's and b's common prefix, given that their first `start` agree."""
    n = min(len(a), len(b))
    for i in range(min(start, n), n):
        if a[i] != b[i]:
            return i
    return n
