"""The shard planner: which contiguous layers each node serves, and whether the model fits.

    sizes    sizes and nodes as people type them (24GiB, --node a=24GiB, --node a=128GiB,gpu=24GiB)
    layout   ModelLayout: a model's memory and seam shape without tensor data
    rules    llama.cpp's rules: KV per layer kind, where shards may be cut, compute buffers
    sources  layouts from a GGUF header, a layout JSON or a manifest
    params   PlanParams: what a plan is for (context, sessions, KV type, GPU options), a node's runtime
    cost     every byte a shard is charged, and the seam frames
    gpu      a GPU node's placement: which of its range's layers its GPU holds, each buffer's bytes
    search   fewest nodes that fit, then the largest smallest headroom
    latency  decode time per token of a plan, from stated assumptions
    render   the `dgr plan` table
    cli      the `dgr plan` command
"""

from dgr.plan.cost import SeamHop, ShardCost, seam_hops, shard_cost
from dgr.plan.gpu import Buffers, GpuPlacement
from dgr.plan.latency import LatencyEstimate, decode_latency
from dgr.plan.layout import KV_DTYPES, KvTerm, ModelLayout
from dgr.plan.params import GPU_RESERVE_BYTES, LLAMA_CPU_RUNTIME_BYTES, PlanParams
from dgr.plan.render import render_plan
from dgr.plan.search import Plan, fitting_ranges, plan, plan_even
from dgr.plan.sizes import Node, format_size, parse_nodes, parse_size
from dgr.plan.sources import layout_from_gguf, layout_from_json, layout_from_manifest, load_layout

__all__ = [
    "GPU_RESERVE_BYTES",
    "KV_DTYPES",
    "LLAMA_CPU_RUNTIME_BYTES",
    "Buffers",
    "GpuPlacement",
    "KvTerm",
    "LatencyEstimate",
    "ModelLayout",
    "Node",
    "Plan",
    "PlanParams",
    "SeamHop",
    "ShardCost",
    "decode_latency",
    "format_size",
    "layout_from_gguf",
    "layout_from_json",
    "layout_from_manifest",
    "load_layout",
    "parse_nodes",
    "parse_size",
    "plan",
    "plan_even",
    "fitting_ranges",
    "render_plan",
    "seam_hops",
    "shard_cost",
]
