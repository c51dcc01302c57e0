"""Where a decoded token's time goes on a route: each stage of a step on each node, and each link.

`dgr bench --only steps` starts a 2-node llama_shard ring of the product's defaults (1 thread a node,
busy polling on) with DGR_STEP_TRACE set, so every node keeps the stage timestamps of its chain steps
(dgr.node.steptrace) and writes them when it stops. It streams one session at a time, then 8 at once,
and lines the stages of each decode step up across the nodes: what each node spends between a step's
arrival and its departure, what each link takes from one node's send call to the next node's read,
and a session's token period at the head. Alone, a token's runtime cost is its period less the nodes'
compute; with 8 sessions the period also holds the other phase group's turn on each node. The bench
process shares the nodes' clock, so it tells the two runs' marks apart by when it ran them.

Linux only (one CLOCK_MONOTONIC for every process of the machine).
"""

from __future__ import annotations

import collections
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dgr.bench.measure import concurrent, stream_once
from dgr.node import steptrace
from dgr.testing.harness import LocalRoute

__all__ = ["run_steps", "analyse", "markdown", "SESSIONS"]

PROMPT = "The lighthouse keeper wrote down every ship that passed the point"
TOKENS = 256  # per stream
ROUNDS = 3
NODES = 2
SESSIONS = (1, 8)  # streams at once in each run
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# the stages of one node, in order, and the name of the gap that ends at each
_STAGES = (("read", None), ("admitted", "read and admitted"), ("iterate", "waiting for the scheduler"),
           ("compute", "batch prepared"), ("computed", "compute"), ("finished", "result encoded"),
           ("done", "back on the loop"))


