"""/metrics on the tracker and nodes moves as a stub route serves requests."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dgr.testing.harness import LocalRoute, first_text, sse_events


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_metric(url: str, ok, what: str, timeout_s: float = 30.0) -> dict:
    """Scrape until `ok(metrics)` holds: waits on the event, bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _scrape(url)
        if ok(m):
            return m
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def test_metrics_follow_a_request() -> None:
    with LocalRoute(nodes=2, extra=("--stub-delay", "0.003")) as route:
        first = _scrape(route.url)
        assert _get(first, "dgr_node_up", node="node0", layers="0:15") == 1.0
        # A session held in decode (a long answer, read one chunk at a time) shows in the active gauge.
        body = {"model": "stub", "prompt": "hold on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{route.api}/completions", json=body, timeout=60) as held:
            events = sse_events(held)  # kept: a dropped generator would close the stream
            first_text(events)
            _wait_metric(route.url, lambda m: _get(m, "dgr_route_sessions_active", state="decode") >= 1,
                         "the held session in dgr_route_sessions_active")
        # leaving cancels it; once it has ended, count what one complete request adds
        before = _wait_metric(
            route.url, lambda m: _get(m, "dgr_route_sessions_total", outcome="failed")
            == _get(first, "dgr_route_sessions_total", outcome="failed") + 1, "the held session end")
        node1 = route.node("node1")["url"]
        before_node1 = _scrape(node1)
        r = httpx.post(f"{route.api}/completions", timeout=60,
                       json={"model": "stub", "prompt": "metrics please", "max_tokens": 60, "temperature": 0})
        assert r.status_code == 200
        after = _scrape(route.url)
        assert _get(after, "dgr_route_sessions_total", outcome="done") - _get(before, "dgr_route_sessions_total", outcome="done") == 1
        assert _get(after, "dgr_generated_tokens_total") - _get(before, "dgr_generated_tokens_total") == 60
        assert _get(after, "dgr_prompt_tokens_total") - _get(before, "dgr_prompt_tokens_total") == len("metrics please")
        assert _get(after, "dgr_time_to_first_token_seconds_count") == _get(before, "dgr_time_to_first_token_seconds_count") + 1
        assert _get(after, "dgr_token_latency_seconds_count") - _get(before, "dgr_token_latency_seconds_count") == 59
        # each decoded token after the first: its round trip is shared out over the hops it crossed
        for node in ("node0", "node1"):
            assert (_get(after, "dgr_seam_hop_latency_seconds_count", node=node)
                    - _get(before, "dgr_seam_hop_latency_seconds_count", node=node)) == 59
        # the gateway sends the head only the prompt's positions (one chunk, a bare header: the head has the
        # ids, it tokenized the prompt inside its open); the tail sends it each decode step, and node0 sends
        # node1 the rest
        prompt_bytes = (_get(after, "dgr_seam_bytes_total", node="node0", kind="PREFILL")
                        - _get(before, "dgr_seam_bytes_total", node="node0", kind="PREFILL"))
        assert prompt_bytes == 48
        assert _get(after, "dgr_seam_bytes_total", node="node0", kind="DECODE") == 0.0
        _wait_metric(route.url, lambda m: _get(m, "dgr_route_sessions_active", state="decode") == 0,
                     "no active session")
        # the gateway frees node KV as the session ends, which may be just after the response
        nm = _wait_metric(node1, lambda m: _get(m, "dgr_node_sessions") == 0, "node1 free of sessions")
        held_decodes = _get(before_node1, "dgr_node_seam_frames_total", kind="DECODE")
        assert _get(nm, "dgr_node_seam_frames_total", kind="DECODE") - held_decodes == 59
        assert _get(nm, "dgr_node_sessions") == 0 and _get(nm, "dgr_node_kv_bytes") == 0
        # a failure shows up by reason
        bad = httpx.post(f"{route.api}/completions", json={"model": "missing", "prompt": "x"})
        assert bad.status_code == 404
        route.kill("node1")
        m = _wait_metric(route.url, lambda m: _get(m, "dgr_node_up", node="node1", layers="15:30") == 0.0,
                         "node1 down in dgr_node_up")
        assert _get(m, "dgr_route_session_failures_total", reason="model_not_found") >= 1
        # /v1/stats counts failures from the same counter
        stats = httpx.get(f"{route.url}/v1/stats", timeout=5).json()
        counted = {labels[0][1]: v for (name, labels), v in _scrape(route.url).items()
                   if name == "dgr_route_session_failures_total"}
        assert stats["failures"] == counted and stats["failures"]["model_not_found"] >= 1
