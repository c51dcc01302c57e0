"""llama.cpp's rules for a layout: KV per layer kind, compute buffers.

Each rule here is read off llama.cpp's sources (cited per function) and
checked against what llama.cpp itself logs by the audits in dgr.bench
(dsv4_tiny, audit_tiny, plan_overhead).

Besides deepseek4, the KV rules know two more kinds of layer:
- glm-dsa (GLM-5 to 5.2, llama.cpp src/models/glm-dsa.cpp): MLA keeps one
  K-only latent row per token (kv_lora_rank + rope wide; V is read from
  it), and a "full" indexer layer adds the lightning indexer's keys;
- qwen35moe / qwen35 / qwen3next (Qwen3.5, Ornith): a gated-delta-net
  layer keeps fixed f32 recurrent state (a conv window and the delta-rule
  matrix), and every `full_attention_interval`-th layer is full attention.

A layout also says at which layers a shard may start (`shard_starts`): a
GLM-5.2 ("glm-dsa") layer with a shared indexer reuses the top-k of the last
full-indexer layer before it, so a shard must start at a full one.

Left out: reading files (dgr.plan.sources), the layout types (dgr.plan.layout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dgr.errors import CallerError, Reason
from dgr.gguf_meta import RECURRENT_HYBRID_ARCHS, is_recurrent_layer
from dgr.plan.layout import DEFAULT_UBATCH, ComputeRule, KvTerm, TensorInfo

__all__ = [
    "DSV4_COMPUTE_ANCHORS",
    "DSV4_COMPUTE_SOURCE",
    "GLM52_CONTEXT",
    "LLAMA_VOCAB_RESIDENT",
    "compute_rule_from_anchors",
    "gguf_compute_rule",
    "glm52_indexer_full",
    "glm_dsa_indexer_full",
    "kv_terms_for_layer",
    "meta_int",
]


# -- KV rules per architecture ---------------------------------------------------


def _per_layer(value: Any, il: int) -> int:
    """llama.cpp's get_key_or_arr: a scalar, or one value per layer."""
    if isinstance(value, (list, tuple)):
        return int(value[il])
    return int(value)


def meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    if key in meta:
        return int(meta[key])
    if default is None:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"model metadata has no {key}")
    return default



# GLM-5.2's indexer roles when a GGUF does not carry glm-dsa.attention.indexer.types: layers 0 to 2
# and every 4th after layer 2 run the indexer ("full"), the rest reuse its top-k (llama.cpp
# glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES, copied there from zai-org/GLM-5.2's config.json).
# GLM-5 and 5.1 (trained context under 1M) run it on every layer.
GLM52_CONTEXT = 1048576


def glm52_indexer_full(il: int) -> bool:
    """GLM-5.2's default indexer role of layer `il`: True for "full", False for "shared"."""
    return il < 3 or (il - 2) % 4 == 0


def glm_dsa_indexer_full(meta: Mapping[str, Any], il: int) -> bool:
    """Whether layer `il` of a glm-dsa model runs its own lightning indexer (llama.cpp's rule)."""
    types = meta.get("glm-dsa.attention.indexer.types")
    if types is not None:
        return bool(_per_layer(types, il))
    if int(meta.get("glm-dsa.context_length", 0) or 0) < GLM52_CONTEXT:
        return True
    return glm52_indexer_full(il)


