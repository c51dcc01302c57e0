"""Write the layout fixtures of the follow-up audits: GLM-5.2 and Ornith-1.0-35B.

Like dgr.specgen.dsv4_layout (whose JSON writer this reuses), each layout
describes a model for `dgr plan` without its weights: GGUF metadata in
llama.cpp's key names, every tensor's name and shape per layer group (from
llama.cpp's loader), quantization recipes, and a compute-buffer rule. The
KV terms are not written out: dgr.plan.rules derives them from the
metadata (tests/test_plan_audits.py checks what it derives).

    python -m dgr.specgen          # rewrite every generated file, these included
    python -m dgr.specgen --check  # exit 1 if any is stale

Sources (spec/glm-5.2.md and spec/ornith.md say which were verified):
- GLM-5.2: llama.cpp src/models/glm-dsa.cpp `load_arch_tensors` (tensor shapes,
  the default indexer roles); HF transformers GlmMoeDsaConfig (GLM-5 defaults:
  6144 hidden, 78 layers, 3 dense, 256 experts top 8, MLA ranks, indexer sizes);
  the 1M context and the 79th (MTP) block from GGUF metadata quoted on the
  Hugging Face card of Deviad/GLM-5.2-mixed-IQ2S-experts-IQ4NL-rest.
- Ornith-1.0-35B: a Qwen3.5-35B-A3B (Qwen3_5MoeForConditionalGeneration,
  xorbitsai/inference PR 5119); shapes from llama.cpp src/models/qwen35moe.cpp
  and HF transformers Qwen3_5MoeTextConfig (its defaults are Qwen3.5-35B-A3B's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgr.plan.layout import DEFAULT_UBATCH
from dgr.plan.rules import DSV4_COMPUTE_ANCHORS, gguf_compute_rule, glm52_indexer_full
from dgr.specgen.dsv4_layout import blk, dump, embed_and_output  # one JSON writer and one tensor notation

__all__ = ["GLM_OUT", "ORNITH_OUT", "OUTPUTS", "glm_layout", "ornith_layout", "render"]

ROOT = Path(__file__).resolve().parents[2]

GLM_OUT = ROOT / "tests" / "fixtures" / "glm-5.2.layout.json"
ORNITH_OUT = ROOT / "tests" / "fixtures" / "ornith-1.0-35b.layout.json"


# -- GLM-5.2 (glm-dsa) --------------------------------------------------------------------------

GLM = {
    "hidden": 6144,
    "vocab": 154880,
    "trunk": 78,  # decoder layers; block 78 is the MTP layer
    "mtp": 1,
    "heads": 64,
    "q_lora": 2048,
    "kv_lora": 512,
    "nope": 192,
    "rope": 64,
    "v_head": 256,
    "dense": 3,
    "ff_dense": 12288,
    "experts": 256,
    "experts_used": 8,
    "ff_exp": 2048,
    "idx_heads": 32,
    "idx_dim": 128,
    "idx_topk": 2048,
    "context": 1048576,
}


def glm_indexer_types(g: dict[str, int] = GLM) -> list[bool]:
    return [glm52_indexer_full(i) for i in range(g["trunk"])]


def glm_metadata(g: dict[str, int] = GLM) -> dict[str, Any]:
    p = "glm-dsa."
    return {
        "general.architecture": "glm-dsa",
        "general.name": "GLM-5.2",
        p + "block_count": g["trunk"] + g["mtp"],
        p + "nextn_predict_layers": g["mtp"],
        p + "context_length": g["context"],
        p + "embedding_length": g["hidden"],
        p + "feed_forward_length": g["ff_dense"],
        p + "vocab_size": g["vocab"],
        p + "leading_dense_block_count": g["dense"],
        p + "attention.head_count": g["heads"],
        p + "attention.head_count_kv": 1,
        p + "attention.q_lora_rank": g["q_lora"],
        p + "attention.kv_lora_rank": g["kv_lora"],
        p + "attention.key_length_mla": g["nope"] + g["rope"],
        p + "attention.value_length_mla": g["v_head"],
        p + "rope.dimension_count": g["rope"],
        p + "attention.indexer.head_count": g["idx_heads"],
        p + "attention.indexer.key_length": g["idx_dim"],
        p + "attention.indexer.top_k": g["idx_topk"],
        p + "attention.indexer.types": glm_indexer_types(g),
        p + "expert_count": g["experts"],
        p + "expert_used_count": g["experts_used"],
        p + "expert_shared_count": 1,
        p + "expert_feed_forward_length": g["ff_exp"],
    }


def glm_tensor_groups(g: dict[str, int] = GLM) -> list[dict[str, Any]]:
    """Every tensor llama.cpp's glm-dsa loader creates (shapes: ne0 first), as unsloth's GGUFs hold them.

    unsloth's files carry indexer weights at every layer; only the "full" layers use them
    (llama.cpp PR 25407). The 1,809 tensors of a BF16 GGUF (ik_llama.cpp issue 2032) are this list.
    """
    D, V, H = g["hidden"], g["vocab"], g["heads"]
    k_head = g["nope"] + g["rope"]
    n_all = g["trunk"] + g["mtp"]
    return [
        {
            "layers": "global",
            "tensors": embed_and_output(D, V),
        },
        {
            "layers": "all",
            "tensors": [
                blk("attn_norm.weight", [D], "norm"),
                blk("attn_q_a_norm.weight", [g["q_lora"]], "norm"),
                blk("attn_kv_a_norm.weight", [g["kv_lora"]], "norm"),
                blk("attn_q_a.weight", [D, g["q_lora"]], "attn"),
                blk("attn_q_b.weight", [g["q_lora"], H * k_head], "attn"),
                blk("attn_kv_a_mqa.weight", [D, g["kv_lora"] + g["rope"]], "attn"),
                blk("attn_k_b.weight", [g["nope"], g["kv_lora"], H], "attn"),
                blk("attn_v_b.weight", [g["kv_lora"], g["v_head"], H], "attn"),
                blk("attn_output.weight", [H * g["v_head"], D], "attn"),
                blk("ffn_norm.weight", [D], "norm"),
                blk("indexer.k_norm.weight", [g["idx_dim"]], "norm"),
                blk("indexer.k_norm.bias", [g["idx_dim"]], "norm"),
                blk("indexer.proj.weight", [D, g["idx_heads"]], "indexer"),
                blk("indexer.attn_k.weight", [D, g["idx_dim"]], "indexer"),
                blk("indexer.attn_q_b.weight", [g["q_lora"], g["idx_heads"] * g["idx_dim"]], "indexer"),
            ],
        },
        {
            "layers": list(range(g["dense"])),
            "tensors": [
                blk("ffn_gate.weight", [D, g["ff_dense"]], "dense"),
                blk("ffn_up.weight", [D, g["ff_dense"]], "dense"),
                blk("ffn_down.weight", [g["ff_dense"], D], "dense"),
            ],
        },
        *(
            {
                "layers": layers,
                "tensors": [
                    blk("ffn_gate_inp.weight", [D, g["experts"]], "router"),
                    blk("exp_probs_b.bias", [g["experts"]], "norm"),
                    blk("ffn_gate_exps.weight", [D, g["ff_exp"], g["experts"]], exp + "_gate"),
                    blk("ffn_up_exps.weight", [D, g["ff_exp"], g["experts"]], exp + "_up"),
                    blk("ffn_down_exps.weight", [g["ff_exp"], D, g["experts"]], exp + "_down"),
                    blk("ffn_gate_shexp.weight", [D, g["ff_exp"]], "shexp"),
                    blk("ffn_up_shexp.weight", [D, g["ff_exp"]], "shexp"),
                    blk("ffn_down_shexp.weight", [g["ff_exp"], D], "shexp"),
                ],
            }
            for layers, exp in ((list(range(g["dense"], g["trunk"])), "exp"), (list(range(g["trunk"], n_all)), "mtp_exp"))
        ),
        # The MTP block: a whole decoder layer plus the projection of [hidden; next embedding].
        {
            "layers": list(range(g["trunk"], n_all)),
            "tensors": [
                blk("nextn.eh_proj.weight", [2 * D, D], "attn"),
                blk("nextn.enorm.weight", [D], "norm"),
                blk("nextn.hnorm.weight", [D], "norm"),
                blk("nextn.shared_head_norm.weight", [D], "norm"),
            ],
        },
    ]


def _glm_recipe(description: str, experts: str, rest: str, embed: str, mtp_experts: str = "") -> dict[str, Any]:
    mtp = mtp_experts or experts
    types = {
        "attn": rest, "indexer": rest, "dense": rest, "shexp": rest, "output": rest, "embed": embed,
        "router": "F32", "norm": "F32", "exp_gate": experts, "exp_up": experts, "exp_down": experts,
        "mtp_exp_gate": mtp, "mtp_exp_up": mtp, "mtp_exp_down": mtp,
    }  # fmt: skip
    return {"description": description, "types": types}


GLM_RECIPES = {
    # Deviad/GLM-5.2-mixed-IQ2S-experts-IQ4NL-rest: "IQ2_S experts, everything else IQ4_NL", about
    # 232 GiB, with the MTP block's experts (blk.78) left IQ4_NL. llama-quantize keeps 1-D tensors
    # and ffn_gate_inp in F32.
    "iq2s-iq4nl": _glm_recipe("IQ2_S experts, IQ4_NL rest (Deviad's file)", "IQ2_S", "IQ4_NL", "IQ4_NL", "IQ4_NL"),
    "q4k-q8": _glm_recipe("Q4_K experts, Q8_0 rest", "Q4_K", "Q8_0", "Q8_0"),
    "q8_0": _glm_recipe("Q8_0 everywhere but norms and router", "Q8_0", "Q8_0", "Q8_0"),
    "bf16": _glm_recipe("BF16, as released", "BF16", "BF16", "BF16"),
}

# unsloth PR 6940 measured DeepSeek-V4-Flash's compute buffer (CUDA, ubatch 512); it grows with the
# lightning indexer's scores, one f32 per (cached key, ubatch row, indexer head). GLM-5.2's indexer
# scores every cached token (DeepSeek-V4: one key per 4 tokens) with 32 heads (DeepSeek-V4: 64): twice
# the growth per context position. An estimate by analogy, not a measurement (spec/glm-5.2.md task 7).
_DSV4_PER_CTX = (DSV4_COMPUTE_ANCHORS[1][1] - DSV4_COMPUTE_ANCHORS[0][1]) / (
    DSV4_COMPUTE_ANCHORS[1][0] - DSV4_COMPUTE_ANCHORS[0][0]
)
GLM_PER_CTX = _DSV4_PER_CTX * 4 * GLM["idx_heads"] / 64


def glm_compute() -> dict[str, Any]:
    fixed = DSV4_COMPUTE_ANCHORS[0][1] - _DSV4_PER_CTX * DSV4_COMPUTE_ANCHORS[0][0]
    anchors = [[c, int(fixed + GLM_PER_CTX * c)] for c in (16384, 1048576)]
    return {
        "anchors": anchors,
        "source": "estimate: unsloth PR 6940's DSV4 compute line, growth x2 (indexer keys 4x denser, half the heads)",
    }


def glm_layout(g: dict[str, int] = GLM) -> dict[str, Any]:
    return {
        "format": "dgr-layout/1",
        "name": "GLM-5.2",
        "architecture": "glm-dsa",
        "sources": [
            "llama.cpp src/models/glm-dsa.cpp load_arch_tensors (shapes, default indexer roles)",
            "huggingface/transformers GlmMoeDsaConfig defaults (GLM-5 sizes)",
            "Deviad/GLM-5.2-mixed-IQ2S-experts-IQ4NL-rest card (GGUF metadata: 79 blocks, 1M context; 232 GiB)",
            "llama.cpp PR 25407 (unsloth GGUFs hold indexer weights at every layer)",
            "unslothai/unsloth PR 6940 (DSV4 compute buffer, scaled)",
        ],
        "metadata": glm_metadata(g),
        "tensor_groups": glm_tensor_groups(g),
        "recipes": GLM_RECIPES,
        "default_recipe": "q4k-q8",
        "compute": glm_compute(),
        "published_sizes_gib": {"iq2s-iq4nl": 232},
    }


# -- Ornith-1.0-35B (qwen35moe) -----------------------------------------------------------------

QWEN = {
    "hidden": 2048,
    "vocab": 248320,
    "layers": 40,
    "heads": 16,
    "kv_heads": 2,
    "head_dim": 256,
    "rope": 64,
    "interval": 4,  # full attention every 4th layer
    "lin_k_heads": 16,
    "lin_v_heads": 32,
    "lin_head": 128,
    "conv": 4,
    "experts": 256,
    "experts_used": 8,
    "ff_exp": 512,
    "ff_shexp": 512,
}


def ornith_metadata(q: dict[str, int] = QWEN) -> dict[str, Any]:
    p = "qwen35moe."
    return {
        "general.architecture": "qwen35moe",
        "general.name": "Ornith-1.0-35B",
        p + "block_count": q["layers"],
        # The trained context is not stated here: Ornith's config.json was not read (spec/ornith.md).
        p + "embedding_length": q["hidden"],
        p + "vocab_size": q["vocab"],
        p + "attention.head_count": q["heads"],
        p + "attention.head_count_kv": q["kv_heads"],
        p + "attention.key_length": q["head_dim"],
        p + "attention.value_length": q["head_dim"],
        p + "rope.dimension_count": q["rope"],
        p + "full_attention_interval": q["interval"],
        p + "ssm.conv_kernel": q["conv"],
        p + "ssm.inner_size": q["lin_v_heads"] * q["lin_head"],
        p + "ssm.state_size": q["lin_head"],
        p + "ssm.time_step_rank": q["lin_v_heads"],
        p + "ssm.group_count": q["lin_k_heads"],
        p + "expert_count": q["experts"],
        p + "expert_used_count": q["experts_used"],
        p + "expert_feed_forward_length": q["ff_exp"],
        p + "expert_shared_feed_forward_length": q["ff_shexp"],
    }


def ornith_tensor_groups(q: dict[str, int] = QWEN) -> list[dict[str, Any]]:
    """Every tensor llama.cpp's qwen35moe loader creates for the trunk (shapes: ne0 first)."""
    D, V = q["hidden"], q["vocab"]
    key_dim = q["lin_k_heads"] * q["lin_head"]
    value_dim = q["lin_v_heads"] * q["lin_head"]
    attn = [i for i in range(q["layers"]) if (i + 1) % q["interval"] == 0]
    delta = [i for i in range(q["layers"]) if (i + 1) % q["interval"] != 0]
    return [
        {
            "layers": "global",
            "tensors": embed_and_output(D, V),
        },
        {
            "layers": "all",
            "tensors": [
                blk("attn_norm.weight", [D], "norm"),
                blk("post_attention_norm.weight", [D], "norm"),
                blk("ffn_gate_inp.weight", [D, q["experts"]], "router"),
                blk("ffn_gate_exps.weight", [D, q["ff_exp"], q["experts"]], "exp_gate"),
                blk("ffn_up_exps.weight", [D, q["ff_exp"], q["experts"]], "exp_up"),
                blk("ffn_down_exps.weight", [q["ff_exp"], D, q["experts"]], "exp_down"),
                blk("ffn_gate_inp_shexp.weight", [D], "norm"),
                blk("ffn_gate_shexp.weight", [D, q["ff_shexp"]], "shexp"),
                blk("ffn_up_shexp.weight", [D, q["ff_shexp"]], "shexp"),
                blk("ffn_down_shexp.weight", [q["ff_shexp"], D], "shexp"),
            ],
        },
        # Gated attention: the query projection also yields the output gate (2 x heads x head_dim).
        {
            "layers": attn,
            "tensors": [
                blk("attn_q.weight", [D, 2 * q["heads"] * q["head_dim"]], "attn"),
                blk("attn_k.weight", [D, q["kv_heads"] * q["head_dim"]], "attn"),
                blk("attn_v.weight", [D, q["kv_heads"] * q["head_dim"]], "attn"),
                blk("attn_output.weight", [q["heads"] * q["head_dim"], D], "attn"),
                blk("attn_q_norm.weight", [q["head_dim"]], "norm"),
                blk("attn_k_norm.weight", [q["head_dim"]], "norm"),
            ],
        },
        # Gated delta net (linear attention).
        {
            "layers": delta,
            "tensors": [
                blk("attn_qkv.weight", [D, 2 * key_dim + value_dim], "attn"),
                blk("attn_gate.weight", [D, value_dim], "attn"),
                blk("ssm_conv1d.weight", [q["conv"], 2 * key_dim + value_dim], "norm"),
                blk("ssm_dt.bias", [q["lin_v_heads"]], "norm"),
                blk("ssm_a", [q["lin_v_heads"]], "norm"),
                blk("ssm_beta.weight", [D, q["lin_v_heads"]], "attn"),
                blk("ssm_alpha.weight", [D, q["lin_v_heads"]], "attn"),
                blk("ssm_norm.weight", [q["lin_head"]], "norm"),
                blk("ssm_out.weight", [value_dim, D], "attn"),
            ],
        },
    ]


