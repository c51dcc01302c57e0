"""A node stopped with SIGTERM drains (issue 54): its sessions are handed over to a spare, or end, then it exits.

The real thing: `dgr up --resume --spares 1` (stub, 3 ranges, one spare of each), 4 clients streaming greedy
answers all along, and every node of the route stopped with SIGTERM in turn and started again once it exited: a
rolling restart. Every answer completes and equals its uninterrupted run, the spares were idle until a drain needed
them, the drains show in the sessions' telemetry (`repairs[].drained`) and on the nodes' stderr, no session failed,
and nothing is left held afterwards. Without a spare, a draining node keeps its session to its end, and exits then.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dgr.testing.harness import LocalRoute, RouteTimeout, sse_events

ROUTE = ("--stub-delay", "0.002", "--dead-after", "1")
PROMPTS = [f"Client {k} asks the route about its {w}." for k, w in enumerate(("shards", "spares", "seams", "drains"))]
MAX_TOKENS = 48


def _metric(route: LocalRoute, name: str, **but: str) -> float:
    """The metric's total, less its samples whose labels are `but`'s."""
    families = text_string_to_metric_families(route.http.get(f"{route.url}/metrics", timeout=5).text)
    return sum(s.value for f in families for s in f.samples
               if s.name == name and not any(s.labels.get(k) == v for k, v in but.items()))


def _answer(route: LocalRoute, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    body = {"model": "stub", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = route.http.post(f"{route.api}/completions", json=body, headers=route.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream(http, route: LocalRoute, prompt: str, max_tokens: int = MAX_TOKENS,
            first: threading.Event | None = None) -> dict[str, Any]:
    body = {"model": "stub", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, error = [], None
    with http.stream("POST", f"{route.api}/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode()[:300], "text": "", "sid": None}
        sid = r.headers["X-Dgr-Route-Session"]
        for kind, data in sse_events(r):
            if kind == "data" and isinstance(data, dict):
                if "error" in data:
                    error = data["error"]
                elif data.get("choices"):
                    text.append(data["choices"][0]["text"])
                    if first is not None:
                        first.set()
    return {"status": 200, "error": error, "text": "".join(text), "sid": sid}


def _gone(route: LocalRoute, pid: int, proc, timeout_s: float) -> float:
    """Wait until the node process `pid` (a `dgr up` child, or `proc`, one the harness restarted) has exited;
    how long that took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc is not None:
            if proc.poll() is not None:
                return time.monotonic() - started
        else:
            try:
                os.kill(pid, 0)  # `dgr up` reaps its children at once: gone means exited
            except ProcessLookupError:
                return time.monotonic() - started
        time.sleep(0.02)
    raise RouteTimeout(f"node pid {pid} still running {timeout_s}s after SIGTERM")


def _holding(route: LocalRoute, name: str, timeout_s: float = 15.0) -> None:
    """Wait until a Route Session decodes on a route through `name` (the tracker's view: heartbeats lag)."""
    deadline = time.monotonic() + timeout_s
    while not any(s["phase"] == "decode" and name in [h["node"] for h in s["route"]]
                  for s in route.http.get(f"{route.api}/route-sessions", timeout=5).json()["active"]):
        if time.monotonic() > deadline:
            raise RouteTimeout(f"{name} never held a session")
        time.sleep(0.01)


