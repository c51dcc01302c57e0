"""/metrics on the tracker and nodes moves as a stub route serves requests."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dgr.testing.harness import LocalRoute


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_a_request() -> None:
    with LocalRoute(nodes=2, extra=("--stub-delay", "0.003")) as route:
        before = _scrape(route.url)
        assert _get(before, "dgr_node_up", node="node0", layers="0:15") == 1.0
        seen_active = []

        def watch() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not seen_active:
                m = _scrape(route.url)
                if _get(m, "dgr_route_sessions_active", state="decode") >= 1:
                    seen_active.append(m)
                time.sleep(0.02)

        t = threading.Thread(target=watch)
        t.start()
        r = httpx.post(f"{route.api}/completions", timeout=60,
                       json={"model": "stub", "prompt": "metrics please", "max_tokens": 60, "temperature": 0})
        t.join(25)
        assert r.status_code == 200
        assert seen_active, "the active session never showed in dgr_route_sessions_active"
        after = _scrape(route.url)
        assert _get(after, "dgr_route_sessions_total", outcome="done") - _get(before, "dgr_route_sessions_total", outcome="done") == 1
        assert _get(after, "dgr_generated_tokens_total") - _get(before, "dgr_generated_tokens_total") == 60
        assert _get(after, "dgr_prompt_tokens_total") - _get(before, "dgr_prompt_tokens_total") == len("metrics please")
        assert _get(after, "dgr_time_to_first_token_seconds_count") == _get(before, "dgr_time_to_first_token_seconds_count") + 1
        assert _get(after, "dgr_token_latency_seconds_count") >= 59
        for node in ("node0", "node1"):
            assert _get(after, "dgr_seam_hop_latency_seconds_count", node=node) >= 60
        decode_bytes = _get(after, "dgr_seam_bytes_total", node="node1", kind="DECODE")
        assert decode_bytes == 59 * (48 + 576 * 4)
        assert _get(after, "dgr_route_sessions_active", state="decode") == 0
        node1 = route.node("node1")["url"]
        nm = _scrape(node1)
        assert _get(nm, "dgr_node_seam_frames_total", kind="DECODE") == 59
        assert _get(nm, "dgr_node_sessions") == 0 and _get(nm, "dgr_node_kv_bytes") == 0
        # a failure shows up by reason
        bad = httpx.post(f"{route.api}/completions", json={"model": "missing", "prompt": "x"})
        assert bad.status_code == 404
        route.kill("node1")
        deadline = time.monotonic() + 15  # the death threshold (--dead-after, 3 s by default), then a sweep
        while _get(m := _scrape(route.url), "dgr_node_up", node="node1", layers="15:30") != 0.0:
            assert time.monotonic() < deadline, "the killed node never showed as down"
            time.sleep(0.1)
        assert _get(m, "dgr_route_session_failures_total", reason="model_not_found") >= 1
