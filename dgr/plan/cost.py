"""The cost model: every byte a node is charged for a layer range, and the seam frames at each boundary.

`shard_cost` prices one node's shard: its layer weights, the global tensors
it must load, its Hot KV State at the given context and session count (per
layer kind, see dgr.plan.layout), the llama.cpp compute and output buffers,
and the runtime. What is left of the node's memory is its headroom.

Globals: with `GlobalNeed.COMPUTE` (the default) each global is charged
only where it is computed with, which is what the layer-range API creates
when dgr's llama_shard backend loads a range straight from the full file
(dgr.backends.llama_engine): token_embd on the head, output_norm and output
on the tail, shared ones everywhere. `GlobalNeed.LOADER` charges every shard
for every global, as a derived shard GGUF held them before that API.

The seam: `seam_hops` prices the frames that cross each boundary, with the
model's seam width (DeepSeek-V4: 4 x hidden_size, its hyper-connection
streams) and the token ids that hash-routed layers need.

A node with a GPU (Node.gpu_bytes) gets a placement (dgr.plan.gpu): the
most of its range's slots, counted back from its end as `--gpu-layers`
counts them, whose GPU buffers fit its GPU; the rest, and every host buffer,
is charged to its memory.

Left out: measuring nodes. A plan predicts; `python -m dgr.bench.plan_overhead`
checks the prediction against the RSS of real llama.cpp shards, and
tests_gpu/test_plan_buffers.py each buffer of a GPU placement against llama.cpp's log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from dgr.artifact.constants import GlobalNeed
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role, layer_of
from dgr.plan.gpu import GpuPlacement, fit
from dgr.plan.layout import DEFAULT_UBATCH, KV_DTYPES, ModelLayout
from dgr.plan.sizes import Node
from dgr.seam.wire import DTYPE_SIZE, HEADER_SIZE, MAX_FRAME_BYTES, DType

__all__ = [
    "GPU_RESERVE_BYTES",
    "LLAMA_CPU_RUNTIME_BYTES",
    "PlanParams",
    "SeamHop",
    "ShardCost",
    "seam_hops",
    "shard_compute_bytes",
    "shard_cost",
    "shard_global_bytes",
]


# RSS of a dgr node process before it loads a model: Python, numpy, trio, quart,
# h11, httpx, cryptography (the node's Ed25519 identity) and llama.cpp's
# libraries. 73 to 74 MiB with llama-cpp-python 0.3.36 on this machine before node
# identities; 85.9 MiB since (tests/test_plan.py measures it). The same packages
# take 83 MiB in a long-used virtualenv and 91.8 to 92.2 MiB in one made fresh by
# `make test` (what CI runs): budgeted at the fresh figure, rounded up.
LLAMA_CPU_RUNTIME_BYTES = 100 * 2**20

# Device memory a node's GPU backend takes besides llama.cpp's buffers (the driver's context, the
# kernels, a BLAS workspace). An allowance, not measured here: it varies with the driver and the card,
# and is a few hundred MiB for CUDA; `dgr plan --gpu-reserve` changes it.
GPU_RESERVE_BYTES = 512 * 2**20


@attrs.frozen
class PlanParams:
    """What the plan is for: context and sessions per node, KV dtype, and what a node costs to run."""

    context: int = 4096  # positions per session
    sessions: int = 1  # concurrent Route Sessions each node keeps KV for
    kv_dtype: str = "f16"
    ubatch: int = DEFAULT_UBATCH
    # llama.cpp's default keeps sliding-window caches at full context; DeepSeek-V4 needs it off
    # (llama_context_params.swa_full = false), or every layer's 128-token window costs a full cache.
    swa_full: bool = False
    globals_need: GlobalNeed = attrs.field(default=GlobalNeed.COMPUTE, converter=GlobalNeed)
    runtime_bytes: int = LLAMA_CPU_RUNTIME_BYTES
    seam_width: int | None = None  # None: the model's own
    seam_dtype: str = "f32"
    prefill_chunk: int = 512
    fewest: bool = True  # False: use every node given
    cpu_moe: bool = False  # a GPU node keeps its routed experts in host memory (`--cpu-moe`)
    gpu_reserve_bytes: int = GPU_RESERVE_BYTES

    def __attrs_post_init__(self) -> None:
        if self.context < 1 or self.sessions < 1 or self.ubatch < 1 or self.prefill_chunk < 1:
            raise CallerError(Reason.INVALID_REQUEST, "context, sessions, ubatch and prefill chunk must be positive")
        if self.gpu_reserve_bytes < 0:
            raise CallerError(Reason.INVALID_REQUEST, "the GPU reserve cannot be negative")
        if self.kv_dtype not in KV_DTYPES:
            raise CallerError(Reason.INVALID_REQUEST, f"KV dtype must be one of {', '.join(KV_DTYPES)}")
        if self.seam_dtype.upper() not in DType.__members__:
            raise CallerError(Reason.INVALID_REQUEST, "seam dtype must be f32 or f16")

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["globals_need"] = self.globals_need.value
        return d


@attrs.frozen
class ShardCost:
    """One node's shard and every byte it is charged: in host memory, and on a GPU node in its GPU too."""

    node: Node
    layers: LayerRange
    weight_bytes: int  # the layers' tensors
    global_bytes: int  # global tensors this shard loads (a tied head on the GPU: both copies)
    kv_bytes: int  # Hot KV State for all sessions at full context
    compute_bytes: int  # llama.cpp compute and output buffers (shard_compute_bytes; a GPU node: both devices')
    runtime_bytes: int
    kv_by_kind: dict[str, int]  # layer kind -> KV bytes, so per-kind rates show
    active_bytes: int  # weight bytes one decode token reads on this shard
    placement: GpuPlacement | None = None  # a GPU node's: what its GPU holds, and each buffer (dgr.plan.gpu)

    @property
    def total_bytes(self) -> int:
        reserve = self.placement.reserve_bytes if self.placement else 0
        return (self.weight_bytes + self.global_bytes + self.kv_bytes + self.compute_bytes + self.runtime_bytes
                + reserve)  # fmt: skip

    @property
    def host_bytes(self) -> int:
        """What the node's host memory holds."""
        return self.placement.cpu.total + self.runtime_bytes if self.placement else self.total_bytes

    @property
    def headroom_bytes(self) -> int:
        """Memory left on the node: host and GPU together (a placement fits each on its own)."""
        return self.node.memory_bytes + self.node.gpu_bytes - self.total_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node.name,
            "memory_bytes": self.node.memory_bytes,
            "gpu_memory_bytes": self.node.gpu_bytes,
            "layers": str(self.layers),
            "weight_bytes": self.weight_bytes,
            "global_bytes": self.global_bytes,
            "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes,
            "runtime_bytes": self.runtime_bytes,
            "kv_by_kind": dict(self.kv_by_kind),
            "active_bytes": self.active_bytes,
            "total_bytes": self.total_bytes,
            "host_bytes": self.host_bytes,
            "headroom_bytes": self.headroom_bytes,
            "placement": self.placement.to_json() if self.placement else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardCost:
        placement = d.get("placement")
        return cls(
            node=Node(d["node"], int(d["memory_bytes"]), int(d.get("gpu_memory_bytes", 0))),
            layers=LayerRange.parse(d["layers"]),
            weight_bytes=int(d["weight_bytes"]),
            global_bytes=int(d["global_bytes"]),
            kv_bytes=int(d["kv_bytes"]),
            compute_bytes=int(d["compute_bytes"]),
            runtime_bytes=int(d["runtime_bytes"]),
            kv_by_kind={k: int(v) for k, v in d["kv_by_kind"].items()},
            active_bytes=int(d["active_bytes"]),
            placement=GpuPlacement.from_json(placement) if placement else None,
        )


