"""Model Layouts: what the shard planner needs to know about a model, and nothing more.

A `ModelLayout` is the memory and traffic shape of a model with no tensor
data: per layer, the bytes of its tensors, the bytes a decode step reads, and
how its Hot KV State grows with context; the global tensors and which end of
a route needs them; the seam width; the compute-buffer rule.

Three sources give the same layout:
- a GGUF file, read header-only with gguf-py's `GGUFReader` (it memory-maps,
  so no tensor data is read);
- a layout JSON (`format: dgr-layout/1`), which describes tensors per layer
  group with a quantization recipe, so a 284B model needs no file at all
  (tests/fixtures/deepseek-v4-flash.layout.json is one);
- a Model Artifact manifest (`layout_from_manifest`).

KV is computed per layer *kind*, never as layers x one rate. Each layer lists
`KvTerm`s, one per cache llama.cpp allocates for it, and a term's rows grow
with context in one of three ways: every `every` tokens (a full cache is
every=1, DeepSeek-V4's compressed caches every=4 or 128), a sliding window
(rows = min(context, window + ubatch), as llama.cpp's SWA cache keeps one
ubatch beyond the window; or the whole context when llama.cpp keeps a
full-size SWA cache), or fixed (recurrent-like compressor state). Rows are
padded as llama.cpp pads them (256 for its KV caches). bench/dsv4_tiny.py
checks these terms against the cache sizes llama.cpp itself logs.

A layout also says which layer kinds every shard must hold
(`shard_needs`): llama.cpp cannot run a DeepSeek-V4 shard without a CSA
and an HCA layer, nor a Qwen3.5 shard without a full-attention layer; and
at which layers a shard may start (`shard_starts`):
a GLM-5.2 ("glm-dsa") layer with a shared indexer reuses the top-k of the
last full-indexer layer before it, so a shard must start at a full one.

Besides deepseek4, the KV rules know two more kinds of layer:
- glm-dsa (GLM-5 to 5.2, llama.cpp src/models/glm-dsa.cpp): MLA keeps one
  K-only latent row per token (kv_lora_rank + rope wide; V is read from
  it), and a "full" indexer layer adds the lightning indexer's keys;
- qwen35moe / qwen35 / qwen3next (Qwen3.5, Ornith): a gated-delta-net
  layer keeps fixed f32 recurrent state (a conv window and the delta-rule
  matrix), and every `full_attention_interval`-th layer is full attention.

Left out: the plan itself (dgr.plan), and any tensor data.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import gguf

from dgr.artifact.constants import GLOBAL_ROLES, MANIFEST_KIND, Role
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = [
    "DEFAULT_UBATCH",
    "DSV4_COMPUTE_ANCHORS",
    "DSV4_COMPUTE_SOURCE",
    "GLM52_CONTEXT",
    "KV_DTYPES",
    "LAYOUT_FORMAT",
    "LLAMA_KV_PAD",
    "LLAMA_VOCAB_RESIDENT",
    "RECURRENT_HYBRID_ARCHS",
    "ComputeRule",
    "GlobalTensor",
    "KvTerm",
    "LayerInfo",
    "ModelLayout",
    "TensorInfo",
    "build_layout",
    "compute_rule_from_anchors",
    "gguf_compute_rule",
    "glm52_indexer_full",
    "glm_dsa_indexer_full",
    "kv_terms_for_layer",
    "layout_from_gguf",
    "layout_from_json",
    "layout_from_manifest",
    "load_layout",
    "row_bytes",
    "tensor_nbytes",
]

LAYOUT_FORMAT = "dgr-layout/1"

# KV cache dtypes llama.cpp offers (--cache-type-k/-v) that the planner prices.
KV_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# llama.cpp pads every KV cache it allocates to a multiple of 256 cells
# (llama_context pads n_ctx; the SWA and DSV4 compressed caches use GGML_PAD(.., 256)).
LLAMA_KV_PAD = 256

# llama.cpp's default physical batch; the SWA cache keeps this many rows beyond the window.
DEFAULT_UBATCH = 512

_BLK = re.compile(r"^blk\.(\d+)\.")
_ROUTED = re.compile(r"_exps?\.")  # stacked routed-expert tensors (ffn_*_exps)


def _ggml_type(name: str) -> gguf.GGMLQuantizationType:
    try:
        return gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        raise CallerError(Reason.INVALID_REQUEST, f"unknown ggml type {name!r}") from None


def tensor_nbytes(ggml_type: str, shape: Iterable[int]) -> int:
    """Bytes of a tensor of `shape` (ggml order, ne0 first) stored as `ggml_type`.

    Raises:
        CallerError(INVALID_REQUEST): unknown type, or rows not a whole number of blocks.
    """
    qt = _ggml_type(ggml_type)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    dims = [int(d) for d in shape]
    if not dims or dims[0] % block:
        raise CallerError(
            Reason.INVALID_REQUEST, f"a {qt.name} row must be a multiple of {block} values, shape is {dims}"
        )
    return math.prod(dims) // block * size


def row_bytes(dtype: str, width: int) -> int:
    """Bytes of one cache row of `width` values in `dtype` (f32, f16, q8_0, ...)."""
    return tensor_nbytes(dtype, (width,))


@attrs.frozen
class TensorInfo:
    """One tensor of a model, without data. `shape` is ggml order (ne0 first)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    n_bytes: int


