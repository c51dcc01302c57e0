"""GPU placements in the shard planner (dgr.plan.gpu): which of a range's layers a node's GPU holds, and each
buffer's bytes, as llama.cpp names and splits them.

On the DeepSeek-V4-Flash fixture: 3 nodes of 128 GiB with a 24 GiB GPU each, with `--cpu-moe` (every range's
layers on its GPU, the experts in host memory) and without (a few layers each); every buffer of each range
against sums written out here from the fixture's tensor list (not through the planner's layout code). On a tiny
random deepseek4 GGUF (with an MTP layer): `--gpu-layers` counts the output first, then the MTP layer, then the
range's own layers from its end. The same buffers against llama.cpp's own load log are tests_gpu/
test_plan_buffers.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from dgr.backends.base import LayerRange
from dgr.errors import CallerError
from dgr.plan import Node, Plan, PlanParams, parse_nodes, plan, shard_cost
from dgr.plan.gpu import OP_OFFLOAD_MIN_BATCH, fit, host_input_bytes, place
from dgr.plan.render import gpu_layers_flag
from dgr.plan.search import _Pricer
from dgr.plan.sources import layout_from_gguf, layout_from_json

from tests.test_plan import run_cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek-v4-flash.layout.json"
GIB, MIB, KIB = 2**30, 2**20, 2**10
RECIPE = "q4k-antirez"  # the fixture's default
NODES = [Node(f"node{i}", 128 * GIB, 24 * GIB) for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def data():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def dsv4(data):
    return layout_from_json(data, recipe=RECIPE)


@pytest.fixture(scope="module")
def must_show(dsv4):
    """`dgr plan --model <fixture> --nodes 3 --gpu-memory 24GiB --memory 128GiB --cpu-moe`"""
    return plan(dsv4, NODES, PlanParams(cpu_moe=True))


def _tensors(data: dict, recipe: str = RECIPE) -> dict[int | None, list[tuple[str, int]]]:
    """The fixture's tensors by layer (None: global), with their bytes from gguf-py's block sizes."""
    types, n = data["recipes"][recipe]["types"], data["metadata"]["deepseek4.block_count"]
    out: dict[int | None, list[tuple[str, int]]] = {}
    for group in data["tensor_groups"]:
        spec = group["layers"]
        for il in [None] if spec == "global" else range(n) if spec == "all" else spec:
            for t in group["tensors"]:
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[types[t["role"]].upper()]]
                name = t["name"] if il is None else t["name"].format(i=il)
                out.setdefault(il, []).append((name, math.prod(t["shape"]) // block * size))
    return out


# KV per layer at context 4096 (ubatch 512, window caches sized to the window, one session), by hand:
# every layer's raw window cache is 512 f16 wide and min(4096, 128 + 512) = 640 -> 768 rows (padded to 256):
# 768 KiB. A CSA layer (ratio 4) adds 1024 rows of 512 f16 (1 MiB), 1024 indexer rows of 128 f16 (256 KiB)
# and f32 state of 16 rows x 1024 (64 KiB) and 16 x 256 (16 KiB); an HCA layer (ratio 128) adds 32 -> 256
# rows of 512 f16 (256 KiB) and 256 f32 rows of 512 (512 KiB).
KV_AT_4096 = {0: 768 * KIB, 4: (768 + 1024 + 256 + 64 + 16) * KIB, 128: (768 + 256 + 512) * KIB}


def _hand(data: dict, layers: LayerRange, on_gpu: set[int], cpu_moe: bool, output_on_gpu: bool) -> dict:
    """Each buffer's bytes for `layers` with `on_gpu` on the GPU, summed from the fixture's tensors."""
    t = _tensors(data)
    ratios = data["metadata"]["deepseek4.attention.compress_ratios"]
    is_exp = lambda name: "_exps." in name  # noqa: E731
    gpu = host = gpu_kv = host_kv = 0
    for il in range(layers.start, layers.stop):
        for name, b in t[il]:
            if il in on_gpu and not (cpu_moe and is_exp(name)):
                gpu += b
            else:
                host += b
        gpu_kv, host_kv = (gpu_kv + KV_AT_4096[ratios[il]], host_kv) if il in on_gpu else (
            gpu_kv, host_kv + KV_AT_4096[ratios[il]])
    for name, b in t[None]:
        if name.startswith("token_embd.") and layers.start == 0:
            host += b
        elif not name.startswith("token_embd.") and layers.stop == 43:
            gpu, host = (gpu + b, host) if output_on_gpu else (gpu, host + b)
    return {"gpu_model": gpu, "host_model": host, "gpu_kv": gpu_kv, "host_kv": host_kv}


# -- the must-show --------------------------------------------------------------------------------


def test_three_gpu_nodes_with_cpu_moe_place_every_range_on_its_gpu(must_show):
    """Each node used holds its whole range on its GPU (attention, shared experts, KV: 2 to 4 GiB of a layer's
    weights), the routed experts in its 128 GiB; both fit, and the fewest nodes are used (2 of 3)."""
    p = must_show
    assert [str(s.layers) for s in p.shards] == ["0:21", "21:43"] and [n.name for n in p.unused] == ["node3"]
    for s in p.shards:
        pl = s.placement
        assert pl is not None and pl.flag == "all" and pl.cpu_moe
        assert pl.gpu_used <= s.node.gpu_bytes and s.host_bytes <= s.node.memory_bytes
        assert pl.cpu.kv == 0 and pl.gpu.kv == s.kv_bytes  # every layer's caches are where the layer is
    assert gpu_layers_flag(p) == "all,all"
    assert p.shards[1].placement.output_on_gpu and not p.shards[0].placement.output_on_gpu


def test_without_cpu_moe_fewer_layers_fit_on_the_gpu(dsv4, must_show):
    """Without --cpu-moe a layer's experts (3.37 GiB of Q4_K) go to the GPU too: 5 layers, not 21."""
    p = plan(dsv4, NODES, PlanParams())
    for s, moe in zip(p.shards, must_show.shards):
        pl = s.placement
        assert 0 < pl.gpu_layers < moe.placement.gpu_layers
        assert pl.gpu_used <= 24 * GIB and s.host_bytes <= 128 * GIB
        assert pl.cpu.kv > 0 and pl.cpu.compute == dsv4.compute.nbytes(4096)  # the host runs some layers
        # the most that fit: one more slot would not
        assert place(dsv4, p.params, s.layers, pl.gpu_layers + 1).gpu_used > 24 * GIB
    assert sum(s.placement.gpu_layers for s in p.shards) < sum(s.placement.gpu_layers for s in must_show.shards)


