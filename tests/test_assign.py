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
from dgr.node.assign import MEMORY_SHARE, memory_budget, read_memory_budget
from dgr.node.membership import registration
from dgr.node.service import NodeService
from dgr.plan import Node, PlanParams, format_size, shard_cost
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


def test_ranges_start_where_the_coverage_changes(manifest: Manifest) -> None:
    """A range that skips the head's token_embd fits more layers (the layer-range API loads only the
    globals a range computes with), yet the first node takes the head and a replica lines up with a
    running node: without the boundary rule they take 1:N."""
    layout = layout_from_manifest(manifest.to_json())
    params = PlanParams(context=4096, sessions=8)
    budget = 390 * 2**20
    first = assign_layers(layout, params, budget, [0] * 30).layers
    cheaper = next(r for r, _ in sorted(_fitting(layout, params, budget), key=lambda rh: -len(rh[0])) if r.start > 0)
    assert first.start == 0 and len(cheaper) > len(first)  # the rule chose against the bigger range
    rest = assign_layers(layout, params, budget, [1] * first.stop + [0] * (30 - first.stop)).layers
    assert rest.start == first.stop
    replica = assign_layers(layout, params, budget, [1] * 30).layers
    assert replica == first  # all layers served once: the only boundary is layer 0


def _fitting(layout, params, budget):
    from dgr.plan import fitting_ranges

    return list(fitting_ranges(layout, params, Node("x", budget)))


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
    async with asgi_client(app, "http://127.0.0.1:8000") as http:
        r = await http.post("/v1/assign", json={"manifest_id": tiny.id, "memory_bytes": memory, "context": 256})
        assert r.status_code == 200, r.text
        assert r.json()["layers"] == "2:4" and r.json()["coverage"] == [1, 1, 0, 0]
        r = await http.post("/v1/assign", json={"manifest_id": "0" * 64, "memory_bytes": memory})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        for bad in ({"memory_bytes": "lots"}, {"memory_bytes": 0}, {"memory_bytes": memory, "context": True},
                    {"memory_bytes": memory, "gpu_memory_bytes": -1}, {"memory_bytes": memory, "gpu_memory_bytes": "1"},
                    {"memory_bytes": memory, "cpu_moe": True}, {"memory_bytes": memory, "gpu_memory_bytes": 2**30,
                                                                  "cpu_moe": "yes"}):
            r = await http.post("/v1/assign", json={"manifest_id": tiny.id, **bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error", r.text


async def test_a_node_with_a_gpu_is_assigned_more_layers_and_its_gpu_layers(manifest: Manifest) -> None:
    """SmolLM2 at 4096 x 8: host memory for part of it alone, and the whole model with a GPU that holds it."""
    layout = layout_from_manifest(manifest.to_json())
    params, budget = PlanParams(context=4096, sessions=8), 390 * 2**20
    cpu_only = assign_layers(layout, params, budget, [0] * 30)
    with_gpu = assign_layers(layout, params, budget, [0] * 30, gpu_bytes=8 * 2**30)
    assert len(cpu_only.layers) < len(with_gpu.layers) == 30
    assert (cpu_only.gpu_layers, with_gpu.gpu_layers) == (None, "all")
    app = make_tracker_app(Gateway(registry=Registry()), prover=Prover.from_manifests([manifest]))
    body = {"manifest_id": manifest.id, "memory_bytes": budget, "context": 4096, "sessions": 8}
    async with asgi_client(app, "http://127.0.0.1:8000") as http:
        r = await http.post("/v1/assign", json={**body, "gpu_memory_bytes": 8 * 2**30})
        assert r.status_code == 200, r.text
        assert (r.json()["layers"], r.json()["gpu_layers"]) == ("0:30", "all")
        r = await http.post("/v1/assign", json=body)
        assert r.json()["layers"] == str(cpu_only.layers) and "gpu_layers" not in r.json()


def test_a_node_with_gpu_memory_asks_with_it_and_starts_with_the_gpu_layers_it_is_given(
        tiny: Manifest, tmp_path: Path, monkeypatch, capsys) -> None:
    from dgr.node import assign

    manifest = tmp_path / "m.json"
    tiny.save(manifest)
    asked: list[dict] = []

    def ask(tracker, manifest_id, memory_bytes, **kw):
        asked.append(kw)
        return LayerRange(0, 4), {"layers": "0:4", "gpu_layers": "all", "newly_covered": 4}

    monkeypatch.setattr(assign, "ask_layers", ask)
    base = ["node", "--tracker", "http://t.test", "--insecure", "--manifest", str(manifest), "--backend", "stub",
            "--memory", "1GiB", "--gpu-memory", "8GiB"]
    args = build_parser().parse_args(base)
    from dgr.cli import _assigned_layers

    assert _assigned_layers(args) == LayerRange(0, 4)
    assert (asked[0]["gpu_memory_bytes"], asked[0]["cpu_moe"], args.gpu_layers) == (8 * 2**30, False, "all")
    assert "--gpu-layers all" in capsys.readouterr().err
    args = build_parser().parse_args([*base, "--gpu-layers", "2"])  # the node's own flag wins
    _assigned_layers(args)
    assert args.gpu_layers == "2"


def test_memory_without_layers_needs_a_tracker_and_a_manifest() -> None:
    args = build_parser().parse_args(["node", "--memory", "8GiB", "--backend", "stub"])
    with pytest.raises(CallerError, match="give --tracker and --manifest"):
        cmd_node(args)
    args = build_parser().parse_args(["node", "--memory", "8GiB", "--backend", "stub", "--tracker", "http://t.test",
                                      "--insecure"])
    with pytest.raises(CallerError, match="give --tracker and --manifest"):
        cmd_node(args)


MEMINFO = """MemTotal:       16318480 kB
MemFree:         1203440 kB
MemAvailable:   10485760 kB
Buffers:          402436 kB
"""


def test_the_default_budget_is_a_share_of_available_memory(tmp_path: Path) -> None:
    assert memory_budget(MEMINFO) == (int(10 * 2**30 * MEMORY_SHARE), 10 * 2**30)  # MemAvailable, not MemFree
    for text in ("MemTotal:       16318480 kB\nMemFree:         1203440 kB\n", "MemAvailable: lots kB\n", ""):
        with pytest.raises(CallerError, match="give --memory SIZE") as err:
            memory_budget(text)
        assert err.value.reason is Reason.INVALID_REQUEST
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert read_memory_budget(str(path)) == memory_budget(MEMINFO)
    with pytest.raises(CallerError, match="give --memory SIZE"):
        read_memory_budget(str(tmp_path / "absent"))


class _Asked(Exception):
    """Stops cmd_node once it has asked the tracker, before it loads anything."""


def _asking(monkeypatch, meminfo: Path) -> list[dict]:
    """Record what cmd_node asks the tracker (and stop there); this machine's meminfo is `meminfo`."""
    from dgr.node import assign

    asked: list[dict] = []

    def ask(tracker, manifest_id, memory_bytes, **kw):
        asked.append({"tracker": tracker, "manifest_id": manifest_id, "memory_bytes": memory_bytes, **kw})
        raise _Asked

    monkeypatch.setattr(assign, "ask_layers", ask)
    monkeypatch.setattr(assign, "MEMINFO", str(meminfo))
    return asked


def test_a_node_with_a_tracker_and_a_manifest_asks_for_layers_with_its_free_memory(
        tiny: Manifest, tmp_path: Path, monkeypatch, capsys) -> None:
    manifest, meminfo = tmp_path / "m.json", tmp_path / "meminfo"
    tiny.save(manifest)
    meminfo.write_text(MEMINFO)
    asked = _asking(monkeypatch, meminfo)
    base = ["node", "--tracker", "http://t.test", "--insecure", "--manifest", str(manifest), "--backend", "stub",
            "--ctx", "256"]
    with pytest.raises(_Asked):
        cmd_node(build_parser().parse_args(base))
    budget, _ = memory_budget(MEMINFO)
    assert asked == [{"tracker": "http://t.test", "manifest_id": tiny.id, "memory_bytes": budget, "context": 256,
                      "sessions": 8, "gpu_memory_bytes": 0, "cpu_moe": False, "tls": asked[0]["tls"],
                      "identity": asked[0]["identity"], "join_token": None}]
    assert asked[0]["identity"] is not None  # the node's own key signs the request
    err = capsys.readouterr().err
    share = f"{MEMORY_SHARE:.0%} of the 10.00 GiB this machine has available"
    assert f"layers that fit {format_size(budget)}, {share}" in err
    with pytest.raises(_Asked):  # --memory wins over the machine's
        cmd_node(build_parser().parse_args([*base, "--memory", "1GiB"]))
    assert asked[1]["memory_bytes"] == 2**30 and "available" not in capsys.readouterr().err
    meminfo.write_text("MemTotal: 1 kB\n")  # no MemAvailable: the node says to give --memory, and asks nothing
    with pytest.raises(CallerError, match="give --memory SIZE"):
        cmd_node(build_parser().parse_args(base))
    assert len(asked) == 2


def test_without_a_manifest_or_a_tracker_a_node_serves_every_layer(tiny: Manifest, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Nothing to ask: `--model FILE` (or the stub) without `--layers` serves the whole model, as before."""
    import dgr.cli

    manifest, meminfo = tmp_path / "m.json", tmp_path / "meminfo"
    tiny.save(manifest)
    meminfo.write_text(MEMINFO)
    asked = _asking(monkeypatch, meminfo)
    served = []
    monkeypatch.setattr(dgr.cli, "run_until_signal", lambda fn, backend, **kw: served.append(backend.layers) or 0)
    for extra in (["--tracker", "http://t.test", "--insecure"], []):
        args = build_parser().parse_args(["node", "--backend", "stub", "--identity", str(tmp_path / "n.key"), *extra])
        assert cmd_node(args) == 0
    assert asked == [] and served == [LayerRange(0, StubSpec().n_layers)] * 2