@attrs.frozen
class KvTerm:
    """One per-sequence cache of one layer and how its rows grow with context.

    Exactly one of `every`, `window`, `fixed` decides the rows:
    every=r: ceil(context / r) rows; window=w: min(context, w + ubatch) rows,
    or context rows when llama.cpp keeps a full-size SWA cache (`swa_full`,
    llama_context_default_params' default); fixed=n: n rows whatever the
    context. Rows are then padded to `pad`.
    `dtype` "cache" follows the planner's --kv-dtype; anything else is fixed
    (llama.cpp keeps DeepSeek-V4's compressor state in f32).
    """

    name: str
    width: int  # values per row
    dtype: str = "cache"
    every: int = 0
    window: int = 0
    fixed: int = 0
    pad: int = LLAMA_KV_PAD

    def __attrs_post_init__(self) -> None:
        if sum(1 for v in (self.every, self.window, self.fixed) if v) != 1:
            raise CallerError(Reason.INVALID_REQUEST, f"KV term {self.name!r}: set exactly one of every, window, fixed")

    def rows(self, context: int, ubatch: int = DEFAULT_UBATCH, swa_full: bool = False) -> int:
        if self.fixed:
            n = self.fixed
        elif self.window:
            n = context if swa_full else min(context, self.window + ubatch)
        else:
            n = -(-context // self.every)
        return -(-n // self.pad) * self.pad

    def nbytes(self, context: int, kv_dtype: str, ubatch: int = DEFAULT_UBATCH, swa_full: bool = False) -> int:
        """Bytes for one sequence at `context` positions."""
        dtype = kv_dtype if self.dtype == "cache" else self.dtype
        return self.rows(context, ubatch, swa_full) * row_bytes(dtype, self.width)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v or k in ("name", "width")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KvTerm:
        return cls(**data)


@attrs.frozen
class LayerInfo:
    """One transformer layer: its weight bytes, what a decode step reads, its KV."""

    index: int
    # "attn": full attention; "swa": sliding window (Gemma 2/3, DeepSeek-V4); "csa" | "hca": DeepSeek-V4;
    # "full" | "share": glm-dsa indexer roles; "delta": a gated-delta-net (recurrent) layer of Qwen3.5
    kind: str
    weight_bytes: int
    active_bytes: int  # weight bytes one decode token reads (routed experts: the used share)
    kv: tuple[KvTerm, ...]

    def kv_bytes(
        self, context: int, sessions: int, kv_dtype: str, ubatch: int = DEFAULT_UBATCH, swa_full: bool = False
    ) -> int:
        return sessions * sum(t.nbytes(context, kv_dtype, ubatch, swa_full) for t in self.kv)


@attrs.frozen
class GlobalTensor:
    """A non-layer tensor and which shards compute with it."""

    name: str
    n_bytes: int
    role: Role  # HEAD, TAIL, HEAD_TAIL or SHARED (dgr.artifact.constants)
    active_bytes: int = 0  # read per decode token by the shard that computes with it

    def needed_by(self, *, is_head: bool, is_tail: bool) -> bool:
        if self.role is Role.SHARED:
            return True
        if self.role is Role.HEAD:
            return is_head
        if self.role is Role.TAIL:
            return is_tail
        return is_head or is_tail  # HEAD_TAIL


@attrs.frozen
class ComputeRule:
    """Compute-buffer bytes of one node: fixed + per_ctx x context (at `ubatch`).

    The buffer llama.cpp reserves for one graph evaluation. It does not depend
    on the layer count much (buffers are reused layer to layer) but it does on
    the context for models whose attention scratch scales with it.
    """

    fixed_bytes: int
    per_ctx_bytes: float
    source: str

    def nbytes(self, context: int) -> int:
        return int(self.fixed_bytes + self.per_ctx_bytes * context)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class ModelLayout:
    """A model's memory and seam shape, per layer, without tensor data."""

    name: str
    architecture: str
    n_layers: int
    hidden_size: int
    seam_width: int  # floats per position crossing a seam
    hash_layers: int  # leading layers that route experts by token id; their node needs token ids
    vocab_size: int
    context_length: int
    layers: tuple[LayerInfo, ...]
    globals: tuple[GlobalTensor, ...]
    compute: ComputeRule
    source: str
    recipe: str | None = None
    # Layer kinds every shard must hold (_shard_needs). deepseek4: a shard with a CSA layer and no
    # HCA layer kills llama.cpp (SIGFPE at context creation; bench/dsv4_tiny.py), so each needs
    # both; qwen35moe: a shard without a full-attention layer aborts (bench/audit_tiny.py).
    shard_needs: frozenset[str] = frozenset()
    # Layers a shard may start at (0 always may); None: any. glm-dsa: the full-indexer layers,
    # since a shared-indexer layer reuses the top-k of the full one before it (glm-dsa.cpp).
    shard_starts: frozenset[int] | None = None
    # Non-empty: why this model runs only whole (llama.cpp switches a hparam by block count,
    # dgr.backends.llama_arch.check_split: Gemma 2/3 27B).
    whole_only: str = ""

    @property
    def needs_token_ids(self) -> bool:
        return self.hash_layers > 0

    def split_rule(self) -> str:
        """The constraints on where shards may be cut, in words (for refusals)."""
        if self.whole_only:
            return self.whole_only
        rules = []
        if self.shard_needs:
            rules.append(f"every shard must hold layers of kinds {sorted(self.shard_needs)}")
        if self.shard_starts is not None:
            rules.append(f"shards may start only at layers {sorted(self.shard_starts)}")
        return "; ".join(rules) or "one layer per shard at least"

    def layer_weight_bytes(self) -> int:
        return sum(layer.weight_bytes for layer in self.layers)

    def global_bytes(self) -> int:
        return sum(g.n_bytes for g in self.globals)

    def tensor_bytes(self) -> int:
        """All tensor bytes of the model, each counted once (a GGUF's data size)."""
        return self.layer_weight_bytes() + self.global_bytes()

    def kinds(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for layer in self.layers:
            out.setdefault(layer.kind, []).append(layer.index)
        return out


# -- KV rules per architecture ---------------------------------------------------


def _per_layer(value: Any, il: int) -> int:
    """llama.cpp's get_key_or_arr: a scalar, or one value per layer."""
    if isinstance(value, (list, tuple)):
        return int(value[il])
    return int(value)


def _meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    if key in meta:
        return int(meta[key])
    if default is None:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"model metadata has no {key}")
    return default


# Architectures whose linear-attention layers keep recurrent state (gated delta net) and whose
# every `full_attention_interval`-th layer is full attention (llama.cpp src/models/qwen35moe.cpp).
RECURRENT_HYBRID_ARCHS = ("qwen35moe", "qwen35", "qwen3next")

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


def _qwen35_is_recurrent(meta: Mapping[str, Any], p: str, il: int) -> bool:
    """Qwen3.5's layer kinds: an explicit per-layer array, else full attention every interval-th layer."""
    flags = meta.get(p + "attention.recurrent_layers")
    if flags is not None:
        return bool(_per_layer(flags, il))
    interval = int(meta.get(p + "full_attention_interval", 4) or 4)
    return (il + 1) % interval != 0


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

    Every other architecture is priced as attention: K and V, one row per
    token each, as wide as the layer's attn_k / attn_v output (which is
    head_count_kv x key/value_length), or from the metadata when the layer
    has no separate attn_k / attn_v (fused QKV). Gemma 2 and 3 layers that
    llama.cpp makes sliding-window (dgr.backends.llama_arch.swa_layers: the
    same per-layer pattern a shard file carries) are kind "swa", their K and V
    a window of `attention.sliding_window` rows.
    """
    p = f"{arch}."
    if arch == "deepseek4":
        head = _meta_int(meta, p + "attention.key_length")
        window = _meta_int(meta, p + "attention.sliding_window")
        index_dim = _meta_int(meta, p + "attention.indexer.key_length")
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
        mla = _meta_int(meta, p + "attention.kv_lora_rank") + _meta_int(meta, p + "rope.dimension_count")
        terms = [KvTerm("mla_k", mla, every=1)]
        if not glm_dsa_indexer_full(meta, il):
            return "share", tuple(terms)
        terms.append(KvTerm("indexer_k", _meta_int(meta, p + "attention.indexer.key_length"), every=1))
        return "full", tuple(terms)
    if arch in RECURRENT_HYBRID_ARCHS and _qwen35_is_recurrent(meta, p, il):
        d_conv = _meta_int(meta, p + "ssm.conv_kernel")
        d_inner = _meta_int(meta, p + "ssm.inner_size")  # value heads x head size
        d_state = _meta_int(meta, p + "ssm.state_size")
        n_group = _meta_int(meta, p + "ssm.group_count")  # key heads
        conv_dim = d_inner + 2 * n_group * d_state  # q, k and v go through the convolution
        return "delta", (
            KvTerm("conv_state", conv_dim, dtype="f32", fixed=d_conv - 1, pad=1),
            KvTerm("delta_state", d_state * d_inner, dtype="f32", fixed=1, pad=1),
        )
    kind, rows = "attn", {"every": 1}
    window = _swa_window(arch, meta, il)
    if window:
        kind, rows = "swa", {"window": window}
    shapes = {t.name.split(".", 2)[2]: t.shape for t in tensors}
    k_shape, v_shape = shapes.get("attn_k.weight"), shapes.get("attn_v.weight")
    if k_shape is not None and v_shape is not None:
        return kind, (KvTerm("k", k_shape[-1], **rows), KvTerm("v", v_shape[-1], **rows))
    if p + "attention.head_count" not in meta:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED, f"layer {il}: no attn_k/attn_v tensors and no {p}attention.head_count"
        )
    n_head = _per_layer(meta[p + "attention.head_count"], il)
    n_kv = _per_layer(meta.get(p + "attention.head_count_kv", n_head), il)
    n_embd = _meta_int(meta, p + "embedding_length")
    k_len = _meta_int(meta, p + "attention.key_length", n_embd // n_head)
    v_len = _meta_int(meta, p + "attention.value_length", n_embd // n_head)
    return kind, (KvTerm("k", n_kv * k_len, **rows), KvTerm("v", n_kv * v_len, **rows))


def _swa_window(arch: str, meta: Mapping[str, Any], il: int) -> int:
    """Layer il's sliding window as llama.cpp sets it (0: full attention).

    gemma2: always SWA, window 4096 unless the file says (src/models/gemma2.cpp:4-12);
    gemma3: SWA only with attention.sliding_window > 0 (src/models/gemma3.cpp:4-12).
    """
    from dgr.backends.llama_arch import SHARD_RULES, swa_layers

    rule = SHARD_RULES.get(arch)
    if rule is None or rule.swa_pattern is None:
        return 0
    p = f"{arch}."
    window = int(meta.get(p + "attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if window <= 0:
        return 0
    n_layer = _meta_int(meta, p + "block_count")
    flags = swa_layers(rule, n_layer, meta.get(p + "attention.sliding_window_pattern"))
    return window if flags and flags[il] else 0


# -- building a layout from (metadata, tensors) -------------------------------------


def _global_role(name: str, has_output: bool) -> Role:
    """Which end of a route computes with a global tensor (dgr.artifact.constants)."""
    prefix = name.split(".", 1)[0]
    if prefix.startswith("output_hc_"):
        return Role.TAIL  # DeepSeek-V4's hc_head collapses the 4 streams before output_norm
    role = GLOBAL_ROLES.get(prefix, Role.SHARED)
    if prefix == "token_embd" and not has_output:
        return Role.HEAD_TAIL  # tied embeddings: the tail's LM head is token_embd
    return role


def _active_bytes(t: TensorInfo, used_share: float) -> int:
    """Bytes of `t` one decode token reads: routed experts in their used share, lookup tables not at all."""
    if _ROUTED.search(t.name + "."):
        return int(t.n_bytes * used_share)
    if "tid2eid" in t.name or t.name.startswith("token_embd."):
        return 0  # one row per token
    return t.n_bytes


def _shard_needs(arch: str, kinds: set[str]) -> frozenset[str]:
    """Layer kinds every shard must hold, or llama.cpp dies creating its context.

    deepseek4: a CSA and an HCA layer (SIGFPE; bench/dsv4_tiny.py). qwen35moe and kin: a
    full-attention layer (a shard of gated-delta-net layers only aborts on its empty KV
    buffer, GGML_ASSERT(buffer); bench/audit_tiny.py).
    """
    if arch == "deepseek4":
        return frozenset({"csa", "hca"} & kinds)
    if arch in RECURRENT_HYBRID_ARCHS:
        return frozenset({"attn"} & kinds)
    return frozenset()


def build_layout(
    *,
    name: str,
    arch: str,
    meta: Mapping[str, Any],
    tensors: Iterable[TensorInfo],
    compute: ComputeRule,
    source: str,
    recipe: str | None = None,
    kv_override: Mapping[str, tuple[KvTerm, ...]] | None = None,
) -> ModelLayout:
    """Group tensors by layer and price each layer's KV. The one path every source takes.

    `blk.N.*` tensors belong to layer N; DeepSeek-V4's next-token-prediction
    layers (N >= block_count - nextn_predict_layers) are charged to the tail.
    `kv_override` maps a layer kind to explicit KV terms (a layout JSON may
    carry them); otherwise they come from `kv_terms_for_layer`.

    Raises:
        CallerError(MODEL_LOAD_FAILED): metadata or tensors do not describe the layers.
    """
    p = f"{arch}."
    n_all = _meta_int(meta, p + "block_count")
    n_trunk = n_all - int(meta.get(p + "nextn_predict_layers", 0) or 0)
    n_embd = _meta_int(meta, p + "embedding_length")
    hc = int(meta.get(p + "hyper_connection.count", 1) or 1)
    n_expert = int(meta.get(p + "expert_count", 0) or 0)
    used_share = int(meta.get(p + "expert_used_count", 0) or 0) / n_expert if n_expert else 1.0

    tensors = list(tensors)
    has_output = any(t.name.startswith("output.") for t in tensors)
    per_layer: list[list[TensorInfo]] = [[] for _ in range(n_trunk)]
    globals_: list[GlobalTensor] = []
    vocab = 0
    for t in tensors:
        if t.name.startswith("token_embd."):
            vocab = t.shape[1] if len(t.shape) > 1 else 0
        m = _BLK.match(t.name)
        if m is None:
            role = _global_role(t.name, has_output)
            # The head only looks up one embedding row per token; everything else is read whole
            # (tied embeddings are the tail's LM head).
            active = 0 if role is Role.HEAD else t.n_bytes
            globals_.append(GlobalTensor(t.name, t.n_bytes, role, active))
            continue
        il = int(m.group(1))
        if il >= n_all:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"tensor {t.name} is beyond block_count {n_all}")
        if il >= n_trunk:
            globals_.append(GlobalTensor(t.name, t.n_bytes, Role.TAIL, _active_bytes(t, used_share)))
            continue
        per_layer[il].append(t)

    layers = []
    for il, ts in enumerate(per_layer):
        if not ts:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"layer {il} of {name} has no tensors")
        kind, kv = kv_terms_for_layer(arch, meta, il, ts)
        if kv_override is not None and kind in kv_override:
            kv = kv_override[kind]
        layers.append(
            LayerInfo(
                index=il,
                kind=kind,
                weight_bytes=sum(t.n_bytes for t in ts),
                active_bytes=sum(_active_bytes(t, used_share) for t in ts),
                kv=kv,
            )
        )
    return ModelLayout(
        name=name,
        architecture=arch,
        n_layers=n_trunk,
        hidden_size=n_embd,
        seam_width=hc * n_embd,
        hash_layers=int(meta.get(p + "hash_layer_count", 0) or 0),
        vocab_size=int(meta.get(p + "vocab_size", 0) or vocab),
        context_length=int(meta.get(p + "context_length", 0) or 0),
        layers=tuple(layers),
        globals=tuple(globals_),
        compute=compute,
        source=source,
        recipe=recipe,
        shard_needs=_shard_needs(arch, {layer.kind for layer in layers}),
        shard_starts=frozenset(layer.index for layer in layers if layer.kind == "full")
        if arch == "glm-dsa"
        else None,
        whole_only=_whole_only(arch, meta, n_trunk, n_embd),
    )


def _whole_only(arch: str, meta: Mapping[str, Any], n_layer: int, n_embd: int) -> str:
    """Why a split of this model would compute wrongly in llama.cpp, or "" (see check_split)."""
    from dgr.backends.llama_arch import SHARD_RULES, check_split

    rule = SHARD_RULES.get(arch)
    n_head = meta.get(f"{arch}.attention.head_count")
    if rule is None or not isinstance(n_head, int) or n_head <= 0 or n_layer < 2:
        return ""
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    try:
        check_split(rule, n_layer, 0, 1, n_embd=n_embd, n_head=n_head, head_dim=head_dim)
    except CallerError as exc:
        return exc.message
    return ""


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
    SmolLM2-135M by bench/plan_overhead.py: a guess for other models, which
    that script re-measures. deepseek4 uses the measured DSV4 rule instead.
    """
    if arch == "deepseek4":
        return compute_rule_from_anchors(DSV4_COMPUTE_ANCHORS, DSV4_COMPUTE_SOURCE)
    return ComputeRule(
        fixed_bytes=vocab * (DEFAULT_UBATCH + LLAMA_VOCAB_RESIDENT),
        per_ctx_bytes=float(DEFAULT_UBATCH * 2),
        source="llama.cpp CPU, measured on SmolLM2: vocab x (ubatch + 384) + f16 mask of context x ubatch",
    )


# -- sources ----------------------------------------------------------------------


def layout_from_gguf(path: str | Path) -> ModelLayout:
    """Read a GGUF's header (metadata and tensor table) into a layout. No tensor data is read.

    Raises:
        CallerError(MODEL_LOAD_FAILED): not a readable GGUF, or metadata missing.
    """
    p = check_gguf_file(path)
    try:
        reader = gguf.GGUFReader(p)
    except (ValueError, OSError) as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot parse GGUF {p}: {exc}") from None
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.", "GGUF.")):
            continue  # the vocabulary arrays are large and the planner needs none of them
        meta[key] = field.contents()
    arch = meta.get(gguf.Keys.General.ARCHITECTURE)
    if not arch:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has no general.architecture: {p}")
    tensors = [
        TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes)) for t in reader.tensors
    ]
    vocab = next((t.shape[1] for t in tensors if t.name.startswith("token_embd.")), 0)
    return build_layout(
        name=str(meta.get(gguf.Keys.General.NAME) or p.stem),
        arch=str(arch),
        meta=meta,
        tensors=tensors,
        compute=gguf_compute_rule(str(arch), meta, vocab),
        source=str(p),
    )


