"""The llama.cpp backend: a whole GGUF model on one node, head and tail.

`LlamaBackend` runs layers [0, n) of the user's GGUF file as is. The session
bookkeeping, the architecture check and `describe()` are shared with
`LlamaShardBackend` (dgr.backends.llama_shard) through `LlamaCppBackend`.

Architectures: `LlamaBackend` serves whatever architecture the vendored
llama.cpp loads, whole: it runs the file as llama-cpp-python would, with no
layer tricks, and llama.cpp's own refusal (an unknown architecture, a broken
file) becomes CallerError(MODEL_LOAD_FAILED). A layer range
(`LlamaShardBackend`) runs only the architectures proven for ranges, each with
through the layer-range API of dgr's patched libllama (dgr.backends.clib);
dgr.backends.llama_arch refuses, at node start, what the API cannot split.

Sessions: a Route Session id maps to one llama.cpp seq_id of the engine's
context; `max_sessions` seq_ids exist, each with `n_ctx` KV cells, all
allocated at load (see dgr.backends.llama_engine for the bytes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import outcome

from dgr.backends.base import COMPUTE_ERRORS, ChatMessage, LayerRange, ShardBackend, Step, forward_by_rows
from dgr.backends.clib import llama_lib
from dgr.backends.gguf_text import GgufText
from dgr.backends.llama_engine import DEFAULT_N_BATCH, LlamaEngine
from dgr.backends.placement import Placement, devices
from dgr.digest import file_sha256
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import ARCHITECTURE_KEY, GgufHeader, read_header
from dgr.models import check_gguf_file
from dgr.seam.types import MAX_DEVICES, DeviceMemory, ModelInfo
from dgr.sessions import SessionTable

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_N_CTX",
    "LlamaBackend",
    "LlamaCppBackend",
    "WINDOW_SIZED",
    "check_header",
    "default_threads",
]

DEFAULT_N_CTX = 2048
DEFAULT_MAX_SESSIONS = 4
# Architectures whose sliding-window caches are window-sized (llama_context_params.swa_full off), as dgr plan
# prices them. DeepSeek-V4: every layer has a 128-token window, so a full-size cache would cost 1 KiB a token
# a layer (43 GiB a session at 1M context), and its compressor state cannot drop positions anyway, so no prefix
# of it is ever kept or rolled back.
WINDOW_SIZED: frozenset[str] = frozenset({"deepseek4"})


def check_header(path: str | Path) -> GgufHeader:
    """The GGUF's header, if it names the layer count and width a llama.cpp backend reports.

    Whether llama.cpp can run the architecture is its own call, at load.

    Raises:
        CallerError(MODEL_LOAD_FAILED): missing, unreadable, not GGUF, or no
        architecture, block_count or embedding_length.
    """
    p = check_gguf_file(path)
    header = read_header(p)
    if not header.architecture:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has no {ARCHITECTURE_KEY}: {p}")
    if header.n_layer <= 0 or header.n_embd <= 0:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"GGUF of architecture {header.architecture!r} lacks {header.architecture}.block_count or "
            f"embedding_length: {p}",
        )
    return header


class LlamaCppBackend(ShardBackend):
    """Session bookkeeping over one LlamaEngine; subclasses choose the file and layers."""

    source: Path  # the user's full model file
    header: GgufHeader  # of the source
    engine: LlamaEngine
    text: GgufText | None  # head and tail only
    # the text is a vocabulary-only model of its own (GgufText), loaded with the backend: tokenizing never
    # touches the compute context, as llama-server tokenizes in its HTTP threads while its loop decodes
    text_apart = True
    n_threads: int
    n_ctx: int

    def _setup(
        self,
        source: Path,
        header: GgufHeader,
        layers: LayerRange,
        *,
        n_threads: int,
        n_ctx: int,
        max_sessions: int,
        n_batch: int,
        name: str | None,
        placement: Placement = Placement(),
    ) -> None:
        """Load `layers` of `source` where `placement` puts them: the whole model through llama.cpp's own loader, a
        range through the range API."""
        self.source = source
        self.header = header
        self.layers = layers
        self.n_threads = n_threads
        self.n_ctx = n_ctx
        self._kept: dict[str, int] = {}  # kept prefix key -> seq_id (dgr.node.prefix)
        digest = file_sha256(source)  # before loading: a node start reads it from the digest cache
        is_tail = layers.stop == header.n_layer  # self.info does not exist yet
        try:
            self.text = GgufText.load(source) if (layers.start == 0 or is_tail) else None
        except CallerError as exc:
            raise _naming_architecture(exc, header) from None
        try:
            self.engine = LlamaEngine.load(
                source,
                layers=None if layers == LayerRange(0, header.n_layer) else (layers.start, layers.stop),
                n_threads=n_threads,
                n_seq_max=max_sessions,
                n_ctx_seq=n_ctx,
                n_batch=n_batch,
                swa_full=header.architecture not in WINDOW_SIZED,
                placement=placement,
            )
            self.placement = placement
        except BaseException as exc:
            if self.text is not None:
                self.text.close()
            if isinstance(exc, CallerError):
                raise _naming_architecture(exc, header) from None
            raise
        self.info = ModelInfo(
            name=name or source.stem,
            architecture=header.architecture,
            n_layers=header.n_layer,
            hidden_size=header.n_embd,
            seam_width=self.engine.n_embd_out,
            needs_token_ids=self.engine.seam_tokens,
            # DeepSeek-V4's compressor keeps state past its window, as a recurrent memory does
            drops_positions=not (self.engine.recurrent or header.architecture in WINDOW_SIZED),
            vocab_size=self.engine.n_vocab,
            context_length=header.context_length or self.engine.n_ctx_train,
            digest=digest,
            metadata={"quantization": sorted(header.tensor_types)},
        )
        # Route Session id -> seq_id, and the checks an open meets; a seq_id is a slot (a kept prefix holds one too)
        self._table: SessionTable[int] = SessionTable("this shard", self.engine.n_seq_max, self.max_positions())

    # -- sessions -----------------------------------------------------------
    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None:
        """Give `sid` a free seq_id: `lane` if it is one.

        Raises:
            CallerError(SESSION_EXISTS | NODE_AT_CAPACITY | CONTEXT_LENGTH_EXCEEDED)
        """
        self._table.check_open(sid, max_positions, in_use=self._in_use())
        free = self._free_seq(lane)
        self.engine.seq_rm(free)  # a seq_id comes back clean whatever happened before
        self._table.add(sid, max_positions, free)

    def _free_seq(self, prefer: int | None = None) -> int:
        """A seq_id neither a session nor a kept prefix holds: `prefer` if it is one, else the lowest.

        Raises:
            CallerError(NODE_AT_CAPACITY)
        """
        used = set(self._table.live.values()) | set(self._kept.values())
        if prefer is not None and 0 <= prefer < self.engine.n_seq_max and prefer not in used:
            return prefer
        self._table.check_room(len(used))
        return next(s for s in range(self.engine.n_seq_max) if s not in used)

    def _in_use(self) -> int:
        """Slots held: open sessions and kept prefixes."""
        return len(self._table) + len(self._kept)

    # -- prefix cache: a kept prefix is a sequence left in place ---------------------------
    prefix_capable = True

    def keep_prefix(self, sid: str, key: str, positions: int) -> int:
        seq = self._seq(sid)
        if not (0 < positions <= self.engine.positions(seq)):
            raise CallerError(Reason.INVALID_REQUEST, f"cannot keep {positions} of {self.engine.positions(seq)} positions")
        self.engine.truncate(seq, positions)  # first: where it cannot, the session stays open, to be closed
        self._table.pop(sid)
        self._kept[key] = seq
        return positions * self.engine.kv_bytes_per_position()

    def open_from_prefix(self, sid: str, max_positions: int, key: str, positions: int, take: bool,
                         lane: int | None = None) -> None:
        # taken over, the prefix's slot becomes the session's (a copy needs a free one: `_free_seq`)
        self._table.check_open(sid, max_positions, in_use=self._in_use() - (1 if take else 0))
        src = self._kept.get(key)
        if src is None or positions > self.engine.positions(src):
            raise CallerError(Reason.INVALID_REQUEST, f"no kept prefix {key} of {positions} positions")
        if take:
            seq = self._kept.pop(key)
        else:
            seq = self._free_seq(lane)
            self.engine.seq_copy(src, seq)
        self.engine.truncate(seq, positions)
        self.engine.reset_evaluated(seq)
        self._table.add(sid, max_positions, seq)

    def drop_prefix(self, key: str) -> None:
        seq = self._kept.pop(key, None)
        if seq is not None:
            self.engine.seq_rm(seq)

    def rename_session(self, sid: str, new: str) -> None:
        self._table.rename(sid, new)

    def trim_session(self, sid: str, positions: int) -> None:
        self.engine.truncate(self._seq(sid), positions)

    def free_slots(self) -> int:
        return self.engine.n_seq_max - self._in_use()

    snapshot_capable = True

    def export_prefix(self, key: str) -> bytes:
        return self.engine.state_get(self._kept[key])

    def import_prefix(self, key: str, data: bytes, positions: int) -> int:
        seq = self._free_seq()
        self.engine.state_set(seq, data, positions)
        self._kept[key] = seq
        return positions * self.engine.kv_bytes_per_position()

    def prefix_bytes(self) -> int:
        per = self.engine.kv_bytes_per_position()
        return sum(self.engine.positions(seq) * per for seq in self._kept.values())

    def close_session(self, sid: str) -> None:
        seq = self._table.pop(sid)
        if seq is not None:
            self.engine.seq_rm(seq)

    def _seq(self, sid: str) -> int:
        return self._table.get(sid)

    def forward(
        self,
        sid: str,
        pos0: int,
        token_ids: np.ndarray | None,  # int32 [n] (head)
        hidden: np.ndarray | None,  # float32 [n, W] (non-head)
        want_logits: int,
    ) -> np.ndarray | None:
        """Positions [pos0, pos0 + n) through this node's layers.

        Returns float32 [n, W] on a non-tail shard; on the tail the logits of
        the last position (float32 [vocab]) when want_logits is 1 or True, of
        the last rows (float32 [rows, vocab]) for more, else None.

        Raises:
            CallerError(UNKNOWN_SESSION | INVALID_REQUEST | WRONG_WIDTH |
            POSITION_DISCONTINUITY | CONTEXT_LENGTH_EXCEEDED)
            PeerError(NODE_AT_CAPACITY | INTERNAL): llama_decode failed.
        """
        seq, tokens, embd = self._prepare(sid, pos0, token_ids, hidden)
        return self.engine.eval(seq, pos0, tokens, embd, want_logits)

    def _prepare(
        self, sid: str, pos0: int, token_ids: np.ndarray | None, hidden: np.ndarray | None
    ) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """(seq_id, token ids or None, hidden states or None) for a step of `sid`, or its refusal."""
        seq = self._seq(sid)
        if self.is_head:
            if token_ids is None:
                raise CallerError(Reason.INVALID_REQUEST, "the head shard takes token ids")
            n = int(np.size(token_ids))
            tokens, embd = token_ids, None
        else:
            if hidden is None:
                raise CallerError(Reason.INVALID_REQUEST, "a non-head shard takes hidden states")
            n = int(hidden.shape[0])
            tokens, embd = None, hidden
            if self.engine.takes_tokens:  # its layers read them (DeepSeek-V4's hash-routed experts)
                if token_ids is None or int(np.size(token_ids)) != n:
                    raise CallerError(Reason.INVALID_REQUEST, f"layers {self.layers} take a token id beside each hidden state")
                tokens = token_ids
        self._table.check_fits(sid, pos0 + n)
        return seq, tokens, embd

    def forward_batch(self, steps: Sequence[Step]) -> list[outcome.Outcome]:
        """Every one-position step in one llama_decode (one row per sequence); longer ones one by one.

        Each row's answer is bit-identical to `forward` alone: llama.cpp keeps one KV stream per
        sequence here, and a row's matmuls do not depend on the other rows (tests/test_batching.py).
        """
        out: list[outcome.Outcome | None] = [None] * len(steps)
        rows: list[tuple[int, tuple[int, int, int | None, np.ndarray | None, bool]]] = []
        for i, s in enumerate(steps):
            try:
                seq, tokens, embd = self._prepare(s.sid, s.pos0, s.token_ids, s.hidden)
                if s.one_row and s.n_tokens > 1:
                    out[i] = outcome.capture(forward_by_rows, self, s)
                elif s.n_tokens == 1 and len(steps) > 1:
                    token = None if tokens is None else int(np.reshape(tokens, -1)[0])
                    rows.append((i, (seq, s.pos0, token, embd, s.want_logits)))
                else:
                    out[i] = outcome.Value(self.engine.eval(seq, s.pos0, tokens, embd, s.want_logits))
            except COMPUTE_ERRORS as exc:
                out[i] = outcome.Error(exc)
        if len(rows) == 1:  # nothing to batch it with
            (i, (seq, pos, token, embd, want)), = rows
            tokens = None if token is None else np.array([token], np.int32)
            out[i] = outcome.capture(self.engine.eval, seq, pos, tokens, embd, want)
        elif rows:
            try:
                results = self.engine.eval_many([r for _, r in rows])
                for (i, _), r in zip(rows, results):
                    out[i] = outcome.Value(r)
            except COMPUTE_ERRORS as exc:
                for i, _ in rows:
                    out[i] = outcome.Error(exc)
        return out

    def positions_computed(self, sid: str) -> int:
        return self.engine.evaluated(self._seq(sid))

    def kv_bytes(self) -> int:
        per = self.engine.kv_bytes_per_position()
        return sum(self.engine.positions(seq) * per for seq in self._table.live.values())

    def session_count(self) -> int:
        return len(self._table.live)

    def max_sessions(self) -> int:
        return self.engine.n_seq_max

    def max_positions(self) -> int:
        return min(self.engine.n_ctx_seq, self.info.context_length)

    # -- text ------------------------------------------------------------------
    def _text(self) -> GgufText:
        if self.text is None:
            raise CallerError(Reason.INVALID_REQUEST, f"layers {self.layers} are neither head nor tail: no text here")
        return self.text

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self._text().tokenize(text, add_special, parse_special)

    def render_chat(self, messages: list[ChatMessage]) -> str:
        return self._text().render_chat(messages)

    def tokenize_chat(self, messages: list[ChatMessage]) -> tuple[list[int], str]:
        return self._text().tokenize_chat(messages)

    def token_bytes(self, token: int) -> bytes:
        return self._text().token_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self._text().is_eog(token)

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        self._table.clear()
        self._kept.clear()
        self.engine.close()
        if self.text is not None:
            self.text.close()

    def device_memory(self) -> list[DeviceMemory]:
        return [DeviceMemory.from_ggml(d) for d in self.placement.devices_used()[:MAX_DEVICES]]

    def describe(self) -> dict[str, Any]:
        import llama_cpp

        return {
            "backend": self.name,
            "layers": str(self.layers),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_system_info": llama_lib().llama_print_system_info().decode().strip(),
            "architecture": self.info.architecture,
            "n_layers": self.info.n_layers,
            "hidden_size": self.info.hidden_size,
            "context_length": self.info.context_length,
            "quantization": {t: b for t, b in sorted(self.header.tensor_types.items())},  # type -> bytes
            "file": str(self.source),
            "file_size": self.source.stat().st_size,
            "sha256": self.info.digest,
            "layers_loaded": [self.engine.layer_start, self.engine.layer_start + self.engine.n_layer],
            "threads": self.n_threads,
            "placement": self.placement.to_json(),
            "devices": devices() if self.placement.offloads else [],
            "n_batch": self.engine.n_batch,
            "n_ctx_per_session": self.engine.n_ctx_seq,
            "max_sessions": self.engine.n_seq_max,
            "kv_bytes_per_position": self.engine.kv_bytes_per_position(),
            "kv_bytes_allocated": self.engine.kv_bytes_per_position() * self.engine.n_ctx_seq * self.engine.n_seq_max,
            "sessions": len(self._table.live),
        }


def _naming_architecture(exc: CallerError, header: GgufHeader) -> CallerError:
    """llama.cpp's refusal, with the architecture it refused: the first thing a user checks."""
    return CallerError(exc.reason, f"architecture {header.architecture!r}: {exc.message}", **exc.details)


def default_threads() -> int:
    """All cores; with several nodes on one machine pass cores / nodes instead."""
    return max(1, os.cpu_count() or 1)


class LlamaBackend(LlamaCppBackend):
    """A whole GGUF model in one llama.cpp context: layers [0, n), head and tail."""

    name = "llama"

    def __init__(
        self,
        model: str | Path,
        *,
        n_threads: int | None = None,
        n_ctx: int = DEFAULT_N_CTX,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        n_batch: int = DEFAULT_N_BATCH,
        name: str | None = None,
        placement: Placement = Placement(),
    ) -> None:
        """Load `model` whole, on the devices `placement` names. `n_ctx` is positions per session; n_batch,
        positions per llama_decode.

        Raises:
            CallerError(MODEL_LOAD_FAILED): the file is missing, unreadable,
            not GGUF, of an unsupported architecture, or refused by llama.cpp.
        """
        source = check_gguf_file(model).resolve()
        header = check_header(source)
        self._setup(
            source,
            header,
            LayerRange(0, header.n_layer),
            n_threads=n_threads or default_threads(),
            n_ctx=n_ctx,
            max_sessions=max_sessions,
            n_batch=n_batch,
            placement=placement,
            name=name,
        )
