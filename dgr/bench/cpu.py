"""Where a route's CPU goes: each process's CPU per decoded token, beside the shards' own compute.

`dgr bench --only cpu` starts 2-node routes of the default topology (the
stub, then llama_shard with one thread a node, its default busy polling on
and then off) and streams 1 and then 8 sessions through each. It reads every
process's CPU time (utime + stime in /proc/PID/stat) before and after, and
divides by the tokens the clients received. The bench process itself is the
client (httpx streams), so its CPU is the client's.

The floor beside each node is the same layer range computed in this process
with no route around it: the backend's own `forward_batch`, token after
token, on the batch a node of the route computes at best. A pipeline of N
nodes keeps the sessions in N phase groups, one computing on each node
(dgr.fsm.phases), so 8 sessions on 2 nodes are batches of 4. What a node
spends above its floor is the runtime's: seam I/O, framing, scheduling,
sampling, telemetry, a busy-polling node's spinning, and batches smaller
than the floor's. The tracker and the client have no floor: all
of theirs is overhead.

Linux only (procfs).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dgr.backends.base import LayerRange, Step
from dgr.bench.measure import concurrent
from dgr.testing.harness import LocalRoute

__all__ = ["run_cpu", "markdown"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PROMPT = "The lighthouse keeper wrote down every ship that passed the point"
TOKENS = 128  # per session
# label, backend, dgr up flags beyond the route's
SETUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("stub", "stub", ()),
    ("llama_shard, 1 thread a node, busy polling", "llama_shard", ("--threads", "1")),
    ("llama_shard, 1 thread a node, no busy polling", "llama_shard", ("--threads", "1", "--busy-poll-ms", "0")),
)
SESSIONS = (1, 8)  # concurrent streams; each node's batch is a phase group of them


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _processes(route: LocalRoute) -> dict[str, int]:
    """The route's processes by name: its nodes (from the registry) and its tracker (dgr up's other child)."""
    if route.proc is None:
        raise RuntimeError("the route has not started")
    nodes = {n["node"]: n["pid"] for n in route.node_table()}
    # each thread lists the children it forked: dgr up forks them from its main thread (dgr.forks)
    children = [int(c) for task in Path(f"/proc/{route.proc.pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    tracker = [c for c in children if c not in nodes.values()]
    return {"tracker": tracker[0], **dict(sorted(nodes.items()))}


def _measure(route: LocalRoute, model: str, sessions: int) -> dict[str, Any]:
    procs = _processes(route)
    nodes = [name for name in procs if name != "tracker"]
    before = {name: _cpu_s(pid) for name, pid in procs.items()}
    computing = {name: route.node_status(name)["scheduler"]["busy_s"] for name in nodes}
    client = sum(os.times()[:2])
    got = concurrent(route.api, model, PROMPT, TOKENS, sessions)
    client = sum(os.times()[:2]) - client
    tokens = got["aggregate_tok_s"] * got["wall_s"]
    per_token = {name: (_cpu_s(pid) - before[name]) / tokens * 1e3 for name, pid in procs.items()}
    per_token["client"] = client / tokens * 1e3
    # the share of the run each node spent in its backend's forward calls (each batch once)
    computing = {name: (route.node_status(name)["scheduler"]["busy_s"] - computing[name]) / got["wall_s"]
                 for name in nodes}
    return {"sessions": sessions, "tokens": round(tokens), "tok_s": got["aggregate_tok_s"],
            "errors": got["errors"], "cpu_ms_per_token": per_token, "computing": computing,
            "cores_busy": sum(per_token.values()) * got["aggregate_tok_s"] / 1e3}


def _floor(backend: str, splits: list[LayerRange], model: Path | None, sessions: int) -> dict[str, float]:
    """CPU ms per token of each layer range computed here, a batch of `sessions` at a time, with no route
    around it."""
    from dgr.backends.factory import make_backend

    stages = [make_backend(backend, r, model, threads=1, n_ctx=1024, max_sessions=8) for r in splits]
    try:
        sids = [f"s{i}" for i in range(sessions)]
        for lane, sid in enumerate(sids):
            hidden = None
            for s in stages:
                s.open_session(sid, 512, lane=lane)
                hidden = s.forward(sid, 0, np.array([1, 2, 3, 4], np.int32) if s.is_head else None, hidden,
                                   s.is_tail)
        spent = [0.0] * len(stages)
        tokens = [1] * sessions
        steps = TOKENS // 2
        for k in range(steps):
            outs: list[Any] = [None] * sessions
            for i, s in enumerate(stages):
                # this thread's CPU clock, to the nanosecond: getrusage's thread times come out in scheduler
                # ticks' shares, and a fast stage's few microseconds a step summed to 0 in one run
                t = time.thread_time()
                done = s.forward_batch([
                    Step(sid, 4 + k, np.array([tokens[j]], np.int32) if s.is_head else None,
                         None if s.is_head else outs[j], s.is_tail, decode=True) for j, sid in enumerate(sids)])
                spent[i] += time.thread_time() - t
                outs = [d.unwrap() for d in done]
            tokens = [int(np.argmax(o)) for o in outs]
        return {f"node{i}": spent[i] / (steps * sessions) * 1e3 for i in range(len(stages))}
    finally:
        for s in stages:
            s.close()


def run_cpu(log: Callable[[str], None]) -> dict[str, Any]:
    from dgr.backends.factory import model_layer_count, resolve_model
    from dgr.up import route_splits

    out: dict[str, Any] = {"topology": "ring", "tokens": TOKENS, "setups": {}, "floor": {}}
    for label, backend, extra in SETUPS:
        model = resolve_model(backend, None)
        splits = route_splits(model, model_layer_count(backend, model, "default"), 2)
        name = "stub" if backend == "stub" else "SmolLM2-135M-Instruct.Q4_1"
        log(f"cpu: {label}")
        with LocalRoute(backend=backend, nodes=2, ready_timeout_s=600, busy_poll_ms=None,  # the product's default
                        extra=("--ctx", "1024", "--max-sessions", "8", *extra)) as route:
            warm = concurrent(route.api, name, PROMPT, 8, 1)  # first requests load what they load
            if warm["errors"]:
                raise RuntimeError(f"{label}: the route failed its first request")
            out["setups"][label] = {"backend": backend, "splits": [str(s) for s in splits],
                                    "runs": [_measure(route, name, n) for n in SESSIONS]}
        if backend not in out["floor"]:
            log(f"cpu: {backend} shards {', '.join(map(str, splits))} in this process")
            # a pipeline of N nodes keeps 1/N of the sessions on each node (dgr.fsm.phases): its batches
            # (keys as JSON writes them: the report reads results.json too)
            out["floor"][backend] = {str(n): _floor(backend, splits, model, -(-n // len(splits))) for n in SESSIONS}
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    lines = ["", "## Where a route's CPU goes", "",
             f"2-node {res['topology']} routes, {res['tokens']} tokens a session. CPU ms per decoded token of each "
             "process (its utime + stime over the tokens all sessions received); the floor is the node's layers "
             "computed in the bench process with no route around them. A node's "
             "excess over its floor is the runtime's cost (for a busy-polling node, its spinning too); the "
             "tracker's and the client's are all overhead. The floor computes the batches a node computes at "
             "best: a pipeline keeps one phase group of the sessions on each node, so 8 sessions on 2 nodes are "
             "batches of 4. \"Computing\" is the share of the run each node spent in its backend's forward "
             "calls.", "",
             "| setup | sessions | tok/s | tracker | node0 (floor) | node1 (floor) | client | cores busy "
             "| computing node0, node1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, setup in res["setups"].items():
        for run in setup["runs"]:
            cpu, floor = run["cpu_ms_per_token"], res["floor"][setup["backend"]][str(run["sessions"])]
            nodes = " | ".join(f"{cpu[n]:.2f} ({floor[n]:.2f})" for n in ("node0", "node1"))
            lines.append(f"| {label} | {run['sessions']} | {run['tok_s']:.1f} | {cpu['tracker']:.2f} | {nodes} "
                         f"| {cpu['client']:.2f} | {run['cores_busy']:.2f} "
                         f"| {', '.join(f'{v:.0%}' for v in run['computing'].values())} |")
    return lines