def _answers(results: list, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(results) < n:
        if time.monotonic() > deadline:
            raise RouteTimeout(f"{len(results)} answers of {n} after {timeout_s}s")
        time.sleep(0.02)


def test_a_rolling_restart_under_four_streaming_clients_costs_a_pause_never_an_answer() -> None:
    started = time.monotonic()
    with LocalRoute(nodes=3, extra=(*ROUTE, "--resume", "--spares", "1")) as route:
        roles = {n["node"]: n["role"] for n in route.node_table()}
        assert roles == {**{f"node{i}": "member" for i in range(3)}, **{f"node{i}-spare0": "spare" for i in range(3)}}
        want = {p: _answer(route, p) for p in PROMPTS}
        layers = {n["node"]: n["layers"] for n in route.node_table()}
        results: list[dict[str, Any]] = []
        done, lock = threading.Event(), threading.Lock()

        def client(prompt: str) -> None:
            with httpx_client(route) as http:
                while not done.is_set():
                    got = _stream(http, route, prompt)
                    with lock:
                        results.append({**got, "prompt": prompt})

        threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in PROMPTS]
        for t in threads:
            t.start()
        _holding(route, "node0")
        # the members have room for 4 clients: the spares stay idle
        assert all(route.node(f"node{i}-spare0")["sessions"] == 0 for i in range(3))
        procs: dict[str, Any] = {}
        drained_in = {}
        for name in ("node0", "node1", "node2"):
            _holding(route, name)
            pid = route.node(name)["pid"]
            os.kill(pid, signal.SIGTERM)
            drained_in[name] = _gone(route, pid, procs.get(name), 20.0)
            procs[name] = route.restart_node(name, layers[name])
            assert route.node(name)["role"] == "member"  # its layers' spare steps back: it asked to be one
            _answers(results, len(results) + len(PROMPTS))  # the clients go on through the restarted node
        done.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        failed = [r for r in results if r["status"] != 200 or r["error"] is not None]
        assert not failed, failed[:3]
        wrong = [r for r in results if r["text"] != want[r["prompt"]]]
        assert not wrong, [(r["prompt"], r["text"][:60]) for r in wrong[:3]]
        snaps = [route.session(r["sid"]) for r in results]
        drains = [rep for s in snaps for rep in s["repairs"] if rep["drained"]]
        assert {rep["lost"] for rep in drains} == {"node0", "node1", "node2"}, drains  # each drain moved sessions
        assert all(rep["replacement"] and 0 < rep["pause_ms"] < 5000 for rep in drains), drains
        assert not [rep for s in snaps for rep in s["repairs"] if not rep["drained"]]  # no loss: drains only
        assert _metric(route, "dgr_route_session_failures_total") == 0
        assert all(d < 10 for d in drained_in.values()), drained_in  # handed over, not waited out
        log = "\n".join(route.log_lines)
        assert all(f"dgr node: {n}: SIGTERM: draining" in log for n in ("node0", "node1", "node2")), log[-3000:]
        route.wait_sessions_freed([n["node"] for n in route.node_table() if n["alive"]], timeout_s=15)
        pauses = sorted(rep["pause_ms"] for rep in drains)
        print(f"\nrolling restart: {len(results)} answers, {len(drains)} handed over (pause ms: median "
              f"{pauses[len(pauses) // 2]:.0f}, max {pauses[-1]:.0f}), drains took "
              + ", ".join(f"{n} {s:.2f}s" for n, s in drained_in.items()))
    assert time.monotonic() - started < 90


def test_without_a_spare_a_draining_node_keeps_its_session_to_its_end_then_exits() -> None:
    with LocalRoute(nodes=2, extra=(*ROUTE, "--resume")) as route:
        want = _answer(route, PROMPTS[0], 400)  # about 2 s of streaming
        out: dict[str, Any] = {}
        first = threading.Event()

        def run() -> None:
            with httpx_client(route) as http:
                out.update(_stream(http, route, PROMPTS[0], 400, first))
                out["ended"] = time.monotonic()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert first.wait(15)
        pid = route.node("node1")["pid"]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while route.node("node1")["role"] != "draining":  # heard at once, not at the next heartbeat
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = route.http.post(f"{route.api}/completions", headers=route.headers, timeout=30,
                            json={"model": "stub", "prompt": "another", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_route"  # nothing new is routed to it
        _gone(route, pid, None, 30.0)
        exited = time.monotonic()
        t.join(30)
        assert out["error"] is None and out["text"] == want
        assert exited >= out["ended"] - 0.5  # it waited for its session (the stream's end reaches us a moment later)
        assert route.session(out["sid"])["repairs"] == []
        assert "dgr node: node1: drained in" in "\n".join(route.log_lines)
        assert _metric(route, "dgr_route_session_failures_total", reason="no_route") == 0  # the open refused above


def httpx_client(route: LocalRoute):
    import httpx

    return httpx.Client(timeout=60, headers=route.headers, verify=route.trust)


def test_a_node_no_tracker_admitted_goes_at_once_and_a_joined_one_waits_to_be_heard() -> None:
    """A draining node waits for its tracker to hear of the drain (at most HEAR_S), as an open may be on its way.
    One that never joined (it refused its tracker, or has none) has nothing routed to it: it waited HEAR_S too,
    2.5 s of every such test's teardown."""
    from dgr.node.drain import HEAR_S, Drain

    admitted = {"yes": False}
    drain = Drain(30.0, "n0", joined=lambda: admitted["yes"])
    drain.start(100.0)
    assert drain.heard_of(100.0)  # never joined: nothing to wait for
    admitted["yes"] = True
    assert not drain.heard_of(100.0) and drain.heard_of(100.0 + HEAR_S)  # joined: heard, or HEAR_S of silence
    drain.heard({"draining": True})
    assert drain.heard_of(100.0)
