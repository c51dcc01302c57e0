"""Automatic layer assignment: a joining node gets the contiguous layers that fit its memory and most improve
coverage, priced with the planner's cost model (dgr.tracker.assign, POST /v1/assign)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.cli import build_parser, cmd_node
from dgr.errors import CallerError, Reason
from dgr.node.membership import registration
from dgr.node.service import NodeService
from dgr.plan import Node, PlanParams, shard_cost
from dgr.plan.sources import layout_from_manifest
from dgr.testing.inproc import asgi_client
from dgr.tracker.app import make_tracker_app
from dgr.tracker.assign import assign_layers, coverage
from dgr.tracker.gateway import Gateway
from dgr.tracker.proofs import Prover
from dgr.tracker.registry import Registry

PARAMS = PlanParams(context=256, sessions=1)
# a small ubatch keeps a non-tail shard's logits buffer below a tiny layer's weights, so single layers cost alike
SMALL_UBATCH = PlanParams(context=256, sessions=1, ubatch=8)


@pytest.fixture
def tiny(tmp_path: Path) -> Manifest:
    return build_manifest(write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4), piece_length=65536)


def _claim(registry: Registry, manifest: Manifest, layers: LayerRange, name: str) -> None:
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=layers), node_id=name)
    data = {**registration(service, "http://127.0.0.1:9"), "artifact": {"manifest_id": manifest.id, "seed": None}}
    registry.register(data, 0.0)


def test_the_uncovered_layers_that_fit_are_assigned(tiny: Manifest) -> None:
    layout = layout_from_manifest(tiny.to_json())
    tail_two = shard_cost(layout, PARAMS, Node("x", 0), LayerRange(2, 4)).total_bytes
    got = assign_layers(layout, PARAMS, tail_two, [1, 1, 0, 0])
    assert (got.layers, got.newly_covered, got.headroom_bytes) == (LayerRange(2, 4), 2, 0)
    # memory for everything: the whole model (every uncovered layer, and more routes through the rest)
    assert assign_layers(layout, PARAMS, 2**40, [1, 1, 0, 0]).layers == LayerRange(0, 4)
    # coverage decides between ranges of equal cost: the thinly served layer
    one = max(shard_cost(layout, SMALL_UBATCH, Node("x", 0), LayerRange(i, i + 1)).total_bytes for i in range(4))
    two = min(shard_cost(layout, SMALL_UBATCH, Node("x", 0), LayerRange(i, i + 2)).total_bytes for i in range(3))
    assert one < two  # only single layers fit
    assert assign_layers(layout, SMALL_UBATCH, one, [2, 2, 1, 2]).layers == LayerRange(2, 3)
    assert assign_layers(layout, SMALL_UBATCH, one, [1, 2, 2, 2]).layers == LayerRange(0, 1)
    with pytest.raises(CallerError, match="holds no layer") as err:
        assign_layers(layout, PARAMS, 1024, [0, 0, 0, 0])
    assert err.value.reason is Reason.INVALID_REQUEST


def test_coverage_counts_live_claims_that_have_not_failed(tiny: Manifest) -> None:
    registry = Registry()
    _claim(registry, tiny, LayerRange(0, 2), "a")
    _claim(registry, tiny, LayerRange(1, 3), "b")
    _claim(registry, tiny, LayerRange(0, 4), "dead")
    registry.mark_dead("dead")
    assert coverage(registry.nodes.values(), tiny.id, 4) == [1, 2, 1, 0]
    assert coverage(registry.nodes.values(), "another manifest", 4) == [0, 0, 0, 0]


async def test_the_tracker_answers_an_assignment(tiny: Manifest) -> None:
    registry = Registry()
    _claim(registry, tiny, LayerRange(0, 2), "a")
    app = make_tracker_app(Gateway(registry=registry), prover=Prover.from_manifests([tiny]))
    layout = layout_from_manifest(tiny.to_json())
    memory = shard_cost(layout, PARAMS, Node("x", 0), LayerRange(2, 4)).total_bytes
    async with asgi_client(app, "http://tracker.test") as http:
        r = await http.post("/v1/assign", json={"manifest_id": tiny.id, "memory_bytes": memory, "context": 256})
        assert r.status_code == 200, r.text
        assert r.json()["layers"] == "2:4" and r.json()["coverage"] == [1, 1, 0, 0]
        r = await http.post("/v1/assign", json={"manifest_id": "0" * 64, "memory_bytes": memory})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        for bad in ({"memory_bytes": "lots"}, {"memory_bytes": 0}, {"memory_bytes": memory, "context": True}):
            r = await http.post("/v1/assign", json={"manifest_id": tiny.id, **bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error", r.text


def test_memory_without_layers_needs_a_tracker_and_a_manifest() -> None:
    args = build_parser().parse_args(["node", "--memory", "8GiB", "--backend", "stub"])
    with pytest.raises(CallerError, match="give --tracker and --manifest"):
        cmd_node(args)
