"""The vocabulary of a tiny model's recipe: sizes, typed values, the common metadata keys, one ArchSpec.

One job: what every architecture's tiny model shares, so that a recipe in
dgr.testing.arch_table only states what differs. The metadata follows
llama.cpp's tests/test-llama-archs.cpp: one set of common keys that covers
what every loader reads (`COMMON_KEYS`), with the expert keys of `MOE_KEYS`
for a mixture of experts and `MLA_KEYS` for MLA attention sized as that test
sizes it.

Rules: a key without a "general." / "tokenizer." / "xielu." prefix is the
architecture's own ("{arch}.key"); a value is a plain Python value, a `Typed`
one where its GGUF type is not the default for its Python type, a function of
the model's `Shape` (resolved when the metadata is built), or `DROP`, which
removes a common key. Nothing here touches llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

__all__ = [
    "COMMON_KEYS",
    "DEFAULT_SPLITS",
    "DROP",
    "MLA_KEYS",
    "MOE_KEYS",
    "N_CTX",
    "N_VOCAB",
    "SLIDING_WINDOW",
    "STDEV",
    "ArchSpec",
    "Shape",
    "Typed",
    "Value",
    "flags",
    "heads_by_kind",
    "per_layer",
]

N_VOCAB = 128
N_CTX = 256
SLIDING_WINDOW = 8  # shorter than a test prompt: a shifted local/global pattern shows in the logits
STDEV = 0.1  # test-llama-archs' default


@attrs.frozen
class Shape:
    """The sizes a metadata value may depend on."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int = N_VOCAB

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@attrs.frozen
class Typed:
    """A metadata value whose GGUF type is not the default one for its Python type.

    Default types: bool -> BOOL, int -> UINT32, float -> FLOAT32, str -> STRING,
    lists of these -> arrays of these. `kind` names another one: "u64", "i32",
    "u8" (scalars or lists).
    """

    kind: str
    value: Any


DROP = object()  # an override that removes a common key

Value = Any  # bool | int | float | str | list | Typed | Callable[[Shape], ...] | DROP


def per_layer(fn: Callable[[Shape, int], Any]) -> Callable[[Shape], list[Any]]:
    return lambda s: [fn(s, il) for il in range(s.n_layer)]


def heads_by_kind(pattern: str) -> Callable[[Shape], list[int]]:
    """Per-layer head counts for a hybrid: 0 where `pattern` (cycled) says R, a recurrent layer."""
    return per_layer(lambda s, il: 0 if pattern[il % len(pattern)] == "R" else s.n_head)


def flags(pattern: str, on: str = "S") -> Callable[[Shape], list[bool]]:
    """A per-layer boolean array (e.g. is-sliding-window) from a pattern string, cycled."""
    return per_layer(lambda s, il: pattern[il % len(pattern)] == on)


