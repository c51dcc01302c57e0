"""The "torch" shard backend: dgr's readable reference, over dgr.backends.torch_model.

It meets dgr.backends.base.ShardBackend exactly. Each session owns one
preallocated KVCache for this shard's layers, sized at open_session, written
in place and freed at close_session. A position enters the cache once and is
never computed again; `positions_computed` counts what was evaluated, so
tests can prove it.

`recompute=True` is a baseline for measurement only, never for serving: the
session keeps no KV between calls, every call must resend the whole sequence
from position 0, and each shard recomputes all of it. Its counters show the
quadratic work, and the seam carries the whole sequence at every step.

Text (tokenize, chat template, detokenize, end of generation) is delegated to
dgr.backends.gguf_text.GgufText, imported when first needed so that shards in
the middle of a route never load the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from dgr.backends.base import ChatMessage, LayerRange, ShardBackend
from dgr.seam.types import ModelInfo
from dgr.digest import file_sha256
from dgr.backends.torch_model import KVCache, ShardModel, load_shard
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file
from dgr.sessions import SessionTable

__all__ = ["TorchBackend"]


@attrs.define
class _Session:
    max_positions: int
    cache: KVCache | None  # None in recompute mode: nothing is kept between calls
    positions: int = 0  # positions held in the cache (recompute: sent by the last call)
    computed: int = 0  # positions evaluated over all calls


@attrs.define
class TorchBackend(ShardBackend):
    """Layers [layers.start, layers.stop) of a llama-family GGUF, in float32 PyTorch."""

    model_path: Path = attrs.field(converter=Path)
    layers: LayerRange
    n_threads: int = 1
    capacity: int = 16
    recompute: bool = False  # baseline for benchmarks only
    model_name: str | None = None  # id served by /v1/models; the file's stem by default
    name: str = "torch"
    info: ModelInfo = attrs.field(init=False)
    _model: ShardModel = attrs.field(init=False)
    _table: SessionTable[_Session] = attrs.field(init=False)  # open sessions, and the checks an open meets
    _kept: dict[str, _Session] = attrs.field(init=False, factory=dict)  # kept prefix key -> its KV (dgr.node.prefix)
    _text: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        check_gguf_file(self.model_path)
        torch.set_num_threads(self.n_threads)  # process-wide: torch has one intra-op pool
        self._model = load_shard(self.model_path, self.layers)
        a = self._model.args
        self.info = ModelInfo(
            name=self.model_name or self.model_path.stem,
            architecture=a.arch,
            n_layers=a.n_layers,
            hidden_size=a.dim,
            seam_width=a.dim,
            vocab_size=a.vocab_size,
            context_length=a.context_length,
            digest=file_sha256(self.model_path),  # the identity the llama backends report
            drops_positions=not self.recompute,  # recompute mode runs every step from position 0
            metadata=attrs.asdict(a),
        )
        self._table = SessionTable("this shard", self.capacity, self.max_positions())

    # -- sessions -------------------------------------------------------------
    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None:
        """Raises: CallerError(SESSION_EXISTS | NODE_AT_CAPACITY | CONTEXT_LENGTH_EXCEEDED)."""
        self._table.check_open(sid, max_positions, in_use=len(self._table) + len(self._kept))
        cache = None if self.recompute else self._model.new_cache(max_positions)
        self._table.add(sid, max_positions, _Session(max_positions, cache))

    def close_session(self, sid: str) -> None:
        self._table.pop(sid)

    # -- prefix cache: a kept prefix is an ended session's cache, copied into the next one -------------
    @property
    def prefix_capable(self) -> bool:  # type: ignore[override]
        return not self.recompute  # recompute mode keeps nothing between calls

    def keep_prefix(self, sid: str, key: str, positions: int) -> int:
        s = self._session(sid)
        if not (0 < positions <= s.positions) or s.cache is None:
            raise CallerError(Reason.INVALID_REQUEST, f"cannot keep {positions} of {s.positions} positions")
        self._table.pop(sid)
        s.positions = positions  # the cache rows past it are stale, and overwritten before any read
        self._kept[key] = s
        return positions * self.kv_bytes_per_position()

    def open_from_prefix(self, sid: str, max_positions: int, key: str, positions: int, take: bool,
                         lane: int | None = None) -> None:
        src = self._kept.get(key)
        if src is None or src.cache is None or positions > src.positions:
            raise CallerError(Reason.INVALID_REQUEST, f"no kept prefix {key} of {positions} positions")
        if take:
            del self._kept[key]  # its slot goes to the new session
        self.open_session(sid, max_positions, lane)
        cache = self._table.live[sid].cache
        cache.k[:, :, :positions] = src.cache.k[:, :, :positions]  # [layers, kv_heads, positions, head_dim]
        cache.v[:, :, :positions] = src.cache.v[:, :, :positions]
        self._table.live[sid].positions = positions

    def drop_prefix(self, key: str) -> None:
        self._kept.pop(key, None)

    def rename_session(self, sid: str, new: str) -> None:
        self._table.rename(sid, new)

    def trim_session(self, sid: str, positions: int) -> None:
        s = self._session(sid)
        if not (0 <= positions <= s.positions):
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"cannot keep {positions} of {s.positions} positions")
        s.positions = positions

    def free_slots(self) -> int:
        return self.capacity - len(self._table.live) - len(self._kept)

    def prefix_bytes(self) -> int:
        return sum(s.positions for s in self._kept.values()) * self.kv_bytes_per_position()

    def session_count(self) -> int:
        return len(self._table.live)

    def max_sessions(self) -> int:
        return self.capacity

    def positions_computed(self, sid: str) -> int:
        return self._session(sid).computed

    def kv_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._table.live.values() if s.cache is not None)

    def session_kv_bytes(self, sid: str) -> int:
        """Bytes of the KV cache preallocated for one session (0 in recompute mode)."""
        cache = self._session(sid).cache
        return 0 if cache is None else cache.nbytes

    def kv_bytes_per_position(self) -> int:
        return KVCache.bytes_for(self._model.args, len(self.layers), 1)

    def _session(self, sid: str) -> _Session:
        return self._table.get(sid)

    # -- compute --------------------------------------------------------------
    def _input(self, token_ids: np.ndarray | None, hidden: np.ndarray | None) -> torch.Tensor:
        """Check the boundary and return int64 ids [n] (head) or float32 hidden [n, W].

        Raises: CallerError(BAD_FRAME | WRONG_DTYPE | WRONG_WIDTH).
        """
        if self.is_head:
            if token_ids is None:
                raise CallerError(Reason.BAD_FRAME, f"layers {self.layers} need token ids")
            ids = np.asarray(token_ids)
            if ids.dtype.kind not in "iu":
                raise CallerError(Reason.WRONG_DTYPE, f"token ids must be integers, not {ids.dtype}")
            if ids.ndim != 1 or ids.size == 0:
                raise CallerError(Reason.BAD_FRAME, f"token ids must be [n] with n > 0, got {ids.shape}")
            if ids.min() < 0 or ids.max() >= self.info.vocab_size:
                raise CallerError(Reason.BAD_FRAME, f"token id outside 0..{self.info.vocab_size - 1}")
            return torch.from_numpy(ids.astype(np.int64))
        if hidden is None:
            raise CallerError(Reason.BAD_FRAME, f"layers {self.layers} need hidden states")
        if hidden.dtype != np.float32:
            raise CallerError(Reason.WRONG_DTYPE, f"hidden states must be float32, not {hidden.dtype}")
        w = self.info.seam_width
        if hidden.ndim != 2 or hidden.shape[1] != w or hidden.shape[0] == 0:
            raise CallerError(Reason.WRONG_WIDTH, f"expected hidden [n, {w}] with n > 0, got {hidden.shape}")
        return torch.tensor(hidden)  # a copy: the caller's buffer may be read-only or reused

    @torch.inference_mode()
    def forward(
        self,
        sid: str,
        pos0: int,
        token_ids: np.ndarray | None,  # int32 [n]
        hidden: np.ndarray | None,  # float32 [n, W]
        want_logits: bool,
    ) -> np.ndarray | None:
        """Run positions [pos0, pos0 + n), appending them to the session's KV.

        In recompute mode pos0 must be 0 and the input is the whole sequence.

        Raises:
            CallerError(UNKNOWN_SESSION | POSITION_DISCONTINUITY |
            CONTEXT_LENGTH_EXCEEDED | BAD_FRAME | WRONG_DTYPE | WRONG_WIDTH),
            all before any state changes.
        """
        s = self._session(sid)
        expected = 0 if self.recompute else s.positions
        if pos0 != expected:
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"pos0 {pos0} != {expected} positions held")
        x = self._input(token_ids, hidden)  # [n] or [n, W]
        n = x.shape[0]
        self._table.check_fits(sid, pos0 + n)
        cache = self._model.new_cache(n) if self.recompute else s.cache  # recompute: scratch, dropped after
        h = self._model(x, pos0, cache)  # [n, W]
        s.positions = pos0 + n
        s.computed += n
        if not self.is_tail:
            return h.numpy()
        if not want_logits:
            return None
        rows = int(want_logits)
        logits = self._model.logits(h[-rows:]).numpy()  # [rows, vocab]
        return logits[0] if rows == 1 else logits

    # -- text -----------------------------------------------------------------
    def _gguf_text(self) -> Any:
        if self._text is None:
            # imported here: only shards that meet text pay for the tokenizer
            from dgr.backends.gguf_text import GgufText

            self._text = GgufText.load(self.model_path)
        return self._text

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self._gguf_text().tokenize(text, add_special=add_special, parse_special=parse_special)

    def render_chat(self, messages: list[ChatMessage]) -> str:
        return self._gguf_text().render_chat(messages)

    def tokenize_chat(self, messages: list[ChatMessage]) -> tuple[list[int], str]:
        return self._gguf_text().tokenize_chat(messages)

    def token_bytes(self, token: int) -> bytes:
        return self._gguf_text().token_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self._gguf_text().is_eog(token)

    def close(self) -> None:
        self._table.clear()
        if self._text is not None:
            self._text.close()
            self._text = None

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "layers": str(self.layers),
            "architecture": self.info.architecture,
            "n_layers": self.info.n_layers,
            "hidden_size": self.info.hidden_size,
            "seam_width": self.info.seam_width,
            "n_threads": self.n_threads,
            "recompute": self.recompute,
            "sessions": len(self._table.live),
            "max_sessions": self.capacity,
            "kv_bytes": self.kv_bytes(),
            "kv_bytes_per_position": self.kv_bytes_per_position(),
            "dtype": "float32",
        }
