"""Prefill through a route of several nodes is a pipeline; how it is cut decides how long a core idles.

Driven through a real 2-node route (the default topology) of stub nodes whose compute is a sleep per
position, so the figures are the schedule's, not the machine's load.
"""

from __future__ import annotations

import time

import httpx

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.tracker.gateway import MIN_PIPELINE_CHUNK, PIPELINE_CUTS, prefill_bounds
from dgr.testing.harness import LocalRoute

DELAY_S = 0.004  # per position, on each node


def _prefill_steps(route: LocalRoute, node: str) -> int:
    for line in httpx.get(f"{route.node(node)['url']}/metrics", timeout=10).text.splitlines():
        if line.startswith('dgr_node_compute_seconds_count{kind="PREFILL"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_two_node_prefill_ends_about_one_short_chunk_after_the_head() -> None:
    """1,500 positions at 4 ms a position a node: 6 s on each node. Cut at 512 the tail's last chunk
    (476 positions, 1.9 s) ran after the head had finished, about 8 s in all; cut into 16 chunks it
    is about 6.4 s."""
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    prompt = "x" * 1499
    n = len(stub.tokenize(prompt, add_special=True, parse_special=True))
    with LocalRoute(backend="stub", nodes=2, extra=("--stub-delay", str(DELAY_S), "--prefill-chunk", "512")) as route:
        body = {"model": "stub", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        t0 = time.monotonic()
        r = httpx.post(f"{route.api}/completions", json=body, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        alone = n * DELAY_S  # one node's compute: no schedule ends sooner
        assert took < 1.2 * alone, f"{took:.2f} s for {n} positions ({alone:.2f} s a node)"
        assert _prefill_steps(route, "node0") == PIPELINE_CUTS


def test_prefill_bounds_cut_equal_short_chunks_on_a_route_and_whole_ones_on_one_node() -> None:
    for start, end, hops in ((0, 2317, 2), (1472, 1577, 2), (0, 2317, 3), (64, 700, 2), (0, 33, 2), (0, 2, 2)):
        b = prefill_bounds(start, end, 512, hops)
        sizes = [y - x for x, y in zip(b, b[1:])]
        assert b[0] == start and b[-1] == end and all(s > 0 for s in sizes)
        assert max(sizes) <= max(MIN_PIPELINE_CHUNK, -(-(end - start) // (PIPELINE_CUTS * (hops - 1))))
        assert max(sizes) - min(sizes) <= 1 or len(sizes) == 1
        assert len(sizes) == 1 or sizes[-1] > 1  # never a lone position after a chunk
    assert prefill_bounds(0, 2317, 512, 1) == [0, 512, 1024, 1536, 2048, 2317]  # no pipeline: whole ubatches
    assert prefill_bounds(0, 1025, 512, 1) == [0, 512, 1023, 1025]