def test_every_buffer_of_the_must_show_is_the_sum_of_its_tensors(data, dsv4, must_show):
    """Model and KV bytes against sums of the fixture's tensors; compute against llama.cpp's rules: the host, with
    every slot on the GPU, holds only the graph's inputs; the GPU the activations (the fixture's compute rule) and
    the op-offload allowance for the experts its ops read from host memory: one copy of the largest expert tensor
    (Q4_K, 4096 x 2048 x 256 / 256 x 144 bytes) and the graph's inputs once more."""
    rule = dsv4.compute.nbytes(4096)
    largest_expert = 4096 * 2048 * 256 // 256 * 144
    for s in must_show.shards:
        pl = s.placement
        want = _hand(data, s.layers, set(range(s.layers.start, s.layers.stop)), True, pl.output_on_gpu)
        assert (pl.gpu.model, pl.cpu.model) == (want["gpu_model"], want["host_model"])
        assert (pl.gpu.kv, pl.cpu.kv) == (want["gpu_kv"], want["host_kv"])
        # inputs, per position of 512: f32 rows, the embeddings input and the lookup's output (the head) or the 4
        # streams in (the tail); i32 ids: the position, the token (the hash layers' routing reads it on every
        # range), the output (the tail); the f32 masks of a 768-cell window, a 1024-cell ratio-4 cache and a
        # 256-cell ratio-128 cache and the f16 mask of its 1024-cell indexer cache, with the window's i64 slot and
        # 16 bytes of slots for each compressed cache; and the indexer's 128 x 128 f32 Hadamard matrix (the
        # other caches' keys are 512 wide, not the indexer's 128: not rotated)
        head = s.layers.start == 0
        rows, ids = (4 * 2 * 4096, 2) if head else (4 * 4 * 4096, 3)
        masks = (768 * 4 + 8) + (1024 * 4 + 16) + (256 * 4 + 16) + (1024 * 2 + 16)
        inputs = 512 * (rows + 4 * ids + masks) + 128 * 128 * 4
        assert pl.cpu.compute == inputs
        assert pl.gpu.compute == rule + largest_expert + inputs
        assert pl.cpu.output == (0 if s.layers.stop == 43 else 512 * 4 * 4096 * 4)  # the 4 streams out
        assert pl.reserve_bytes == 512 * MIB and s.runtime_bytes == 100 * MIB
        assert s.weight_bytes + s.global_bytes == pl.gpu.model + pl.cpu.model
        assert s.total_bytes == pl.gpu_used + s.host_bytes


