"""Every architecture's tiny-model recipe (`ARCHS`): its overrides of the common keys, and where to cut it.

One job: the table. Per architecture the few overrides it needs (a smaller
width for MLA attention, per-layer head counts that make hybrids' recurrent
layers, sliding-window pattern arrays), and the boundaries a layer range is
cut at (`ArchSpec.splits`, for dgr.bench.certify) with what they cut
(`ArchSpec.why`). The models have enough layers for a layer range to cut
inside each layer-pattern period and next to each change of layer kind, and a
sliding window of 8 positions, shorter than a test prompt, so that a range
which shifted a local/global pattern would change the answer; hybrids' splits
include stages of one layer kind.

Left out: architectures that are not decoder-only text models (encoders,
vision, audio, TTS, diffusion and draft models). dgr.testing.arch_models
turns a recipe into metadata and a file.
"""

from __future__ import annotations

from typing import Any

from dgr.testing.arch_keys import DROP, MLA_KEYS, ArchSpec, Typed, Value, flags, heads_by_kind, per_layer

__all__ = ["ARCHS"]


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
    "attention.head_count": per_layer(lambda s, il: 0 if "AMF"[il % 3] == "M" else s.n_head),
    "attention.head_count_kv": per_layer(lambda s, il: 0 if "AMF"[il % 3] == "M" else s.n_head),
    "feed_forward_length": per_layer(lambda s, il: s.n_ff if "AMF"[il % 3] == "F" else 0),
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
        keys={"attention.sliding_window_pattern": flags("SSF")},
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
    "deepseek2": _a(moe="only", keys=MLA_KEYS, why=_DENSE_FIRST + "; MLA", **_MLA_SIZE),
    "deepseek32": _a(moe="only", keys=MLA_KEYS, why=_DENSE_FIRST + "; MLA, indexer", **_MLA_SIZE),
    "glm4moe": _a(
        moe="only",
        keys={"rope.dimension_sections": DROP},
        mtp=True,
        why=_DENSE_FIRST + "; plain RoPE (no sections: GLM-4.5 text); +mtp: an MTP layer 6 on the tail",
    ),
    "glm-dsa": _a(moe="only", keys=MLA_KEYS, why=_DENSE_FIRST + "; MLA, indexer", **_MLA_SIZE),
    "mistral4": _a(moe="only", keys=MLA_KEYS, why=_DENSE_FIRST + "; MLA", **_MLA_SIZE),
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
        keys={"attention.sliding_window_pattern": flags("FSS", on="S")},
        why=_DENSE_FIRST + "; sliding pattern FSS (1 also full->sliding, 3 sliding->full)",
    ),
    "mimo2": _a(
        moe="only",
        keys={"attention.sliding_window_pattern": flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "step35": _a(
        n_embd=160,
        moe="only",
        saver=False,
        keys={"attention.sliding_window_pattern": flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "spark2_5": _a(
        keys={"attention.sliding_window_pattern": flags("FSS", on="S")},
        why="sliding pattern FSS: 1 full->sliding, 2 inside, 3 sliding->full, 4 full->sliding",
    ),
    "maple": _a(
        moe="only",
        keys={"attention.sliding_window_pattern": flags("FSS", on="S"), "swiglu_clamp_exp": 7.0},
        splits=((2,), (3,), (2, 4), (1,)),
        why="sliding pattern FSS: 2 inside, 3 sliding->full, 2|4; 1: a full-only head",
    ),
    "dots3note": _a(
        moe="only",
        keys={
            **MLA_KEYS,
            "attention.kv_lora_rank_swa": 512,
            "attention.key_length_swa": 576,
            "attention.value_length_swa": 512,
            "attention.key_length_mla_swa": 192,
            "attention.value_length_mla_swa": 128,
            "rope.freq_base_swa": 10000.0,
            "attention.sliding_window_pattern": per_layer(lambda s, il: il % 2),
            "attention.indexer.types": per_layer(lambda s, il: 0 if il % 2 else 1),
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
        keys={"attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "plamo2": _a(
        keys={
            "attention.head_count": heads_by_kind(_HYB),
            "attention.head_count_kv": heads_by_kind(_HYB),
            "ssm.group_count": 0,
        },
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "granitehybrid": _a(
        moe="optional",
        keys={"attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "lfm2": _a(
        keys={"attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
        why=_HYBRID,
        **_HYB_SPLITS,
    ),
    "lfm2moe": _a(
        moe="only",
        keys={"attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
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
        keys={**MLA_KEYS, "attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
        why=_HYBRID + "; MLA, dense layer 0",
        **_MLA_SIZE,
        **_HYB_SPLITS,
    ),
    "bailingmoe3": _a(
        moe="only",
        keys={
            **MLA_KEYS,
            "attention.head_count": heads_by_kind(_HYB),
            "attention.head_count_kv": heads_by_kind(_HYB),
            "rope.dimension_sections": [8, 12, 12, 0],
            "swiglu_clamp_exp": per_layer(lambda s, il: 4.0 if il else 0.0),
            "swiglu_clamp_shexp": per_layer(lambda s, il: 5.0 if il else 0.0),
        },
        why=_HYBRID + "; MLA, dense layer 0",
        **_MLA_SIZE,
        **_HYB_SPLITS,
    ),
    "kimi-k3": _a(
        moe="only",
        keys={**MLA_KEYS, "attention.head_count": heads_by_kind(_HYB), "attention.head_count_kv": heads_by_kind(_HYB)},
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
            "attention.sliding_window_pattern": flags("SSSSF"),
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
            **MLA_KEYS,
            "hyper_connection.count": 4,
            "hyper_connection.epsilon": 1.0e-6,
            "hyper_connection.magnitude": 2.0,
            "swiglu_clamp_exp": 10.0,
            "expert_weights_scale": 1.0,
            "expert_weights_norm": True,
            "attention.indexer.types": per_layer(lambda s, il: 0 if il % 2 else 1),
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
        "attention.compress_ratios": per_layer(lambda s, il: 4),
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
        **MLA_KEYS,
        **_hyper_ple(128),
        "attention.key_length": 512,
        "rope.dimension_count": 0,
        "attention.head_count": 1,
        "attention.head_count_kv": heads_by_kind("RRA"),
    },
    why=_RRA + "; MLA, hyper-connections, n-gram embeddings on layer 0 (recurrent)",
    **_RRA_SPLITS,
    expect="hyper-connection streams (seam wider than n_embd): expected to fail",
    **_MLA_SIZE,
)
