"""The RTT sweep: what a ring predicts a route pays per RTT, and those figures measured on namespaced routes.

One job: `dgr bench --rtt`'s numbers. `round_trips_per_token` and
`ttft_round_trips` are the model (how many round trips a decoded token and
the first token wait on); `expectations` sets each measured row beside it,
taken from the 0 ms row; `rtt_sweep` runs routes of
dgr.bench.netns.NetnsRoute at each RTT and measures them. The model is pure;
the sweep needs what `prerequisites()` checks (root, `ip netns`), and returns
{"skipped": why} without it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from dgr.bench.netns import PLACEMENT, NetnsRoute, prerequisites
from dgr.tracker.live import pipeline_chunk

__all__ = ["expectations", "round_trips_per_token", "rtt_sweep", "ttft_round_trips"]


def round_trips_per_token(hops: int) -> float:
    """RTTs one decoded token waits on a ring: node0 -> ... -> tail -> node0, N one-way trips (the tail's
    answer to the gateway is off that path)."""
    return hops / 2


def expectations(rows: list[dict[str, Any]], hops: int, ttft_trips: float) -> list[dict[str, Any]]:
    """Add to each row what the ring predicts from the 0 ms row.

    Decode: + `round_trips_per_token` x RTT per token. TTFT: + ttft_trips x
    RTT, the round trips before the first token (see `ttft_round_trips`).
    Rows hold `rtt_ms`, `decode_tok_s` and `ttft_s`; one must have rtt_ms == 0.
    """
    trips = round_trips_per_token(hops)
    base = next(r for r in rows if r["rtt_ms"] == 0)
    base_ms = 1e3 / base["decode_tok_s"]
    out = []
    for r in rows:
        ms = 1e3 / r["decode_tok_s"] if r["decode_tok_s"] else float("inf")
        expected = base_ms + trips * r["rtt_ms"]
        extra = ms - base_ms
        out.append({**r, "hops": hops, "round_trips_per_token": trips,
                    "ms_per_token": ms, "expected_ms_per_token": expected,
                    "expected_tok_s": 1e3 / expected, "extra_ms_per_token": extra,
                    "expected_extra_ms_per_token": trips * r["rtt_ms"],
                    "extra_rtts_per_token": extra / r["rtt_ms"] if r["rtt_ms"] else None,
                    "extra_ms_per_hop": extra / hops if r["rtt_ms"] else None,
                    "decode_vs_0": r["decode_tok_s"] / base["decode_tok_s"],
                    "ttft_extra_ms": (r["ttft_s"] - base["ttft_s"]) * 1e3,
                    "expected_ttft_extra_ms": ttft_trips * r["rtt_ms"]})
    return out


def ttft_round_trips(hops: int, prompt_tokens: int, prefill_chunk: int, reused: bool = False) -> float:
    """Round trips before the first token, on warm connections.

    Every node opens the session at once, the head tokenizing a text prompt
    inside its open (1); where the head reused a prefix, the later hops are
    told it (1, `reused` on a route of 2 or more); then K prefill chunks flow
    through the hops as a pipeline, the last one leaving the tail with the
    first token: K - 1 trips, plus the last chunk's way gateway -> head -> ...
    -> tail -> gateway (N + 1 one-way trips). K counts a ubatch's positions as one chunk however
    finely a pipeline cuts them, as the gateway keeps that many in flight a hop.
    """
    # chunks of a pipeline (dgr.tracker.live.pipeline_chunk) go a ubatch's worth in flight a hop: trips by ubatches
    size = pipeline_chunk(prompt_tokens, prefill_chunk, hops)
    chunks = max(1, math.ceil(prompt_tokens / (size * max(1, prefill_chunk // size))))
    return 1 + (1 if reused and hops > 1 else 0) + chunks - 1 + (hops + 1) / 2


def rtt_sweep(*, backend: str, node_counts: tuple[int, ...], rtts_ms: tuple[float, ...], prompt: str | list[int],
              decode_tokens: int, threads: int, ctx: int = 4096, link: str = "auto", repeats: int = 1,
              ready_timeout_s: float = 600.0, stub_delay: float = 0.0,
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Decode tok/s and TTFT of namespaced rings at each RTT, with the N/2 x RTT expectation.

    One route per node count, started once; the RTT is changed under it, and
    each RTT gets a warm-up request first (connections settle at the new
    delay). With `repeats` > 1 the best run counts, at every RTT alike: the
    highest decode rate and, separately, the lowest TTFT (a shared machine
    only ever adds time).
    Returns {"skipped": why} where namespaces cannot be made.
    """
    from dgr.bench.measure import stream_once

    why = prerequisites()
    if why is not None:
        log(f"rtt: skipped: {why}")
        return {"skipped": why}
    rtts = sorted({0.0, *(float(r) for r in rtts_ms)})
    out: dict[str, Any] = {"backend": backend, "rtts_ms": rtts, "placement": PLACEMENT, "repeats": repeats,
                           "routes": {}}
    for n in node_counts:
        label = f"dgr {backend}, {n} nodes, ring, namespaces"
        per_node = max(1, threads // n)
        log(f"rtt: {label} ({per_node} thread(s) per node)")
        with NetnsRoute(backend=backend, nodes=n, threads=per_node, ctx=ctx, link=link, stub_delay=stub_delay,
                        ready_timeout_s=ready_timeout_s) as route:
            out["link"] = route.kind
            model = route.model_id()
            rows = []
            for rtt in rtts:
                route.set_rtt(rtt)
                stream_once(route.api, model, prompt[:16], 4, headers=route.headers)
                runs = [stream_once(route.api, model, prompt, decode_tokens, headers=route.headers)
                        for _ in range(repeats)]
                best = max(runs, key=lambda r: r.decode_tok_s)
                ttft = min(r.ttft_s for r in runs)
                log(f"rtt: {label}, {rtt:g} ms: {best.decode_tok_s:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms")
                rows.append({"rtt_ms": rtt, "decode_tok_s": best.decode_tok_s, "ttft_s": ttft,
                             "tokens": best.tokens, "prompt_tokens": best.prompt_tokens})
            # the warm-up's prompt is the start of the measured one: its kept prefix is reused
            trips = ttft_round_trips(n, rows[0]["prompt_tokens"], route.prefill_chunk, reused=True)
            out["routes"][label] = {"nodes": n, "threads_per_node": per_node,
                                    "ttft_round_trips": trips, "rows": expectations(rows, n, trips)}
    return out
