"""LlamaShardBackend: layer ranges of the real default model, chained in process.

- Splits 15:15, 10:10:10, 1:29 and 10:20: greedy decode of 128 tokens after a
  ~300-token prompt gives the same tokens and bit-identical logits as the
  single-node LlamaBackend (max abs difference 0.0).
- The decode seam is 576 float32 values (2,304 bytes) per step; prefill chunks
  longer than n_batch are split and put back in order, bit-identically.
- No recompute: each shard evaluates each position once, by its own counter
  and by llama.cpp's perf counter.
- Sessions interleaved on one shard give the tokens each gives alone.
- A session's lane picks its sequence id; rows of consecutive ids decode as one graph.
- A range is loaded from the unmodified file: a middle range holds only its
  layers' tensors (llama.cpp's own size), the head and tail what their stage
  needs; nothing is written.
"""

from __future__ import annotations

import numpy as np
import outcome
import pytest

from dgr.backends.base import LayerRange, Step
from dgr.backends.llama import LlamaBackend
import ctypes

from dgr.backends.clib import ggml_lib, llama_lib
from dgr.backends.llama_engine import LlamaEngine
from dgr.gguf_meta import read_header
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.digest import file_sha256
from dgr.errors import CallerError, Reason
from dgr.models import default_model_path
from dgr.pipeline import Pipeline
from dgr.testing.reference import split_greedy

pytestmark = pytest.mark.llama  # in process, one thread: not serial (tests/conftest.py)

N_NEW = 128
SPLITS = {"15:15": [15, 15], "10:10:10": [10, 10, 10], "1:29": [1, 29], "10:20": [10, 20]}


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("dgr-cache")
    mp.setenv("DGR_CACHE_DIR", str(root))
    yield root
    mp.undo()


def shards(sizes: list[int], **kw) -> list[LlamaShardBackend]:
    out, at = [], 0
    for n in sizes:
        out.append(LlamaShardBackend(default_model_path(), LayerRange(at, at + n), n_threads=1, n_ctx=512, **kw))
        at += n
    return out


@pytest.fixture(scope="module")
def full(cache_dir):
    b = LlamaBackend(default_model_path(), n_threads=1, n_ctx=512, max_sessions=1)
    yield b
    b.close()


@pytest.fixture(scope="module")
def prompt(full) -> list[int]:
    story = "The keeper wrote down every ship that passed the point, the wind, and the birds on the rail. " * 14
    text = full.render_chat([{"role": "user", "content": story + "What did the keeper write down?"}])
    ids = full.tokenize(text, add_special=True, parse_special=True)
    assert 280 <= len(ids) <= 340
    return ids


@pytest.fixture(scope="module")
def reference(full, prompt):
    return Pipeline([full]).generate_greedy(prompt, N_NEW, keep_logits=True)


# a second even-ish two-way split adds little to 15:15 and 1:29: under `make test-slow`
@pytest.mark.parametrize("split", [pytest.param(s, marks=pytest.mark.slow) if s == "10:20" else s for s in SPLITS])
def test_split_equals_single_node(split, prompt, reference):
    got = split_greedy(default_model_path(), SPLITS[split], prompt, N_NEW, n_threads=1, n_ctx=512, max_sessions=1)
    diff = float(np.max(np.abs(got.logits - reference.logits)))
    print(f"split {split}: max abs logit difference over {N_NEW} steps: {diff}")
    assert got.tokens == reference.tokens
    assert diff == 0.0


def test_seam_chunks_and_no_recompute(prompt):
    # n_batch 64 and prefill chunks of 100: each chunk is split 64 + 36 inside the
    # engine, and the hidden rows must be put back in order to stay bit-identical.
    full = LlamaBackend(default_model_path(), n_threads=1, n_ctx=512, max_sessions=1, n_batch=64)
    stages = shards([10, 10, 10], max_sessions=1, n_batch=64)
    p, ref = Pipeline(stages), Pipeline([full])
    try:
        p.open("s", len(prompt) + 16)
        ref.open("s", len(prompt) + 16)
        logits = p.prefill("s", prompt, chunk=100)
        assert np.array_equal(logits, ref.prefill("s", prompt, chunk=100))
        pos = len(prompt)
        for _ in range(8):
            tok = int(np.argmax(logits))
            seam = stages[0].forward("s", pos, np.array([tok], np.int32), None, True)
            assert seam.shape == (1, 576) and seam.dtype == np.float32 and seam.nbytes == 2304
            h = stages[1].forward("s", pos, None, seam, True)
            assert h.shape == (1, 576) and h.nbytes == 2304
            logits = stages[2].forward("s", pos, None, h, True)
            assert np.array_equal(logits, ref.decode("s", tok, pos))
            pos += 1
        for s in stages:
            assert s.positions_computed("s") == pos
            assert s.engine.tokens_evaluated_total() == pos  # llama.cpp's own count, fresh context
        p.close("s")
        assert all(s.kv_bytes() == 0 and s.session_count() == 0 for s in stages)
    finally:
        for s in [*stages, full]:
            s.close()


