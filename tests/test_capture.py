"""A member that would capture every prompt (spec/security.md, "Routing resists capture").

The attack: a node that registers every layer and a capacity of a million
won every route (fewest hops first, least loaded by the capacity it
declared), so the head it served read every chat in clear. Now declared
capacity is bounded and only grows as the node is seen to carry sessions,
routes take turns and are spread by sessions held, and an operator can name
the keys that may hold a route's ends (`--trusted-head`).
"""

from __future__ import annotations

import random
from operator import attrgetter

import httpx
import pytest
import trio
from hypothesis import given, settings, strategies as st

from dgr.api.openai import parse_request
from dgr.errors import PeerError, Reason
from dgr.procs import dgr_command
from dgr.testing.harness import LocalRoute
from dgr.testing.inproc import InProcRoute, registration
from dgr.testing.launcher import launch
from dgr.tracker.gateway import GatewayConfig
from dgr.seam.types import ModelInfo
from dgr.tracker.registry import MAX_NODE_SESSIONS, PROVEN_START, NodeEntry, Registry
from dgr.tracker.routing import _best_path, _shortest, choose_route, draw

QUIET = GatewayConfig(sweep_s=3600.0)
_MODEL = ModelInfo("m", "stub", 6, 8, 8, 10, 64, "0" * 64)


def _head(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["dgr"]["telemetry"]["route"][0]["node"]


def test_a_node_claiming_every_layer_and_a_million_slots_gets_its_turn_not_every_session() -> None:
    """A real member process (stub, layers 0:30, --max-sessions 1000000) joins a 2-node route with the join token."""
    with LocalRoute(nodes=2) as route:
        thief = launch(dgr_command("node", "--backend", "stub", "--layers", "0:30", "--max-sessions", "1000000",
                                   "--name", "thief", "--tracker", route.url, "--busy-poll-ms", "0"),
                       env=route.env())
        try:
            route.wait_nodes_alive(["thief"], timeout_s=60)
            entry = route.node("thief")
            assert entry["capacity"] == MAX_NODE_SESSIONS and entry["limit"] == PROVEN_START, entry
            heads = [_head(route.http.post(f"{route.api}/completions", json={
                "model": "stub", "prompt": f"secret {i}", "max_tokens": 2}, headers=route.headers, timeout=30))
                for i in range(8)]
        finally:
            thief.terminate()
            thief.wait(timeout=30)
    # before: fewest hops first, so every one of the 8 prompts reached the thief
    assert heads.count("thief") == 4 and heads.count("node0") == 4, heads


def _nodes(route: InProcRoute) -> dict:
    return {e.node_id: e for e in route.registry.nodes.values()}


async def test_sessions_at_once_spread_by_sessions_held_not_by_declared_capacity(nursery) -> None:
    """Held sessions go to the route whose busiest node holds fewest, whatever capacity a node declares."""
    route = InProcRoute.stub(splits=((0, 15), (15, 30), (0, 30)), config=QUIET, capacity=8, delay_s=0.01)
    route.register(0)
    route.register(1)
    body = registration(route.services[2], route.urls[2])
    route.registry.register({**body, "capacity": 1_000_000}, trio.current_time(), key=route.services[2].identity.public)
    await nursery.start(route.run)
    held = []
    for i in range(6):
        held.append(await route.gateway.open(parse_request(
            {"model": "stub", "prompt": f"p{i}", "max_tokens": 200, "stream": True}, "completion")))
    # before: least loaded by declared capacity, so the million-slot node took all 6
    assert [live.rs.route[0].node_id for live in held].count("n2") == 3
    nodes = _nodes(route)
    assert (nodes["n2"].reserved, nodes["n0"].reserved, nodes["n1"].reserved) == (3, 3, 3)
    for live in held:
        route.gateway.cancel(live.rs.sid, "test over")
    for live in held:
        async for _ in live.recv:
            pass


async def test_a_declared_capacity_is_bounded_and_grows_only_as_far_as_it_is_shown() -> None:
    registry = Registry(max_node_sessions=32)
    route = InProcRoute.stub(splits=((0, 30),))
    entry = registry.register({**registration(route.services[0], route.urls[0]), "capacity": 10 ** 9}, 0.0,
                              key=route.services[0].identity.public)
    assert entry.capacity == 32 and entry.limit() == PROVEN_START
    entry.reserved = PROVEN_START - 1
    entry.served()  # it never held its limit at once: nothing shown
    assert entry.limit() == PROVEN_START
    entry.reserved = PROVEN_START
    entry.served()
    assert entry.limit() == 32  # doubled, up to what the tracker allows
    entry.faulted()
    assert entry.limit() == PROVEN_START


async def test_trusted_heads_hold_the_ends_of_every_route() -> None:
    """With --trusted-head keys, an untrusted node may serve middle layers, never the first or the last."""
    route = InProcRoute.stub(splits=((0, 10), (10, 20), (20, 30), (0, 30), (0, 10), (20, 30)))
    for i in range(6):
        route.register(i)
    keys = [s.identity.public for s in route.services]
    nodes = list(route.registry.nodes.values())
    trusted = frozenset({keys[0], keys[2]})
    for _ in range(4):  # every turn of the rotation
        choice = choose_route(nodes, "stub", trusted=trusted)
        assert [h.node_id for h in choice.hops] == ["n0", "n1", "n2"]
        for n in choice.nodes:
            n.routed_at += 100.0
    assert "n3" in [h.node_id for h in choose_route(nodes, "stub").hops]  # untrusted, the 1-hop node takes turns
    with pytest.raises(PeerError) as refused:
        choose_route(nodes, "stub", trusted=frozenset({keys[1]}))
    assert refused.value.reason is Reason.NO_ROUTE and "--trusted-head" in refused.value.message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 4), st.integers(0, 5),
                          st.integers(0, 2)), min_size=1, max_size=10), st.integers(0, 4), st.integers(0, 5))
