"""`dgr plan`: argparse in, a plan table or JSON out. All the arithmetic is elsewhere in dgr.plan."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dgr.artifact.constants import GlobalNeed
from dgr.errors import CallerError, DgrError, Reason
from dgr.plan.params import GPU_RESERVE_BYTES, LLAMA_CPU_RUNTIME_BYTES, PlanParams
from dgr.plan.latency import decode_latency
from dgr.plan.layout import DEFAULT_UBATCH, KV_DTYPES
from dgr.plan.render import gpu_layers_flag, render_plan
from dgr.plan.search import ANSWER_TOKENS, PROMPT_POSITIONS, even_split, plan
from dgr.plan.sizes import parse_nodes, parse_size
from dgr.plan.sources import load_layout

__all__ = [
    "register",
]


def _handler(args: argparse.Namespace) -> int:
    try:
        model = args.model
        if model is None:
            from dgr.models import default_model_path

            model = default_model_path()
        layout = load_layout(Path(model), recipe=args.recipe)
        nodes = parse_nodes(args.nodes, args.memory, args.node or [], args.gpu_memory)
        params = PlanParams(
            context=args.context,
            sessions=args.sessions,
            kv_dtype=args.kv_dtype,
            ubatch=args.ubatch,
            swa_full=args.swa_full,
            globals_need=args.globals,
            runtime_bytes=parse_size(args.runtime) if args.runtime else LLAMA_CPU_RUNTIME_BYTES,
            seam_width=args.seam_width,
            seam_dtype=args.seam_dtype,
            prefill_chunk=args.prefill_chunk,
            fewest=not args.all_nodes,
            cpu_moe=args.cpu_moe,
            gpu_reserve_bytes=parse_size(args.gpu_reserve) if args.gpu_reserve else GPU_RESERVE_BYTES,
        )
        if (args.cpu_moe or args.gpu_reserve) and not any(n.gpu_bytes for n in nodes):
            raise CallerError(Reason.INVALID_REQUEST, "--cpu-moe and --gpu-reserve place what a GPU holds: "
                              "give --gpu-memory SIZE, or gpu=SIZE in a --node")
        result = plan(layout, nodes, params)
        # what `dgr up` would give this many nodes on one machine, where speed, not memory, decides the cut
        speed = even_split(layout, len(result.shards), args.prompt_positions, args.answer_tokens)
    except DgrError as exc:
        print(f"dgr plan: {exc.message}", file=sys.stderr)
        return 2
    estimates = [
        decode_latency(
            result, link_gbit=g, mem_bw_gbs=args.mem_bw, rtt_ms=args.rtt_ms, frame_ms=args.frame_ms, via_gateway=v
        )
        for g in (args.link or [1.0, 10.0])
        for v in (True, False)
    ]
    assumptions = (
        f"{args.mem_bw:g} GB/s memory bandwidth per node, RTT {args.rtt_ms:g} ms, "
        f"{args.frame_ms:g} ms handling per frame, one sequence"
    )
    if args.json:
        out = {
            "plan": result.to_json(),
            "estimates": [e.to_json() for e in estimates],
            "assumptions": {"mem_bw_gbs": args.mem_bw, "rtt_ms": args.rtt_ms, "frame_ms": args.frame_ms},
            "gpu_layers": gpu_layers_flag(result),
            "speed_cut": {"layers": [str(r) for r in speed.ranges], "prompt_positions": speed.prompt_positions,
                          "answer_tokens": speed.answer_tokens, "decode_bytes": speed.decode_bytes,
                          "prefill_bytes": speed.prefill_bytes},
        }
        print(json.dumps(out, indent=2))
    else:
        print(render_plan(result, layout, estimates, assumptions))
        print(f"\nspeed cut (dgr up, {len(speed.ranges)} node(s) on one machine): "
              f"{' | '.join(str(r) for r in speed.ranges)}, {speed.describe()}")
    return 0


def register(subparsers: Any) -> None:
    """Add `dgr plan` to the CLI."""
    p = subparsers.add_parser(
        "plan",
        help="split a model's layers over nodes and check that it fits",
        description=(
            "Split a model's layers into contiguous ranges over nodes: fewest nodes that fit, then the "
            "largest smallest headroom. Prices weights, global tensors, KV per layer kind, llama.cpp "
            "buffers and the runtime per node, the seam frames per hop, and a decode latency estimate."
        ),
    )
    p.add_argument("--model", help="a GGUF file, or a layout/manifest JSON (default: the embedded SmolLM2)")
    p.add_argument("--recipe", help="quantization recipe of a layout JSON (default: the layout's own)")
    p.add_argument("--nodes", type=int, help="how many identical nodes (with --memory)")
    p.add_argument("--memory", help="memory per node, e.g. 24GiB (with --nodes)")
    p.add_argument("--node", action="append", metavar="NAME=SIZE[,gpu=SIZE]",
                   help="one node, in route order (repeatable); gpu=SIZE: its GPU's memory")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="each node's GPU memory, e.g. 24GiB: each range gets the most of its layers (counted "
                   "from its end, as --gpu-layers counts them) whose buffers fit it, the rest in --memory")
    p.add_argument("--cpu-moe", action="store_true",
                   help="a GPU node keeps its routed experts in host memory, as `dgr node --cpu-moe` does")
    p.add_argument("--gpu-reserve", metavar="SIZE",
                   help="device memory the GPU backend takes besides llama.cpp's buffers (default 512MiB, an "
                   "allowance)")
    p.add_argument("--context", type=int, default=4096, help="positions per session (default 4096)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent sessions per node (default 1)")
    p.add_argument("--kv-dtype", default="f16", choices=KV_DTYPES, help="KV cache type (default f16)")
    p.add_argument("--ubatch", type=int, default=DEFAULT_UBATCH, help="llama.cpp physical batch (default 512)")
    p.add_argument(
        "--swa-full",
        action="store_true",
        help="price sliding-window caches at full context (llama.cpp's default swa_full=true)",
    )
    p.add_argument(
        "--globals",
        default=GlobalNeed.COMPUTE.value,
        choices=[g.value for g in GlobalNeed],
        help="compute: each global tensor only where it is computed with, as the layer-range API loads "
        "them (default); loader: every shard holds every global, as a derived shard file did",
    )
    p.add_argument("--runtime", help="per-node runtime memory (default: the measured llama.cpp CPU node, 80MiB)")
    p.add_argument("--seam-width", type=int, help="floats per position on the seam (default: the model's)")
    p.add_argument("--seam-dtype", default="f32", choices=["f32", "f16"], help="seam value type (default f32)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="positions per prefill frame (default 512)")
    p.add_argument("--all-nodes", action="store_true", help="use every node given instead of the fewest")
    p.add_argument("--prompt-positions", type=int, default=PROMPT_POSITIONS,
                   help=f"the prompt the speed cut is balanced for (default {PROMPT_POSITIONS})")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help=f"the answer the speed cut is balanced for (default {ANSWER_TOKENS})")
    p.add_argument(
        "--link", type=float, action="append", help="link speed in Gbit/s for the estimate (default 1 and 10)"
    )
    p.add_argument("--mem-bw", type=float, default=50.0, help="memory bandwidth per node in GB/s (default 50)")
    p.add_argument("--rtt-ms", type=float, default=0.5, help="round-trip time between hosts (default 0.5 ms)")
    p.add_argument("--frame-ms", type=float, default=0.5, help="HTTP handling per frame (default 0.5 ms)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_handler)