def kv_terms_for_layer(
    arch: str, meta: Mapping[str, Any], il: int, tensors: Sequence[TensorInfo] = ()
) -> tuple[str, tuple[KvTerm, ...]]:
    """The layer's kind and its per-sequence KV terms, from GGUF metadata and the layer's tensors.

    deepseek4 (llama.cpp src/llama-kv-cache-dsv4.cpp): every layer has a raw
    K-only sliding-window cache (K is also V, 512 wide). Ratio-4 layers (CSA)
    add a compressed K cache (one 512-wide row per 4 tokens), the lightning
    indexer's keys (one 128-wide row per 4 tokens) and f32 compressor state
    (kv + score, 2 x ratio rows of 2 x 512, and 2 x ratio rows of 2 x 128 for
    the indexer). Ratio-128 layers (HCA) add one 512-wide row per 128 tokens
    and f32 state of 128 rows x 512 (kv + score). Ratio 0: window only.

    glm-dsa (llama.cpp src/models/glm-dsa.cpp, src/llama-kv-cache.cpp): MLA
    caches one K row per token, kv_lora_rank + rope wide, and no V (V is
    the latent part of K). A "full" indexer layer also caches the lightning
    indexer's key, indexer.key_length wide; a "share" layer reuses the
    top-k of the full layer before it and caches no indexer key (llama.cpp
    PR 26474).

    qwen35moe / qwen35 / qwen3next: a gated-delta-net ("delta") layer keeps,
    per sequence, f32 state whatever the context: the convolution's last
    conv_kernel - 1 inputs (q, k and v: inner_size + 2 x group_count x
    state_size wide) and the delta rule's state_size x inner_size matrix.
    The other layers ("attn") are full attention, priced as below.

    Every other architecture is priced by what each layer's tensors compute:
    - a recurrent layer (Mamba-style SSM, RWKV, LFM2 short convolution) keeps
      fixed f32 state per sequence (`_recurrent_terms`), kind "ssm", "rwkv"
      or "conv";
    - an attention layer caches K and V, one row per token each, as wide as
      its attn_k / attn_v output (which is head_count_kv x key/value_length),
      or from the metadata when it has no separate attn_k / attn_v (fused
      QKV); an MLA layer (key_length_mla set) one K-only latent row, kind
      "mla", with the indexer's keys where the model has an indexer. Gemma 2
      and 3 layers that llama.cpp makes sliding-window (`_swa_layers`, as
      llama.cpp's load_swa_pattern derives them from the file) are kind
      "swa", their K and V a window of `attention.sliding_window` rows;
    - a layer with both (falcon-h1) keeps both, kind "ssm+attn"; one with
      neither (nemotron_h's FFN-only layers) nothing, kind "ffn".
    """
    p = f"{arch}."
    if arch == "deepseek4":
        head = meta_int(meta, p + "attention.key_length")
        window = meta_int(meta, p + "attention.sliding_window")
        index_dim = meta_int(meta, p + "attention.indexer.key_length")
        ratio = _per_layer(meta[p + "attention.compress_ratios"], il)
        terms = [KvTerm("raw_k", head, window=window)]
        if ratio == 0:
            return "swa", tuple(terms)
        if ratio == 4:
            terms += [
                KvTerm("csa_k", head, every=4),
                KvTerm("indexer_k", index_dim, every=4),
                KvTerm("csa_state", 2 * head, dtype="f32", fixed=2 * 2 * ratio, pad=1),
                KvTerm("indexer_state", 2 * index_dim, dtype="f32", fixed=2 * 2 * ratio, pad=1),
            ]
            return "csa", tuple(terms)
        if ratio == 128:
            terms += [
                KvTerm("hca_k", head, every=128),
                KvTerm("hca_state", head, dtype="f32", fixed=2 * ratio, pad=1),
            ]
            return "hca", tuple(terms)
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"deepseek4 layer {il}: compress ratio {ratio} is not 0, 4 or 128")
    if arch == "glm-dsa":
        mla = meta_int(meta, p + "attention.kv_lora_rank") + meta_int(meta, p + "rope.dimension_count")
        terms = [KvTerm("mla_k", mla, every=1)]
        if not glm_dsa_indexer_full(meta, il):
            return "share", tuple(terms)
        terms.append(KvTerm("indexer_k", meta_int(meta, p + "attention.indexer.key_length"), every=1))
        return "full", tuple(terms)
    if arch in RECURRENT_HYBRID_ARCHS and is_recurrent_layer(arch, meta, il):
        d_conv = meta_int(meta, p + "ssm.conv_kernel")
        d_inner = meta_int(meta, p + "ssm.inner_size")  # value heads x head size
        d_state = meta_int(meta, p + "ssm.state_size")
        n_group = meta_int(meta, p + "ssm.group_count")  # key heads
        conv_dim = d_inner + 2 * n_group * d_state  # q, k and v go through the convolution
        return "delta", (
            KvTerm("conv_state", conv_dim, dtype="f32", fixed=d_conv - 1, pad=1),
            KvTerm("delta_state", d_state * d_inner, dtype="f32", fixed=1, pad=1),
        )
    if arch == "minimax-01" and is_recurrent_layer(arch, meta, il):
        # lightning attention: a key_length x key_length f32 state per head (llama.cpp's n_embd_s, n_embd_head_la)
        head, n_head = meta_int(meta, p + "attention.key_length"), _per_layer(meta[p + "attention.head_count"], 0)
        return "lightning", (KvTerm("la_state", head * head * n_head, dtype="f32", fixed=1, pad=1),)
    names = {t.name.split(".", 2)[2] for t in tensors}
    state = _recurrent_terms(p, meta, names)
    # attention where the layer has its tensors (or, without a tensor list, unless nothing says otherwise),
    # and never where the file gives the layer no KV heads (jamba, nemotron_h, granitehybrid, lfm2)
    attn = any(n.startswith(_ATTN_TENSORS) for n in names) if names else not state
    if _per_layer(meta.get(p + "attention.head_count_kv", 1), il) == 0:
        attn = False
    if not attn:
        return (_recurrent_kind(names) if state else "ffn"), state
    kind, kv = _attention_terms(arch, meta, il, tensors)
    return (kind if not state else f"{_recurrent_kind(names)}+{kind}"), state + kv


