"""A tiny random DeepSeek-V4 GGUF with the real model's tensor layout, written in the test itself.

No DeepSeek-V4 weights are needed: dgr.specgen.dsv4_layout describes the model
with its sizes as parameters (the tensor list of llama.cpp's deepseek4 loader,
checked against the planner's fixture of the real 43-layer model), so the
same list at toy sizes becomes a GGUF of random tensors that the vendored
llama.cpp loads and runs. `TINY` keeps what makes the model hard to split:
- mHC: 4 residual streams cross every layer boundary (a seam of 4 x hidden);
- hash routing: layers 0 to 2 pick their experts by the input token id;
- compressed attention: window-only layers 0 and 1, then CSA (4:1 with the
  lightning indexer) and HCA (128:1) layers in turn;
- MTP: one next-token-prediction layer after the trunk;
- routed and shared experts in every layer.
It carries the tiny models' tokenizer and chat template, so dgr serves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dgr.specgen import dsv4_layout as mk
from dgr.testing.tiny_gguf import vocab_size, word_rows, write_layout_gguf

__all__ = ["EXTRA", "TINY", "write_dsv4_gguf"]

TINY = mk.Dims(
    hidden=64, vocab=vocab_size(), layers=6, heads=4, head_dim=128, rope_dim=16, q_lora=32, o_lora=16, o_groups=2,
    experts=4, experts_used=2, experts_shared=1, ff_exp=32, idx_heads=2, idx_dim=128, idx_topk=8,
    window=16, hc=4, hash_layers=3, context=4096, mtp=1,
)  # fmt: skip

# What llama.cpp's deepseek4 loader reads beyond the layout's metadata.
EXTRA = {
    "attention.layer_norm_rms_epsilon": 1e-6,
    "rope.freq_base": 10000.0,
    "attention.compress_rope_freq_base": 160000.0,
    "hyper_connection.epsilon": 1e-6,
    "hyper_connection.sinkhorn_iterations": 20,
    "expert_weights_scale": 1.5,
    "expert_weights_norm": True,
    "expert_gating_func": 4,  # sqrtsoftplus
    "swiglu_clamp_exp": 10.0,
    "leading_dense_block_count": 0,
}

# Everything f32 but the hash table; the planner is checked on structure, not on quant types.
TYPES = {role: "F32" for role in mk.RECIPES["q8_0"]["types"]} | {"hash": "I32"}


def write_dsv4_gguf(path: str | Path, d: mk.Dims = TINY) -> dict[str, Any]:
    """The layout at dims `d`, as a random GGUF; returns the layout priced as written (recipe "f32").

    With the tiny vocabulary (d.vocab == vocab_size()) the file gets its tokenizer, and the output
    rows of control and byte pieces are scaled down, so that greedy text is words.
    """
    vocab = d.vocab == vocab_size()
    rows = word_rows()[:, None] if vocab else 1.0  # numpy [vocab, 1]

    def value(name: str, role: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
        if role == "hash":
            return rng.integers(0, d.experts, shape, dtype=np.int32)
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        data = rng.standard_normal(shape) * 0.2  # large enough that every layer moves the greedy tokens
        if name == "output.weight":
            data = data * rows
        return data.astype(np.float32)

    return write_layout_gguf(mk.layout(d), path, extra=EXTRA, types=TYPES, value=value, vocab=vocab)