def _expand_layers(spec: Any, n_layers: int) -> list[int | None]:
    """A tensor group's layers: "all", "global", or a list of layer indices."""
    if spec == "global":
        return [None]
    if spec == "all":
        return list(range(n_layers))
    return [int(i) for i in spec]


def layout_from_json(data: Mapping[str, Any], *, recipe: str | None = None, source: str = "<json>") -> ModelLayout:
    """A `dgr-layout/1` description (tensors per layer group, priced by a recipe), or a manifest.

    The layout format:
      metadata       GGUF metadata keys the planner reads ({arch}.block_count, ...)
      tensor_groups  [{layers: "all" | "global" | [i, ...], tensors: [{name, shape, role}]}]
                     names use "{i}" for the layer index; shapes are ggml order
      recipes        {name: {types: {role: ggml type}}}: one quantization of the model
      default_recipe which recipe to price when none is asked for
      kv.kinds       optional explicit KV terms per layer kind (checked against the code)
      compute        {anchors: [[context, bytes], [context, bytes]], source}: a linear rule

    Raises:
        CallerError(INVALID_REQUEST | MODEL_LOAD_FAILED)
    """
    fmt = data.get("format")
    if fmt != LAYOUT_FORMAT:
        if data.get("kind") == MANIFEST_KIND:
            return layout_from_manifest(data)
        raise CallerError(Reason.INVALID_REQUEST, f"not a {LAYOUT_FORMAT} layout or a {MANIFEST_KIND} manifest")
    try:
        return _layout_from_json(data, recipe, source)
    except (KeyError, TypeError, ValueError) as exc:
        raise CallerError(
            Reason.INVALID_REQUEST, f"layout {source}: a field is missing or malformed: {exc!r}"
        ) from None


