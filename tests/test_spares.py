"""Spares (issue 54): nodes whose layers members cover are kept idle, by layers alone, and taken first by a repair.

In process, over the registry and routing: which nodes `settle` makes spares (the tracker's `--spares N`, a node's
`--spare`, coverage first), a dead or draining member replaced by a spare of its layers, routing that keeps spares
idle while members have room, a repair that takes a spare first, and the role in the node table.
"""

from __future__ import annotations

import random

import pytest

from dgr.errors import CallerError, Reason
from dgr.fsm.proof import ProofState, ProofStatus
from dgr.seam.types import ModelInfo
from dgr.tracker.entry import NodeEntry, Role
from dgr.tracker.registry import Registry
from dgr.tracker.registration import read_heartbeat
from dgr.tracker.routing import choose_route, repair_route
from dgr.tracker.spares import settle

INFO = {"name": "m", "architecture": "stub", "n_layers": 30, "hidden_size": 8, "seam_width": 8, "vocab_size": 300,
        "context_length": 4096, "digest": "0" * 64}


def _entry(node: str, start: int, stop: int, at: float = 0.0, wants_spare: bool = False) -> NodeEntry:
    return NodeEntry(node_id=node, url=f"http://{node}", start=start, stop=stop, backend="stub",
                     model=ModelInfo.from_json(INFO), capacity=2, describe={}, registered_at=at, last_seen=at,
                     proof=ProofStatus(ProofState.PASSED), wants_spare=wants_spare)


def _roles(entries: list[NodeEntry]) -> dict[str, str]:
    return {n.node_id: n.role.value for n in entries}


def _body(node: str, layers: tuple[int, int], **more) -> dict:
    return {"node": node, "url": f"http://127.0.0.1:{9000 + len(node)}", "pid": None, "layers": list(layers),
            "backend": "stub", "model": INFO, "capacity": 2, "describe": {}, **more}


def test_a_node_whose_layers_members_cover_is_a_spare_by_its_layers_alone() -> None:
    a, b, a2, b2 = _entry("a", 0, 15), _entry("b", 15, 30), _entry("a2", 0, 15, 1.0), _entry("b2", 15, 30, 1.0)
    everyone = [a2, b2, a, b]  # the order they are listed in does not matter: the oldest registration is a member
    assert settle(everyone, keep=0) == [] and set(_roles(everyone).values()) == {"member"}  # as before spares
    changed = settle(everyone, keep=1)
    assert _roles(everyone) == {"a": "member", "b": "member", "a2": "spare", "b2": "spare"}
    assert sorted((n.node_id, before) for n, before in changed) == [("a2", Role.MEMBER), ("b2", Role.MEMBER)]
    # beyond the spares kept, a replica serves; a node asking to be a spare is one whatever the count
    a3, b3 = _entry("a3", 0, 15, 2.0), _entry("b3", 15, 30, 2.0, wants_spare=True)
    a3.role = b3.role = Role.SPARE  # as the registry enters a newcomer: behind the members settled already
    settle([*everyone, a3, b3], keep=1)
    assert a3.role is Role.MEMBER and b3.role is Role.SPARE
    # a node spanning both ranges is covered by the members: a spare while its layers want one more
    whole = _entry("whole", 0, 30, 3.0)
    whole.role = Role.SPARE
    settle([*everyone, whole], keep=1)
    assert whole.role is Role.MEMBER  # a2 and b2 are the one spare each layer keeps
    settle([*everyone, whole], keep=2)
    assert whole.role is Role.SPARE