# A layer that has one of these computes attention, and caches K (and V) per token.
_ATTN_TENSORS = ("attn_k", "attn_v", "attn_qkv", "attn_kv_a_mqa", "attn_q.")


def _recurrent_kind(names: set[str]) -> str:
    if "ssm_conv1d.weight" in names:
        return "ssm"
    if "ssm_conv1d_q.weight" in names:
        return "kda"
    if "shortconv.conv.weight" in names:
        return "conv"
    return "rwkv"


def _recurrent_terms(p: str, meta: Mapping[str, Any], names: set[str]) -> tuple[KvTerm, ...]:
    """The fixed f32 state of a recurrent layer, per sequence, as llama.cpp's recurrent memory holds it
    (llama_hparams::n_embd_r and n_embd_s); () for a layer without one.

    - Mamba-style SSM layers (ssm_conv1d: mamba, mamba2, jamba, falcon-h1, granitehybrid, nemotron_h, plamo2):
      the convolution's last conv_kernel - 1 inputs, inner_size + 2 x group_count x state_size wide, and the
      state_size x inner_size SSM state;
    - RWKV layers (time_mix_*): token_shift_count x n_embd of token shift and n_embd x wkv.head_size of WKV state;
    - Kimi delta attention (ssm_conv1d_q/k/v: kimi-linear, bailingmoe3): the three convolutions' last
      conv_kernel - 1 inputs and a kda.head_dim x kda.head_dim state per head (llama.cpp's n_head(), layer 0's);
    - LFM2 short convolutions (shortconv.conv): the last l_cache - 1 inputs, n_embd wide.
    """
    if "ssm_conv1d.weight" in names:
        d_inner, d_state = meta_int(meta, p + "ssm.inner_size"), meta_int(meta, p + "ssm.state_size")
        conv = (meta_int(meta, p + "ssm.conv_kernel") - 1) * (d_inner + 2 * int(meta.get(p + "ssm.group_count", 0) or 0) * d_state)
        return (KvTerm("conv_state", conv, dtype="f32", fixed=1, pad=1),
                KvTerm("ssm_state", d_state * d_inner, dtype="f32", fixed=1, pad=1))  # fmt: skip
    if "ssm_conv1d_q.weight" in names:
        head, n_head = meta_int(meta, p + "kda.head_dim"), _per_layer(meta[p + "attention.head_count"], 0)
        conv = 3 * (meta_int(meta, p + "ssm.conv_kernel") - 1) * n_head * head
        return (KvTerm("conv_state", conv, dtype="f32", fixed=1, pad=1),
                KvTerm("kda_state", head * head * n_head, dtype="f32", fixed=1, pad=1))  # fmt: skip
    n_embd = meta_int(meta, p + "embedding_length")
    if "shortconv.conv.weight" in names:
        return (KvTerm("conv_state", n_embd * (meta_int(meta, p + "shortconv.l_cache") - 1), dtype="f32", fixed=1, pad=1),)
    if any(n.startswith("time_mix_") for n in names):
        shift = int(meta.get(p + "token_shift_count", 2) or 2)
        return (KvTerm("token_shift", shift * n_embd, dtype="f32", fixed=1, pad=1),
                KvTerm("wkv_state", n_embd * meta_int(meta, p + "wkv.head_size"), dtype="f32", fixed=1, pad=1))  # fmt: skip
    return ()


