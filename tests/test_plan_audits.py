"""The follow-up audits' layouts (GLM-5.2, Ornith-1.0-35B) through the shard planner.

Each fixture is what dgr.specgen.audit_layouts writes (tests/test_spec.py
checks it, and the audits' pasted `dgr plan` outputs); its tensor list
matches what was published about real files; the KV per layer kind is what
dgr.plan.rules derives from llama.cpp's rules; the planner honours the
split rules (GLM-5.2: shards start at full-indexer layers); the seam is
hidden_size wide with no token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr.backends.base import LayerRange
from dgr.errors import CallerError
from dgr.plan import Node, PlanParams, plan, plan_even, seam_hops
from dgr.plan.layout import KvTerm
from dgr.plan.rules import glm52_indexer_full, kv_terms_for_layer
from dgr.plan.sources import layout_from_json
from dgr.seam.wire import HEADER_SIZE

ROOT = Path(__file__).resolve().parent.parent
GLM = ROOT / "tests" / "fixtures" / "glm-5.2.layout.json"
ORNITH = ROOT / "tests" / "fixtures" / "ornith-1.0-35b.layout.json"
GIB = 2**30


def _count(data: dict, n_all: int) -> int:
    n = 0
    for group in data["tensor_groups"]:
        layers = {"global": 1, "all": n_all}.get(group["layers"]) if isinstance(group["layers"], str) else None
        n += (layers if layers is not None else len(group["layers"])) * len(group["tensors"])
    return n


def _params(data: dict, recipe: str) -> int:
    layout = layout_from_json(data, recipe=recipe)
    return sum(layer.weight_bytes for layer in layout.layers) + sum(g.n_bytes for g in layout.globals)


@pytest.fixture(scope="module")
def glm_data():
    return json.loads(GLM.read_text())


@pytest.fixture(scope="module")
def glm(glm_data):
    return layout_from_json(glm_data, recipe="q4k-q8")


@pytest.fixture(scope="module")
def ornith_data():
    return json.loads(ORNITH.read_text())


@pytest.fixture(scope="module")
def ornith(ornith_data):
    return layout_from_json(ornith_data, recipe="q4k-q8")


# -- GLM-5.2 --------------------------------------------------------------------------------------


def test_glm_fixture_matches_published_files(glm_data):
    # ik_llama.cpp issue 2032 logs a BF16 GLM-5.2 GGUF of 1,809 tensors (79 blocks, indexer weights in each).
    assert _count(glm_data, 79) == 1809
    # BF16: 2 bytes a parameter; Z.ai states 744B, third parties 753B and "1.51 TB" of BF16 weights.
    params = _params(glm_data, "bf16") / 2
    assert 744e9 <= params <= 760e9
    # Deviad's IQ2_S-experts / IQ4_NL-rest file: "about 232 GiB".
    for recipe, gib in glm_data["published_sizes_gib"].items():
        assert layout_from_json(glm_data, recipe=recipe).tensor_bytes() / GIB == pytest.approx(gib, rel=0.005)


def test_glm_kinds_and_kv_follow_the_indexer_roles(glm, glm_data):
    full = [i for i in range(78) if glm52_indexer_full(i)]
    assert full[:4] == [0, 1, 2, 6] and full[-1] == 74 and len(full) == 21
    assert glm.kinds() == {"full": full, "share": [i for i in range(78) if i not in full]}
    assert glm.n_layers == 78  # block 78 is the MTP layer, charged to the tail
    assert any(g.name.startswith("blk.78.") for g in glm.globals)
    by_kind = {k: glm.layers[v[0]] for k, v in glm.kinds().items()}
    # f16 per token: MLA latent K 576 values (no V); a full layer adds the indexer key, 128 values.
    assert by_kind["share"].kv == (KvTerm("mla_k", 576, every=1),)
    assert by_kind["full"].kv == (KvTerm("mla_k", 576, every=1), KvTerm("indexer_k", 128, every=1))
    growth = {k: (x.kv_bytes(2 * 65536, 1, "f16") - x.kv_bytes(65536, 1, "f16")) / 65536 for k, x in by_kind.items()}
    assert growth == {"full": 1408, "share": 1152}
    # The metadata's explicit roles and llama.cpp's GLM-5.2 default agree; GLM-5/5.1 (shorter context): all full.
    meta = dict(glm_data["metadata"])
    del meta["glm-dsa.attention.indexer.types"]
    assert [kv_terms_for_layer("glm-dsa", meta, i)[0] for i in range(78)] == [x.kind for x in glm.layers]
    meta["glm-dsa.context_length"] = 202752
    assert {kv_terms_for_layer("glm-dsa", meta, i)[0] for i in range(78)} == {"full"}


def test_glm_shards_start_at_full_indexer_layers(glm):
    full = set(glm.kinds()["full"])
    for k in (2, 3, 4, 8, 21):
        ranges = plan_even(glm, k)
        assert all(r.start in full for r in ranges) and ranges[-1].stop == 78
    with pytest.raises(CallerError, match="shards may start only at layers"):
        plan_even(glm, 22)  # 21 full layers: 21 shards at most
    p = plan(glm, [Node(f"n{i}", 128 * GIB) for i in range(8)], PlanParams(context=32768))
    assert all(s.layers.start in full for s in p.shards)
    # Balanced over 3 large nodes, the cuts still fall on full-indexer layers.
    p = plan(glm, [Node(f"n{i}", 4096 * GIB) for i in range(3)], PlanParams(fewest=False))
    assert len(p.shards) == 3 and all(s.layers.start in full for s in p.shards)


def test_glm_seam_is_hidden_wide_without_token_ids(glm):
    assert glm.seam_width == glm.hidden_size == 6144 and not glm.needs_token_ids
    hops = seam_hops(glm, PlanParams(), [LayerRange(0, 6), LayerRange(6, 42), LayerRange(42, 78)])
    assert [h.decode_bytes for h in hops] == [HEADER_SIZE + 6144 * 4] * 2
    assert not any(h.token_ids for h in hops)


# -- Ornith-1.0-35B -----------------------------------------------------------------------------


def test_ornith_fixture_matches_published_sizes(ornith_data):
    # Qwen3.5-35B-A3B / Ornith-1.0-35B: "35B total, 3B active" (second-hand).
    total = _params(ornith_data, "bf16") / 2
    assert 34e9 <= total <= 36e9
    layout = layout_from_json(ornith_data, recipe="bf16")
    active = sum(layer.active_bytes for layer in layout.layers) / 2
    assert 2e9 <= active <= 3.5e9


def test_ornith_kinds_and_state(ornith, ornith_data):
    attn = list(range(3, 40, 4))
    assert ornith.kinds() == {"delta": [i for i in range(40) if i not in attn], "attn": attn}
    delta, full = ornith.layers[0], ornith.layers[3]
    # Full attention: K and V, 2 heads x 256, per token.
    assert full.kv == (KvTerm("k", 512, every=1), KvTerm("v", 512, every=1))
    # Gated delta net: f32 state, the same at any context: 3 x 8192 conv rows and a 128 x 4096 matrix.
    assert delta.kv_bytes(4096, 1, "f16") == delta.kv_bytes(262144, 1, "f16") == (3 * 8192 + 128 * 4096) * 4
    assert kv_terms_for_layer("qwen35moe", ornith_data["metadata"], 0)[0] == "delta"
    meta = {**ornith_data["metadata"], "qwen35moe.attention.recurrent_layers": [i % 2 for i in range(40)]}
    assert kv_terms_for_layer("qwen35moe", meta, 1, ())[0] == "delta"


def test_ornith_seam_is_hidden_wide_and_any_split_is_planned(ornith):
    """A range of gated-delta-net layers only runs since llama.cpp patch 0002 keeps every input of a range
    (qwen35moe's stages of one layer kind split bit for bit: tests/test_certify.py), so no shard needs a
    full-attention layer: 11 nodes and more are plans."""
    assert ornith.seam_width == ornith.hidden_size == 2048 and not ornith.needs_token_ids
    assert ornith.shard_starts is None
    for k in (2, 11, 20):
        assert len(plan_even(ornith, k)) == k
