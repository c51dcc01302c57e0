"""The shard planner (dgr.plan) and model layouts (dgr.plan.layout, rules, sources).

On the real default model (SmolLM2-135M GGUF): splits over 1, 2 and 3 nodes,
the fewest-nodes and balance rules against brute force, refusal, JSON, the
manifest adapter, and (with llama-cpp-python) the plan against the RSS of a
real llama.cpp process. On the DeepSeek-V4-Flash fixture: the fixture is what
its generator writes, its recipes reproduce published file sizes, KV differs
per layer kind as llama.cpp allocates it, the seam is 4 x 4096 wide, and the
audit's pasted `dgr plan` outputs are current.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr.artifact.constants import GlobalNeed
from dgr.backends.base import LayerRange
from dgr.bench import plan_overhead
from dgr.errors import CallerError, Reason
from dgr.models import default_model_path
from dgr.plan import (
    LLAMA_CPU_RUNTIME_BYTES,
    Node,
    Plan,
    PlanParams,
    decode_latency,
    format_size,
    parse_nodes,
    parse_size,
    plan,
    plan_even,
    seam_hops,
    shard_cost,
)
from dgr.plan.cli import register
from dgr.plan.cost import shard_global_bytes
from dgr.plan.search import LAYER_OVERHEAD_BYTES, even_split
from dgr.plan.layout import KvTerm, tensor_nbytes
from dgr.plan.rules import kv_terms_for_layer
from dgr.plan.sources import layout_from_gguf, layout_from_json, layout_from_manifest, load_layout
from dgr.seam.wire import HEADER_SIZE, MAX_FRAME_BYTES
from dgr.specgen import audits

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek-v4-flash.layout.json"
GIB, MIB = 2**30, 2**20


def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="dgr")
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = args.func(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def smol():
    return layout_from_gguf(default_model_path())


@pytest.fixture(scope="module")
def dsv4_data():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def dsv4(dsv4_data):
    return layout_from_json(dsv4_data, recipe="q4k-antirez")


def _headroom_of(layout, params, nodes, cuts):
    return min(
        shard_cost(layout, params, nodes[j], LayerRange(cuts[j], cuts[j + 1])).headroom_bytes for j in range(len(nodes))
    )


# -- sizes and nodes ------------------------------------------------------------------------


def test_parse_size_units():
    assert parse_size("24GiB") == 24 * GIB
    assert parse_size("24G") == 24 * GIB
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("512 MiB") == 512 * MIB
    assert parse_size("1.5GiB") == int(1.5 * GIB)
    assert parse_size("123") == 123
    for bad in ("", "GiB", "24 parsecs", "-1G"):
        with pytest.raises(CallerError):
            parse_size(bad)


def test_parse_nodes_forms():
    assert parse_nodes(3, "24GiB", []) == [Node(f"node{i}", 24 * GIB) for i in (1, 2, 3)]
    assert parse_nodes(None, None, ["a=24GiB", "b=64GiB"]) == [Node("a", 24 * GIB), Node("b", 64 * GIB)]
    for count, memory, specs in ((None, None, []), (2, "1G", ["a=1G"]), (None, None, ["a=1G", "a=2G"]), (0, "1G", [])):
        with pytest.raises(CallerError):
            parse_nodes(count, memory, specs)


# -- the default model (a real GGUF) ---------------------------------------------------------


def test_default_layout_accounts_for_every_tensor_byte(smol):
    reader = gguf.GGUFReader(default_model_path())
    data_bytes = os.path.getsize(default_model_path()) - reader.data_offset
    assert smol.tensor_bytes() == data_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert smol.n_layers == 30 and smol.seam_width == smol.hidden_size == 576
    assert {g.name for g in smol.globals} == {"token_embd.weight", "output_norm.weight"}
    assert smol.kinds() == {"attn": list(range(30))}


def test_default_kv_matches_llamacpp():
    """llama.cpp logged "15.00 MiB (2048 cells, 10 layers, 1/1 seqs)" for a 10-layer SmolLM2 shard."""
    layout = layout_from_gguf(default_model_path())
    assert sum(layer.kv_bytes(2048, 1, "f16") for layer in layout.layers[:10]) == 15 * MIB
    # K and V, 3 KV heads x 64 each, f16: 768 bytes per position per layer.
    assert layout.layers[0].kv == (KvTerm("k", 192, every=1), KvTerm("v", 192, every=1))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_split_default_model(smol, k):
    params = PlanParams(context=2048, sessions=2, fewest=False)
    nodes = [Node(f"n{i}", 2 * GIB) for i in range(k)]
    p = plan(smol, nodes, params)
    ranges = p.ranges()
    assert len(ranges) == k and ranges[0].start == 0 and ranges[-1].stop == 30
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    # A range loads only the globals it computes with (the layer-range API): the file once, plus, once
    # the head and the tail are two nodes, the tail's own token_embd (SmolLM2's output is tied to it).
    loaded = sum(s.weight_bytes + s.global_bytes for s in p.shards)
    token_embd = next(g.n_bytes for g in smol.globals if g.name == "token_embd.weight")
    assert loaded == smol.tensor_bytes() + (token_embd if k > 1 else 0)
    assert sum(s.kv_bytes for s in p.shards) == 2 * sum(layer.kv_bytes(2048, 1, "f16") for layer in smol.layers)
    for s in p.shards:
        assert s.total_bytes == s.weight_bytes + s.global_bytes + s.kv_bytes + s.compute_bytes + s.runtime_bytes
        assert s.headroom_bytes == 2 * GIB - s.total_bytes
    # Balanced in bytes, not in layers (the tail alone pays llama.cpp's logits buffer):
    # headrooms differ by less than one layer's cost.
    one_layer = smol.layers[0].weight_bytes + smol.layers[0].kv_bytes(2048, 2, "f16")
    rooms = [s.headroom_bytes for s in p.shards]
    assert max(rooms) - min(rooms) < one_layer
    assert [h.decode_bytes for h in p.hops] == [HEADER_SIZE + 576 * 4] * (k - 1)


def test_globals_as_computed_are_charged_once(smol):
    p = plan(
        smol, [Node(f"n{i}", 2 * GIB) for i in range(3)], PlanParams(globals_need=GlobalNeed.COMPUTE, fewest=False)
    )
    head, mid, tail = p.shards
    embd = next(g.n_bytes for g in smol.globals if g.name == "token_embd.weight")
    norm = next(g.n_bytes for g in smol.globals if g.name == "output_norm.weight")
    # Tied embeddings: the head looks rows up, the tail's LM head is the same matrix.
    assert (head.global_bytes, mid.global_bytes, tail.global_bytes) == (embd, 0, embd + norm)
    # Only the tail reads it whole per token.
    assert tail.active_bytes - tail.weight_bytes == embd + norm and head.active_bytes == head.weight_bytes


def test_fewest_nodes_then_unused(smol):
    params = PlanParams(context=8192, sessions=4)  # KV-heavy, so splitting pays
    one = shard_cost(smol, params, Node("x", 0), LayerRange(0, 30)).total_bytes
    nodes = [Node(f"n{i}", one - 1) for i in range(3)]
    p = plan(smol, nodes, params)
    assert len(p.shards) == 2 and [n.name for n in p.unused] == ["n2"]
    big = plan(smol, [Node("small", one // 2), Node("big", one)], params)
    assert [s.node.name for s in big.shards] == ["big"]  # one node suffices: the largest


@pytest.mark.parametrize("k", [2, 3])
def test_split_maximises_smallest_headroom(smol, k):
    params = PlanParams(context=8192, sessions=3, fewest=False)
    nodes = [Node("a", 600 * MIB), Node("b", 900 * MIB), Node("c", 700 * MIB)][:k]
    p = plan(smol, nodes, params)
    got = min(s.headroom_bytes for s in p.shards)
    best = max(
        _headroom_of(smol, params, nodes, [0, *cuts, 30]) for cuts in itertools.combinations(range(1, 30), k - 1)
    )
    assert got == best


@settings(max_examples=100)
@given(st.data())
def test_the_vectorised_split_search_equals_the_scalar_scan(data):
    """_max_min_split scans each node's ranges with numpy; the plain dynamic programme it replaced (every
    (a, b) by a call of `score`, strict gains kept) must give the same value and the same cuts, ties and
    ranges that may not be a shard (-inf) included."""
    import math

    import numpy as np

    from dgr.plan.search import _max_min_split

    n = data.draw(st.integers(2, 7))
    k = data.draw(st.integers(2, n))
    values = st.sampled_from([0, 1, 2, -math.inf])  # narrow: many ties
    s = {(j, a, b): data.draw(values) for j in range(k) for a in range(n) for b in range(a + 1, n + 1)}

    def score(j, a, b):
        return s[(j, a, b)]

    def table(j):
        t = np.full((n + 1, n + 1), -math.inf)
        for (jj, a, b), v in s.items():
            if jj == j:
                t[a, b] = v
        return t

    neg = -math.inf
    best = [[neg] * (n + 1) for _ in range(k)]
    arg = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n - k + 2):
        best[0][b] = score(0, 0, b)
    for j in range(1, k):
        for b in range(j + 1, n - (k - j - 1) + 1):
            for a in range(j, b):
                v = min(best[j - 1][a], score(j, a, b))
                if v > best[j][b]:
                    best[j][b], arg[j][b] = v, a
    cuts = [n]
    for j in range(k - 1, 0, -1):
        cuts.append(arg[j][cuts[-1]])
    cuts.append(0)
    assert _max_min_split(n, k, score, table) == (best[k - 1][n], cuts[::-1])


def test_the_range_tables_hold_need_and_valid_of_every_range(smol, dsv4):
    """The split search reads need and validity from tables built at once; they must be need() and valid()
    for every range, on layouts with allowed starts (GLM-5.2) and a whole-only rule (a layout marked so)."""
    import attrs

    from dgr.plan.search import _Pricer

    glm = load_layout(ROOT / "tests" / "fixtures" / "glm-5.2.layout.json")
    assert glm.shard_starts
    for layout in (smol, dsv4, glm, attrs.evolve(smol, whole_only="its tensors are not split by layer")):
        pricer = _Pricer(layout, PlanParams(context=4096, sessions=2))
        n = layout.n_layers
        for a in range(n + 1):
            for b in range(n + 1):
                assert bool(pricer.valid_table[a, b]) == (a < b and pricer.valid(a, b)), (layout.name, a, b)
                if a < b:
                    assert pricer.need_table[a, b] == pricer.need(a, b)


def test_plan_even_minimises_a_prompt_and_an_answer_on_a_full_pipeline(smol, dsv4):
    """A shard's decode pace is the bytes it reads per token plus a fixed cost per layer (the tail also reads
    the LM head); its prefill pace, its layers' weights (the head runs once a chunk). The cut minimises
    positions x the slowest prefill pace + tokens x the slowest decode pace: decode alone puts SmolLM2's
    at 18:12 (shards measured 7.1 and 7.6 ms a token against 6.1 and 8.6 for 15:15), a long prompt at
    15:15 (a 2,316-token cold turn 6.4 s against 7.5 s at 18:12)."""
    for layout, k, prompt, answer in ((smol, 2, 2048, 256), (smol, 2, 0, 1), (smol, 2, 300, 256), (smol, 3, 2048, 256),
                                      (smol, 4, 100, 1000), (dsv4, 5, 2048, 256)):
        split = even_split(layout, k, prompt, answer)
        ranges = split.ranges
        assert ranges == plan_even(layout, k, prompt, answer)
        assert ranges[0].start == 0 and ranges[-1].stop == layout.n_layers
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
        n = layout.n_layers
        tail_reads = shard_global_bytes(layout, PlanParams(), is_head=False, is_tail=True)[1]
        assert tail_reads > 0

        def decode(a: int, b: int) -> int:
            head = shard_global_bytes(layout, PlanParams(), is_head=a == 0, is_tail=b == n)[1]
            return head + sum(layer.active_bytes + LAYER_OVERHEAD_BYTES for layer in layout.layers[a:b])

        def prefill(a: int, b: int) -> int:
            return sum(layer.active_bytes for layer in layout.layers[a:b])

        def time(cuts: list[int]) -> int:
            pairs = list(zip(cuts, cuts[1:]))
            return answer * max(decode(a, b) for a, b in pairs) + prompt * max(prefill(a, b) for a, b in pairs)

        got = [0] + [r.stop for r in ranges]
        assert (split.decode_bytes, split.prefill_bytes) == (max(decode(r.start, r.stop) for r in ranges),
                                                              max(prefill(r.start, r.stop) for r in ranges))
        assert f"a prompt of {prompt} positions and an answer of {answer} tokens" in split.describe()
        if layout is smol:
            best = min(time([0, *c, n]) for c in itertools.combinations(range(1, n), k - 1))
            assert time(got) == best, (k, prompt, answer, [str(r) for r in ranges])
    assert [str(r) for r in plan_even(smol, 2)] == ["0:15", "15:30"]  # the default: a chat turn's long prompt
    assert [str(r) for r in plan_even(smol, 2, prompt_positions=0)] == ["0:18", "18:30"]
    with pytest.raises(CallerError):
        plan_even(smol, 31)


def test_refuses_with_the_missing_amount(smol):
    params = PlanParams(context=8192, sessions=4)
    nodes = [Node(f"n{i}", 500 * MIB) for i in range(2)]
    with pytest.raises(CallerError) as info:
        plan(smol, nodes, params)
    exc = info.value
    assert exc.reason is Reason.INVALID_REQUEST
    missing = exc.details["missing_bytes"]
    # With two nodes the total need does not depend on where the boundary is.
    need = sum(
        shard_cost(smol, params, n, r).total_bytes for n, r in zip(nodes, [LayerRange(0, 15), LayerRange(15, 30)])
    )
    assert missing == need - 1000 * MIB > 0
    assert "does not fit" in exc.message and f"{format_size(missing)} missing" in exc.message
    m = int(re.search(r"; (\d+) nodes of 500.00 MiB would hold it", exc.message).group(1))
    assert plan(smol, [Node(f"n{i}", 500 * MIB) for i in range(m)], params)
    with pytest.raises(CallerError):
        plan(smol, [Node(f"n{i}", 500 * MIB) for i in range(m - 1)], params)
    rc, out, err = run_cli("--nodes", "2", "--memory", "500MiB", "--context", "8192", "--sessions", "4")
    assert rc == 2 and out == "" and f"{format_size(missing)} missing" in err
    with pytest.raises(CallerError) as info:
        plan(smol, [Node("tiny", 150 * MIB)] * 3, params)
    assert "no number of 150.00 MiB nodes holds it" in info.value.message


def test_refuses_context_beyond_the_model(smol):
    with pytest.raises(CallerError) as info:
        plan(smol, [Node("a", 8 * GIB)], PlanParams(context=16384))
    assert info.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED


def test_json_round_trips(smol):
    p = plan(smol, [Node("a", 300 * MIB), Node("b", 400 * MIB)], PlanParams(context=2048, sessions=2, fewest=False))
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    rc, out, _ = run_cli(
        "--node", "a=300MiB", "--node", "b=400MiB", "--context", "2048", "--sessions", "2", "--all-nodes", "--json"
    )
    assert rc == 0
    data = json.loads(out)
    assert Plan.from_json(data["plan"]) == p
    assert [e["link_gbit"] for e in data["estimates"]] == [1.0, 1.0, 10.0, 10.0]
    # what dgr up would give these 2 nodes, balanced for a chat turn's prompt, or (--prompt-positions 0) decode
    assert data["speed_cut"]["layers"] == [str(r) for r in plan_even(smol, 2)] == ["0:15", "15:30"]
    rc, out, _ = run_cli("--node", "a=300MiB", "--node", "b=400MiB", "--all-nodes", "--prompt-positions", "0")
    assert rc == 0 and "speed cut (dgr up, 2 node(s) on one machine): 0:18 | 18:30, balanced for a prompt of 0 " \
                      "positions and an answer of 256 tokens" in out


def test_human_table_names_every_node(smol):
    rc, out, _ = run_cli("--nodes", "3", "--memory", "300MiB", "--context", "2048", "--all-nodes")
    assert rc == 0
    p = plan(smol, [Node(f"node{i}", 300 * MIB) for i in (1, 2, 3)], PlanParams(context=2048, fewest=False))
    for s in p.shards:
        row = next(line.split() for line in out.splitlines() if line.startswith(s.node.name + " "))
        assert row[1] == str(s.layers) and " ".join(row[-2:]) == format_size(s.headroom_bytes)
    assert "  attn   30 layers" in out and "2 hop(s)" in out


def test_manifest_gives_the_same_layout(smol):
    from dgr.artifact.build import build_manifest

    manifest = build_manifest(default_model_path())
    layout = layout_from_manifest(manifest.to_json())
    assert layout.layers == smol.layers and layout.globals == smol.globals and layout.compute == smol.compute
    path = ROOT / ".cache" / "test_plan.manifest.json"
    path.parent.mkdir(exist_ok=True)
    manifest.save(path)
    try:
        assert load_layout(path).layers == smol.layers
    finally:
        path.unlink()


def test_decode_latency_adds_up(smol):
    p = plan(smol, [Node(f"n{i}", GIB) for i in range(3)], PlanParams(context=2048, fewest=False))
    relay = decode_latency(p, link_gbit=1.0)
    direct = decode_latency(p, link_gbit=1.0, via_gateway=False)
    assert (relay.frames, direct.frames) == (6, 4)
    active = sum(s.active_bytes + s.kv_bytes for s in p.shards)
    assert relay.compute_s == pytest.approx(active / 50e9)
    assert relay.network_s > direct.network_s > decode_latency(p, link_gbit=10.0, via_gateway=False).network_s


# -- DeepSeek-V4-Flash -------------------------------------------------------------------------


def test_fixture_reproduces_published_files(dsv4_data):
    for recipe, gib in dsv4_data["published_sizes_gib"].items():
        layout = layout_from_json(dsv4_data, recipe=recipe)
        assert layout.tensor_bytes() / GIB == pytest.approx(gib, rel=1e-3)
    # A third-party port counted a real container: 1,328 tensors, 137.06 GiB of MXFP4 routed experts.
    n = 0
    experts = 0
    for group in dsv4_data["tensor_groups"]:
        layers = 1 if group["layers"] == "global" else 43 if group["layers"] == "all" else len(group["layers"])
        n += layers * len(group["tensors"])
        experts += sum(
            layers * tensor_nbytes("MXFP4", t["shape"]) for t in group["tensors"] if t["role"].startswith("exp_")
        )
    assert n == 1328
    assert experts / GIB == pytest.approx(137.06, abs=0.005)


def test_bad_layouts_are_refused_with_reasons(dsv4_data, tmp_path):
    with pytest.raises(CallerError) as info:
        layout_from_json(dsv4_data, recipe="q3-nobody")
    assert "q2-antirez" in info.value.message and info.value.reason is Reason.INVALID_REQUEST
    broken = {k: v for k, v in dsv4_data.items() if k != "tensor_groups"}
    with pytest.raises(CallerError, match="missing or malformed"):
        layout_from_json(broken)
    odd = json.loads(json.dumps(dsv4_data))
    odd["tensor_groups"][1]["tensors"][2]["shape"] = [4100, 1024]  # not a whole number of Q8_0 blocks
    with pytest.raises(CallerError, match="multiple of 32"):
        layout_from_json(odd)
    for text in ("[1, 2]", "not json"):
        path = tmp_path / "layout.json"
        path.write_text(text)
        with pytest.raises(CallerError):
            load_layout(path)
    rc, _, err = run_cli("--model", str(FIXTURE), "--recipe", "q3-nobody", "--nodes", "1", "--memory", "1TiB")
    assert rc == 2 and "unknown recipe" in err


def test_kv_differs_per_layer_kind(dsv4, dsv4_data):
    assert dsv4.kinds() == {"swa": [0, 1], "csa": list(range(2, 43, 2)), "hca": list(range(3, 43, 2))}
    by_kind = {kind: dsv4.layers[idx[0]] for kind, idx in dsv4.kinds().items()}
    # Growth per position at f16, away from padding: 512/4 + 128/4 values (CSA), 512/128 (HCA), none (window).
    growth = {
        k: (layer.kv_bytes(131072, 1, "f16") - layer.kv_bytes(65536, 1, "f16")) / 65536 for k, layer in by_kind.items()
    }
    assert growth == {"swa": 0, "csa": 320, "hca": 8}
    q8 = {
        k: (layer.kv_bytes(131072, 1, "q8_0") - layer.kv_bytes(65536, 1, "q8_0")) / 65536
        for k, layer in by_kind.items()
    }
    assert q8 == {"swa": 0, "csa": 170, "hca": 4.25}
    # Fixed f32 compressor state per sequence: 80 KiB (CSA + indexer), 512 KiB (HCA).
    assert sum(t.nbytes(4096, "f16") for t in by_kind["csa"].kv if t.fixed) == 80 * 1024
    assert sum(t.nbytes(4096, "f16") for t in by_kind["hca"].kv if t.fixed) == 512 * 1024
    # llama.cpp's default full-size window cache costs 1 KiB per position per layer.
    assert by_kind["swa"].kv_bytes(1 << 20, 1, "f16", swa_full=True) == 1 << 30
    # The fixture's written-out terms are what the code derives from the metadata.
    for kind, terms in dsv4_data["kv"]["kinds"].items():
        il = dsv4.kinds()[kind][0]
        assert kv_terms_for_layer("deepseek4", dsv4_data["metadata"], il) == (
            kind,
            tuple(KvTerm.from_json(t) for t in terms),
        )


def test_seam_is_four_streams_wide(dsv4):
    assert dsv4.seam_width == 4 * 4096 and dsv4.hidden_size == 4096 and dsv4.needs_token_ids
    p = plan(dsv4, [Node(f"n{i}", 64 * GIB) for i in range(5)], PlanParams(context=32768))
    assert p.seam_width == 16384 and len(p.shards) == 3
    # Every hop carries the token ids beside the 4 streams: a deepseek4 range takes them wherever it starts.
    for hop in p.hops:
        assert hop.decode_bytes == HEADER_SIZE + 4 + 16384 * 4 and hop.token_ids
        assert hop.max_chunk == (MAX_FRAME_BYTES - HEADER_SIZE) // (4 + 16384 * 4) == 1023
    hop = seam_hops(dsv4, PlanParams(seam_dtype="f16"), [LayerRange(0, 2), LayerRange(2, 43)])[0]
    assert hop.token_ids and hop.decode_bytes == HEADER_SIZE + 4 + 16384 * 2


def test_dsv4_shards_of_one_layer_are_planned(dsv4):
    """Any range of DeepSeek-V4 runs (llama.cpp patches 0001 and 0009; tests/test_dsv4_route.py), so one node a layer
    is a plan; a 44th node has no layer to hold."""
    assert [s.stop - s.start for s in plan_even(dsv4, 43)] == [1] * 43
    with pytest.raises(CallerError):
        plan_even(dsv4, 44)


def test_node_counts_follow_size_and_bits():
    audit = audits.AUDITS["deepseek-v4-flash"]
    plans = audits.node_counts(audit)
    for recipe in audit.recipes:
        for context, sessions in audit.cases:
            counts = [plans[(recipe, context, sessions, g)] for g in audit.node_gib]
            fitted = [len(p.shards) for p in counts if p is not None]
            assert fitted == sorted(fitted, reverse=True)  # bigger nodes, no more of them
            assert counts[-1] is not None  # 128 GiB nodes hold every recipe at every context here
    order = [len(plans[(r, 32768, 1, 64)].shards) for r in audit.recipes]
    assert order == sorted(order)  # q2 < mxfp4 <= q4k < q8_0 in bytes, so in nodes
    assert plans[("q2-antirez", 32768, 1, 128)].shards[0].headroom_bytes > 0


# -- against a real llama.cpp process ------------------------------------------------------------


@pytest.mark.llama
def test_plan_matches_rss_of_a_real_llamacpp_node(smol):
    r = LayerRange(0, 30)
    got = plan_overhead.run_shard(default_model_path(), r, smol.n_layers, 2048, 2)
    want = shard_cost(smol, PlanParams(context=2048, sessions=2), Node("n", 0), r).total_bytes
    assert got["base"] <= LLAMA_CPU_RUNTIME_BYTES
    assert 0.85 <= got["rss"] / want <= 1.0, (got, want)