def test_a_partial_placement_is_the_sum_of_its_tensors(data, dsv4):
    """Without --cpu-moe, 3 slots of the tail: the output and layers 41, 42 whole on the GPU; the GPU's compute
    buffer holds the op-offload allowance for the layers on the host: a copy of the largest host tensor (an
    expert of layer 40, the same Q4_K size) and the graph's inputs."""
    prm = PlanParams()
    pl = place(dsv4, prm, LayerRange(30, 43), 3)
    assert pl.on_gpu == (41, 42, 43) and pl.output_on_gpu and pl.flag == "3"
    want = _hand(data, LayerRange(30, 43), {41, 42}, False, True)
    assert (pl.gpu.model, pl.cpu.model, pl.gpu.kv, pl.cpu.kv) == (
        want["gpu_model"], want["host_model"], want["gpu_kv"], want["host_kv"])
    inputs = host_input_bytes(dsv4, prm, LayerRange(30, 43))
    assert pl.gpu.compute == dsv4.compute.nbytes(4096) + 4096 * 2048 * 256 // 256 * 144 + inputs
    assert pl.cpu.compute == dsv4.compute.nbytes(4096)  # the host still runs layers 30 to 40
    # below ggml's op-offload batch no op is offloaded: no weight is copied, no split moves an input
    small = place(dsv4, PlanParams(ubatch=OP_OFFLOAD_MIN_BATCH - 1), LayerRange(30, 43), 3)
    assert small.gpu.compute == dsv4.compute.nbytes(4096)


def test_no_gpu_layers_is_the_cpu_plan(dsv4):
    """0 slots: no device, and every byte where the CPU-only plan puts it."""
    for r in (LayerRange(0, 10), LayerRange(10, 30), LayerRange(30, 43)):
        pl, cpu = place(dsv4, PlanParams(), r, 0), shard_cost(dsv4, PlanParams(), Node("n", 0), r)
        assert pl.gpu.total == pl.reserve_bytes == 0 and pl.on_gpu == ()
        assert pl.cpu.total + cpu.runtime_bytes == cpu.total_bytes


def test_the_search_tables_are_what_fit_prices(dsv4):
    """The dynamic program's headroom of each range on a GPU node is shard_cost's, through fit."""
    node = Node("n", 64 * GIB, 24 * GIB)
    prm = PlanParams(cpu_moe=True, context=32768)
    table = _Pricer(dsv4, prm).headroom_table(node)
    rng = np.random.default_rng(0)
    for a, b in sorted({tuple(sorted(rng.choice(44, 2, replace=False))) for _ in range(40)}):
        c = shard_cost(dsv4, prm, node, LayerRange(int(a), int(b)))
        host_left = node.memory_bytes - c.host_bytes
        assert table[a, b] == (c.headroom_bytes if host_left >= 0 else host_left)
        assert c.placement == fit(dsv4, prm, LayerRange(int(a), int(b)), node.gpu_bytes)


