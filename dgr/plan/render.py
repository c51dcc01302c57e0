"""The human table of `dgr plan`: one row per node (with GPUs: where each range sits, and every buffer of each
device), KV per layer kind, the seam, latency estimates."""

from __future__ import annotations

from collections.abc import Sequence

from dgr.plan.latency import LatencyEstimate
from dgr.plan.layout import ModelLayout
from dgr.plan.cost import ShardCost
from dgr.plan.search import Plan
from dgr.plan.sizes import format_size

__all__ = [
    "gpu_layers_flag",
    "render_plan",
]


def gpu_layers_flag(p: Plan) -> str | None:
    """The `--gpu-layers` list to start the plan's nodes with, in route order (as `dgr up` takes it); None when
    no node has a GPU."""
    if not any(s.placement for s in p.shards):
        return None
    return ",".join(s.placement.flag if s.placement else "0" for s in p.shards)


def _columns(rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Rows as aligned columns: the first `left` to the left, the rest to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _on_gpu(s: ShardCost, n_layers: int) -> str:
    """What of the range the GPU holds, in words."""
    pl = s.placement
    if pl is None or not pl.gpu_layers:
        return "nothing (no device)"
    own = [i for i in pl.on_gpu if s.layers.start <= i < s.layers.stop]
    parts = [f"layers {own[0]}-{own[-1]}" if len(own) > 1 else f"layer {own[0]}"] if own else []
    mtp = [i for i in pl.on_gpu if i >= n_layers and not (pl.output_on_gpu and i == pl.on_gpu[-1])]
    parts += [f"MTP layer {i}" for i in mtp] + (["the output"] if pl.output_on_gpu else [])
    return ", ".join(parts) + ("; experts in host memory" if pl.cpu_moe else "")


def _gpu_tables(p: Plan) -> list[str]:
    """Where each range sits, then each device's buffers, named and split as llama.cpp's load log has them."""
    f = format_size
    where = [("node", "layers", "--gpu-layers", "on the GPU")]
    gpu = [("GPU", "model", "KV", "compute", "reserve", "used", "of", "free")]
    host = [("CPU", "model", "KV", "compute", "output", "runtime", "used", "of", "free")]
    for s in p.shards:
        pl = s.placement
        where.append((s.node.name, str(s.layers), pl.flag if pl else "0", _on_gpu(s, p.n_layers)))
        if pl is None:
            continue
        g, c = pl.gpu, pl.cpu
        gpu.append((s.node.name, f(g.model), f(g.kv), f(g.compute), f(pl.reserve_bytes), f(pl.gpu_used),
                    f(s.node.gpu_bytes), f(s.node.gpu_bytes - pl.gpu_used)))
        host.append((s.node.name, f(c.model), f(c.kv), f(c.compute), f(c.output), f(s.runtime_bytes),
                     f(s.host_bytes), f(s.node.memory_bytes), f(s.node.memory_bytes - s.host_bytes)))
    flag = gpu_layers_flag(p)
    moe = " --cpu-moe" if p.params.cpu_moe and any(s.placement and s.placement.cpu_moe for s in p.shards) else ""
    return [*_columns(where, 4), "", *_columns(gpu, 1), "", *_columns(host, 1), "",
            f"start   --gpu-layers {flag}{moe} (dgr up takes the list; each `dgr node --layers A:B` its own value)"]


def render_plan(p: Plan, layout: ModelLayout, estimates: Sequence[LatencyEstimate], assumptions: str) -> str:
    """The human table of `dgr plan`."""
    prm = p.params
    lines = [
        f"model   {p.model} ({p.architecture}, {p.n_layers} layers"
        + (f", recipe {p.recipe}" if p.recipe else "")
        + f"), {format_size(layout.tensor_bytes())} of tensors",
        (
            f"for     context {prm.context} x {prm.sessions} session(s), KV {prm.kv_dtype}, ubatch {prm.ubatch}, "
            f"swa_full {'on' if prm.swa_full else 'off'}, globals: {prm.globals_need.value}"
        ),
        f"uses    {len(p.shards)} of {len(p.shards) + len(p.unused)} node(s)"
        + (" (fewest that fit, then the largest smallest headroom)" if prm.fewest else " (all given)"),
        "",
    ]
    head = ("node", "layers", "weights", "globals", "KV", "buffers", "runtime", "total", "memory", "headroom")
    rows = [head]
    for s in p.shards:
        rows.append(
            (
                s.node.name, str(s.layers), format_size(s.weight_bytes), format_size(s.global_bytes),
                format_size(s.kv_bytes), format_size(s.compute_bytes), format_size(s.runtime_bytes),
                format_size(s.total_bytes), format_size(s.node.memory_bytes), format_size(s.headroom_bytes),
            )
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    if any(s.placement for s in p.shards):
        lines += _gpu_tables(p)  # a GPU node's bytes are two devices': per buffer, not one total
    else:
        for r in rows:
            lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    kv_kinds: dict[str, int] = {}
    for s in p.shards:
        for kind, b in s.kv_by_kind.items():
            kv_kinds[kind] = kv_kinds.get(kind, 0) + b
    kinds = layout.kinds()
    lines += ["", "KV by layer kind (all sessions):"]
    for kind, b in kv_kinds.items():
        per_layer = layout.layers[kinds[kind][0]].kv_bytes(prm.context, 1, prm.kv_dtype, prm.ubatch, prm.swa_full)
        lines.append(
            f"  {kind:<5} {len(kinds[kind]):>3} layers  {format_size(b):>11}  ({format_size(per_layer)} per layer per session)"
        )
    lines += [
        "",
        f"seam    width {p.seam_width} x {prm.seam_dtype}"
        + (
            f" ({p.seam_width // layout.hidden_size} x hidden {layout.hidden_size})"
            if p.seam_width != layout.hidden_size
            else ""
        )
        + f", {len(p.hops)} hop(s)",
    ]
    for i, h in enumerate(p.hops):
        lines.append(
            f"  hop {i + 1} -> layer {h.boundary}: decode {h.decode_bytes:,} B/token; prefill chunk of "
            f"{prm.prefill_chunk}: {format_size(h.prefill_bytes)}; at most {h.max_chunk} positions per frame"
            + ("; carries token ids" if h.token_ids else "")
        )
    if estimates:
        lines += ["", f"decode latency per token (estimate; {assumptions}):"]
        for e in estimates:
            lines.append(
                f"  {e.link_gbit:g} Gbit/s {'via gateway' if e.via_gateway else 'direct':<11}: compute "
                f"{e.compute_s * 1e3:7.1f} ms + network {e.network_s * 1e3:6.2f} ms ({e.frames} frames) = "
                f"{e.total_s * 1e3:7.1f} ms, {1 / e.total_s:6.2f} tokens/s; seam time per prefill chunk "
                f"{e.prefill_network_s * 1e3:.0f} ms"
            )
    return "\n".join(lines)
