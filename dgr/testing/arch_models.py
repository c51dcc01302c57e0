"""Tiny random-weight GGUFs of any architecture the vendored llama.cpp knows, made by llama.cpp itself.

`write_arch_gguf(arch, path, n_layer=..., moe=..., seed=...)` writes no tensor
list of its own. It builds the model's metadata in a gguf_context (ggml's C
GGUF API, through ctypes), hands it to libllama's
`llama_model_init_from_user`, which creates every tensor the architecture's
loader asks for (optional ones included) and has a callback here fill each with
random normal values, then writes the model with `llama_model_save_to_file`
(for the few architectures llama.cpp's saver refuses, or writes incompletely,
the metadata given and the tensors created are written here instead). So each
file holds exactly what the vendored loader of that architecture wants,
whatever its tensor names and shapes; only the per-weight ".scale" /
".input_scale" tensors that llama.cpp's generic NVFP4 pass adds to every
weight of a model made from metadata are left out (meaningless for F32
weights; `scale_tensors=True` keeps them).

The metadata follows llama.cpp's own tests/test-llama-archs.cpp: one set of
common keys that covers what every loader reads (`COMMON_KEYS`, with the
expert keys of `MOE_KEYS` for a mixture of experts), and per architecture the
few overrides it needs (`ARCHS`): a smaller width for MLA attention, per-layer
head counts that make hybrids' recurrent layers, sliding-window pattern
arrays. Unlike that test, the models here have enough layers for a layer range
to cut inside each layer-pattern period and next to each change of layer kind
(the boundaries are kept in the table, `ArchSpec.splits`, for
dgr.bench.certify), and a sliding window of 8 positions, shorter than a test
prompt, so that a range which shifted a local/global pattern would change the
answer; hybrids' splits include stages of one layer kind. The values are
deterministic: a normal(0, stdev) draw seeded by the tensor's name and `seed`,
negative for Mamba's `ssm_a` (state decay).

Left out: a tokenizer (the vocabulary is 128 pieces of llama.cpp's "test"
tokenizer; callers feed token ids), quantized tensors (all F32), realistic
sizes, and architectures that are not decoder-only text models (encoders,
vision, audio, TTS, diffusion and draft models), which are not in `ARCHS`.
"""

from __future__ import annotations