def _qwen_recipe(description: str, experts: str, rest: str) -> dict[str, Any]:
    types = {
        "attn": rest, "shexp": rest, "output": rest, "embed": rest, "router": "F32", "norm": "F32",
        "exp_gate": experts, "exp_up": experts, "exp_down": experts,
    }  # fmt: skip
    return {"description": description, "types": types}


ORNITH_RECIPES = {
    "q4k-q8": _qwen_recipe("Q4_K experts, Q8_0 rest", "Q4_K", "Q8_0"),
    "q8_0": _qwen_recipe("Q8_0 everywhere but norms and router", "Q8_0", "Q8_0"),
    "bf16": _qwen_recipe("BF16, as released", "BF16", "BF16"),
}


def ornith_compute() -> dict[str, Any]:
    rule = gguf_compute_rule("qwen35moe", {}, QWEN["vocab"])
    return {
        "anchors": [[c, int(rule.nbytes(c))] for c in (4096, 262144)],
        "source": f"dgr's generic llama.cpp CPU rule at ubatch {DEFAULT_UBATCH} (fit on SmolLM2; not measured here)",
    }


def ornith_layout(q: dict[str, int] = QWEN) -> dict[str, Any]:
    return {
        "format": "dgr-layout/1",
        "name": "Ornith-1.0-35B",
        "architecture": "qwen35moe",
        "sources": [
            "xorbitsai/inference PR 5119 (Ornith-1.0-35B is Qwen3_5MoeForConditionalGeneration)",
            "llama.cpp src/models/qwen35moe.cpp load_arch_tensors (shapes, layer kinds)",
            "huggingface/transformers Qwen3_5MoeTextConfig defaults (Qwen3.5-35B-A3B sizes)",
        ],
        "metadata": ornith_metadata(q),
        "tensor_groups": ornith_tensor_groups(q),
        "recipes": ORNITH_RECIPES,
        "default_recipe": "q4k-q8",
        "compute": ornith_compute(),
    }


OUTPUTS = {GLM_OUT: glm_layout, ORNITH_OUT: ornith_layout}


def render(path: Path) -> str:
    return dump(OUTPUTS[path]()) + "\n"
