"""Model Layouts: what the shard planner needs to know about a model, and nothing more.

A `ModelLayout` is the memory and traffic shape of a model with no tensor
data: per layer, the bytes of its tensors, the bytes a decode step reads, and
how its Hot KV State grows with context; the global tensors and which end of
a route needs them; the seam width; the compute-buffer rule.

KV is computed per layer *kind*, never as layers x one rate. Each layer lists
`KvTerm`s, one per cache llama.cpp allocates for it, and a term's rows grow
with context in one of three ways: every `every` tokens (a full cache is
every=1, DeepSeek-V4's compressed caches every=4 or 128), a sliding window
(rows = min(context, window + ubatch), as llama.cpp's SWA cache keeps one
ubatch beyond the window; or the whole context when llama.cpp keeps a
full-size SWA cache), or fixed (recurrent-like compressor state). Rows are
padded as llama.cpp pads them (256 for its KV caches).

Left out: where layouts come from (dgr.plan.sources), the per-architecture
rules that fill them in (dgr.plan.rules), and the plan itself (dgr.plan.search).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import gguf

from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role

__all__ = [
    "DEFAULT_UBATCH",
    "KV_DTYPES",
    "LAYOUT_FORMAT",
    "LLAMA_KV_PAD",
    "ComputeRule",
    "GlobalTensor",
    "KvTerm",
    "LayerInfo",
    "ModelLayout",
    "TensorInfo",
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
    # for a GPU placement (dgr.plan.gpu): the routed-expert bytes `--cpu-moe` keeps in host memory, the
    # largest tensor an op reads as a weight (not a lookup table), and the largest expert tensor
    expert_bytes: int = 0
    largest_bytes: int = 0
    largest_expert_bytes: int = 0

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
    # Layers a shard may start at (0 always may); None: any. glm-dsa: the full-indexer layers,
    # since a shared-indexer layer reuses the top-k of the full one before it (glm-dsa.cpp).
    shard_starts: frozenset[int] | None = None
    # Non-empty: why this model runs only whole (nothing sets it from a file today: the layer-range
    # API keeps every hparam of the whole model in each range).
    whole_only: str = ""

    @property
    def needs_token_ids(self) -> bool:
        return self.hash_layers > 0

    def split_rule(self) -> str:
        """The constraints on where shards may be cut, in words (for refusals)."""
        if self.whole_only:
            return self.whole_only
        rules = []
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
