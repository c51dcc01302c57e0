"""The human table of `dgr plan`: one row per node, KV per layer kind, the seam, latency estimates."""

from __future__ import annotations

from collections.abc import Sequence

from dgr.plan.latency import LatencyEstimate
from dgr.plan.layout import ModelLayout
from dgr.plan.search import Plan
from dgr.plan.sizes import format_size

__all__ = [
    "render_plan",
]


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