def _attention_terms(
    arch: str, meta: Mapping[str, Any], il: int, tensors: Sequence[TensorInfo]
) -> tuple[str, tuple[KvTerm, ...]]:
    """Attention's K and V rows of layer il (one per token, or a window), and the layer's kind."""
    p = f"{arch}."
    kind, rows = "attn", {"every": 1}
    window = _swa_window(arch, meta, il)
    if window:
        kind, rows = "swa", {"window": window}
    shapes = {t.name.split(".", 2)[2]: t.shape for t in tensors}
    # the layer has a sparse-attention indexer of its own (deepseek32, dots3note's full layers, minimax-m3)
    has_indexer = any(n.startswith("indexer.") for n in shapes) if shapes else (
        int(meta.get(p + "attention.indexer.head_count", 0) or 0) > 0)
    if int(meta.get(p + "attention.key_length_mla", 0) or 0) > 0:
        # MLA (deepseek2, deepseek32, mistral4, kimi-linear, dots3note): one K-only latent row per token,
        # key_length wide (kv_lora_rank + rope), V read from it; an indexer caches its keys too
        n_kv = _per_layer(meta.get(p + "attention.head_count_kv", 1), il)
        terms = [KvTerm("mla_k", n_kv * meta_int(meta, p + "attention.key_length"), **rows)]
        if has_indexer:
            terms.append(KvTerm("indexer_k", meta_int(meta, p + "attention.indexer.key_length"), **rows))
        return "mla", tuple(terms)
    # an indexer beside plain attention (minimax-m3) caches its keys and values, key_length wide each
    indexer = ()
    if has_indexer:
        width = meta_int(meta, p + "attention.indexer.key_length")
        indexer = (KvTerm("indexer_k", width, **rows), KvTerm("indexer_v", width, **rows))
    k_shape, v_shape = shapes.get("attn_k.weight"), shapes.get("attn_v.weight")
    if k_shape is not None and v_shape is not None:
        return kind, (KvTerm("k", k_shape[-1], **rows), KvTerm("v", v_shape[-1], **rows), *indexer)
    if p + "attention.head_count" not in meta:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED, f"layer {il}: no attn_k/attn_v tensors and no {p}attention.head_count"
        )
    n_head = _per_layer(meta[p + "attention.head_count"], il)
    n_kv = _per_layer(meta.get(p + "attention.head_count_kv", n_head), il)
    if not n_head:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"layer {il}: attention tensors, but no attention heads")
    n_embd = meta_int(meta, p + "embedding_length")
    k_len = meta_int(meta, p + "attention.key_length", n_embd // n_head)
    v_len = meta_int(meta, p + "attention.value_length", n_embd // n_head)
    return kind, (KvTerm("k", n_kv * k_len, **rows), KvTerm("v", n_kv * v_len, **rows))


# the architectures whose loader makes layers sliding-window by a period, and that period's
# (default length, dense_first), as llama.cpp's load_swa_pattern applies it (src/models/gemma2.cpp:4-6,
# gemma3.cpp:4-9)
_SWA_PERIODS = {"gemma2": (2, False), "gemma3": (6, False)}


def _swa_layers(arch: str, n_layer: int, pattern: object) -> list[bool] | None:
    """Each layer's sliding-window flag, as llama.cpp's load_swa_pattern derives it; None without a period.

    `pattern` is the file's `{arch}.attention.sliding_window_pattern`: an array (one flag per layer),
    an integer period, or None (the architecture's default period).
    """
    if arch not in _SWA_PERIODS:
        return None
    if isinstance(pattern, (list, tuple)):
        return [bool(x) for x in pattern]
    n_pattern, dense_first = _SWA_PERIODS[arch]
    if pattern is not None:
        n_pattern = int(pattern)
    # src/llama-hparams.cpp, set_swa_pattern
    if dense_first:
        return [n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer)]
    return [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer)]