def _layout_from_json(data: Mapping[str, Any], recipe: str | None, source: str) -> ModelLayout:
    arch = str(data["architecture"])
    meta = dict(data["metadata"])
    recipes = data.get("recipes", {})
    name = recipe or data.get("default_recipe")
    if name not in recipes:
        raise CallerError(
            Reason.INVALID_REQUEST, f"unknown recipe {name!r}; this layout has: {', '.join(sorted(recipes))}"
        )
    types: Mapping[str, str] = recipes[name]["types"]
    n_all = _meta_int(meta, f"{arch}.block_count")
    tensors: list[TensorInfo] = []
    for group in data["tensor_groups"]:
        for il in _expand_layers(group["layers"], n_all):
            for t in group["tensors"]:
                role = t["role"]
                if role not in types:
                    raise CallerError(Reason.INVALID_REQUEST, f"recipe {name!r} gives no type for role {role!r}")
                tname = t["name"].format(i=il) if il is not None else t["name"]
                tensors.append(
                    TensorInfo(tname, types[role], tuple(t["shape"]), tensor_nbytes(types[role], t["shape"]))
                )
    compute = data.get("compute")
    if compute:
        rule = compute_rule_from_anchors(compute["anchors"], str(compute.get("source", "")))
    else:
        rule = ComputeRule(0, 0.0, "none given")
    kv_override = None
    if "kv" in data and "kinds" in data["kv"]:
        kv_override = {k: tuple(KvTerm.from_json(t) for t in ts) for k, ts in data["kv"]["kinds"].items()}
    return build_layout(
        name=str(data.get("name", source)),
        arch=arch,
        meta=meta,
        tensors=tensors,
        compute=rule,
        source=source,
        recipe=name,
        kv_override=kv_override,
    )


