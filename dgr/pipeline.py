"""An in-process pipeline: backends' compute (dgr.backends.base.Compute) chained in one process, no network.

It is the reference the distributed route is checked against, and the
harness for differential tests and benchmarks: any backends whose layer
ranges tile [0, n) of one model (same ModelInfo.digest) can be chained, and
hidden states pass from one to the next exactly as the seam would carry them.

`prefill` feeds the prompt in chunks, `decode` one token at a position, and
both return the tail's logits of the last position, float32 [vocab].
Positions are explicit; a session is opened on every stage and closed on
every stage, whatever happens.

Left out: sampling beyond greedy argmax, transport, failures of remote nodes.
"""

from __future__ import annotations

import attrs
import numpy as np

from dgr.backends.base import Compute
from dgr.seam.types import ModelInfo
from dgr.errors import CallerError, PeerError, Reason

__all__ = ["Greedy", "Pipeline"]


@attrs.frozen
class Greedy:
    """What generate_greedy produced."""

    tokens: list[int]
    logits: np.ndarray | None  # float32 [n, vocab]: the logits each token was taken from


@attrs.define
class Pipeline:
    """Backends' compute whose layers tile [0, n_layers), head first."""

    stages: list[Compute]

    def __attrs_post_init__(self) -> None:
        if not self.stages:
            raise CallerError(Reason.INVALID_REQUEST, "a pipeline needs at least one stage")
        info = self.stages[0].info
        at = 0
        for s in self.stages:
            if s.info.digest != info.digest:
                raise CallerError(Reason.INVALID_REQUEST, f"stage {s.layers} serves other weights ({s.info.digest[:12]})")
            if s.layers.start != at:
                raise CallerError(Reason.INVALID_REQUEST, f"stage {s.layers} does not start at layer {at}")
            at = s.layers.stop
        if at != info.n_layers:
            raise CallerError(Reason.INVALID_REQUEST, f"stages end at layer {at}, the model has {info.n_layers}")

    @property
    def info(self) -> ModelInfo:
        return self.stages[0].info

    def open(self, sid: str, max_positions: int) -> None:
        """Open `sid` on every stage (all or none)."""
        opened: list[Compute] = []
        try:
            for s in self.stages:
                s.open_session(sid, max_positions)
                opened.append(s)
        except BaseException:
            for s in opened:
                s.close_session(sid)
            raise

    def close(self, sid: str) -> None:
        for s in self.stages:
            s.close_session(sid)

    def forward(self, sid: str, pos0: int, token_ids: np.ndarray, want_logits: bool) -> np.ndarray | None:
        """Positions [pos0, pos0 + n) through every stage; the tail's logits or None."""
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int32)  # [n]
        hidden: np.ndarray | None = None  # float32 [n, W] between stages
        out: np.ndarray | None = None
        for s in self.stages:
            ids = token_ids if (s.is_head or s.info.needs_token_ids) else None
            out = s.forward(sid, pos0, ids, hidden, want_logits)
            hidden = out
        return out

    def prefill(self, sid: str, token_ids: list[int] | np.ndarray, chunk: int = 512, pos0: int = 0) -> np.ndarray:
        """Feed the prompt from position `pos0` (the session holds the ones before) in chunks; float32 [vocab]
        logits of its last token."""
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.size <= pos0 or chunk < 1:
            raise CallerError(Reason.INVALID_REQUEST, "prefill needs tokens and a positive chunk")
        logits = None
        for i in range(pos0, ids.size, chunk):
            last = i + chunk >= ids.size
            logits = self.forward(sid, i, ids[i : i + chunk], want_logits=last)
        return _logits(logits)

    def decode(self, sid: str, token: int, pos: int) -> np.ndarray:
        """One token at position `pos`; float32 [vocab] logits."""
        return _logits(self.forward(sid, pos, np.array([token], dtype=np.int32), want_logits=True))

    def generate_greedy(
        self, prompt_ids: list[int], n: int, *, chunk: int = 512, sid: str = "greedy", keep_logits: bool = False
    ) -> Greedy:
        """Exactly `n` argmax tokens after the prompt (no stop on end-of-generation)."""
        self.open(sid, len(prompt_ids) + n)
        try:
            logits = self.prefill(sid, prompt_ids, chunk)
            tokens: list[int] = []
            kept: list[np.ndarray] = []
            pos = len(prompt_ids)
            for _ in range(n):
                if keep_logits:
                    kept.append(logits)
                tok = int(np.argmax(logits))
                tokens.append(tok)
                if len(tokens) == n:
                    break
                logits = self.decode(sid, tok, pos)
                pos += 1
            return Greedy(tokens=tokens, logits=np.stack(kept) if keep_logits else None)
        finally:
            self.close(sid)


def _logits(out: np.ndarray | None) -> np.ndarray:
    if out is None or out.ndim != 1:
        raise PeerError(Reason.INTERNAL, "the tail stage returned no logits")
    return out  # float32 [vocab]