def _swa_window(arch: str, meta: Mapping[str, Any], il: int) -> int:
    """Layer il's sliding window as llama.cpp sets it (0: full attention).

    gemma2: always SWA, window 4096 unless the file says (src/models/gemma2.cpp:4-12);
    gemma3: SWA only with attention.sliding_window > 0 (src/models/gemma3.cpp:4-12).
    """
    if arch not in _SWA_PERIODS:
        return 0
    p = f"{arch}."
    window = int(meta.get(p + "attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if window <= 0:
        return 0
    n_layer = meta_int(meta, p + "block_count")
    flags = _swa_layers(arch, n_layer, meta.get(p + "attention.sliding_window_pattern"))
    return window if flags and flags[il] else 0


# -- llama.cpp CPU compute buffer for GGUF files ---------------------------------


# unslothai/unsloth PR 6940 measured DeepSeek-V4-Flash's compute buffer on CUDA at ubatch 512:
# about 2 GiB at 16K context, about 65.5 GiB at 1M (the lightning indexer's scores grow with context).
DSV4_COMPUTE_ANCHORS = ((16384, 2 * 2**30), (1048576, int(65.5 * 2**30)))
DSV4_COMPUTE_SOURCE = "unsloth PR 6940: DSV4 compute buffer ~2 GiB at 16K, ~65.5 GiB at 1M context (CUDA, ubatch 512)"

# Resident bytes per vocabulary entry that a loaded llama.cpp model holds beyond its weights and
# KV (the vocabulary, the GGUF metadata, graph bookkeeping): 17.4 MB for SmolLM2's 49,152 tokens.
LLAMA_VOCAB_RESIDENT = 384


def compute_rule_from_anchors(anchors: Sequence[Sequence[int]], source: str) -> ComputeRule:
    """The line through two (context, compute-buffer bytes) measurements."""
    (c0, b0), (c1, b1) = anchors
    per_ctx = (b1 - b0) / (c1 - c0)
    return ComputeRule(int(b0 - per_ctx * c0), per_ctx, source)


def gguf_compute_rule(arch: str, meta: Mapping[str, Any], vocab: int) -> ComputeRule:
    """Resident llama.cpp CPU buffers of a GGUF model beyond weights and KV, at ubatch 512.

    llama.cpp allocates a compute buffer for the whole graph, logits included
    (a shard GGUF keeps the LM head), but dgr never computes more than one row
    of logits, so most of it is never touched and never resident. What is: the
    activations of one ubatch, which measured at ubatch x vocab bytes, and
    LLAMA_VOCAB_RESIDENT bytes per vocabulary entry; plus the f16 attention
    mask, context x ubatch (flash attention, llama.cpp's CPU default). Fit to
    SmolLM2-135M by dgr/bench/plan_overhead.py: a guess for other models, which
    that script re-measures. deepseek4 uses the measured DSV4 rule instead.
    """
    if arch == "deepseek4":
        return compute_rule_from_anchors(DSV4_COMPUTE_ANCHORS, DSV4_COMPUTE_SOURCE)
    return ComputeRule(
        fixed_bytes=vocab * (DEFAULT_UBATCH + LLAMA_VOCAB_RESIDENT),
        per_ctx_bytes=float(DEFAULT_UBATCH * 2),
        source="llama.cpp CPU, measured on SmolLM2: vocab x (ubatch + 384) + f16 mask of context x ubatch",
    )
