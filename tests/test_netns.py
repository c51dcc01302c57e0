"""Namespaced routes (dgr.bench.netns): each node in its own network namespace, links with a real RTT.

A 2-node stub route is measured at 0 and 5 ms RTT: the gateway relays
every hop, so each decoded token must cost about 2 x 5 ms more. Every test
that builds namespaces also checks that none are left afterwards. Skipped
without root or `ip netns`.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from dgr.bench.netns import (
    NetnsRoute,
    expectations,
    leftovers,
    prerequisites,
    remove_stale,
    rtt_sweep,
    ttft_round_trips,
)
from dgr.errors import PeerError

PROMPT = "The lighthouse keeper kept a log of every ship that passed the point."


@pytest.fixture
def netns():
    why = prerequisites()
    if why is not None:
        pytest.skip(why)
    yield
    assert leftovers() == [], "namespaces or links left behind"


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _ns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True,
                          check=False).stdout.strip()


def test_expected_time_per_token_adds_hops_times_rtt() -> None:
    rows = expectations([{"rtt_ms": 0.0, "decode_tok_s": 50.0, "ttft_s": 0.1},
                         {"rtt_ms": 5.0, "decode_tok_s": 25.0, "ttft_s": 0.13}], hops=3, ttft_trips=4)
    assert rows[1]["expected_ms_per_token"] == pytest.approx(20.0 + 15.0)
    assert rows[1]["expected_tok_s"] == pytest.approx(1e3 / 35.0)
    assert rows[1]["extra_ms_per_token"] == pytest.approx(20.0)
    assert rows[1]["extra_ms_per_hop"] == pytest.approx(20.0 / 3)
    assert rows[1]["ttft_extra_ms"] == pytest.approx(30.0)
    assert rows[1]["expected_ttft_extra_ms"] == pytest.approx(20.0)
    assert rows[0]["extra_ms_per_hop"] is None


def test_round_trips_before_the_first_token() -> None:
    # token ids: open + 1 chunk through 3 hops; text adds the head's tokenize; 2 chunks add 1 pipelined trip
    assert ttft_round_trips(3, [1, 2, 3], 3, 512) == 1 + 3
    assert ttft_round_trips(3, "hi", 3, 512) == 1 + 1 + 3
    assert ttft_round_trips(2, list(range(600)), 600, 512) == 1 + 2 + 1


def test_nodes_run_in_their_own_namespaces(netns) -> None:
    with NetnsRoute(backend="stub", nodes=2, ready_timeout_s=40) as route:
        table = httpx.get(f"{route.url}/v1/nodes", headers=route.headers, timeout=5).json()["nodes"]
        by_name = {n["node"]: n for n in table}
        for link in route.links:
            node = by_name[f"node{link.index}"]
            assert node["url"].startswith(f"http://{link.ns_addr}:")
            assert _ns_of(node["pid"]) == link.ns
        assert _ns_of(os.getpid()) == ""  # the client and tracker stay in the root namespace
        assert httpx.get(f"{route.url}/v1/models", timeout=5).status_code == 401  # not loopback: keyed
        pids = [n["pid"] for n in table]
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def test_decode_time_grows_by_hops_times_rtt(netns) -> None:
    t0 = time.monotonic()
    res = rtt_sweep(backend="stub", node_counts=(2,), rtts_ms=(5.0,), prompt=PROMPT, decode_tokens=60,
                    threads=2, repeats=3, ready_timeout_s=40, log=lambda m: None)
    rows = {r["rtt_ms"]: r for r in res["routes"]["dgr stub, 2 nodes, namespaces"]["rows"]}
    assert sorted(rows) == [0.0, 5.0]
    extra = rows[5.0]["extra_ms_per_token"]
    # 2 hops x 5 ms = 10 ms; the wide band absorbs a shared 2-core machine, but not 0 (no delay) or 20 (4 trips)
    assert 6.0 < extra < 16.0, rows
    # tokenize, open, and one prefill chunk through both hops: 4 x 5 ms
    assert rows[5.0]["expected_ttft_extra_ms"] == 20.0
    assert 5.0 < rows[5.0]["ttft_extra_ms"] < 45.0, rows
    assert time.monotonic() - t0 < 45


def test_a_route_that_fails_to_start_leaves_nothing(netns) -> None:
    with pytest.raises(PeerError):
        NetnsRoute(backend="stub", nodes=2, ready_timeout_s=0.05).start()
    assert leftovers() == []


def test_stale_namespaces_of_dead_runs_are_removed(netns) -> None:
    dead, mine = f"dgrb-{_dead_pid()}-0", f"dgrb-{os.getpid()}-keep"
    for ns in (dead, mine):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = remove_stale()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert dead in removed and dead not in names
        assert mine not in removed and mine in names  # a live run's namespaces are left alone
    finally:
        subprocess.run(["ip", "netns", "del", mine], check=True)
        subprocess.run(["ip", "netns", "del", dead], capture_output=True, check=False)  # gone already if it passed