@attrs.frozen
class SeamHop:
    """The frames crossing one boundary between consecutive shards."""

    boundary: int  # the first layer of the receiving shard
    token_ids: bool  # the model's layers read token ids (hash routing), so every frame carries them
    decode_bytes: int  # one decode step, header included
    prefill_bytes: int  # one prefill chunk of `prefill_chunk` positions
    max_chunk: int  # most positions one frame may carry (MAX_FRAME_BYTES)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def shard_global_bytes(layout: ModelLayout, params: PlanParams, *, is_head: bool, is_tail: bool) -> tuple[int, int]:
    """(bytes loaded, bytes read per decode token) of the globals one shard holds."""
    loaded = active = 0
    for g in layout.globals:
        computes = g.needed_by(is_head=is_head, is_tail=is_tail)
        # A next-token-prediction layer lives only on the tail, even in a shard file.
        loads = computes or (params.globals_need is GlobalNeed.LOADER and layer_of(g.name) is None)
        if loads:
            loaded += g.n_bytes
        if computes and (is_tail or g.role is not Role.HEAD_TAIL):
            active += g.active_bytes  # a head only looks up embedding rows; a tied tail reads them all
    return loaded, active


def shard_compute_bytes(layout: ModelLayout, params: PlanParams, *, is_tail: bool) -> int:
    """llama.cpp's compute buffer and output buffer for one shard.

    The model's rule as fitted (dgr.plan.rules.gguf_compute_rule), for every
    shard. A range that stops before the last layer has no LM head (the
    layer-range API ends its graph at the residual stream), but what of its
    compute buffer becomes resident is no smaller: taking the ubatch x vocab
    term out left a middle range of SmolLM2 5% above its plan
    (dgr/bench/plan_overhead.py, 12:24 of 3). It also keeps an output buffer
    of ubatch x seam width f32 hidden states.
    """
    base = layout.compute.nbytes(params.context)
    if is_tail:
        return base
    return base + params.ubatch * layout.seam_width * 4


