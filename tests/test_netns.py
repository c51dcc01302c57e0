"""Namespaced routes (dgr.bench.netns): each node in its own network namespace, links with a real RTT.

A 2-node stub route runs at 0 and 5 ms RTT: the delay is checked where it
is configured, and the sweep's report shape and expectations are checked;
what the delay costs a token is a figure `dgr bench --rtt` prints, not a
test threshold. Every test that builds namespaces also checks that none are
left afterwards. Skipped without root or `ip netns`.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from dgr.bench.netns import NetnsRoute, prerequisites
from dgr.bench.rtt import expectations, round_trips_per_token, rtt_sweep, ttft_round_trips
from dgr.testing.namespaces import leftovers, remove_stale
from dgr.errors import PeerError

pytestmark = pytest.mark.serial  # network namespaces: one at a time under make test (tests/conftest.py)

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


def test_expected_time_per_token_adds_half_the_hops_times_rtt() -> None:
    rows = expectations([{"rtt_ms": 0.0, "decode_tok_s": 50.0, "ttft_s": 0.1},
                         {"rtt_ms": 5.0, "decode_tok_s": 25.0, "ttft_s": 0.13}], hops=3, ttft_trips=4)
    assert rows[1]["expected_ms_per_token"] == pytest.approx(20.0 + 7.5)
    assert rows[1]["expected_tok_s"] == pytest.approx(1e3 / 27.5)
    assert rows[1]["extra_ms_per_token"] == pytest.approx(20.0)
    assert rows[1]["extra_ms_per_hop"] == pytest.approx(20.0 / 3)
    assert rows[1]["ttft_extra_ms"] == pytest.approx(30.0)
    assert rows[1]["expected_ttft_extra_ms"] == pytest.approx(20.0)
    assert rows[0]["extra_ms_per_hop"] is None


def test_a_ring_waits_n_one_way_trips_per_token() -> None:
    assert round_trips_per_token(3) == 1.5  # node0 -> node1 -> node2 -> node0
    rows = expectations([{"rtt_ms": 0.0, "decode_tok_s": 50.0, "ttft_s": 0.1},
                         {"rtt_ms": 5.0, "decode_tok_s": 1e3 / 31.0, "ttft_s": 0.13}], hops=3, ttft_trips=4)
    assert rows[1]["expected_ms_per_token"] == pytest.approx(20.0 + 7.5)
    assert rows[1]["extra_rtts_per_token"] == pytest.approx(11.0 / 5.0)


def test_round_trips_before_the_first_token() -> None:
    # token ids: open + 1 chunk from the gateway through 3 hops and back (4 one-way trips); text adds the
    # head's tokenize; 2 chunks add 1 pipelined trip
    assert ttft_round_trips(3, 3, 512) == 1 + 2  # the head tokenizes inside its open, with the others'
    assert ttft_round_trips(3, 3, 512, reused=True) == 1 + 1 + 2  # and names a reused prefix to them
    assert ttft_round_trips(1, 3, 512, reused=True) == 1 + 1
    assert ttft_round_trips(2, 600, 512) == 1 + 1 + 1.5


def test_nodes_run_in_their_own_namespaces(netns) -> None:
    with NetnsRoute(backend="stub", nodes=2, ready_timeout_s=40) as route:
        table = httpx.get(f"{route.url}/v1/nodes", headers=route.headers, timeout=5).json()["nodes"]
        by_name = {n["node"]: n for n in table}
        for link in route.links:
            node = by_name[f"node{link.index}"]
            assert node["url"].startswith(f"http://{link.addr}:")
            assert _ns_of(node["pid"]) == link.ns
        assert _ns_of(os.getpid()) == ""  # the client and tracker stay in the root namespace
        assert httpx.get(f"{route.url}/v1/models", timeout=5).status_code == 401  # not loopback: keyed
        pids = [n["pid"] for n in table]
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)


def _qdiscs(route, link) -> list[str]:
    """The root qdisc lines on both ends of an endpoint's link to the hub."""
    out = subprocess.run([*link.in_ns("tc"), "qdisc", "show", "dev", link.dev], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "netns", "exec", route.hub, "tc", "qdisc", "show", "dev", link.hub_dev],
                          capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " root " in line]


def test_set_rtt_delays_every_pair_of_endpoints_alike(netns) -> None:
    # What the RTT costs a token is a figure for `dgr bench --rtt`; here, that the delay is in place
    # on every endpoint's link (the tracker's too), and that nodes reach each other (the ring needs it).
    with NetnsRoute(backend="stub", nodes=2, ready_timeout_s=120) as route:
        route.set_rtt(5.0)
        if route.kind == "netem":
            for link in route.endpoints:
                lines = _qdiscs(route, link)
                assert len(lines) == 2 and all("netem" in q and "delay 1.25ms" in q for q in lines), lines
        r = httpx.post(f"{route.api}/completions", headers=route.headers, timeout=60,
                       json={"model": route.model_id(), "prompt": PROMPT, "max_tokens": 8})
        # node0 posts each step straight to node1, node1 to node0: this answer needs node-to-node routes
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        route.set_rtt(0.0)
        if route.kind == "netem":
            assert all("netem" not in q for link in route.endpoints for q in _qdiscs(route, link))


def test_rtt_sweep_reports_every_rtt_with_its_expectation(netns) -> None:
    res = rtt_sweep(backend="stub", node_counts=(2,), rtts_ms=(5.0,), prompt=PROMPT, decode_tokens=16,
                    threads=2, repeats=1, ready_timeout_s=120, log=lambda m: None)
    route = res["routes"]["dgr stub, 2 nodes, ring, namespaces"]
    rows = {r["rtt_ms"]: r for r in route["rows"]}
    assert sorted(rows) == [0.0, 5.0] and route["ttft_round_trips"] == 3.5
    # tokenize, open, and one prefill chunk from the gateway through both hops and back: 3.5 x 5 ms expected
    assert rows[5.0]["expected_ttft_extra_ms"] == 17.5
    assert all(r["tokens"] == 16 and r["decode_tok_s"] > 0 and r["ttft_s"] > 0 for r in rows.values())
    print(f"\nat 5 ms RTT a token cost {rows[5.0]['extra_ms_per_token']:.1f} ms more (2 one-way trips: 5 ms expected)")


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
