"""Losing the middle node of a real 3-node llama_shard route, in prefill and in decode."""

from __future__ import annotations

import httpx
import pytest

from dgr.testing.harness import LOSS_BOUND_S, LocalRoute, first_error, first_text, sse_events

pytestmark = [pytest.mark.llama, pytest.mark.serial]
import llama_cpp  # noqa: F401  a hard dependency: a broken build fails here

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _stream(route: LocalRoute, prompt: str, max_tokens: int):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return httpx.stream("POST", f"{route.api}/completions", json=body, timeout=120)


# a loss in prefill is in the gate in process, on MockClock (test_gateway_clock.test_a_node_killed_in_prefill_is_named_in_prefill)
@pytest.mark.parametrize("phase", [pytest.param("prefill", marks=pytest.mark.slow), "decode"])
def test_kill_middle_node(phase: str) -> None:
    # 32-position prefill chunks make a long prompt take many steps, so the kill lands mid-prefill
    with LocalRoute(backend="llama_shard", nodes=3, ready_timeout_s=300,
                    extra=("--ctx", "4096", "--prefill-chunk", "32")) as route:
        middle = route.node("node1")["layers"]  # as dgr up planned it (the tail, with the LM head, has fewer)
        prompt = "The quick brown fox jumps over the lazy dog. " * 120 if phase == "prefill" else "Count: 1, 2, 3,"
        with _stream(route, prompt, 300) as r:
            sid = r.headers["x-dgr-route-session"]
            events = sse_events(r)
            killed: list[float] = []
            if phase == "prefill":
                route.when(sid, lambda s: s["phase"] == "prefill" and s["prefill"]["done"] >= 64,
                           lambda: killed.append(route.kill("node1")))
            else:
                first_text(events)
                killed.append(route.kill("node1"))
            error, seen_at = first_error(events)
        assert killed, "the fault never fired"
        assert seen_at - killed[0] < LOSS_BOUND_S, f"failure after {seen_at - killed[0]:.2f}s"
        assert (error["code"], error["node"], error["phase"]) == ("route_node_lost", "node1", phase)
        route.wait_sessions_freed(["node0", "node2"])
        # the tracker stops routing through the dead node: no route covers its layers now
        r = httpx.post(f"{route.api}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and f"missing layers: {middle}" in r.json()["error"]["message"]
        route.restart_node("node1", middle)
        ok = httpx.post(f"{route.api}/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
