"""A llama_batch's memory: numpy arrays, allocated once per engine, that every llama_decode call points into.

Rules:
- The arrays hold `cap` rows (the engine's n_batch); a call fills rows [0, n) and views them as a
  llama_batch (`view`), so no call allocates.
- Token ids go in `token` where rows are tokens, and also beside hidden states where the range takes
  them (`takes_tokens`: DeepSeek-V4's hash-routed experts).
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

from dgr.backends.clib import llama_lib

__all__ = ["LlamaBatch"]


@attrs.define(eq=False)
class LlamaBatch:
    """Rows for one llama_decode call; filled in place, viewed as a llama_batch."""

    cap: int  # rows: the engine's n_batch
    n_pos_per_row: int  # 4 for M-RoPE models' hidden-state rows, else 1
    takes_tokens: bool  # hidden-state rows carry their token ids too
    token: np.ndarray = attrs.field(init=False)  # int32 [cap]
    pos: np.ndarray = attrs.field(init=False)  # int32 [cap]
    seq: np.ndarray = attrs.field(init=False)  # int32 [cap]
    logits: np.ndarray = attrs.field(init=False)  # int8 [cap]: 1 where the row's output is wanted
    _pos_sections: np.ndarray = attrs.field(init=False)  # int32 [cap * n_pos_per_row], section-major
    _n_seq_id: np.ndarray = attrs.field(init=False)  # int32 [cap]: one sequence a row
    _seq_ptr: np.ndarray = attrs.field(init=False)  # uintp [cap]: row i -> &seq[i]
    _ptrs: dict[str, Any] = attrs.field(init=False, repr=False)  # ctypes pointers into the arrays

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

        Its token ids are the token array where embd is None, or where the range takes them beside the
        hidden states (`takes_tokens`).
        """
        batch = llama_lib().llama_batch()
        ptrs = self._ptrs
        batch.n_tokens = n
        batch.pos = ptrs["pos"]
        if embd is None or self.takes_tokens:
            batch.token = ptrs["token"]
        if embd is not None:
            batch.embd = embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            if self.n_pos_per_row > 1 and not self.takes_tokens:
                # llama.cpp reads an embedding row's M-RoPE positions section-major (n rows per section);
                # text rows sit at the same position in every section, as token rows are broadcast
                for k in range(self.n_pos_per_row):
                    self._pos_sections[k * n : (k + 1) * n] = self.pos[:n]
                batch.pos = ptrs["pos_sections"]
        batch.n_seq_id = ptrs["n_seq_id"]
        batch.seq_id = ptrs["seq_id"]
        batch.logits = ptrs["logits"]
        return batch