def test_the_route_rule_searches_its_ceilings_exactly_and_compares_routes_on_what_differs(specs, busy, late) -> None:
    """The binary search over ceilings picks what trying every ceiling in order picks (the rule's reference), and a
    node on every cover (a shared stage) changes nothing whatever its sessions and turn: before, routes through a
    shared stage tied on it and the lowest node id won."""
    nodes = []
    for i, (start, span, reserved, routed, turns) in enumerate(specs):
        entry = NodeEntry(f"n{i}", f"http://n{i}:1", start, min(start + span, 6), "stub", _MODEL, 8, {},
                          0.0, 0.0)
        entry.reserved, entry.routed_at, entry.turns = reserved, float(routed), turns
        nodes.append(entry)
    ranks = draw(nodes, random.Random(len(specs)))

    def settle(pool, key):
        shared: list[NodeEntry] = []
        while _shortest(shared, 6) is None:
            free = [n for n in pool if all(n is not m for m in shared)]
            ceiling = next(c for c in sorted({key(n) for n in free})
                           if _shortest([*shared, *(n for n in free if key(n) <= c)], 6) is not None)
            pool = [*shared, *(n for n in free if key(n) <= ceiling)]
            forced = [n for n in pool if key(n) == ceiling and all(n is not m for m in shared)
                      and _shortest([m for m in pool if m is not n], 6) is None]
            if not forced:
                break
            shared += forced
        return pool

    def reference():
        if _shortest(nodes, 6) is None:
            return None
        return _shortest(settle(settle(nodes, attrgetter("load")), attrgetter("turns", "routed_at")), 6, ranks)

    chosen = _best_path(nodes, 6, ranks)
    assert chosen == reference()
    if chosen is None:
        return
    for n in nodes:
        if _shortest([m for m in nodes if m is not n], 6) is None:  # on every cover
            n.reserved, n.routed_at, n.turns = busy, float(late), late
    assert _best_path(nodes, 6, ranks) == chosen
