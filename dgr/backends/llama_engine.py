"""The low-level llama.cpp engine: one GGUF, one context, many sessions.

A shard is layers [a, b) of the user's unmodified GGUF, loaded through the
layer-range API that dgr's patch series adds to libllama
(`llama_model_params.layer_start`/`layer_end`, llama/patches/, spec/llama-layer-boundary.md),
and driven through llama-cpp-python's ctypes module:
- input is token ids (head, a == 0) or float32 hidden states via `batch.embd`
  (any later range), the residual stream entering layer a, taken as is;
  that stream is `llama_model_n_embd_inp` wide (DeepSeek-V4: its hc_mult streams), and
  where the model's layers read token ids (`seam_tokens`: DeepSeek-V4's
  hash-routed experts) a later range takes them too, in `batch.token`;
- positions are explicit and continue across chunks and decode steps;
- a range that stops before the last layer (`hidden_out`) outputs the residual
  stream after layer b-1 for every row as embeddings (`llama_get_embeddings`,
  `llama_model_n_embd_out` wide), with no output norm, no LM head and no logits buffer;
- the range that holds the last layer returns the logits of the last position.
The engine knows no architecture: llama.cpp's builders compute the range with
the file's layer numbering, so sliding-window patterns, dense-first layers
and input scaling stay right without any rule here.
A chunk of n_batch positions is one llama_decode call and one ubatch.

Sessions: one llama_context with `n_seq_max` sequences, a seq_id per Route
Session, each with its own KV stream of `n_ctx_seq` cells (kv_unified off).
The KV is allocated once, up front, for the loaded layers of all sequences:
    n_seq_max * n_ctx_seq * n_layer * (n_embd_k_gqa + n_embd_v_gqa) * 2 bytes (f16)
`kv_bytes_per_position` gives the last three factors; for SmolLM2-135M whole it
is 30 * (192 + 192) * 2 = 23,040 bytes, so 2,048 positions cost 45 MiB a session.

Blocking calls only, never two at once: the node's trio driver calls them in
one thread.

Left out: sampling, tokenization (dgr.backends.gguf_text), which
architectures may run a range (dgr.backends.llama_arch), loading the C
libraries and declaring the range API (dgr.backends.clib), the batch's
memory layout (dgr.backends.llama_batch), reading the GGUF header
(dgr.gguf_meta).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dgr.backends.clib import llama_lib, llama_log_tail, model_reads_tokens, range_api, seam_width
from dgr.backends.llama_batch import LlamaBatch
from dgr.backends.placement import Placement
from dgr.errors import CallerError, PeerError, Reason
from dgr.gguf_meta import ARCHITECTURE_KEY, arch_key
from dgr.models import check_gguf_file

__all__ = ["DEFAULT_N_BATCH", "LlamaEngine"]

# Positions per llama_decode call (and per ubatch). Every stage of a route, and the
# single-node model it is compared with, must use the same value: a different
# split of a prefill changes the float sums, so the logits stop being bit-identical.
DEFAULT_N_BATCH = 512
# llama_rope_type values whose rotary embedding has GGML_MROPE_SECTIONS position sections (llama.h)
_MROPE_TYPES = (8, 40)  # LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE
_MROPE_SECTIONS = 4


@attrs.define(eq=False)
class LlamaEngine:
    """A loaded GGUF layer range and one llama_context with `n_seq_max` sequences."""

    path: Path
    layer_start: int  # first layer held, in the file's numbering
    hidden_out: bool  # the range stops before the last layer: hidden states out, no head
    n_threads: int
    n_seq_max: int
    n_ctx_seq: int  # KV cells per sequence (llama.cpp pads to 256)
    n_batch: int  # positions per llama_decode call (= n_ubatch)
    n_layer: int  # layers this engine holds
    n_embd: int  # width of the hidden states in: the seam after layer 0, the model's input width on the head
    n_embd_out: int  # width of the hidden states out (hidden_out): the seam
    seam_tokens: bool  # the model's layers past layer 0 read token ids: every frame of a route carries them
    n_vocab: int
    n_ctx_train: int
    # positions llama.cpp reads per row of a hidden-state batch: 4 (one per M-RoPE section) for
    # M-RoPE models (qwen2vl, qwen35, ...), else 1; a token batch gives one and llama.cpp repeats it
    n_pos_per_row: int = attrs.field(default=1, kw_only=True)
    # the memory keeps per-position cells a sequence can drop from the end (not a recurrent state)
    recurrent: bool = attrs.field(default=False, kw_only=True)
    _model: int | None = attrs.field(repr=False)  # llama_model *
    _ctx: int | None = attrs.field(repr=False)  # llama_context *
    _mem: int | None = attrs.field(repr=False)  # llama_memory_t
    _n_pos: dict[int, int] = attrs.field(factory=dict)  # seq -> positions in KV
    _evaluated: dict[int, int] = attrs.field(factory=dict)  # seq -> positions evaluated since freed
    _batch: LlamaBatch | None = attrs.field(default=None, repr=False)  # the rows every llama_decode call points into

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        layers: tuple[int, int] | None = None,
        n_threads: int,
        n_seq_max: int,
        n_ctx_seq: int,
        n_batch: int = DEFAULT_N_BATCH,
        swa_full: bool = True,
        placement: Placement = Placement(),
    ) -> LlamaEngine:
        """Load layers [start, stop) of the GGUF at `path` (None: all of them) on the devices `placement` names
        (dgr.backends.placement; the CPU by default) and make its context.

        Raises:
            CallerError(MODEL_LOAD_FAILED): llama.cpp refused the file or the
            range, or the installed libllama lacks the layer-range API;
            CallerError(INVALID_REQUEST): a GPU placement this build cannot give.
        """
        p = check_gguf_file(path)
        lib = llama_lib()
        mparams = lib.llama_model_default_params()
        held = placement.apply(mparams)  # the C arrays it points mparams at, held until the model is loaded
        # next-token-prediction layers (DeepSeek-V4, GLM-4.5 MTP) load where the last layer is, for drafting;
        # plain decoding never reads them, and a range that stops earlier skips them
        mparams.load_mtp = True
        if layers is not None:
            range_api()  # refuses a stock build, saying how to get the patched one
            mparams.layer_start, mparams.layer_end = layers
        model = lib.llama_model_load_from_file(str(p).encode(), mparams)
        del held
        if not model:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"llama.cpp cannot load {p}: {llama_log_tail()}")
        n_layer = lib.llama_model_n_layer(model)
        start, stop = (0, n_layer) if layers is None else (layers[0], n_layer if layers[1] < 0 else layers[1])
        hidden_out = stop < n_layer
        seam = seam_width(model, start, stop)
        seam_tokens = model_reads_tokens(model)
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx_seq * n_seq_max
        cparams.n_seq_max = n_seq_max
        cparams.n_batch = cparams.n_ubatch = n_batch  # one ubatch per llama_decode call
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.no_perf = False  # llama_perf_context counts evaluated tokens: an independent check
        cparams.kv_unified = False  # each sequence has its own n_ctx_seq cells
        # llama.cpp's default keeps sliding-window caches full-size, so that a sequence can drop positions
        # anywhere (prefix reuse); False sizes them to the window plus a batch
        cparams.swa_full = swa_full
        # llama-cpp-python's Llama() turns flash attention off; AUTO turns it on for CPU and rounds
        # differently, so the same prompt would decode differently here and there
        cparams.flash_attn_type = llama_lib().LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"llama.cpp cannot make a context for {p}: {llama_log_tail()}")
        self = cls(
            path=p,
            layer_start=start,
            hidden_out=hidden_out,
            n_threads=n_threads,
            n_seq_max=n_seq_max,
            n_ctx_seq=lib.llama_n_ctx_seq(ctx),
            n_batch=lib.llama_n_batch(ctx),
            n_layer=stop - start,
            # a range after layer 0 takes the residual stream; the head, the model's own input width
            n_embd=seam if start > 0 else lib.llama_model_n_embd_inp(model),
            n_embd_out=seam,
            seam_tokens=seam_tokens,
            n_vocab=n_vocab,
            n_ctx_train=lib.llama_model_n_ctx_train(model),
            n_pos_per_row=_MROPE_SECTIONS if lib.llama_model_rope_type(model) in _MROPE_TYPES else 1,
            recurrent=bool(lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model)),
            model=model,
            ctx=ctx,
            mem=lib.llama_get_memory(ctx),
        )
        self._batch = LlamaBatch(self.n_batch, self.n_pos_per_row, self.takes_tokens, ctx)
        return self

    @property
    def takes_tokens(self) -> bool:
        """A range after layer 0 whose layers read token ids: it takes them beside the hidden states."""
        return self.layer_start > 0 and self.seam_tokens

    def _llama_batch(self, n: int, embd: np.ndarray | None) -> Any:
        """A llama_batch over the engine's rows [0, n) (dgr.backends.llama_batch)."""
        return self._batch.view(n, embd)

    # -- evaluation -------------------------------------------------------------
    def eval(
        self,
        seq: int,
        pos0: int,
        tokens: np.ndarray | None,  # int32 [n]
        embd: np.ndarray | None,  # float32 [n, n_embd]
        want_logits: int = 1,
    ) -> np.ndarray | None:
        """Run positions [pos0, pos0 + n) of sequence `seq`, appending to its KV.

        Returns float32 [n, n_embd_out] when hidden_out, else float32 [n_vocab]
        logits of the last position when want_logits is 1 (or True), float32
        [want_logits, n_vocab] of the last rows for more, else None.

        Raises:
            CallerError(POSITION_DISCONTINUITY | CONTEXT_LENGTH_EXCEEDED | WRONG_WIDTH | WRONG_SIZE |
            INVALID_REQUEST)
            PeerError(NODE_AT_CAPACITY | INTERNAL): llama_decode failed.
        """
        if not (0 <= seq < self.n_seq_max):
            raise CallerError(Reason.INVALID_REQUEST, f"seq {seq} outside 0..{self.n_seq_max - 1}")
        if self.takes_tokens:
            if tokens is None or embd is None:
                raise CallerError(Reason.INVALID_REQUEST, self._needs_tokens())
        elif (tokens is None) == (embd is None):
            raise CallerError(Reason.INVALID_REQUEST, "give exactly one of token ids or hidden states")
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
            n = tokens.shape[0]
            if n and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
                raise CallerError(Reason.INVALID_REQUEST, f"token ids must lie in [0, {self.n_vocab})")
        if embd is not None:
            embd = np.ascontiguousarray(embd, dtype=np.float32)
            if embd.ndim != 2 or embd.shape[1] != self.n_embd:
                raise CallerError(
                    Reason.WRONG_WIDTH, f"hidden states must be [n, {self.n_embd}], got {list(embd.shape)}"
                )
            if tokens is not None and tokens.shape[0] != embd.shape[0]:
                raise CallerError(Reason.WRONG_SIZE, f"{tokens.shape[0]} token ids for {embd.shape[0]} hidden rows")
            n = embd.shape[0]
        have = self._n_pos.get(seq, 0)
        if pos0 != have:
            raise CallerError(
                Reason.POSITION_DISCONTINUITY, f"seq {seq}: pos0 {pos0} but {have} positions are in its KV"
            )
        if n == 0:
            raise CallerError(Reason.INVALID_REQUEST, "no positions to evaluate")
        if have + n > self.n_ctx_seq:
            raise CallerError(
                Reason.CONTEXT_LENGTH_EXCEEDED, f"seq {seq}: {have + n} positions exceed {self.n_ctx_seq}"
            )
        rows = int(want_logits)
        last = n - (n - 1) // self.n_batch * self.n_batch  # rows in the last chunk
        if rows > last:
            raise CallerError(Reason.INVALID_REQUEST, f"logits of {rows} rows: the last chunk of {n} has {last}")
        b = self._batch
        parts: list[np.ndarray] = []  # hidden_out: float32 [m, n_embd_out] per chunk
        for i in range(0, n, self.n_batch):
            m = min(self.n_batch, n - i)
            if tokens is not None:
                b.token[:m] = tokens[i : i + m]
            b.pos[:m] = np.arange(pos0 + i, pos0 + i + m, dtype=np.int32)
            b.seq[:m] = seq
            b.logits[:m] = 0  # a hidden_out context outputs every row whatever these say
            if i + m == n and rows and not self.hidden_out:
                b.logits[m - rows : m] = 1
            self._decode(seq, pos0 + i, m, self._llama_batch(m, None if embd is None else embd[i : i + m]))
            if self.hidden_out:
                parts.append(self._take_hidden(m))
            self._n_pos[seq] = pos0 + i + m
            self._evaluated[seq] = self._evaluated.get(seq, 0) + m
        if self.hidden_out:
            return parts[0] if len(parts) == 1 else np.concatenate(parts)  # float32 [n, n_embd_out]
        if not rows:
            return None
        if rows == 1:
            ptr = llama_lib().llama_get_logits_ith(self._ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()  # float32 [n_vocab]
        out = np.empty((rows, self.n_vocab), np.float32)  # float32 [rows, n_vocab]
        for r in range(rows):
            ptr = llama_lib().llama_get_logits_ith(self._ctx, last - rows + r)
            out[r] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return out

    def eval_many(
        self,
        rows: list[tuple[int, int, int | None, np.ndarray | None, bool]],  # (seq, pos, token, embd [n_embd], want)
    ) -> list[np.ndarray | None]:
        """One position for each of several sequences, as one llama_decode call.

        Each row is (seq, pos, token id or None, float32 [n_embd] hidden state
        or None, want_logits); seqs are distinct and every row gives the same
        kind of input. Returns, in row order, float32 [1, n_embd] per row when
        hidden_out, else float32 [n_vocab] logits for rows that want them and
        None for the others.

        Rows are laid out by ascending seq id: with one KV stream per sequence
        llama.cpp splits a batch into ubatches of consecutive seq ids
        (llama_batch_allocr::split_equal, sequential), each computed as one
        graph; outputs come back in batch order. Every sequence attends only
        to its own stream, so each row's answer is the one `eval` gives for it
        alone.

        Raises:
            CallerError(INVALID_REQUEST | POSITION_DISCONTINUITY | CONTEXT_LENGTH_EXCEEDED | WRONG_WIDTH)
            PeerError(NODE_AT_CAPACITY | INTERNAL): llama_decode failed; no row was applied.
        """
        m = len(rows)
        if m == 0 or m > self.n_batch:
            raise CallerError(Reason.INVALID_REQUEST, f"{m} rows: a batch holds 1 to {self.n_batch}")
        order = sorted(range(m), key=lambda i: rows[i][0])
        seqs = [rows[i][0] for i in order]
        if len(set(seqs)) != m:
            raise CallerError(Reason.INVALID_REQUEST, "one row per sequence in a batch")
        by_token = rows[0][3] is None  # else by hidden state (and token id, where the range takes both)
        b = self._batch
        embd = None if by_token else np.empty((m, self.n_embd), np.float32)  # float32 [m, n_embd]
        for j, i in enumerate(order):
            seq, pos, token, row, want = rows[i]
            if not (0 <= seq < self.n_seq_max):
                raise CallerError(Reason.INVALID_REQUEST, f"seq {seq} outside 0..{self.n_seq_max - 1}")
            if self.takes_tokens and (token is None or row is None):
                raise CallerError(Reason.INVALID_REQUEST, self._needs_tokens())
            if (row is None) != by_token or (token is not None) != (by_token or self.takes_tokens):
                raise CallerError(Reason.INVALID_REQUEST, "every row gives a token id, or every row a hidden state")
            have = self._n_pos.get(seq, 0)
            if pos != have:
                raise CallerError(
                    Reason.POSITION_DISCONTINUITY, f"seq {seq}: pos0 {pos} but {have} positions are in its KV"
                )
            if have + 1 > self.n_ctx_seq:
                raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"seq {seq}: {have + 1} positions exceed {self.n_ctx_seq}")
            if token is not None:
                if not 0 <= token < self.n_vocab:
                    raise CallerError(Reason.INVALID_REQUEST, f"token ids must lie in [0, {self.n_vocab})")
                b.token[j] = token
            if not by_token:
                if np.shape(row) not in ((self.n_embd,), (1, self.n_embd)):
                    raise CallerError(Reason.WRONG_WIDTH, f"hidden states must be [{self.n_embd}], got {list(np.shape(row))}")
                embd[j] = np.reshape(row, -1)
            b.pos[j] = pos
            b.seq[j] = seq
            b.logits[j] = 1 if want else 0
        batch = self._llama_batch(m, embd)
        self._decode_rows(seqs, [rows[i][1] for i in order], batch)
        hidden = self._take_hidden(m) if self.hidden_out else None
        out: list[np.ndarray | None] = [None] * m
        for j, i in enumerate(order):
            seq = seqs[j]
            self._n_pos[seq] = rows[i][1] + 1
            self._evaluated[seq] = self._evaluated.get(seq, 0) + 1
            if hidden is not None:
                out[i] = hidden[j : j + 1].copy()  # float32 [1, n_embd_out]
            elif rows[i][4]:
                ptr = llama_lib().llama_get_logits_ith(self._ctx, j)
                out[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()  # float32 [n_vocab]
        return out

    def _decode_rows(self, seqs: list[int], positions: list[int], batch: Any) -> None:
        lib = llama_lib()
        rc = self._batch.submit(self._ctx, batch)
        lib.llama_synchronize(self._ctx)
        if rc != 0:
            # llama.cpp has taken back what it placed of this batch: every row stays where it was
            for seq, pos in zip(seqs, positions):
                self._n_pos[seq] = pos
            reason = Reason.NODE_AT_CAPACITY if rc == 1 else Reason.INTERNAL
            raise PeerError(reason, f"llama_decode failed ({rc}) on seqs {seqs}: {llama_log_tail()}")

    def _decode(self, seq: int, pos: int, m: int, batch: Any) -> None:
        lib = llama_lib()
        rc = self._batch.submit(self._ctx, batch)
        lib.llama_synchronize(self._ctx)  # also settles llama.cpp's perf counters for this call
        if rc != 0:
            # llama.cpp has removed this chunk's positions [pos, ...) from the KV.
            self._n_pos[seq] = pos
            reason = Reason.NODE_AT_CAPACITY if rc == 1 else Reason.INTERNAL
            raise PeerError(reason, f"llama_decode failed ({rc}) on seq {seq}: {llama_log_tail()}")

    def _take_hidden(self, m: int) -> np.ndarray:
        """The hidden states of the last llama_decode, one row per batch row: float32 [m, n_embd_out]."""
        ptr = llama_lib().llama_get_embeddings(self._ctx)  # a range that ends early outputs every row
        if not ptr:
            raise PeerError(Reason.INTERNAL, f"llama_get_embeddings gave nothing: {llama_log_tail()}")
        return np.ctypeslib.as_array(ptr, shape=(m, self.n_embd_out)).copy()

    def _needs_tokens(self) -> str:
        return (f"layers {self.layer_start}.. of this model read token ids: every row takes its token id "
                "beside its hidden state")

    # -- sessions ---------------------------------------------------------------
    def seq_rm(self, seq: int) -> None:
        """Free sequence `seq`'s KV. Idempotent."""
        llama_lib().llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._n_pos.pop(seq, None)
        self._evaluated.pop(seq, None)

    def seq_copy(self, src: int, dst: int) -> None:
        """Make `dst` a copy of `src`'s whole KV (positions and all).

        With kv_unified off each sequence has its own stream, and llama.cpp copies a whole stream's
        buffers (only whole-sequence copies are allowed across streams) at the next llama_decode;
        the cells' positions are copied now, so `truncate` may follow at once.
        """
        lib = llama_lib()
        lib.llama_memory_seq_rm(self._mem, dst, -1, -1)
        lib.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._n_pos[dst] = self._n_pos.get(src, 0)
        self.reset_evaluated(dst)

    def reset_evaluated(self, seq: int) -> None:
        """Count `seq`'s evaluated positions from zero: a session that reuses a prefix evaluated none of it."""
        self._evaluated[seq] = 0

    def state_get(self, seq: int) -> bytes:
        """Sequence `seq`'s KV state (cells, positions, K and V of every layer), free of this context's shape.

        llama.cpp writes 8 bytes of its own (kept as they are), a u32 stream count, then per stream
        a u32 cell count and, where it is not zero, that stream's cells. With a stream per sequence only `seq`'s is not empty, and the
        reader puts it in the stream of the sequence it loads into, whatever its index; so what is
        kept is that one stream's part, and `state_set` wraps it for its own stream count (a node
        restarted with another --max-sessions still loads it).
        """
        lib = llama_lib()
        size = lib.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        data = bytes(buf[: lib.llama_state_seq_get_data(self._ctx, buf, size, seq)])
        n = self.n_seq_max
        head, tail = data[8 : 12 + 4 * seq], data[len(data) - 4 * (n - seq - 1) :] if seq < n - 1 else b""
        if head != n.to_bytes(4, "little") + bytes(4 * seq) or tail != bytes(len(tail)):
            raise CallerError(Reason.INTERNAL, "llama.cpp's sequence state is not laid out as expected")
        return data[:8] + data[12 + 4 * seq : len(data) - len(tail)]

    def state_set(self, seq: int, data: bytes, positions: int) -> None:
        """Load `data` (from `state_get` of a context of this file) into sequence `seq`, holding `positions`.

        Raises:
            CallerError(SNAPSHOT_MISMATCH): llama.cpp refused the bytes.
        """
        lib = llama_lib()
        self.seq_rm(seq)
        data = data[:8] + self.n_seq_max.to_bytes(4, "little") + data[8:] + bytes(4 * (self.n_seq_max - 1))
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if lib.llama_state_seq_set_data(self._ctx, buf, len(data), seq) == 0:
            self.seq_rm(seq)
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"llama.cpp refused the sequence state: {llama_log_tail()}")
        held = lib.llama_memory_seq_pos_max(self._mem, seq) + 1  # positions [0, held) are in the loaded cells
        if held != positions:  # a manifest that claims what the bytes do not hold: never believed
            self.seq_rm(seq)
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"the sequence state holds {held} positions, "
                                                        f"its manifest claims {positions}", field="positions")
        self._n_pos[seq] = positions
        self.reset_evaluated(seq)

    def truncate(self, seq: int, positions: int) -> None:
        """Keep only positions [0, positions) of `seq`'s KV.

        Raises:
            CallerError(POSITION_DISCONTINUITY): more positions than `seq` holds.
            CallerError(INVALID_REQUEST): llama.cpp cannot drop the later positions of this model's memory
            (a recurrent state, or DeepSeek-V4's compressor state, keeps no earlier copy); `seq` is unchanged.
        """
        have = self._n_pos.get(seq, 0)
        if not (0 <= positions <= have):
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"seq {seq}: cannot keep {positions} of {have} positions")
        if positions < have and not llama_lib().llama_memory_seq_rm(self._mem, seq, positions, -1):
            raise CallerError(Reason.INVALID_REQUEST,
                              f"seq {seq}: this model's memory cannot drop positions {positions}..{have - 1}")
        self._n_pos[seq] = positions

    def positions(self, seq: int) -> int:
        """Positions now in `seq`'s KV."""
        return self._n_pos.get(seq, 0)

    def evaluated(self, seq: int) -> int:
        """Positions evaluated for `seq` since it was last freed."""
        return self._evaluated.get(seq, 0)

    def tokens_evaluated_total(self) -> int:
        """llama.cpp's own count of tokens it evaluated in this context (perf counters).

        llama.cpp reports its prompt and decode counts as at least 1 each, so
        this is exact once the context has done both a prefill and a decode.
        """
        perf = llama_lib().llama_perf_context(self._ctx)
        return int(perf.n_p_eval + perf.n_eval)

    def kv_bytes_per_position(self) -> int:
        """KV bytes one position costs in this file's layers (f16 K and V).

        Head widths are `attention.key_length` / `value_length` where the file
        sets them (Gemma: 256 where n_embd / n_head is not), else n_embd / n_head.
        """
        lib = llama_lib()
        default = lib.llama_model_n_embd(self._model) // lib.llama_model_n_head(self._model)
        head_k = self._meta_int("attention.key_length") or default
        head_v = self._meta_int("attention.value_length") or default
        return self.n_layer * lib.llama_model_n_head_kv(self._model) * (head_k + head_v) * 2

    def _meta_int(self, key: str) -> int:
        """`{arch}.{key}` of the loaded model as an int; 0 when absent."""
        lib, buf = llama_lib(), ctypes.create_string_buffer(128)
        if lib.llama_model_meta_val_str(self._model, ARCHITECTURE_KEY.encode(), buf, len(buf)) < 0:
            return 0
        key_full = arch_key(buf.value.decode(), key).encode()
        if lib.llama_model_meta_val_str(self._model, key_full, buf, len(buf)) < 0:
            return 0
        try:
            return int(buf.value)
        except ValueError:
            return 0

    def close(self) -> None:
        """Free the context and the model. Idempotent."""
        lib = llama_lib()
        if self._batch is not None:
            self._batch.free()
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None