def run_steps(log: Callable[[str], None], backend: str = "llama_shard") -> dict[str, Any]:
    """Trace ROUNDS streams of TOKENS tokens through a NODES-node ring and line its stages up."""
    folder = Path(tempfile.mkdtemp(prefix="dgr-steps-"))
    old = os.environ.get(steptrace.ENV)
    os.environ[steptrace.ENV] = str(folder)  # the route's processes inherit it
    try:
        log(f"steps: {NODES}-node {backend} ring, stage timestamps in {folder}")
        with LocalRoute(backend=backend, nodes=NODES, ready_timeout_s=600, busy_poll_ms=None,
                        extra=("--ctx", "1024", "--threads", "1")) as route:
            model = MODEL if backend != "stub" else "stub"
            stream_once(route.api, model, PROMPT, 8)  # first requests load what they load
            runs = []
            for n in SESSIONS:
                t0 = time.monotonic_ns()
                if n == 1:
                    rates = [stream_once(route.api, model, PROMPT, TOKENS).decode_tok_s for _ in range(ROUNDS)]
                else:
                    rates = [concurrent(route.api, model, PROMPT, TOKENS, n)["aggregate_tok_s"] for _ in range(ROUNDS)]
                runs.append({"sessions": n, "window": (t0, time.monotonic_ns()), "tok_s": [round(r, 1) for r in rates]})
            order = [n["node"] for n in sorted(route.node_table(), key=lambda n: int(n["layers"].split(":")[0]))]
    finally:
        if old is None:
            os.environ.pop(steptrace.ENV, None)
        else:
            os.environ[steptrace.ENV] = old
    marks = {node: steptrace.read_marks(folder / f"{node}.tsv") for node in order}
    for run in runs:
        a, b = run.pop("window")
        run.update(analyse({node: [m for m in rows if a <= m[3] <= b] for node, rows in marks.items()}, order))
    return {"backend": backend, "nodes": order, "tokens": TOKENS, "rounds": ROUNDS, "runs": runs,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def _stats(values: list[float]) -> dict[str, float]:
    a = np.array(values) / 1e3  # ns -> us
    return {"p50": round(float(np.percentile(a, 50)), 1), "p10": round(float(np.percentile(a, 10)), 1),
            "p90": round(float(np.percentile(a, 90)), 1), "n": len(values)}


def analyse(marks: dict[str, list[tuple[str, str, int, int]]], order: list[str]) -> dict[str, Any]:
    """Per-node stage gaps, link times and the token period (microseconds: p50, p10, p90) of decode steps.

    A decode step is one whose session also had a step at the position before it on the head. On the
    last node, relay `on` is the ring's step to the head: its marks carry the next position.
    """
    at: dict[str, dict[tuple[str, int], dict[str, int]]] = {}
    for node, rows in marks.items():
        table: dict[tuple[str, int], dict[str, int]] = collections.defaultdict(dict)
        for stage, sid, pos, ns in rows:
            table[(sid, pos)].setdefault(stage, ns)
        at[node] = table
    head, tail = at[order[0]], at[order[-1]]
    steps = [k for k in head if (k[0], k[1] - 1) in head and "read" in head[k]]
    nodes: dict[str, list[dict[str, Any]]] = {}
    for i, node in enumerate(order):
        table, last = at[node], i == len(order) - 1
        gaps: dict[str, list[int]] = collections.defaultdict(list)
        for key in steps:
            st = table.get(key, {})
            for (a, _), (b, name) in zip(_STAGES, _STAGES[1:]):
                if a in st and b in st:
                    gaps[name].append(st[b] - st[a])
            for role, label in (("on", "to the head" if last else "to the next node"), ("answer", "to the gateway")):
                # a ring tail's relay `on` carries the next step: its marks are at the next position
                nxt = table.get((key[0], key[1] + 1), {}) if last and role == "on" else st
                if "done" in st and f"woken:{role}" in nxt:
                    gaps[f"relay woken, {label}"].append(nxt[f"woken:{role}"] - st["done"])
                if f"woken:{role}" in nxt and f"send:{role}" in nxt:
                    gaps[f"record encoded, {label}"].append(nxt[f"send:{role}"] - nxt[f"woken:{role}"])
        nodes[node] = [{"gap": name, **_stats(v)} for name, v in gaps.items() if v]
    links: list[dict[str, Any]] = []
    for a, b in zip(order, order[1:]):
        v = [at[b][k]["read"] - at[a][k]["send:on"] for k in steps
             if "send:on" in at[a].get(k, {}) and "read" in at[b].get(k, {})]
        if v:
            links.append({"link": f"{a} sends, {b} has read", **_stats(v)})
    v = [head[(s, p + 1)]["read"] - tail[(s, p + 1)]["send:on"] for s, p in steps
         if "send:on" in tail.get((s, p + 1), {}) and "read" in head.get((s, p + 1), {})]
    if v:  # a ring of one node admits its next step in process (dgr.node.relay.SelfLoop): no link
        links.append({"link": f"{order[-1]} sends, {order[0]} has read (the ring)", **_stats(v)})
    period = [head[(s, p + 1)]["read"] - head[(s, p)]["read"] for s, p in steps if "read" in head.get((s, p + 1), {})]
    compute = [sum(at[n][k]["computed"] - at[n][k]["compute"] for n in order) for k in steps
               if all("computed" in at[n].get(k, {}) and "compute" in at[n].get(k, {}) for n in order)]
    period_us, compute_us = _stats(period), _stats(compute)
    return {"steps": len(steps), "node_gaps": nodes, "links": links, "period": period_us, "compute": compute_us,
            "runtime": round(period_us["p50"] - compute_us["p50"], 1)}


def markdown(res: dict[str, Any]) -> list[str]:
    lines = ["", "## Where a decoded token's time goes", "",
             f"A {len(res['nodes'])}-node {res['backend']} ring with the product's defaults (1 thread a node, busy "
             f"polling), {res['rounds']} rounds of streams of {res['tokens']} tokens: one stream at a time, then "
             f"{', '.join(str(r['sessions']) for r in res['runs'][1:])} at once. Every node kept the stage "
             "timestamps of its steps (DGR_STEP_TRACE, dgr/node/steptrace.py), lined up here across the nodes "
             "step by step. Microseconds, p50 (p10 to p90). A link runs from its sender's send call to the next "
             "node's read of the record."]
    for run in res["runs"]:
        n = run["sessions"]
        rate = "tok/s" if n == 1 else "aggregate tok/s"
        lines += ["", f"### {n} session{'s' if n > 1 else ''} ({', '.join(map(str, run['tok_s']))} {rate}; "
                  f"{run['steps']} decode steps)", "", "| where | gap | p50 us | p10 to p90 us |", "|---|---|---|---|"]
        for node, gaps in run["node_gaps"].items():
            for g in gaps:
                lines.append(f"| {node} | {g['gap']} | {g['p50']:.0f} | {g['p10']:.0f} to {g['p90']:.0f} |")
        for link in run["links"]:
            lines.append(f"| link | {link['link']} | {link['p50']:.0f} | {link['p10']:.0f} to {link['p90']:.0f} |")
        p, c = run["period"], run["compute"]
        lines += ["", f"A session's token period at the head: {p['p50']:.0f} us p50 ({p['p10']:.0f} to "
                  f"{p['p90']:.0f}); the nodes' compute for its step: {c['p50']:.0f} us p50 (for a batched step, "
                  "its batch's)."]
        if n == 1:
            lines[-1] += (f" The rest, about {run['runtime']:.0f} us a token, is the runtime's: the gaps above, "
                          "bar compute.")
        else:
            lines[-1] += (" The rest is the other phase group's turn on each node, the phase holds (in the tail's "
                          "relay to the head), and the gaps above.")
    return lines