# Architectures whose KV the planner derives from GGUF metadata a manifest does not carry.
_METADATA_KV_ARCHS = {
    "deepseek4": "window, compression ratios",
    "glm-dsa": "kv_lora_rank, indexer roles",
    **{a: "recurrent layers, ssm sizes" for a in RECURRENT_HYBRID_ARCHS},
}


def layout_from_manifest(data: Mapping[str, Any]) -> ModelLayout:
    """A Model Artifact manifest (dgr.artifact.manifest, schema 1) as a layout.

    The manifest is checked (Manifest.from_json) and gives the model identity
    and every tensor's name, ggml type, shape and size: enough for weights
    and, through attn_k / attn_v shapes, for full-attention KV. It carries
    no other GGUF metadata, so architectures whose KV needs more (deepseek4:
    its window and compression ratios; glm-dsa: its MLA rank and indexer
    roles; Qwen3.5: its recurrent layers) are refused; plan those from the
    GGUF or a layout JSON.

    Raises:
        CallerError(ARTIFACT_MISMATCH): not a valid manifest.
        CallerError(MODEL_LOAD_FAILED): the architecture needs metadata a manifest lacks.
    """
    from dgr.artifact.manifest import (
        Manifest,  # deferred: the artifact plane is not needed to plan a GGUF
    )

    m = Manifest.from_json(data)
    arch = m.model.architecture
    if arch in _METADATA_KV_ARCHS:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"a manifest has no {arch} attention metadata ({_METADATA_KV_ARCHS[arch]}); "
            "plan this model from its GGUF or a layout JSON",
        )
    p = f"{arch}."
    meta = {
        "general.architecture": arch,
        p + "block_count": m.model.block_count,
        p + "embedding_length": m.model.hidden_size,
        p + "vocab_size": m.model.vocab_size,
        p + "context_length": m.model.context_length,
    }
    tensors = [TensorInfo(t.name, t.type, t.shape, t.size) for t in m.tensors]
    return build_layout(
        name=m.model.name or arch,
        arch=arch,
        meta=meta,
        tensors=tensors,
        compute=gguf_compute_rule(arch, meta, m.model.vocab_size),
        source=f"manifest {m.id[:12]} of {m.file.name}",
    )


def load_layout(path: str | Path, *, recipe: str | None = None) -> ModelLayout:
    """A layout from a GGUF file or a layout/manifest JSON file, chosen by content.

    Raises:
        CallerError(MODEL_LOAD_FAILED | INVALID_REQUEST)
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read {p}: {exc.strerror}") from None
    if head == b"GGUF":
        if recipe is not None:
            raise CallerError(Reason.INVALID_REQUEST, "--recipe applies to a layout JSON, not a GGUF file")
        return layout_from_gguf(p)
    try:
        data = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"{p} is neither GGUF nor JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CallerError(Reason.INVALID_REQUEST, f"{p}: a layout or manifest is a JSON object")
    return layout_from_json(data, recipe=recipe, source=str(p))
