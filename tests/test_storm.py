"""A concurrency storm on a real 2-node llama_shard route: 8 streaming clients, random disconnects.

Clients leave mid-prefill and mid-decode while others keep streaming, for a
fixed number of rounds (the default suite) or a fixed time (`DGR_SLOW=1`,
at least 60 s). Afterwards: no 5xx and no error event was ever answered, no
429 while clients never outnumbered a node's sessions, greedy answers to fixed
questions are what they were before, and every node holds no session and no KV.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import httpx
import pytest

from dgr.testing.harness import LocalRoute

pytestmark = pytest.mark.serial  # llama.cpp routes of several nodes: one at a time under make test (tests/conftest.py)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CLIENTS = 8
PREFILL_CHUNK = 128  # short chunks: a prompt of a few hundred tokens is still several prefill steps
QUESTIONS = ["The capital of France is", "Water boils at", "The largest planet is"]


def _greedy(route: LocalRoute) -> list[str]:
    out = []
    for q in QUESTIONS:
        r = httpx.post(f"{route.api}/completions", timeout=120,
                       json={"model": MODEL, "prompt": q, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def _client(route: LocalRoute, k: int, until, tally: dict, lock: threading.Lock) -> None:
    rng = random.Random(k)
    with httpx.Client(timeout=120) as http:
        n = 0
        while until(n):
            n += 1
            # a third leave during prefill (a prompt of 3 to 5 chunks, gone after the headers), a third mid-decode
            fate = rng.choice(["complete", "prefill", "decode"])
            words = rng.randint(100, 200) if fate == "prefill" else rng.randint(5, 40)  # within --ctx 2048
            body = {"model": MODEL, "prompt": f"Client {k} asks: " + "tell me more " * words,
                    "max_tokens": rng.randint(8, 40), "temperature": 0, "stream": True}
            with http.stream("POST", f"{route.api}/completions", json=body) as r:
                with lock:
                    tally[r.status_code] = tally.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    with lock:
                        tally.setdefault("bodies", []).append(r.read().decode()[:300])
                    continue
                if fate == "prefill":
                    continue  # leave before the first token
                leave_after = rng.randint(1, 6) if fate == "decode" else None
                chunks = 0
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        data = json.loads(line[6:])
                        if "error" in data:
                            with lock:
                                tally.setdefault("errors", []).append(data["error"])
                            break
                        chunks += 1
                        if leave_after is not None and chunks >= leave_after:
                            break


def _storm(seconds: float | None, rounds: int) -> None:
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=300, busy_poll_ms=None,  # as `dgr up` runs
                    extra=("--ctx", "2048", "--prefill-chunk", str(PREFILL_CHUNK),
                           "--max-sessions", str(CLIENTS))) as route:
        before = _greedy(route)
        tally: dict = {}
        lock = threading.Lock()
        end = None if seconds is None else time.monotonic() + seconds
        until = (lambda n: time.monotonic() < end) if end is not None else (lambda n: n < rounds)
        threads = [threading.Thread(target=_client, args=(route, k, until, tally, lock)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        assert not any(t.is_alive() for t in threads)
        print(f"\nstorm: responses by status {({k: v for k, v in tally.items() if isinstance(k, int)})}")
        assert set(k for k in tally if isinstance(k, int)) == {200}, tally
        assert "errors" not in tally, tally["errors"][:5]
        route.wait_sessions_freed(["node0", "node1"])
        assert _greedy(route) == before
        stats = httpx.get(f"{route.api}/stats", timeout=10).json()
        assert "internal_error" not in stats["failures"] and "node_error" not in stats["failures"], stats
        for name in ("node0", "node1"):
            status = route.node_status(name)
            print(f"{name}: scheduler {status['scheduler']}")
            assert status["sessions"] == 0 and status["kv_bytes"] == 0


def test_storm_of_disconnecting_clients_leaves_the_route_clean() -> None:
    _storm(None, rounds=4)


@pytest.mark.slow
def test_storm_for_a_minute() -> None:
    _storm(float(os.environ.get("DGR_STORM_S", "75")), rounds=0)