def test_coverage_wins_over_asking_and_members_stay_members() -> None:
    spare = _entry("s", 0, 30, 0.0, wants_spare=True)
    settle([spare], keep=0)
    assert spare.role is Role.MEMBER  # the only node of its layers: it serves, asked or not
    node = _entry("n", 0, 30, 1.0)
    node.role = Role.SPARE  # a newcomer, as the registry enters one
    settle([spare, node], keep=0)
    assert (node.role, spare.role) == (Role.MEMBER, Role.SPARE)  # once another covers, the asker is idle again
    late = _entry("late", 0, 30, 2.0)
    late.role = Role.SPARE
    settle([spare, node, late], keep=2)
    assert (node.role, late.role) == (Role.MEMBER, Role.SPARE)  # a member stays one; the newcomer waits
    node.alive = False  # the member dies: a spare of its layers becomes a member
    settle([spare, node, late], keep=2)
    assert late.role is Role.MEMBER and spare.role is Role.SPARE
    drained = _entry("d", 0, 30, 3.0)
    drained.role = Role.DRAINING
    settle([drained], keep=0)
    assert drained.role is Role.DRAINING and not drained.routable  # terminal: never routed again


def test_routing_keeps_spares_idle_while_members_have_room_and_a_repair_takes_a_spare_first() -> None:
    a, b, a2, b2 = _entry("a", 0, 15), _entry("b", 15, 30), _entry("a2", 0, 15, 1.0), _entry("b2", 15, 30, 1.0)
    nodes = [a, b, a2, b2]
    settle(nodes, keep=1)
    rng = random.Random(0)
    for _ in range(2):  # sessions come one at a time: the members take them all while they have room
        choice = choose_route(nodes, "m", rng=rng)
        assert [n.node_id for n in choice.nodes] == ["a", "b"]
        for n in choice.nodes:
            n.reserved += 1
    # the members are full (capacity 2): the spares serve rather than a 429
    assert [n.node_id for n in choose_route(nodes, "m", rng=rng).nodes] == ["a2", "b2"]
    a2.reserved = 0
    # a repair of a route that lost b: the spare of b's layers, though a member of them (c) is idler
    c = _entry("c", 15, 30, 2.0)
    c.role, b.alive = Role.MEMBER, False
    b2.reserved = 1
    choice = repair_route([a, b, c, a2, b2], (a, b), frozenset({"b"}), rng=rng)
    assert [n.node_id for n in choice.nodes] == ["a", "b2"]


def test_the_registry_settles_roles_and_drains_from_a_heartbeat() -> None:
    registry = Registry(spares=1)
    registry.register(_body("n0", (0, 15)), 0.0)
    registry.register(_body("n1", (15, 30)), 0.0)
    registry.register(_body("n0-spare0", (0, 15), spare=True), 0.0)
    registry.register(_body("n1-late", (15, 30)), 0.1)
    assert {k: v.role for k, v in registry.nodes.items()} == {"n0": Role.MEMBER, "n1": Role.MEMBER,
                                                               "n0-spare0": Role.SPARE, "n1-late": Role.SPARE}
    assert registry.nodes["n0-spare0"].to_json(0.0)["role"] == "spare"
    with pytest.raises(CallerError) as err:
        registry.register(_body("bad", (0, 15), spare="yes"), 0.0)
    assert err.value.reason is Reason.INVALID_REQUEST
    assert read_heartbeat({"node": "n0"}).draining is False
    registry.heartbeat({"node": "n0", "draining": True}, 0.2)
    n0 = registry.nodes["n0"]
    assert n0.role is Role.DRAINING and not n0.routable and n0.to_json(0.2)["role"] == "draining"
    assert registry.nodes["n0-spare0"].role is Role.MEMBER  # it covers the drained node's layers now
    assert [n.node_id for n in choose_route(registry.alive(), "m").nodes] == ["n0-spare0", "n1"]
    registry.register(_body("n0", (0, 15)), 1.0)  # the drained node restarts: a new entry, a member again
    assert registry.nodes["n0"].role is Role.MEMBER and registry.nodes["n0-spare0"].role is Role.SPARE
    registry.sweep(10.0)  # every node silent: dead, and no role is settled among the dead
    assert not registry.alive()