import ctypes
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = [
    "ARCHS",
    "COMMON_KEYS",
    "DROP",
    "MOE_KEYS",
    "ArchSpec",
    "Shape",
    "Typed",
    "arch_metadata",
    "write_arch_gguf",
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


def _per_layer(fn: Callable[[Shape, int], Any]) -> Callable[[Shape], list[Any]]:
    return lambda s: [fn(s, il) for il in range(s.n_layer)]


def _heads_by_kind(pattern: str) -> Callable[[Shape], list[int]]:
    """Per-layer head counts for a hybrid: 0 where `pattern` (cycled) says R, a recurrent layer."""
    return _per_layer(lambda s, il: 0 if pattern[il % len(pattern)] == "R" else s.n_head)


def _flags(pattern: str, on: str = "S") -> Callable[[Shape], list[bool]]:
    """A per-layer boolean array (e.g. is-sliding-window) from a pattern string, cycled."""
    return _per_layer(lambda s, il: pattern[il % len(pattern)] == on)


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
_MLA: dict[str, Value] = {
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


def _a(**kw: Any) -> ArchSpec:
    return ArchSpec(**kw)


_SWA4 = "period 4 (3 sliding, 1 full: layer 3): 1, 2 inside it, 3 sliding->full, 4 full->sliding"
_DENSE_FIRST = "leading dense layer 0 then MoE: 1 dense->MoE; 3 and 2|4 inside"
_PLAIN = "uniform layers: 1, 3 and a 3-stage 2|4"
# Hybrids over 9 layers (R recurrent, A attention), cut inside periods, next to each change of kind, and into
# stages of one kind (which died in llama.cpp, on an input no layer of theirs read, until patch 0002 kept every
# input of a range in its graph). Where the loader makes the pattern
# (full_attention_interval 3): RRA x3. Where per-layer head counts make it (0: recurrent), as in
# test-llama-archs with layer 0 attention: ARR x3.
_RRA = ("RRA x3: 4 inside a period (R|R), 5 recurrent->attention, 3|6 attention->recurrent; "
        "2 (a recurrent-only head), 5|6 (an attention-only middle stage)")  # fmt: skip
_RRA_SPLITS = dict(n_layer=9, splits=((4,), (5,), (3, 6), (2,), (5, 6)))
_HYB = "ARR"
_HYBRID = ("ARR x3: 5 inside a period (R|R), 3|6 recurrent->attention, 4 attention->recurrent; "
           "1 (an attention-only head), 4|6 (a recurrent-only middle stage)")  # fmt: skip
_HYB_SPLITS = dict(n_layer=9, splits=((4,), (5,), (3, 6), (1,), (4, 6)))
_MLA_SIZE = dict(n_embd=128, n_head=1, n_ff=192)
# nemotron_h's MFA cycle: M mamba (no heads, no FFN), F FFN only, A attention only
_AMF_KEYS = {
    "attention.head_count": _per_layer(lambda s, il: 0 if "AMF"[il % 3] == "M" else s.n_head),
    "attention.head_count_kv": _per_layer(lambda s, il: 0 if "AMF"[il % 3] == "M" else s.n_head),
    "feed_forward_length": _per_layer(lambda s, il: s.n_ff if "AMF"[il % 3] == "F" else 0),
}
_AMF_SPLITS = dict(n_layer=9, splits=((4,), (5,), (3, 6), (1,), (4, 5)))
_AMF_WHY = ("AMF x3 (attention, mamba, {ffn}): 4 attention->mamba, 5 mamba->{ffn}, 3|6 {ffn}->attention; "
            "1 an attention-only head, 4|5 a mamba-only middle stage")
_RWKV7 = {  # not in test-llama-archs, which skips RWKV
    "attention.decay_lora_rank": 64,
    "attention.iclr_lora_rank": 64,
    "attention.value_residual_mix_lora_rank": 32,
    "attention.gate_lora_rank": 64,
}

ARCHS: dict[str, ArchSpec] = {
    # -- dense, uniform layers ---------------------------------------------------------------------
    "llama": _a(moe="optional", why=_PLAIN),
    "deci": _a(why=_PLAIN),
    "falcon": _a(why=_PLAIN),
    "gpt2": _a(why=_PLAIN + "; position embeddings on the head only"),
    "gptneox": _a(why=_PLAIN),
    "mpt": _a(why=_PLAIN),
    "baichuan": _a(why=_PLAIN),
    "starcoder": _a(why=_PLAIN),
    "refact": _a(moe="optional", why=_PLAIN),
    "bloom": _a(why=_PLAIN + "; input norm on the head only"),
    "stablelm": _a(why=_PLAIN),
    "qwen": _a(why=_PLAIN),
    "qwen2": _a(why=_PLAIN),
    "qwen2vl": _a(why=_PLAIN),
    "qwen3": _a(n_head=4, n_head_kv=1, why=_PLAIN),
    "qwen3vl": _a(why=_PLAIN),
    "phi2": _a(why=_PLAIN),
    "phi3": _a(why=_PLAIN),
    "plamo": _a(why=_PLAIN),
    "codeshell": _a(why=_PLAIN),
    "orion": _a(why=_PLAIN),
    "internlm2": _a(why=_PLAIN),
    "minicpm": _a(moe="optional", why=_PLAIN),
    "minicpm3": _a(why=_PLAIN),
    "gemma": _a(why=_PLAIN + "; input scaling on the head only"),
    "starcoder2": _a(why=_PLAIN),
    "xverse": _a(why=_PLAIN),
    "command-r": _a(why=_PLAIN),
    "dbrx": _a(moe="only", why=_PLAIN),
    "olmo": _a(why=_PLAIN),
    "openelm": _a(why=_PLAIN),
    "chatglm": _a(why=_PLAIN),
    "glm4": _a(keys={"rope.dimension_sections": DROP}, why=_PLAIN + "; plain RoPE (no sections: GLM-4 text)"),
    "jais": _a(why=_PLAIN),
    "jais2": _a(why=_PLAIN),
    "nemotron": _a(why=_PLAIN),
    "exaone": _a(why=_PLAIN),
    "granite": _a(moe="optional", why=_PLAIN),
    "granitemoe": _a(moe="optional", why=_PLAIN),
    "arcee": _a(why=_PLAIN),
    "ernie4_5": _a(why=_PLAIN),
    "hunyuan-dense": _a(why=_PLAIN),
    "hunyuan_vl": _a(why=_PLAIN),
    "seed_oss": _a(why=_PLAIN),
    "apertus": _a(why=_PLAIN, saver=False),
    "pangu-embedded": _a(why=_PLAIN),
    "mistral3": _a(moe="optional", why=_PLAIN),
    "maincoder": _a(why=_PLAIN),
    "nanbeige": _a(why=_PLAIN),
    "bitnet": _a(why=_PLAIN, saver=False, own_scales=True),
    "cogvlm": _a(why=_PLAIN),
    "paddleocr": _a(moe="only", why=_PLAIN),
    "plm": _a(why=_PLAIN),
    "talkie": _a(why=_PLAIN, expect="second stream: expected to fail or differ"),
    "hrm_text": _a(
        keys={"hrm.layers_per_stack": 1, "hrm.h_cycles": 2, "hrm.l_cycles": 2},
        why="6 cache slots over 2 physical blocks (1 per stack, 2 h-cycles x 3)",
    ),
    # -- sliding-window patterns -------------------------------------------------------------------
    "gemma2": _a(why="period 2 (sliding, full): every boundary cuts a period; input scaling on the head only"),
    "gemma3": _a(
        n_layer=8,
        splits=((3,), (5,), (2, 6)),
        why="period 6 (5 sliding, 1 full: layer 5): 3, 2 inside it, 5 sliding->full, 6 full->sliding",
    ),
    "cohere2": _a(why=_SWA4),
    "exaone4": _a(why=_SWA4),
    "olmo2": _a(why=_SWA4),
    "mellum": _a(moe="only", why=_SWA4),
    "smollm3": _a(why="no RoPE on every 4th layer (3): 1, 2 inside the period, 3 and 4 next to the NoPE layer"),
    "gpt-oss": _a(moe="only", why="period 2 (sliding, full): every boundary cuts a period"),
    "plamo3": _a(
        n_layer=10,
        splits=((3,), (7,), (2, 8)),
        why="period 8 (7 sliding, 1 full: layer 7): 3, 2 inside, 7 sliding->full, 8 full->sliding",
    ),
    "granite_swa": _a(
        keys={"attention.sliding_window_pattern": _flags("SSF")},
        why="sliding pattern SSF: 1 inside, 2 sliding->full, 3 full->sliding, 4 inside",
    ),
    "muse-glimmer": _a(n_head=4, n_head_kv=2, why=_SWA4),
    "afmoe": _a(n_head=4, n_head_kv=2, moe="only", why=_DENSE_FIRST + "; sliding period 4; input scaling on the head"),
    "smallthinker": _a(
        moe="only",
        splits=((3,), (4,), (2, 4), (1,)),
        why="sliding period 4, full first (0, 4 full): 3 inside, 4 sliding->full, 2|4; 1: a full-only head",
    ),
    "laguna": _a(n_embd=160, moe="only", why=_DENSE_FIRST + "; sliding period 4 with layer 0 full"),
    # -- mixtures of experts -----------------------------------------------------------------------
    "llama4": _a(
        n_layer=12,
        moe="only",
        splits=((4,), (5,), (4, 8), (1,), (2, 4)),
        why="MoE on odd layers, NoPE + chunked-attention period 4 (NoPE 3, 7, 11): 4 NoPE->RoPE, 5 inside a period "
        "and dense->MoE; 1 and 2|4: stages without a NoPE layer",
    ),
    "grok": _a(moe="only", why=_PLAIN),
    "qwen2moe": _a(moe="only", why=_PLAIN),
    "qwen3moe": _a(moe="only", why=_PLAIN),
    "qwen3vlmoe": _a(moe="only", why=_PLAIN),
    "phimoe": _a(moe="only", why=_PLAIN),
    "olmoe": _a(moe="only", why=_PLAIN),
    "arctic": _a(moe="only", why=_PLAIN),
    "deepseek": _a(moe="only", why=_DENSE_FIRST),
    "deepseek2": _a(moe="only", keys=_MLA, why=_DENSE_FIRST + "; MLA", **_MLA_SIZE),
    "deepseek32": _a(moe="only", keys=_MLA, why=_DENSE_FIRST + "; MLA, indexer", **_MLA_SIZE),
    "glm4moe": _a(
        moe="only",
        keys={"rope.dimension_sections": DROP},
        mtp=True,
        why=_DENSE_FIRST + "; plain RoPE (no sections: GLM-4.5 text); +mtp: an MTP layer 6 on the tail",
    ),
    "glm-dsa": _a(moe="only", keys=_MLA, why=_DENSE_FIRST + "; MLA, indexer", **_MLA_SIZE),
    "mistral4": _a(moe="only", keys=_MLA, why=_DENSE_FIRST + "; MLA", **_MLA_SIZE),
    "exaone-moe": _a(moe="only", why=_DENSE_FIRST + "; sliding period 4"),
    "bailingmoe": _a(moe="only", why=_DENSE_FIRST),
    "bailingmoe2": _a(moe="only", why=_DENSE_FIRST),
    "dots1": _a(moe="only", why=_DENSE_FIRST),
    "ernie4_5-moe": _a(moe="only", why="dense layer 0, then MoE on every 2nd layer (odd): 1 dense->MoE, 3 and 2|4"),
    "hunyuan-moe": _a(moe="only", why=_PLAIN),
    "hy_v3": _a(moe="only", why=_PLAIN + " (a router in every layer: MoE throughout)"),
    "grovemoe": _a(moe="only", why=_PLAIN),
    "minimax-m2": _a(moe="only", why=_PLAIN),
    "minimax-m3": _a(
        moe="only",
        keys={"rope.dimension_count": 64, "attention.indexer.head_count": 2},  # one indexer head per KV head
        why=_DENSE_FIRST + "; sparse attention",
    ),
    "cohere2moe": _a(
        moe="only",
        keys={"attention.sliding_window_pattern": _flags("FSS", on="S")},
        why=_DENSE_FIRST + "; sliding pattern FSS (1 also full->sliding, 3 sliding->full)",
    ),
    "mimo2": _a(
        moe="only",
        keys={"attention.sliding_window_pattern": _flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "step35": _a(
        n_embd=160,
        moe="only",
        saver=False,
        keys={"attention.sliding_window_pattern": _flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "spark2_5": _a(
        keys={"attention.sliding_window_pattern": _flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "maple": _a(
        moe="only",
        keys={"attention.sliding_window_pattern": _flags("FSS", on="S"), "swiglu_clamp_exp": 7.0},
        splits=((2,), (3,), (2, 4), (1,)),
        why="sliding pattern FSS: 2 inside, 3 sliding->full, 2|4; 1: a full-only head",
    ),
    "dots3note": _a(
        moe="only",
        keys={
            **_MLA,
            "attention.kv_lora_rank_swa": 512,
            "attention.key_length_swa": 576,
            "attention.value_length_swa": 512,
            "attention.key_length_mla_swa": 192,
            "attention.value_length_mla_swa": 128,
            "rope.freq_base_swa": 10000.0,
            "attention.sliding_window_pattern": _per_layer(lambda s, il: il % 2),
            "attention.indexer.types": _per_layer(lambda s, il: 0 if il % 2 else 1),
        },
        splits=((2,), (3,), (2, 4), (1,)),
        why="dense layer 0, MLA, sliding period 2 (full, sliding) with an indexer on full layers: 3 inside a period, "
        "2 sliding->full, 2|4; 1: a full-only head",
        **_MLA_SIZE,
    ),
    # -- recurrent and hybrid ----------------------------------------------------------------------
    "mamba": _a(why="all recurrent: " + _PLAIN),
    "mamba2": _a(why="all recurrent: " + _PLAIN),
    "falcon-h1": _a(why="attention and SSM in parallel in every layer: " + _PLAIN),
    "jamba": _a(
        moe="optional",
        keys={"attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "plamo2": _a(
        keys={
            "attention.head_count": _heads_by_kind(_HYB),
            "attention.head_count_kv": _heads_by_kind(_HYB),
            "ssm.group_count": 0,
        },
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "granitehybrid": _a(
        moe="optional",
        keys={"attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "lfm2": _a(
        keys={"attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "lfm2moe": _a(
        moe="only",
        keys={"attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID + "; dense layer 0",
        **_HYB_SPLITS,
    ),
    "nemotron_h": _a(keys=_AMF_KEYS, why=_AMF_WHY.format(ffn="FFN"), **_AMF_SPLITS),
    "nemotron_h_moe": _a(moe="only", keys=_AMF_KEYS, why=_AMF_WHY.format(ffn="MoE"), **_AMF_SPLITS),
    "qwen3next": _a(moe="only", keys={"ssm.inner_size": 256}, why=_RRA, **_RRA_SPLITS),
    "qwen35": _a(keys={"ssm.inner_size": 256}, why=_RRA, **_RRA_SPLITS),
    "qwen35moe": _a(moe="only", keys={"ssm.inner_size": 256}, why=_RRA, **_RRA_SPLITS),
    "minimax-01": _a(moe="only", why=_RRA, **_RRA_SPLITS),
    "kimi-linear": _a(
        moe="only",
        keys={**_MLA, "attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID + "; MLA, dense layer 0",
        **_MLA_SIZE,
        **_HYB_SPLITS,
    ),
    "bailingmoe3": _a(
        moe="only",
        keys={
            **_MLA,
            "attention.head_count": _heads_by_kind(_HYB),
            "attention.head_count_kv": _heads_by_kind(_HYB),
            "rope.dimension_sections": [8, 12, 12, 0],
            "swiglu_clamp_exp": _per_layer(lambda s, il: 4.0 if il else 0.0),
            "swiglu_clamp_shexp": _per_layer(lambda s, il: 5.0 if il else 0.0),
        },
        why=_HYBRID + "; MLA, dense layer 0",
        **_MLA_SIZE,
        **_HYB_SPLITS,
    ),
    "kimi-k3": _a(
        moe="only",
        keys={**_MLA, "attention.head_count": _heads_by_kind(_HYB), "attention.head_count_kv": _heads_by_kind(_HYB)},
        why=_HYBRID + "; MLA, dense layer 0",
        **_MLA_SIZE,
        **_HYB_SPLITS,
    ),
    "rwkv6": _a(why="all recurrent: " + _PLAIN),
    "rwkv6qwen2": _a(keys={"token_shift_count": 1}, why="all recurrent: " + _PLAIN),
    "rwkv7": _a(
        keys=_RWKV7,
        why="all recurrent: " + _PLAIN,
        expect="second stream (v_first): expected to fail or differ",
    ),
    "arwkv7": _a(
        keys={**_RWKV7, "token_shift_count": 1},
        why="all recurrent: " + _PLAIN,
        expect="second stream (v_first): expected to fail or differ",
    ),
    # -- builders dgr's patch series left unchanged, or with per-layer token inputs -----------------
    "gemma3n": _a(
        n_layer=22,
        n_embd=64,
        n_head=1,
        n_ff=96,
        saver=False,
        splits=((3,), (5,), (10, 20)),
        why="period 5, n_layer_kv_from_start = 20 is hard-coded (22 layers)",
        expect="per-layer token inputs: expected to fail or differ",
    ),
    "gemma4": _a(
        n_layer=5,
        n_embd=128,
        n_head=2,
        n_ff=192,
        keys={
            "embedding_length_per_layer_input": 64,
            "attention.shared_kv_layers": 0,
            "attention.key_length_swa": 64,
            "attention.value_length_swa": 64,
            "rope.freq_base_swa": 10000.0,
            "attention.sliding_window_pattern": _flags("SSSSF"),
        },
        splits=((2,), (4,), (1, 3)),
        saver=False,  # llama_model_save_to_file leaves out embedding_length_per_layer_input
        why="period 5 (4 sliding, 1 full: layer 4)",
        expect="per-layer token inputs: expected to fail or differ",
    ),
    "deepseek4": _a(
        n_layer=6,
        n_embd=512,
        n_head=8,
        n_ff=1024,
        moe="only",
        keys={
            "attention.head_count_kv": 1,
            "attention.key_length": 64,
            "attention.value_length": 64,
            "rope.dimension_count": 32,
            "attention.q_lora_rank": 64,
            "attention.output_group_count": 8,
            "attention.output_lora_rank": 32,
            "attention.compress_ratios": [0, 0, 4, 128, 4, 128],
            "attention.compress_rope_freq_base": 160000.0,
            "hyper_connection.count": 4,
            "hyper_connection.sinkhorn_iterations": 2,
            "hyper_connection.epsilon": 1.0e-6,
            "hash_layer_count": 0,
            "swiglu_clamp_exp": 10.0,
            "expert_weights_scale": 1.0,
            "expert_weights_norm": True,
            "expert_gating_func": 4,
        },
        splits=((1,), (2,), (3,), (1, 4)),
        why="compress ratios 0 0 4 128 4 128: every boundary next to a change (window, CSA, HCA); a seam of "
        "4 x n_embd (hash-routed layers: tests/test_dsv4_route.py)",
    ),
    "hy_v4": _a(
        moe="only",
        keys={
            **_MLA,
            "hyper_connection.count": 4,
            "hyper_connection.epsilon": 1.0e-6,
            "hyper_connection.magnitude": 2.0,
            "swiglu_clamp_exp": 10.0,
            "expert_weights_scale": 1.0,
            "expert_weights_norm": True,
            "attention.indexer.types": _per_layer(lambda s, il: 0 if il % 2 else 1),
        },
        why=_DENSE_FIRST + "; MLA, indexer owned by even layers",
        expect="hyper-connection streams (seam wider than n_embd): expected to fail",
        **_MLA_SIZE,
    ),
}


def _hyper_ple(shape_embd: int) -> dict[str, Value]:
    """qwen4exp / glm5-next: hyper-connections, QSA compression and per-layer n-gram embeddings."""
    ngram, per_ngram = 3, 2
    n_heads = (ngram - 1) * per_ngram
    return {
        "hyper_connection.count": 4,
        "hyper_connection.sinkhorn_iterations": 2,
        "hyper_connection.epsilon": 1.0e-6,
        "hyper_connection.low_rank": 8,
        "attention.compress_ratios": _per_layer(lambda s, il: 4),
        "ple.layers": [0],
        "ple.ngram_size": ngram,
        "ple.heads_per_ngram": per_ngram,
        "ple.conv_kernel": 4,
        "ple.eos_token_id": 0,
        "embedding_length_per_layer_input": shape_embd // n_heads,
        "ple.layer_multipliers": Typed("u64", [1, 3, 5]),
        "ple.head_offsets": lambda s: Typed("u64", [h * s.n_vocab for h in range(n_heads)]),
        "ple.head_vocab_sizes": lambda s: Typed("u64", [s.n_vocab] * n_heads),
    }


ARCHS["qwen4exp"] = _a(
    moe="only",
    keys={**_hyper_ple(256), "ssm.inner_size": 256, "attention.indexer.key_length": 128},
    **_RRA_SPLITS,
    why=_RRA + "; hyper-connections, n-gram embeddings on layer 0 (recurrent)",
    expect="hyper-connection streams (seam wider than n_embd): expected to fail",
)
ARCHS["glm5-next"] = _a(
    moe="only",
    keys={
        **_MLA,
        **_hyper_ple(128),
        "attention.key_length": 512,
        "rope.dimension_count": 0,
        "attention.head_count": 1,
        "attention.head_count_kv": _heads_by_kind("RRA"),
    },
    why=_RRA + "; MLA, hyper-connections, n-gram embeddings on layer 0 (recurrent)",
    **_RRA_SPLITS,
    expect="hyper-connection streams (seam wider than n_embd): expected to fail",
    **_MLA_SIZE,
)


# -- building the gguf_context ---------------------------------------------------------------------
_GGUF = {"u8": 0, "i8": 1, "u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "u64": 10, "i64": 11}
_CT = {
    "u8": ctypes.c_uint8, "i8": ctypes.c_int8, "u32": ctypes.c_uint32, "i32": ctypes.c_int32,
    "f32": ctypes.c_float, "bool": ctypes.c_bool, "u64": ctypes.c_uint64, "i64": ctypes.c_int64,
}  # fmt: skip
_GLOBAL_PREFIXES = ("general.", "tokenizer.", "xielu.")
_LIBS: dict[str, Any] = {}


def _ggml() -> ctypes.CDLL:
    """libggml-base (its own handle) with the gguf writer and tensor functions used here."""
    lib = _LIBS.get("ggml")
    if lib is not None:
        return lib
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    vp, cp, sz, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64
    for name, args, res in [
        ("gguf_init_empty", [], vp),
        ("gguf_free", [vp], None),
        ("gguf_set_val_u32", [vp, cp, ctypes.c_uint32], None),
        ("gguf_set_val_i32", [vp, cp, ctypes.c_int32], None),
        ("gguf_set_val_u64", [vp, cp, ctypes.c_uint64], None),
        ("gguf_set_val_i64", [vp, cp, ctypes.c_int64], None),
        ("gguf_set_val_u8", [vp, cp, ctypes.c_uint8], None),
        ("gguf_set_val_i8", [vp, cp, ctypes.c_int8], None),
        ("gguf_set_val_f32", [vp, cp, ctypes.c_float], None),
        ("gguf_set_val_bool", [vp, cp, ctypes.c_bool], None),
        ("gguf_set_val_str", [vp, cp, cp], None),
        ("gguf_set_arr_data", [vp, cp, ctypes.c_int, vp, sz], None),
        ("gguf_set_arr_str", [vp, cp, ctypes.POINTER(cp), sz], None),
        ("gguf_set_kv", [vp, vp], None),
        ("gguf_add_tensor", [vp, vp], None),
        ("gguf_write_to_file", [vp, cp, ctypes.c_bool], ctypes.c_bool),
        ("gguf_init_from_file", [cp, _GgufInitParams], vp),
        ("gguf_get_n_tensors", [vp], i64),
        ("gguf_get_tensor_name", [vp, i64], cp),
        ("ggml_get_tensor", [vp, cp], vp),
        ("ggml_free", [vp], None),
        ("ggml_get_name", [vp], cp),
        ("ggml_nelements", [vp], i64),
        ("ggml_nbytes", [vp], sz),
        ("ggml_backend_tensor_set", [vp, vp, sz, sz], None),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _LIBS["ggml"] = lib
    return lib


def _llama() -> Any:
    """libllama (llama-cpp-python's handle, backend initialised, log captured by dgr) with what is used here."""
    lib = _LIBS.get("llama")
    if lib is not None:
        return lib
    import llama_cpp.llama_cpp as llama

    from dgr.backends.clib import llama_lib, range_api

    llama_lib()  # backend init and dgr's log callback
    lib = range_api()
    for name, args, res in [
        (
            "llama_model_init_from_user",
            [ctypes.c_void_p, llama.llama_model_set_tensor_data_t, ctypes.c_void_p, llama.llama_model_params],
            ctypes.c_void_p,
        ),
        ("llama_model_save_to_file", [ctypes.c_void_p, ctypes.c_char_p], None),
        ("llama_model_free", [ctypes.c_void_p], None),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _LIBS["llama"] = lib
    return lib


def _resolve(value: Value, shape: Shape) -> Any:
    while callable(value) and not isinstance(value, Typed):
        value = value(shape)
    return value


def arch_metadata(
    arch: str, *, n_layer: int | None = None, moe: bool = False, mtp: bool = False
) -> tuple[dict[str, Any], Shape]:
    """The full metadata of `arch`'s tiny model: {full key: value (Typed where not the default type)}.

    Raises:
        ValueError: `arch` is not in ARCHS, it has no (or only a) MoE variant, or n_layer < 2.
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"no tiny-model recipe for architecture {arch!r}; known: {', '.join(sorted(ARCHS))}")
    if moe and spec.moe == "no":
        raise ValueError(f"{arch} has no mixture-of-experts variant")
    n = spec.n_layer if n_layer is None else n_layer
    if mtp and not spec.mtp:
        raise ValueError(f"{arch} has no MTP variant")
    if n < 2:
        raise ValueError(f"n_layer must be at least 2, got {n}")
    # an MTP layer follows the trunk: block_count counts it, nextn_predict_layers says it is one
    shape = Shape(n_layer=n + int(mtp), n_embd=spec.n_embd, n_head=spec.n_head,
                  n_head_kv=spec.n_head if spec.n_head_kv is None else spec.n_head_kv, n_ff=spec.n_ff)  # fmt: skip
    merged: dict[str, Value] = dict(COMMON_KEYS)
    if moe or spec.moe == "only":
        merged.update(MOE_KEYS)
    merged.update(spec.keys)
    if mtp:
        merged["nextn_predict_layers"] = 1
    out: dict[str, Any] = {"general.architecture": arch}
    for key, value in merged.items():
        if value is DROP:
            continue
        full = key if key.startswith(_GLOBAL_PREFIXES) else f"{arch}.{key}"
        out[full] = _resolve(value, shape)
    return out, shape


def _set(g: ctypes.CDLL, ctx: int, key: str, value: Any) -> None:
    k = key.encode()
    kind = None
    if isinstance(value, Typed):
        kind, value = value.kind, value.value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key}: an empty array")
        if kind is None:
            first = value[0]
            kind = "bool" if isinstance(first, bool) else "u32" if isinstance(first, int) else \
                "f32" if isinstance(first, float) else "str" if isinstance(first, str) else None  # fmt: skip
        if kind is None:
            raise ValueError(f"metadata {key}: cannot store an array of {type(value[0]).__name__}")
        if kind == "str":
            arr = (ctypes.c_char_p * len(value))(*[v.encode() for v in value])
            g.gguf_set_arr_str(ctx, k, arr, len(value))
            return
        if kind == "bool":  # gguf stores bool arrays as int8
            data = (ctypes.c_int8 * len(value))(*[1 if v else 0 for v in value])
        else:
            data = (_CT[kind] * len(value))(*value)
        g.gguf_set_arr_data(ctx, k, _GGUF[kind], ctypes.cast(data, ctypes.c_void_p), len(value))
        return
    if kind is None:
        kind = "bool" if isinstance(value, bool) else "u32" if isinstance(value, int) else \
            "f32" if isinstance(value, float) else "str" if isinstance(value, str) else None  # fmt: skip
    if kind is None:
        raise ValueError(f"metadata {key}: cannot store a {type(value).__name__}")
    if kind == "str":
        g.gguf_set_val_str(ctx, k, value.encode())
    else:
        getattr(g, {"f32": "gguf_set_val_f32", "bool": "gguf_set_val_bool"}.get(kind, f"gguf_set_val_{kind}"))(
            ctx, k, value
        )


def _tensor_values(name: str, n: int, seed: int, stdev: float) -> np.ndarray:
    """Deterministic normal(0, stdev) float32 [n] for the tensor `name`; negative for ssm_a."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    v = rng.standard_normal(n, dtype=np.float32) * np.float32(stdev)
    return -np.abs(v) if "ssm_a" in name else v


_GGML_F32, _GGML_F16 = 0, 1


def write_arch_gguf(
    arch: str,
    path: str | Path,
    *,
    n_layer: int | None = None,
    moe: bool = False,
    mtp: bool = False,
    seed: int = 0,
    stdev: float = STDEV,
    scale_tensors: bool = False,
) -> Path:
    """Write a tiny random-weight GGUF of `arch` to `path`, made by libllama; returns the path.

    n_layer: None for the recipe's own (ARCHS[arch].n_layer); moe: the
    mixture-of-experts variant (always on where the architecture has only that);
    mtp: one next-token-prediction layer after the trunk (ArchSpec.mtp).
    scale_tensors: keep the per-tensor ".scale" / ".input_scale" tensors that
    llama.cpp's generic NVFP4 pass (llama_model::load_tensors, after the
    architecture's own loader) creates for every weight of a model made from
    metadata; they mean nothing for F32 weights, so by default the file is
    rewritten without them.

    Raises:
        ValueError: no recipe for `arch`, or an impossible request (see arch_metadata).
        RuntimeError: llama.cpp could not create the model from the metadata
        (its last log lines in the message), or the file was not written.
        CallerError(MODEL_LOAD_FAILED): the installed libllama lacks dgr's
        layer-range patches (dgr.backends.clib.range_api).
        llama.cpp may also abort the process on an inconsistent recipe.
    """
    meta, _shape = arch_metadata(arch, n_layer=n_layer, moe=moe, mtp=mtp)  # raises for an unknown arch
    spec = ARCHS[arch]
    out = Path(path)
    g, lib = _ggml(), _llama()
    import llama_cpp.llama_cpp as llama

    errors: list[BaseException] = []
    created: list[int] = []  # ggml_tensor * of every tensor llama.cpp created, in order

    @llama.llama_model_set_tensor_data_t
    def _fill(tensor: int, _ud: int) -> None:
        try:
            name = g.ggml_get_name(tensor).decode()
            n = g.ggml_nelements(tensor)
            ttype = ctypes.c_int.from_address(tensor).value  # ggml_tensor.type is its first field
            v = _tensor_values(name, n, seed, stdev)
            if ttype == _GGML_F16:
                v = v.astype(np.float16)
            elif ttype != _GGML_F32:
                raise RuntimeError(f"tensor {name}: ggml type {ttype} is neither F32 nor F16")
            if v.nbytes != g.ggml_nbytes(tensor):
                raise RuntimeError(f"tensor {name}: {v.nbytes} bytes of values for {g.ggml_nbytes(tensor)}")
            g.ggml_backend_tensor_set(tensor, v.ctypes.data, 0, v.nbytes)
            created.append(tensor)
        except BaseException as e:  # noqa: BLE001 - an exception must not cross into C
            errors.append(e)

    ctx = g.gguf_init_empty()
    model = None
    try:
        for key, value in meta.items():
            _set(g, ctx, key, value)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mtp = mtp  # else the loader skips the MTP layer's tensors, and the file would lack them
        model = lib.llama_model_init_from_user(ctx, _fill, None, params)
        if not model:
            raise RuntimeError(f"llama.cpp cannot create a {arch} model from the metadata: {_log_error()}")
        if errors:
            raise RuntimeError(f"filling {arch}'s tensors failed: {errors[0]!r}") from errors[0]
        out.parent.mkdir(parents=True, exist_ok=True)
        drop = None if scale_tensors else _generic_scale_re(spec)
        if spec.saver:
            lib.llama_model_save_to_file(model, str(out).encode())
            if drop is not None:
                _rewrite_without(g, out, drop)
        else:
            _write_own(g, ctx, created, out, drop)
        if not out.is_file():
            raise RuntimeError(f"{arch}: llama.cpp wrote no file at {out}")
        return out
    finally:
        if model:
            lib.llama_model_free(model)
        g.gguf_free(ctx)


# The weights llama.cpp's generic pass gives optional ".scale" / ".input_scale" tensors (NVFP4 scale2 and
# activation scales), by their GGUF names; created for every such weight of a model made from metadata.
_GENERIC_SCALED = (
    r"attn_(?:q|k|v|output|qkv|gate)|ffn_(?:gate|down|up)(?:_exps|_shexp)?|ssm_(?:in|out|alpha|beta)"
    r"|nextn\.(?:eh_proj|shared_head_head)"
)


def _generic_scale_re(spec: ArchSpec) -> re.Pattern[str]:
    """Names of the generic pass's scale tensors; ".scale" is kept where the architecture's own loader wants it."""
    suffix = "input_scale" if spec.own_scales else "(?:scale|input_scale)"
    return re.compile(rf"^(?:blk\.\d+\.(?:{_GENERIC_SCALED})|output)\.{suffix}$")


def _log_error() -> str:
    """llama.cpp's error lines among its last log lines (else the last lines)."""
    from dgr.backends.clib import llama_log_tail

    lines = [ln for ln in llama_log_tail(40).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln or "failed" in ln]
    return " | ".join((errors or lines)[-3:])


def _write_own(g: ctypes.CDLL, meta_ctx: int, tensors: list[int], out: Path, drop: re.Pattern[str] | None) -> None:
    """The metadata given to llama.cpp, and the tensors it created (their data still in the model's buffers)."""
    ctx = g.gguf_init_empty()
    try:
        g.gguf_set_kv(ctx, meta_ctx)
        seen: set[str] = set()
        for t in tensors:
            name = g.ggml_get_name(t).decode()
            # a tensor every layer asks for (rope_freqs) is created once per layer, as duplicates
            if name not in seen and (drop is None or not drop.match(name)):
                g.gguf_add_tensor(ctx, t)
            seen.add(name)
        if not g.gguf_write_to_file(ctx, str(out).encode(), False):
            raise RuntimeError(f"gguf_write_to_file failed for {out}")
    finally:
        g.gguf_free(ctx)


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _rewrite_without(g: ctypes.CDLL, path: Path, drop: re.Pattern[str]) -> None:
    """Rewrite the GGUF at `path` without the tensors whose names `drop` matches (nothing when none does)."""
    ggml_ctx = ctypes.c_void_p()
    src = g.gguf_init_from_file(str(path).encode(), _GgufInitParams(False, ctypes.pointer(ggml_ctx)))
    if not src:
        raise RuntimeError(f"cannot read back {path}")
    dst = g.gguf_init_empty()
    try:
        names = [g.gguf_get_tensor_name(src, i).decode() for i in range(g.gguf_get_n_tensors(src))]
        if not any(drop.match(n) for n in names):
            return
        g.gguf_set_kv(dst, src)
        for n in names:
            if not drop.match(n):
                g.gguf_add_tensor(dst, g.ggml_get_tensor(ggml_ctx, n.encode()))
        tmp = path.with_name(path.name + ".tmp")
        if not g.gguf_write_to_file(dst, str(tmp).encode(), False):
            raise RuntimeError(f"gguf_write_to_file failed for {tmp}")
        tmp.replace(path)
    finally:
        g.gguf_free(dst)
        g.gguf_free(src)
        if ggml_ctx:
            g.ggml_free(ggml_ctx)
