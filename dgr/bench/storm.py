"""The storm under contention: a route's control and tokens while a CPU hog holds a core (issue 43).

`dgr bench --only storm` starts a 2-node llama_shard route of the default
model (1 thread a node, the default topology and prefill chunk) and a
Python busy loop pinned to core 0 (`cpu_hog`) for the whole run, then runs
8 streaming clients for `seconds` (90 by default). Client 0 sends a prompt
of about 1,500 tokens every time; the others short ones. Each request's fate
is drawn: complete, leave mid-prefill (after the headers), or leave
mid-decode (after 1 to 6 tokens), a third each.

Figures: requests, 5xx answers, error events in streams, the nodes the
tracker declared lost (its failures by code, and nodes not alive at the
end), p50/p99 open latency (request sent to response headers: routing,
tokenizing at the head, every node's open), and the p99 gap between two
tokens of one session, over all gaps and over those that overlapped a long
prompt's prefill (client 0's request start to its first token). Other work
on the machine moves these figures: the report says so.

Linux only where it pins the hog (sched_setaffinity); elsewhere it is unpinned.

With kills (`dgr bench --only storm --storm-kills`, issue 54): the route has
one spare a range and `--resume`, and a killer (`killing`) SIGKILLs a random
live node every 10 to 20 s and starts it again at once. A session whose node
dies is repaired onto a spare, an open that meets a dead node is routed
around, so no request should fail while a spare exists. Extra figures: the
kills, the repairs and their pauses (p50/p99/max), and what every node holds
once the storm is over (0 sessions and 0 KV bytes, or the report says which).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import numpy as np

from dgr.testing.harness import LocalRoute, RouteTimeout

__all__ = ["cpu_hog", "killing", "run_storm", "markdown", "SECONDS", "CLIENTS", "KILL_EVERY_S"]

SECONDS = 90.0
CLIENTS = 8
KILL_EVERY_S = (10.0, 20.0)  # with kills: the wait before each, drawn
MODEL = "SmolLM2-135M-Instruct.Q4_1"
LONG_PROMPT = "Client 0 asks: " + "tell me more " * 500  # about 1,500 tokens
_HOG = "import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {0})\nwhile True: pass"


@contextlib.contextmanager
def cpu_hog() -> Iterator[subprocess.Popen]:
    """A Python busy loop pinned to core 0 (where there is affinity), from entry to exit: another program
    that wants one of the cores a route computes on, all the time."""
    hog = subprocess.Popen([sys.executable, "-c", _HOG])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait(10)


def killing(route: LocalRoute, end: float, every: tuple[float, float], rng: random.Random, kills: list,
            stop: threading.Event | None = None) -> None:
    """Until `end` (monotonic) or `stop`: wait `every` (drawn), SIGKILL a random live node of `route`, start it
    again under its name and layers at once; each kill appended to `kills` (node, when, how long its restart took
    to register)."""
    stop = stop or threading.Event()
    while not stop.wait(rng.uniform(*every)) and time.monotonic() < end:
        alive = [n for n in route.node_table() if n["alive"]]
        if not alive:
            continue
        victim = rng.choice(alive)
        at = route.kill(victim["node"])
        route.restart_node(victim["node"], victim["layers"])
        kills.append({"node": victim["node"], "role": victim.get("role"), "at": at,
                      "restart_s": time.monotonic() - at})


def _client(api: str, k: int, end: float, rows: list, windows: list, lock: threading.Lock) -> None:
    rng = random.Random(1000 + k)
    with httpx.Client(timeout=300) as http:
        while time.monotonic() < end:
            fate = rng.choice(["complete", "prefill", "decode"])
            prompt = LONG_PROMPT if k == 0 else f"Client {k} asks: " + "tell me more " * rng.randint(5, 40)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(8, 40), "temperature": 0,
                    "stream": True}
            row: dict[str, Any] = {"client": k, "fate": fate, "long": k == 0, "tokens": [], "error": None}
            t0 = time.monotonic()
            with http.stream("POST", f"{api}/completions", json=body) as r:
                row["status"], row["open_s"] = r.status_code, time.monotonic() - t0
                row["sid"] = r.headers.get("X-Dgr-Route-Session")
                if r.status_code == 200 and fate != "prefill":
                    leave_after = rng.randint(1, 6) if fate == "decode" else None
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            row["error"] = data["error"]
                            break
                        row["tokens"].append(time.monotonic())
                        if leave_after is not None and len(row["tokens"]) >= leave_after:
                            break
                elif r.status_code != 200:
                    row["error"] = r.read().decode()[:300]
            if k == 0:  # the long prompt prefilled from its request to its first token (or its leaving)
                stop = row["tokens"][0] if row["tokens"] else time.monotonic()
                with lock:
                    windows.append((t0, stop))
            with lock:
                rows.append(row)


def _pct(xs: list[float], q: float) -> float | None:
    return None if not xs else float(np.percentile(np.asarray(xs), q))


def run_storm(log: Callable[[str], None], seconds: float = SECONDS, kills: bool = False,
              every: tuple[float, float] = KILL_EVERY_S) -> dict[str, Any]:
    """Run the storm; its figures (see the module docstring). `kills`: with a spare a range and --resume, a node
    killed and started again every `every` seconds (drawn)."""
    log(f"storm: 2-node llama_shard route, 1 thread a node, {CLIENTS} clients for {seconds:g}s beside a CPU hog"
        + (f", a node killed every {every[0]:g} to {every[1]:g}s (a spare a range, --resume)" if kills else ""))
    spares = ("--spares", "1", "--resume") if kills else ()
    killed: list[dict[str, Any]] = []
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=600, busy_poll_ms=None,  # the product's default
                    extra=("--threads", "1", "--ctx", "2048", "--max-sessions", str(CLIENTS), *spares)) as route:
        warm = httpx.post(f"{route.api}/completions", timeout=300,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        if warm.status_code != 200:
            raise RuntimeError(f"storm: the route failed its first request: {warm.text[:300]}")
        rows: list[dict[str, Any]] = []
        windows: list[tuple[float, float]] = []
        lock = threading.Lock()
        with cpu_hog():
            end = time.monotonic() + seconds
            threads = [threading.Thread(target=_client, args=(route.api, k, end, rows, windows, lock))
                       for k in range(CLIENTS)]
            if kills:
                threads.append(threading.Thread(target=killing, args=(route, end, every, random.Random(54), killed)))
            for t in threads:
                t.start()
            for t in threads:
                t.join(seconds + 600)
        stats = httpx.get(f"{route.api}/stats", timeout=30).json()
        after = _after(route, rows) if kills else {}
        nodes = route.node_table()
        schedulers = {n: route.node_status(n).get("scheduler", {}) for n in ("node0", "node1")}
    gaps, contended = [], []
    for row in rows:
        if row["long"]:
            continue
        for a, b in zip(row["tokens"], row["tokens"][1:]):
            gaps.append(b - a)
            if any(a < w1 and b > w0 for w0, w1 in windows):
                contended.append(b - a)
    opens = [r["open_s"] for r in rows if r["status"] == 200]
    failures = stats.get("failures", {})
    return {
        "topology": "ring", "seconds": seconds, "clients": CLIENTS, "threads_per_node": 1,
        "hog": "a Python busy loop pinned to core 0",
        "requests": len(rows),
        "status": {str(s): sum(1 for r in rows if r["status"] == s) for s in sorted({r["status"] for r in rows})},
        "http_5xx": sum(1 for r in rows if r["status"] >= 500),
        "error_events": sum(1 for r in rows if r["status"] == 200 and r["error"] is not None),
        "errors": [r["error"] for r in rows if r["error"] is not None][:10],
        "long_prompts": len(windows),
        "nodes_declared_lost": failures.get("route_node_lost", 0),
        "nodes_not_alive": [n["node"] for n in nodes if not n.get("alive", True)],
        "gateway_failures": failures,
        "slow_waits": stats.get("slow_waits"),
        "open_s": {"p50": _pct(opens, 50), "p99": _pct(opens, 99), "n": len(opens)},
        "gap_s": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99), "max": max(gaps, default=None), "n": len(gaps)},
        "gap_during_long_prefill_s": {"p50": _pct(contended, 50), "p99": _pct(contended, 99),
                                      "max": max(contended, default=None), "n": len(contended)},
        "schedulers": schedulers,
        "kills": killed, **after,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _after(route: LocalRoute, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What a storm with kills leaves: its sessions' repairs and their pauses, and what every live node holds once
    its sessions are freed (or still holds after 30 s)."""
    repairs = []
    for row in rows:
        if row.get("sid"):
            snap = route.session(row["sid"])
            repairs += snap.get("repairs") or []
    pauses = [r["pause_ms"] / 1e3 for r in repairs if r.get("pause_ms") is not None]
    live = [n["node"] for n in route.node_table() if n["alive"]]
    try:
        route.wait_sessions_freed(live, timeout_s=30)
    except RouteTimeout:
        pass
    held = {n: (s["sessions"], s["kv_bytes"]) for n in live for s in [route.node_status(n)]}
    return {"repairs": len(repairs), "drained": sum(bool(r.get("drained")) for r in repairs),
            "pause_s": {"p50": _pct(pauses, 50), "p99": _pct(pauses, 99), "max": max(pauses, default=None)},
            "held_after": {n: h for n, h in held.items() if h != (0, 0)}, "nodes_after": len(held)}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def markdown(res: dict[str, Any]) -> list[str]:
    o, g, c = res["open_s"], res["gap_s"], res["gap_during_long_prefill_s"]
    lines = ["", "## The storm beside a CPU hog", "",
             f"A 2-node llama_shard {res['topology']} route, {res['threads_per_node']} thread a node, "
             f"{res['clients']} streaming clients for {res['seconds']:g} s, {res['hog']} for the whole run. "
             "Client 0 sends a prompt of about 1,500 tokens each time, the others short ones; a third of the "
             "requests leave mid-prefill, a third mid-decode. Other work on the machine moves these figures "
             "(the machine this ran on is shared), so read them as one run's, not as a bound.", "",
             "| requests | 5xx | error events | nodes declared lost | open p50 / p99 ms | token gap p50 / p99 ms "
             "| gap while a long prompt prefills p50 / p99 / max ms |",
             "|---|---|---|---|---|---|---|",
             f"| {res['requests']} | {res['http_5xx']} | {res['error_events']} | {res['nodes_declared_lost']} "
             f"| {_ms(o['p50'])} / {_ms(o['p99'])} | {_ms(g['p50'])} / {_ms(g['p99'])} "
             f"| {_ms(c['p50'])} / {_ms(c['p99'])} / {_ms(c['max'])} ({c['n']} gaps) |", "",
             f"Responses by status: {res['status']}; gateway failures by code: {res['gateway_failures'] or 'none'} "
             f"(cancelled: clients that left); deadlines extended for slow nodes: {res['slow_waits']}; "
             f"nodes not alive at the end: {res['nodes_not_alive'] or 'none'}."]
    for name, s in res["schedulers"].items():
        lines.append(f"- {name}: {s.get('iterations')} iterations, {s.get('cuts')} prefill chunks cut, "
                     f"prefill rate {s.get('prefill_rate')} positions/s at the end")
    if res.get("kills"):
        p = res["pause_s"]
        lines += ["", f"With kills: {len(res['kills'])} nodes killed and started again "
                      f"({', '.join(k['node'] for k in res['kills'])}), {res['repairs']} repairs, pause p50 / p99 / "
                      f"max {_ms(p['p50'])} / {_ms(p['p99'])} / {_ms(p['max'])} ms; after the storm "
                      f"{res['nodes_after']} live nodes, holding "
                      f"{res['held_after'] or 'no session and no KV'}."]
    if res["errors"]:
        lines += ["", "First errors: " + "; ".join(str(e)[:200] for e in res["errors"][:5])]
    return lines
