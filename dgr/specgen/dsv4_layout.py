"""Write tests/fixtures/deepseek-v4-flash.layout.json from DeepSeek-V4-Flash's public facts.

The layout describes the model for `dgr plan` without its 155 GB of weights:
GGUF metadata (from config.json, in llama.cpp's key names), every tensor's
name and shape per layer group (from llama.cpp's loader), quantization
recipes (which ggml type each tensor role gets), the KV terms per layer kind
and a compute-buffer rule. tests/test_plan.py checks the file is what this
module writes, so edit the facts here and rerun:

    python -m dgr.specgen

Sources, each second-hand unless spec/deepseek-v4-flash.md says it was checked:
- config.json of deepseek-ai/DeepSeek-V4-Flash (huggingface.co/deepseek-ai/DeepSeek-V4-Flash);
- llama.cpp src/models/deepseek4.cpp `load_arch_tensors` (tensor shapes, read for this file);
- llama.cpp src/llama-kv-cache-dsv4.cpp (cache sizes, read for this file);
- gguf-py constants.py (GGUF tensor names);
- antirez/deepseek-v4-gguf README (per-tensor-class quant types and file sizes);
- unslothai/unsloth PR #6940 (compute buffer of about 2 GiB at 16K and 65.5 GiB at 1M context, ubatch 512, CUDA).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from dgr.plan.rules import DSV4_COMPUTE_ANCHORS, DSV4_COMPUTE_SOURCE

__all__ = ["OUT", "Dims", "dump", "layout", "render"]

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "deepseek-v4-flash.layout.json"


@attrs.frozen
class Dims:
    """The model's sizes; the defaults are config.json's (-0731; the base model differs only in DSpark)."""

    hidden: int = 4096
    vocab: int = 129280
    layers: int = 43
    heads: int = 64
    head_dim: int = 512  # 448 + 64 rope
    rope_dim: int = 64
    q_lora: int = 1024
    o_lora: int = 1024
    o_groups: int = 8
    experts: int = 256
    experts_used: int = 6
    experts_shared: int = 1
    ff_exp: int = 2048
    idx_heads: int = 64
    idx_dim: int = 128
    idx_topk: int = 512
    window: int = 128
    hc: int = 4
    hash_layers: int = 3
    context: int = 1048576
    # next-token-prediction layers after the trunk: 0 here, as the base model's MTP layer ships as a
    # separate GGUF (antirez: 3.6 GiB); a file that carries it has 1
    mtp: int = 0

    @property
    def ratios(self) -> list[int]:
        """compress_ratios: layers 0-1 none, then even layers CSA (4:1), odd layers HCA (128:1)."""
        return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(self.layers)]


def metadata(d: Dims) -> dict[str, Any]:
    """The GGUF metadata keys the planner (and llama.cpp's deepseek4 loader) read."""
    return {
        "general.architecture": "deepseek4",
        "general.name": "DeepSeek-V4-Flash",
        "deepseek4.block_count": d.layers + d.mtp,
        "deepseek4.context_length": d.context,
        "deepseek4.embedding_length": d.hidden,
        "deepseek4.vocab_size": d.vocab,
        "deepseek4.attention.head_count": d.heads,
        "deepseek4.attention.head_count_kv": 1,
        "deepseek4.attention.key_length": d.head_dim,
        "deepseek4.attention.value_length": d.head_dim,
        "deepseek4.rope.dimension_count": d.rope_dim,
        "deepseek4.attention.q_lora_rank": d.q_lora,
        "deepseek4.attention.output_lora_rank": d.o_lora,
        "deepseek4.attention.output_group_count": d.o_groups,
        "deepseek4.attention.sliding_window": d.window,
        "deepseek4.attention.compress_ratios": d.ratios + [0] * d.mtp,  # the MTP layer: window only
        "deepseek4.attention.indexer.head_count": d.idx_heads,
        "deepseek4.attention.indexer.key_length": d.idx_dim,
        "deepseek4.attention.indexer.top_k": d.idx_topk,
        "deepseek4.expert_count": d.experts,
        "deepseek4.expert_used_count": d.experts_used,
        "deepseek4.expert_shared_count": d.experts_shared,
        "deepseek4.expert_feed_forward_length": d.ff_exp,
        "deepseek4.hash_layer_count": d.hash_layers,
        "deepseek4.hyper_connection.count": d.hc,
        "deepseek4.nextn_predict_layers": d.mtp,
    }


def t(name: str, shape: list[int], role: str) -> dict[str, Any]:
    return {"name": name, "shape": shape, "role": role}


def blk(suffix: str, shape: list[int], role: str) -> dict[str, Any]:
    return t("blk.{i}." + suffix, shape, role)


def embed_and_output(D: int, V: int) -> list[dict[str, Any]]:
    """The global tensors every llama-descended layout has: the embedding, the final norm, the output head."""
    return [
        t("token_embd.weight", [D, V], "embed"),
        t("output_norm.weight", [D], "norm"),
        t("output.weight", [D, V], "output"),
    ]


def tensor_groups(d: Dims) -> list[dict[str, Any]]:
    """Every tensor llama.cpp's deepseek4 loader creates, by the layers that have it (shapes: ne0 first)."""
    D, V, HD, IDX = d.hidden, d.vocab, d.head_dim, d.idx_dim
    mix = (2 + d.hc) * d.hc  # pre, post and the hc x hc comb of each hyper-connection
    ff_sh = d.ff_exp * d.experts_shared
    csa = [i for i, r in enumerate(d.ratios) if r == 4]
    hca = [i for i, r in enumerate(d.ratios) if r == 128]
    return [
        {
            "layers": "global",
            "tensors": [
                *embed_and_output(D, V),
                t("output_hc_fn.weight", [d.hc * D, d.hc], "hc"),
                t("output_hc_base.weight", [d.hc], "hc_small"),
                t("output_hc_scale.weight", [1], "hc_small"),
            ],
        },
        {
            "layers": "all",
            "tensors": [
                blk("attn_norm.weight", [D], "norm"),
                blk("attn_sinks.weight", [d.heads], "sinks"),
                blk("attn_q_a.weight", [D, d.q_lora], "attn"),
                blk("attn_q_a_norm.weight", [d.q_lora], "norm"),
                blk("attn_q_b.weight", [d.q_lora, d.heads * HD], "attn"),
                blk("attn_kv.weight", [D, HD], "attn"),
                blk("attn_kv_a_norm.weight", [HD], "norm"),
                blk("attn_output_a.weight", [d.heads * HD // d.o_groups, d.o_lora * d.o_groups], "attn"),
                blk("attn_output_b.weight", [d.o_groups * d.o_lora, D], "attn"),
                blk("hc_attn_fn.weight", [d.hc * D, mix], "hc"),
                blk("hc_attn_base.weight", [mix], "hc_small"),
                blk("hc_attn_scale.weight", [3], "hc_small"),
                blk("hc_ffn_fn.weight", [d.hc * D, mix], "hc"),
                blk("hc_ffn_base.weight", [mix], "hc_small"),
                blk("hc_ffn_scale.weight", [3], "hc_small"),
                blk("ffn_gate_inp.weight", [D, d.experts], "router"),
                blk("ffn_norm.weight", [D], "norm"),
                blk("ffn_gate_exps.weight", [D, d.ff_exp, d.experts], "exp_gate"),
                blk("ffn_up_exps.weight", [D, d.ff_exp, d.experts], "exp_up"),
                blk("ffn_down_exps.weight", [d.ff_exp, D, d.experts], "exp_down"),
                blk("ffn_gate_shexp.weight", [D, ff_sh], "shexp"),
                blk("ffn_up_shexp.weight", [D, ff_sh], "shexp"),
                blk("ffn_down_shexp.weight", [ff_sh, D], "shexp"),
            ],
        },
        # The first layers pick experts from a table indexed by the input token id.
        {
            "layers": list(range(d.hash_layers)),
            "tensors": [blk("ffn_gate_tid2eid.weight", [d.experts_used, V], "hash")],
        },
        {"layers": list(range(d.hash_layers, d.layers + d.mtp)), "tensors": [blk("exp_probs_b.bias", [d.experts], "bias")]},
        # MTP: a whole layer more (every "all" tensor), fed the final streams and the next token's embedding
        *([{
            "layers": list(range(d.layers, d.layers + d.mtp)),
            "tensors": [
                blk("nextn.eh_proj.weight", [2 * D, D], "attn"),
                blk("nextn.enorm.weight", [D], "norm"),
                blk("nextn.hnorm.weight", [D], "norm"),
            ],
        }] if d.mtp else []),
        # CSA: the compressor's rows are 2 x head wide (overlapping windows), plus the lightning indexer.
        {
            "layers": csa,
            "tensors": [
                blk("attn_compressor_kv.weight", [D, 2 * HD], "compressor"),
                blk("attn_compressor_gate.weight", [D, 2 * HD], "compressor"),
                blk("attn_compressor_ape.weight", [2 * HD, 4], "compressor"),
                blk("attn_compressor_norm.weight", [HD], "norm"),
                blk("indexer.proj.weight", [D, d.idx_heads], "indexer"),
                blk("indexer.attn_q_b.weight", [d.q_lora, d.idx_heads * IDX], "indexer"),
                blk("indexer_compressor_kv.weight", [D, 2 * IDX], "indexer"),
                blk("indexer_compressor_gate.weight", [D, 2 * IDX], "indexer"),
                blk("indexer_compressor_ape.weight", [2 * IDX, 4], "indexer"),
                blk("indexer_compressor_norm.weight", [IDX], "norm"),
            ],
        },
        {
            "layers": hca,
            "tensors": [
                blk("attn_compressor_kv.weight", [D, HD], "compressor"),
                blk("attn_compressor_gate.weight", [D, HD], "compressor"),
                blk("attn_compressor_ape.weight", [HD, 128], "compressor"),
                blk("attn_compressor_norm.weight", [HD], "norm"),
            ],
        },
    ]


# antirez/deepseek-v4-gguf: "Q8_0 attn proj / shared experts / output, F16 router + embed +
# indexer + compressor + HC, F32 norms / sinks / bias", I32 hash table; the files differ in experts.
_REST = {
    "attn": "Q8_0",
    "shexp": "Q8_0",
    "output": "Q8_0",
    "embed": "F16",
    "router": "F16",
    "indexer": "F16",
    "compressor": "F16",
    "hc": "F16",
    "hc_small": "F32",
    "norm": "F32",
    "sinks": "F32",
    "bias": "F32",
    "hash": "I32",
}


def recipe(description: str, gate: str, up: str, down: str) -> dict[str, Any]:
    return {"description": description, "types": {**_REST, "exp_gate": gate, "exp_up": up, "exp_down": down}}


RECIPES = {
    "q2-antirez": recipe("antirez 2-bit: IQ2_XXS gate/up + Q2_K down experts, Q8_0 rest", "IQ2_XXS", "IQ2_XXS", "Q2_K"),
    "q4k-antirez": recipe("antirez 4-bit: Q4_K experts, Q8_0 rest", "Q4_K", "Q4_K", "Q4_K"),
    "mxfp4-q8": recipe("the released FP4 experts kept as MXFP4, Q8_0 rest", "MXFP4", "MXFP4", "MXFP4"),
    "q8_0": recipe("Q8_0 experts and rest", "Q8_0", "Q8_0", "Q8_0"),
}


def kv_kinds(d: Dims) -> dict[str, list[dict[str, Any]]]:
    """Per-sequence caches of llama.cpp's llama_kv_cache_dsv4, written out from its constructor.

    tests/test_plan.py checks dgr.plan.rules derives the same from the metadata. "cache" rows
    follow --kv-dtype; the compressor state is always f32. Cache rows are padded to 256.
    """
    raw = {"name": "raw_k", "width": d.head_dim, "window": d.window}
    return {
        "swa": [raw],
        "csa": [
            raw,
            {"name": "csa_k", "width": d.head_dim, "every": 4},
            {"name": "indexer_k", "width": d.idx_dim, "every": 4},
            # kv and score, 2 x ratio rows each, of 2 x width (the overlapping windows)
            {"name": "csa_state", "width": 2 * d.head_dim, "dtype": "f32", "fixed": 16, "pad": 1},
            {"name": "indexer_state", "width": 2 * d.idx_dim, "dtype": "f32", "fixed": 16, "pad": 1},
        ],
        "hca": [
            raw,
            {"name": "hca_k", "width": d.head_dim, "every": 128},
            {"name": "hca_state", "width": d.head_dim, "dtype": "f32", "fixed": 256, "pad": 1},
        ],
    }


KV_NOTE = [
    "Per sequence and layer, at context C and ubatch U (llama.cpp default 512); pad256(x) rounds up to 256 rows.",
    "raw_k (every layer): pad256(min(C, 128 + U)) rows x 512 values, K only (K is also V).",
    "csa (21 even layers 2..42): + pad256(ceil(C/4)) x 512 compressed K + pad256(ceil(C/4)) x 128 indexer K",
    "  + f32 compressor state: 2 (kv, score) x 8 rows x 1024 + 2 x 8 rows x 256 = 80 KiB.",
    "hca (20 odd layers 3..41): + pad256(ceil(C/128)) x 512 compressed K + f32 state 2 x 128 rows x 512 = 512 KiB.",
    "swa (layers 0, 1): raw_k only.",
    "So per token, f16: CSA 320 B, HCA 8 B, SWA 0 B beyond the window; fixed state ~12 MiB per sequence.",
]


def layout(d: Dims = Dims()) -> dict[str, Any]:
    return {
        "format": "dgr-layout/1",
        "name": "DeepSeek-V4-Flash",
        "architecture": "deepseek4",
        "sources": SOURCES,
        "metadata": metadata(d),
        "tensor_groups": tensor_groups(d),
        "recipes": RECIPES,
        "default_recipe": "q4k-antirez",
        "kv": {"note": KV_NOTE, "kinds": kv_kinds(d)},
        "compute": {"anchors": [list(a) for a in DSV4_COMPUTE_ANCHORS], "source": DSV4_COMPUTE_SOURCE},
        "published_sizes_gib": {"q2-antirez": 80.8, "q4k-antirez": 153.3},
    }


SOURCES = [
    "config.json of deepseek-ai/DeepSeek-V4-Flash (huggingface.co/deepseek-ai/DeepSeek-V4-Flash)",
    "llama.cpp src/models/deepseek4.cpp load_arch_tensors (shapes)",
    "llama.cpp src/llama-kv-cache-dsv4.cpp (caches)",
    "gguf-py constants.py (tensor names)",
    "huggingface.co/antirez/deepseek-v4-gguf README (quant types, file sizes)",
    "github.com/unslothai/unsloth pull 6940 (compute buffer anchors)",
]


def dump(obj: Any, indent: int = 0) -> str:
    """JSON with one tensor or one KV term per line, so the fixture stays short and reviewable."""
    pad = "  " * indent
    if isinstance(obj, dict) and not any(isinstance(v, (dict, list)) and v and _nested(v) for v in obj.values()):
        return json.dumps(obj)
    if isinstance(obj, dict):
        items = [f"{pad}  {json.dumps(k)}: {dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        items = [f"{pad}  {dump(v, indent + 1)}" for v in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj)


def _nested(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v))


def render() -> str:
    return dump(layout()) + "\n"
