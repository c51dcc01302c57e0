"""Decode latency per token of a planned route, from stated assumptions (an estimate, not a measurement).

Compute is each shard's bytes read per token over a memory bandwidth; the
network is every frame of one decode step (dgr v1 relays each hop through the
gateway unless the route is a chain).
"""

from __future__ import annotations

from typing import Any

import attrs

from dgr.plan.search import Plan
from dgr.seam.wire import HEADER_SIZE, TOKEN_RESULT

__all__ = ["LatencyEstimate", "decode_latency"]


@attrs.frozen
class LatencyEstimate:
    """Decode time per token on one route, from stated assumptions (not a measurement)."""

    link_gbit: float
    compute_s: float  # all shards, one after another: bytes read / memory bandwidth
    network_s: float  # every frame of one decode step: latency + serialization + handling
    frames: int
    via_gateway: bool
    prefill_network_s: float  # the seam frames of one prefill chunk (compute not estimated)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.network_s

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "total_s": self.total_s}


def decode_latency(
    p: Plan,
    *,
    link_gbit: float,
    mem_bw_gbs: float = 50.0,
    rtt_ms: float = 0.5,
    frame_ms: float = 0.5,
    via_gateway: bool = True,
) -> LatencyEstimate:
    """Per-token decode latency of a single sequence on the route of `p`.

    Compute: each shard reads its active weight bytes (routed experts in their
    used share) and one session's KV once per token, at `mem_bw_gbs` GB/s.
    Network: each frame costs half an RTT, its bytes at `link_gbit` Gbit/s and
    `frame_ms` of HTTP handling. dgr v1 relays every hop through the gateway
    (a HIDDEN frame to the gateway, then a DECODE frame to the next node), so
    a route of n shards sends 2n frames per token; `via_gateway=False` prices
    direct node-to-node hops (n + 1 frames).
    """
    compute = sum((s.active_bytes + s.kv_bytes / p.params.sessions) / (mem_bw_gbs * 1e9) for s in p.shards)
    small_in = HEADER_SIZE + 4  # gateway -> head: the token id
    small_out = HEADER_SIZE + TOKEN_RESULT.size + 16  # tail -> gateway: the sampled token and its text
    sizes = [small_in, small_out]
    for hop in p.hops:
        sizes += [hop.decode_bytes, hop.decode_bytes] if via_gateway else [hop.decode_bytes]
    per_frame = rtt_ms / 2e3 + frame_ms / 1e3
    network = sum(per_frame + b * 8 / (link_gbit * 1e9) for b in sizes)
    copies = 2 if via_gateway else 1
    prefill = sum(copies * (per_frame + h.prefill_bytes * 8 / (link_gbit * 1e9)) for h in p.hops)
    return LatencyEstimate(link_gbit, compute, network, len(sizes), via_gateway, prefill)