def shard_cost(layout: ModelLayout, params: PlanParams, node: Node, layers: LayerRange) -> ShardCost:
    """Every byte `node` is charged for serving `layers` of `layout`; on a node with a GPU, placed by
    dgr.plan.gpu.fit (the most slots its GPU holds)."""
    is_head, is_tail = layers.start == 0, layers.stop == layout.n_layers
    g_loaded, g_active = shard_global_bytes(layout, params, is_head=is_head, is_tail=is_tail)
    weights = active = 0
    kinds: dict[str, int] = {}
    for layer in layout.layers[layers.start : layers.stop]:
        weights += layer.weight_bytes
        active += layer.active_bytes
        kv = layer.kv_bytes(params.context, params.sessions, params.kv_dtype, params.ubatch, params.swa_full)
        kinds[layer.kind] = kinds.get(layer.kind, 0) + kv
    placement = fit(layout, params, layers, node.gpu_bytes) if node.gpu_bytes else None
    if placement is not None:
        g_loaded = placement.gpu.model + placement.cpu.model - weights
    return ShardCost(
        node=node,
        layers=layers,
        weight_bytes=weights,
        global_bytes=g_loaded,
        kv_bytes=sum(kinds.values()),
        compute_bytes=(shard_compute_bytes(layout, params, is_tail=is_tail) if placement is None else
                       placement.gpu.compute + placement.cpu.compute + placement.cpu.output),
        runtime_bytes=params.runtime_bytes,
        kv_by_kind=kinds,
        active_bytes=active + g_active,
        placement=placement,
    )


def seam_hops(layout: ModelLayout, params: PlanParams, ranges: Sequence[LayerRange]) -> tuple[SeamHop, ...]:
    """The frame sizes at each boundary of a route (dgr.seam.wire's frame: header + ids + floats)."""
    width = params.seam_width or layout.seam_width
    value = DTYPE_SIZE[DType[params.seam_dtype.upper()]]
    hops = []
    for r in ranges[1:]:
        # a range of DeepSeek-V4 takes the token ids beside the streams wherever it starts (llama.cpp's
        # deepseek4 range refuses a batch without them: they also tell text rows from media rows)
        ids = layout.needs_token_ids
        per_pos = width * value + (4 if ids else 0)
        hops.append(
            SeamHop(
                boundary=r.start,
                token_ids=ids,
                decode_bytes=HEADER_SIZE + per_pos,
                prefill_bytes=HEADER_SIZE + params.prefill_chunk * per_pos,
                max_chunk=(MAX_FRAME_BYTES - HEADER_SIZE) // per_pos,
            )
        )
    return tuple(hops)