def test_interleaved_sessions(full):
    prompts = [
        full.tokenize(full.render_chat([{"role": "user", "content": q}]), add_special=True, parse_special=True)
        for q in ("Name three rivers.", "Why is the sky blue?", "Write a haiku about rain.")
    ]
    stages = shards([15, 15], max_sessions=3)
    p = Pipeline(stages)
    try:
        alone = [p.generate_greedy(ids, 12, sid=f"alone{i}").tokens for i, ids in enumerate(prompts)]
        sids = ["x", "y", "z"]
        for sid, ids in zip(sids, prompts):
            p.open(sid, len(ids) + 12)
        logits = {sid: p.prefill(sid, ids) for sid, ids in zip(sids, prompts)}
        pos = {sid: len(ids) for sid, ids in zip(sids, prompts)}
        toks: dict[str, list[int]] = {sid: [] for sid in sids}
        for step in range(12):
            for sid in sids if step % 2 else reversed(sids):
                tok = int(np.argmax(logits[sid]))
                toks[sid].append(tok)
                logits[sid] = p.decode(sid, tok, pos[sid])
                pos[sid] += 1
        assert [toks[s] for s in sids] == alone
        assert stages[0].session_count() == 3
        with pytest.raises(CallerError) as e:
            stages[0].open_session("w", 8)
        assert e.value.reason is Reason.NODE_AT_CAPACITY
        for sid in sids:
            p.close(sid)
    finally:
        for s in stages:
            s.close()


def test_lanes_pick_sequence_ids_and_consecutive_ones_decode_as_one_graph(prompt, monkeypatch):
    """Phase groups (dgr.fsm.phases) rest on two facts: a session opened on a free lane gets that
    sequence id, and llama.cpp computes rows of consecutive sequence ids as one graph but rows of spread
    ids one graph each. The graphs are counted by an eval callback that watches the range's output node."""
    graphs = [0]
    # a prototype of its own: the shared handle's ggml_get_name returns the name's bytes
    get_name = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(("ggml_get_name", ggml_lib()))
    name_off = get_name(0x1000) - 0x1000  # ggml_get_name only offsets the pointer

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def count(t, ask, _user):
        if ctypes.string_at(t + name_off, 6) == b"h_out\0":
            graphs[0] += 0 if ask else 1
            return True
        return False

    load = LlamaEngine.load.__func__

    def load_counting(cls, path, **kw):
        real = llama_lib().llama_context_default_params

        def params():
            p = real()
            p.cb_eval = count
            return p

        monkeypatch.setattr(llama_lib(), "llama_context_default_params", params)
        try:
            return load(cls, path, **kw)
        finally:
            monkeypatch.setattr(llama_lib(), "llama_context_default_params", real)

    monkeypatch.setattr(LlamaEngine, "load", classmethod(load_counting))
    head, = shards([15], max_sessions=6)
    try:
        for lane in (5, 1, 2, 0, 4):
            head.open_session(f"s{lane}", 64, lane=lane)
        head.open_session("taken", 64, lane=1)  # lane 1 is in use: the lowest free id instead
        assert {sid: head._seq(sid) for sid in head._table.live} == {"s5": 5, "s1": 1, "s2": 2, "s0": 0, "s4": 4,
                                                                  "taken": 3}
        ids = np.array(prompt[:8], np.int32)
        for sid in head._table.live:
            head.forward(sid, 0, ids, None, False)
        pos = dict.fromkeys(head._table.live, len(ids))

        def decode(sids):
            steps = [Step(sid, pos[sid], ids[:1], None, False, decode=True) for sid in sids]
            graphs[0] = 0
            outs = head.forward_batch(steps)
            assert all(isinstance(o, outcome.Value) for o in outs), outs
            for sid in sids:
                pos[sid] += 1
            return graphs[0]

        assert decode(["s0", "s1", "s2", "taken"]) == 1  # sequence ids 0-3: one graph
        assert decode(["s0", "s2", "s4", "s5"]) == 3  # ids 0, 2 and 4-5: three
    finally:
        head.close()


def test_a_range_loads_only_what_its_stage_needs(cache_dir):
    """Straight from the unmodified file: the middle range 10:20 holds blk.10-19 and nothing else (no
    token_embd, no output norm), the head adds token_embd, the tail the output norm and the tied output
    (token_embd); llama.cpp reports its own size. Nothing is written to the cache."""
    src = default_model_path()
    sizes = {t.name: int(t.n_bytes) for t in read_header(src).tensors}

    def layers(a, b):
        return sum(n for name, n in sizes.items() if name.startswith("blk.") and a <= int(name.split(".")[1]) < b)

    want = {
        (10, 20): layers(10, 20),
        (0, 10): layers(0, 10) + sizes["token_embd.weight"],
        (20, 30): layers(20, 30) + sizes["output_norm.weight"] + sizes["token_embd.weight"],
    }
    infos = []
    for (a, b), n_bytes in want.items():
        shard = LlamaShardBackend(src, LayerRange(a, b), n_threads=1, n_ctx=256, max_sessions=1)
        try:
            infos.append(shard.info)
            assert llama_lib().llama_model_size(shard.engine._model) == n_bytes, (a, b)
            assert shard.engine.n_layer == b - a and shard.engine.hidden_out == (b < 30)
            assert shard.engine.kv_bytes_per_position() == (b - a) * 3 * (64 + 64) * 2  # only its layers' KV
        finally:
            shard.close()
    # every range reports the source model's identity, as the whole model does
    assert all(info == infos[0] for info in infos) and infos[0].digest == file_sha256(src)
    assert not any(p.is_file() and p.suffix == ".gguf" for p in cache_dir.rglob("*"))
    with pytest.raises(CallerError) as e:
        LlamaShardBackend(src, LayerRange(20, 31))
    assert e.value.reason is Reason.MODEL_LOAD_FAILED
