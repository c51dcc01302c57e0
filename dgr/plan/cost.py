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
from dgr.gguf_meta import Role, layer_of
from dgr.plan.gpu import GpuPlacement, fit
from dgr.plan.layout import ModelLayout
from dgr.plan.params import PlanParams
from dgr.plan.sizes import Node
from dgr.seam.wire import DTYPE_SIZE, HEADER_SIZE, MAX_FRAME_BYTES, DType

__all__ = [
    "SeamHop",
    "ShardCost",
    "seam_hops",
    "shard_compute_bytes",
    "shard_cost",
    "shard_global_bytes",
]


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