def test_a_mixed_route_and_its_json(dsv4):
    """A CPU node beside GPU nodes keeps the CPU plan; the plan round-trips through JSON; the CLI prints the
    --gpu-layers list and refuses --cpu-moe where no node has a GPU."""
    nodes = parse_nodes(None, None, ["a=96GiB,gpu=24GiB", "b=160GiB"])
    assert nodes == [Node("a", 96 * GIB, 24 * GIB), Node("b", 160 * GIB)]
    p = plan(dsv4, nodes, PlanParams(cpu_moe=True, fewest=False))
    assert p.shards[0].placement is not None and p.shards[1].placement is None
    assert gpu_layers_flag(p) == "all,0"
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    rc, out, _ = run_cli("--model", str(FIXTURE), "--node", "a=96GiB,gpu=24GiB", "--node", "b=160GiB", "--cpu-moe",
                         "--all-nodes", "--json")
    assert rc == 0 and json.loads(out)["gpu_layers"] == "all,0"
    assert json.loads(out)["plan"]["shards"][0]["placement"]["buffers"]["GPU"].keys() == {
        "model", "KV", "compute", "output"}
    rc, out, _ = run_cli("--model", str(FIXTURE), "--nodes", "3", "--memory", "128GiB", "--gpu-memory", "24GiB",
                         "--cpu-moe")
    assert rc == 0 and "--gpu-layers all,all --cpu-moe" in out
    assert run_cli("--model", str(FIXTURE), "--nodes", "3", "--memory", "128GiB", "--cpu-moe")[0] == 2
    for bad in (["a=1GiB,gpu"], ["a=1GiB,vram=2GiB"], ["a=1GiB,gpu=lots"]):
        with pytest.raises(CallerError):
            parse_nodes(None, None, bad)


def test_a_gpu_counts_as_memory_in_the_refusal(dsv4):
    """Q8_0 (282 GiB) on 3 nodes of 64 GiB with 24 GiB GPUs does not fit; the refusal counts the GPUs in."""
    with pytest.raises(CallerError) as e:
        plan(layout_from_json(json.loads(FIXTURE.read_text()), recipe="q8_0"),
             [Node(f"n{i}", 64 * GIB, 24 * GIB) for i in range(3)], PlanParams())
    assert "the nodes have 264.00 GiB" in e.value.message and "with a 24.00 GiB GPU would hold it" in e.value.message


# -- the order --gpu-layers counts in, on a file with an MTP layer ---------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dgr.bench.dsv4_tiny import write_dsv4_gguf

    path = tmp_path_factory.mktemp("dsv4") / "tiny.gguf"
    write_dsv4_gguf(path)
    return layout_from_gguf(path)


def test_gpu_layers_count_the_output_then_mtp_then_the_range_from_its_end(tiny):
    """llama.cpp's n_gpu_layers for a range (dgr's patch): slots from the end, the output counted as one (index
    n_layer_all = 6 trunk + 1 MTP), then the MTP layer (6), then layers 5, 4, ...; a range before the tail counts
    its own layers only. The token embedding never leaves the host."""
    prm = PlanParams(context=256)
    assert [place(tiny, prm, LayerRange(3, 6), g).on_gpu for g in (1, 2, 3, 5)] == [
        (7,), (6, 7), (5, 6, 7), (3, 4, 5, 6, 7)]
    assert place(tiny, prm, LayerRange(3, 6), -1).flag == "all" and place(tiny, prm, LayerRange(3, 6), 5).flag == "all"
    head = place(tiny, prm, LayerRange(0, 3), 2)
    assert head.on_gpu == (1, 2) and not head.output_on_gpu and head.slots == 3
    whole = place(tiny, prm, LayerRange(0, 6), -1)
    embd = next(g.n_bytes for g in tiny.globals if g.name == "token_embd.weight")
    assert whole.cpu.model == embd and whole.gpu.model == tiny.tensor_bytes() - embd
