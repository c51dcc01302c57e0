"""A llama_batch's memory: numpy arrays, allocated once per engine, that every llama_decode call points into.

Rules:
- The arrays hold `cap` rows (the engine's n_batch); a call fills rows [0, n) and views them as a
  llama_batch (`view`), so no call allocates.
- Token ids go in `token` where rows are tokens, and also beside hidden states where the range takes
  them (`takes_tokens`: DeepSeek-V4's hash-routed experts). Such rows go through upstream's extended
  batch, the form that carries both (llama_batch_ext_set_embd_token): the legacy llama_batch documents
  its token and embd as exclusive. Either kind is decoded by `submit`.
- Hidden-state rows of an M-RoPE model (`n_pos_per_row` > 1) give llama.cpp their positions
  section-major (n rows per section), each section a copy of `pos`, as token rows are broadcast.
- Each row belongs to one sequence (`seq`); `logits` marks the rows whose output is wanted.

Left out: what goes in the rows (dgr.backends.llama_engine) and the library (dgr.backends.clib).
"""

from __future__ import annotations

import ctypes
from typing import Any

import attrs
import numpy as np

from dgr.backends.clib import llama_lib, llama_log_tail
from dgr.errors import PeerError, Reason

__all__ = ["LlamaBatch"]


@attrs.define(eq=False)
class LlamaBatch:
    """Rows for one llama_decode call; filled in place, viewed as a llama_batch."""

    cap: int  # rows: the engine's n_batch
    n_pos_per_row: int  # 4 for M-RoPE models' hidden-state rows, else 1
    takes_tokens: bool  # hidden-state rows carry their token ids too
    ctx: Any = None  # the llama_context: an extended batch is made for it where rows carry both
    token: np.ndarray = attrs.field(init=False)  # int32 [cap]
    pos: np.ndarray = attrs.field(init=False)  # int32 [cap]
    seq: np.ndarray = attrs.field(init=False)  # int32 [cap]
    logits: np.ndarray = attrs.field(init=False)  # int8 [cap]: 1 where the row's output is wanted
    _pos_sections: np.ndarray = attrs.field(init=False)  # int32 [cap * n_pos_per_row], section-major
    _n_seq_id: np.ndarray = attrs.field(init=False)  # int32 [cap]: one sequence a row
    _seq_ptr: np.ndarray = attrs.field(init=False)  # uintp [cap]: row i -> &seq[i]
    _ptrs: dict[str, Any] = attrs.field(init=False, repr=False)  # ctypes pointers into the arrays
    _ext: Any = attrs.field(init=False, default=None, repr=False)  # llama_batch_ext *, made on first use

    def __attrs_post_init__(self) -> None:
        cap = self.cap
        self.token = np.zeros(cap, np.int32)
        self.pos = np.zeros(cap, np.int32)
        self.seq = np.zeros(cap, np.int32)
        self.logits = np.zeros(cap, np.int8)
        self._pos_sections = np.zeros(cap * self.n_pos_per_row, np.int32)
        self._n_seq_id = np.ones(cap, np.int32)
        self._seq_ptr = self.seq.ctypes.data + 4 * np.arange(cap, dtype=np.uintp)  # int32*[cap]
        i32 = ctypes.POINTER(ctypes.c_int32)
        self._ptrs = {
            "token": self.token.ctypes.data_as(i32),
            "pos": self.pos.ctypes.data_as(i32),
            "pos_sections": self._pos_sections.ctypes.data_as(i32),
            "n_seq_id": self._n_seq_id.ctypes.data_as(i32),
            "seq_id": self._seq_ptr.ctypes.data_as(ctypes.POINTER(i32)),
            "logits": self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        }

    def view(self, n: int, embd: np.ndarray | None) -> Any:
        """A llama_batch over the first `n` rows; embd (float32 [n, n_embd], C order) is used in place.

        Its token ids are the token array where embd is None; where the range takes them beside the hidden
        states (`takes_tokens`) it is an extended batch holding both.
        """
        if embd is not None and self.takes_tokens:
            return self._view_ext(n, embd)
        batch = llama_lib().llama_batch()
        ptrs = self._ptrs
        batch.n_tokens = n
        batch.pos = ptrs["pos"]
        if embd is None:
            batch.token = ptrs["token"]
        else:
            batch.embd = embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            if self.n_pos_per_row > 1:
                # llama.cpp reads an embedding row's M-RoPE positions section-major (n rows per section);
                # text rows sit at the same position in every section, as token rows are broadcast
                for k in range(self.n_pos_per_row):
                    self._pos_sections[k * n : (k + 1) * n] = self.pos[:n]
                batch.pos = ptrs["pos_sections"]
        batch.n_seq_id = ptrs["n_seq_id"]
        batch.seq_id = ptrs["seq_id"]
        batch.logits = ptrs["logits"]
        return batch

    def _view_ext(self, n: int, embd: np.ndarray) -> Any:
        """An extended batch of rows [0, n), each its token id with its hidden state (copied by llama.cpp)."""
        lib = llama_lib()
        if self._ext is None:
            self._ext = lib.llama_batch_ext_init(self.ctx)
        ext, width = self._ext, embd.shape[1]
        lib.llama_batch_ext_clear(ext)
        f32, i32 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32)
        for i in range(n):
            idx = lib.llama_batch_ext_add_token(ext, int(self.seq[i]), int(self.token[i]))
            row = lib.llama_embd(ctypes.cast(embd.ctypes.data + 4 * width * i, f32), 1, width)
            if (idx < 0 or not lib.llama_batch_ext_set_embd_token(ext, idx, row)
                    or not lib.llama_batch_ext_set_pos(ext, idx, ctypes.cast(self.pos.ctypes.data + 4 * i, i32))
                    or not lib.llama_batch_ext_set_output_logits(ext, idx, bool(self.logits[i]))):
                raise PeerError(Reason.INTERNAL, f"llama.cpp refused row {i} of a batch ({idx}): {llama_log_tail()}")
        return ext

    def submit(self, ctx: Any, batch: Any) -> int:
        """Decode a batch `view` gave; llama_decode's return code."""
        lib = llama_lib()
        if isinstance(batch, lib.llama_batch):
            return int(lib.llama_decode(ctx, batch))
        return int(lib.llama_process(ctx, lib.LLAMA_PROCESS_TYPE_DECODE, batch))

    def free(self) -> None:
        """Free the extended batch, before its context. Idempotent."""
        if self._ext is not None:
            llama_lib().llama_batch_ext_free(self._ext)
            self._ext = None