# -- the metadata ------------------------------------------------------------------------------------
# Keys without a "general." / "tokenizer." / "xielu." prefix are the architecture's own ("{arch}.key").
# test-llama-archs sets every key any loader reads; a loader ignores those it does not know.
COMMON_KEYS: dict[str, Value] = {
    "vocab_size": lambda s: s.n_vocab,
    "context_length": N_CTX,
    "embedding_length": lambda s: s.n_embd,
    "features_length": lambda s: s.n_embd,
    "block_count": lambda s: s.n_layer,
    "leading_dense_block_count": 1,
    "feed_forward_length": lambda s: s.n_ff,
    "use_parallel_residual": False,
    "logit_scale": 1.0,
    "time_mix_extra_dim": 64,
    "time_decay_extra_dim": 128,
    "full_attention_interval": 3,
    "attention.head_count": lambda s: s.n_head,
    "attention.head_count_kv": lambda s: s.n_head_kv,
    "attention.max_alibi_bias": 8.0,
    "attention.clamp_kqv": 1.0,
    "attention.layer_norm_epsilon": 1e-5,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "attention.group_norm_epsilon": 1e-5,
    "attention.group_norm_groups": 8,
    "attention.q_lora_rank": 512,
    "attention.kv_lora_rank": 512,
    "attention.relative_buckets_count": 8,
    "attention.sliding_window": SLIDING_WINDOW,
    # no attention.sliding_window_pattern: each loader's own period applies unless ARCHS sets one
    "attention.indexer.head_count": 64,
    "attention.indexer.key_length": 128,
    "attention.indexer.top_k": 131072,  # every position selected: deterministic, as in test-llama-archs
    "attention.indexer.block_size": 4,
    "attention.indexer.kpool": 4,
    "attention.indexer.kpool_select_tail": True,
    "attention.indexer.local_blocks": 1,
    "rope.dimension_sections": lambda s: [s.head_dim // 4] * 4,
    "posnet.embedding_length": lambda s: s.n_embd,
    "posnet.block_count": lambda s: s.n_layer,
    "convnext.embedding_length": lambda s: s.n_embd,
    "convnext.block_count": lambda s: s.n_layer,
    "xielu.alpha_n": 1.0,
    "xielu.alpha_p": 1.0,
    "xielu.beta": 1.0,
    "xielu.eps": 1e-7,
    "ssm.inner_size": lambda s: 2 * s.n_embd,
    "ssm.conv_kernel": 4,
    "ssm.state_size": 128,
    "ssm.time_step_rank": lambda s: s.n_head,
    "ssm.group_count": 2,
    "kda.head_dim": 128,
    "kda.safe_gate": True,
    "kda.gate_lower_bound": -5.0,
    "wkv.head_size": lambda s: s.head_dim,
    "shortconv.l_cache": 3,
    "residual_scale": 3.5565588200778455,
    "attn_res.block_size": 12,
    "activation.situ_beta": 4.0,
    "activation.situ_linear_beta": 25.0,
    "tokenizer.ggml.model": "test",
    "tokenizer.ggml.tokens": lambda s: [f"tok_{i}" for i in range(s.n_vocab)],
    "tokenizer.ggml.scores": lambda s: [0.0] * s.n_vocab,
}

MOE_KEYS: dict[str, Value] = {
    "expert_feed_forward_length": lambda s: s.n_ff,
    "expert_shared_feed_forward_length": lambda s: s.n_ff // 2,
    "expert_latent_length": lambda s: s.n_ff,
    "interleave_moe_layer_step": 2,
    "expert_count": 4,
    "expert_used_count": 2,
    "expert_shared_count": 1,
    "expert_gating_func": 2,  # sigmoid
    "expert_group_scale": 1.0,
    "experts_per_group": 1,
}

# MLA attention (DeepSeek-2 style), as test-llama-archs sizes it
MLA_KEYS: dict[str, Value] = {
    "attention.key_length": 576,
    "attention.value_length": 512,
    "rope.dimension_count": 64,
    "attention.key_length_mla": 192,
    "attention.value_length_mla": 128,
}

DEFAULT_SPLITS = ((1,), (3,), (2, 4))


@attrs.frozen
class ArchSpec:
    """How to make one architecture's tiny model, and where to cut it.

    moe: "no" (dense only), "optional" (both), "only" (a mixture of experts only).
    splits: each a tuple of boundaries, one layer range per stage: (2, 4) is
    [0, 2) [2, 4) [4, n_layer).
    why: what the boundaries cut (pattern periods, changes of layer kind).
    saver: llama_model_save_to_file supports the architecture (llama_model_saver_supports_arch);
    where it does not, the file is written from the metadata and the created tensors here.
    """

    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 2
    n_head_kv: int | None = None  # None: n_head
    n_ff: int = 384
    moe: str = "no"
    keys: Mapping[str, Value] = attrs.field(factory=dict)
    splits: tuple[tuple[int, ...], ...] = DEFAULT_SPLITS
    why: str = ""
    saver: bool = True
    own_scales: bool = False  # the architecture's own loader asks for per-weight ".scale" tensors (bitnet)
    expect: str = ""  # what dgr's patch series says to expect, where it left the builder unchanged
    mtp: bool = False  # also a variant with one next-token-prediction (MTP) layer after the trunk, ARCH+mtp

