"""The bench's own parts that can be checked without timing anything: baselines are built the way
the project builds llama.cpp, and a shaped random-weight file is a model llama.cpp runs."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import attrs
import gguf
import llama_cpp
import numpy as np
import pytest

from dgr.bench import peers, shapes
from dgr.bench.shapes import LlamaShape, random_llama_gguf
from dgr.gguf_meta import read_header
from dgr.models import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def test_peer_tools_use_the_makefiles_llama_cpp_flags() -> None:
    make = (ROOT / "Makefile").read_text()
    flags = re.search(r"^LLAMA_CMAKE_ARGS := (.+)$", make, re.M).group(1).split()
    assert tuple(flags) == peers.LLAMA_CMAKE_ARGS
    assert "-DGGML_RPC=ON" in peers._TOOL_ARGS


def test_llama_server_command_splits_context_over_slots_and_puts_layers_on_rpc() -> None:
    tools = peers.PeerTools(Path("/x/llama-server"), Path("/x/rpc"), "0")
    srv = peers.LlamaServer(tools, "m.gguf", threads=1, ctx=1000, parallel=8, rpc=("127.0.0.1:1", "127.0.0.1:2"))
    cmd = srv.command()
    assert cmd[cmd.index("-c") + 1] == "8000" and cmd[cmd.index("-np") + 1] == "8"
    assert cmd[cmd.index("--rpc") + 1] == "127.0.0.1:1,127.0.0.1:2" and "-ngl" in cmd
    assert cmd[cmd.index("-t") + 1] == "1" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_a_shaped_random_model_runs_with_the_default_tokenizer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = LlamaShape("tiny-test", n_layers=2, hidden=256, heads=4, kv_heads=2, ffn=512)
    path = random_llama_gguf(shape)
    assert path.parent == tmp_path / "dgr" / "models" and random_llama_gguf(shape) == path  # cached
    meta = read_header(path).fields  # gguf-py's GGUFReader takes seconds on the 49k-token vocabulary
    assert meta["llama.block_count"] == 2 and meta["llama.embedding_length"] == 256
    text = b"The lighthouse keeper kept a log"
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    ref = llama_cpp.Llama(str(default_model_path()), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    try:
        assert llm.tokenize(text) == ref.tokenize(text)
        out = llm.create_completion(text.decode(), max_tokens=4, temperature=0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()
        ref.close()


def test_the_1b_shape_is_a_1b_llama() -> None:
    s = shapes.LLAMA_1B
    vocab = 49152
    per_layer = 2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * s.head_dim + 3 * s.hidden * s.ffn
    params = s.n_layers * per_layer + vocab * s.hidden
    assert params == pytest.approx(1.07e9, rel=0.02) and s.params(vocab) == params


def test_the_8b_and_moe_shapes_have_their_models_sizes() -> None:
    """Llama-3.1-8B's blocks (its 128k vocabulary is SmolLM2's 49k here), and OLMoE-1B-7B's: 6.8B weights, of which
    a token reads 1.2B (OLMoE's own 1.3B counts an untied output head of its 50k vocabulary)."""
    assert shapes.LLAMA_8B.params() == pytest.approx(7.18e9, rel=0.01)
    moe = shapes.OLMOE_7B
    assert moe.params() == pytest.approx(6.81e9, rel=0.01)
    active = attrs.evolve(moe, experts=moe.experts_used).params() - moe.n_layers * moe.hidden * moe.experts_used
    assert active == pytest.approx(1.17e9, rel=0.01)


def test_random_q4_0_blocks_have_the_weights_spread() -> None:
    """A Q4_0 matrix is uniform codes under one scale: its weights' standard deviation is the quantized normal
    draws' 0.02, and it dequantizes to the block layout llama.cpp reads."""
    rng = np.random.default_rng(0)
    raw = shapes._random_q4_0(rng, (64,), 256)  # uint8 [64, 256 / 32 * 18]
    assert raw.shape == (64, 8 * 18) and raw.dtype == np.uint8
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)  # float32 [64, 256]
    assert w.shape == (64, 256) and float(np.std(w)) == pytest.approx(0.02, rel=0.05)


def test_a_moe_shape_runs_with_its_experts_where_cpu_moe_finds_them(tmp_path, monkeypatch) -> None:
    """Experts stacked as llama.cpp's llama (Mixtral) loader wants them, named as --cpu-moe's pattern matches, with
    the tokenizer of a vocabulary-only file (what travels to a GPU machine in place of the default model)."""
    from dgr.backends.placement import CPU_MOE_PATTERN

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    vocab = shapes.write_vocab_gguf(tmp_path / "vocab.gguf")
    assert vocab.stat().st_size < 3_000_000
    shape = LlamaShape("tiny-moe-test", n_layers=2, hidden=256, heads=4, kv_heads=2, ffn=128, experts=4,
                       experts_used=2)
    path = random_llama_gguf(shape, vocab_from=vocab)
    meta = read_header(path)
    assert meta.fields["llama.expert_count"] == 4 and meta.fields["llama.expert_used_count"] == 2
    experts = [t for t in meta.tensors if re.search(CPU_MOE_PATTERN.decode(), t.name)]
    assert len(experts) == 3 * shape.n_layers
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        out = llm.create_completion("The lighthouse keeper kept a log", max_tokens=4, temperature=0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()


def test_paired_ratios_are_per_round_medians_against_the_targets() -> None:
    """A round's ratio compares setups measured seconds apart; the report's figure is their median."""
    T = "ring"  # every route is a ring
    from dgr.bench.paired import TTFT_RATIOS, ratios
    from dgr.bench.report import markdown

    rates = {f"dgr 2-node {T}": [30.0, 40.0, 35.0], "llama-server 1 thread": [40.0, 40.0, 50.0],
             "llama-server over RPC x2": [30.0, 0.0, 35.0], f"dgr 3-node {T}": [20.0, 20.0, 20.0],
             f"dgr 2-node {T}, 8 sessions": [60.0, 80.0, 70.0], f"dgr 2-node {T}, 1 session": [30.0, 40.0, 35.0],
             "llama-server -np 8, all threads, 8 sessions": [100.0, 80.0, 0.0]}
    r = ratios(rates)
    assert r[f"2-node {T} / llama-server 1 thread"]["per_round"] == [0.75, 1.0, 0.7]
    assert r[f"2-node {T} / llama-server 1 thread"]["median"] == 0.75
    assert r[f"2-node {T} / llama-server 1 thread"]["target"] == 0.95
    assert r[f"2-node {T} / llama-server over RPC x2"]["per_round"] == [1.0, 1.0]  # a failed round is left out
    assert "1 `llama` node / llama-server, same threads" not in r  # neither setup ran
    assert r[f"2-node {T}, 8 sessions / llama-server -np 8"]["per_round"] == [0.6, 1.0]
    assert r[f"2-node {T}, 8 sessions / llama-server -np 8"]["target"] == 0.8
    assert r[f"2-node {T}, 8 sessions / 1 session"]["per_round"] == [2.0, 2.0, 2.0]
    ttft = {f"dgr 2-node {T}": [0.8, 0.6, 0.7], "llama-server 1 thread": [0.5, 0.6, 0.0]}
    t = ratios(ttft, TTFT_RATIOS, at_most=True)
    name = f"short-prompt TTFT: 2-node {T} / llama-server 1 thread"
    assert t[name]["per_round"] == [1.6, 1.0] and t[name]["median"] == 1.3 and t[name]["at_most"]
    assert t[name]["target"] == 1.15
    res = {"config": {"quick": True, "threads": 2, "decode_tokens": 48, "only": "paired", "peers": True},
           "started": "s", "finished": "f", "setups": {}, "ttft": {}, "seam": {},
           "paired": {"rounds": 3, "rates": rates, "ratios": r, "ttft": ttft, "ttft_ratios": t}}
    text = markdown(res, [])
    assert f"| 2-node {T} / llama-server 1 thread | at least 0.95x | 0.75x | 0.70x to 1.00x |" in text
    assert f"| {name} | at most 1.15x | 1.30x | 1.00x to 1.60x |" in text
    assert f"| dgr 2-node {T} | 800.0 | 600.0 | 700.0 | 700.0 |" in text
    assert f"| dgr 2-node {T} | 30.0 | 40.0 | 35.0 | 35.0 |" in text
    assert "Made by `dgr bench --quick --only paired`." in text


def test_paired_rounds_time_a_new_short_prompt_on_the_ttft_setups(monkeypatch) -> None:
    """Each round's TTFT prompt is that round's own, the same for every setup timed, on the setups
    TTFT_RATIOS names only."""
    from dgr.bench import paired

    T = "ring"
    calls: list[tuple[str, list[int], int]] = []

    def fake_stream(api, model, prompt, n, extra=None):
        calls.append((api, list(prompt), n))
        return SimpleNamespace(decode_tok_s=10.0, ttft_s=0.5 if api == "dgr" else 0.4)

    monkeypatch.setattr(paired, "stream_once", fake_stream)
    setups = [paired.PairedSetup(f"dgr 2-node {T}", "dgr", "m"),
              paired.PairedSetup("llama-server 1 thread", "ls", "x"),
              paired.PairedSetup(f"dgr 3-node {T}", "three", "m")]
    shorts = [[1, 10, 11], [1, 20, 21]]
    res = paired.run_paired(lambda stack: setups, [5, 6, 7], 8, rounds=2, log=lambda _m: None, story="s",
                            shorts=shorts)
    timed = [(api, p) for api, p, n in calls if n == 2]
    assert timed == [("dgr", shorts[0]), ("ls", shorts[0]), ("dgr", shorts[1]), ("ls", shorts[1])]
    assert res["ttft"] == {f"dgr 2-node {T}": [0.5, 0.5], "llama-server 1 thread": [0.4, 0.4]}
    assert res["ttft_ratios"][f"short-prompt TTFT: 2-node {T} / llama-server 1 thread"]["median"] == 1.25
    with pytest.raises(ValueError):
        paired.run_paired(lambda stack: setups, [5], 8, rounds=3, log=lambda _m: None, story="s", shorts=shorts)


def test_paired_rounds_keep_each_decodes_ttft_and_time_the_setups_asked(monkeypatch) -> None:
    """`ttft_labels` names the setups timed on the short prompts (the GPU run times every one); each round's
    decode keeps the TTFT of its whole prompt too."""
    from dgr.bench import paired

    def fake_stream(api, model, prompt, n, extra=None):
        return SimpleNamespace(decode_tok_s=10.0, ttft_s={"a": 0.5, "b": 0.25}[api] * (2 if n == 2 else 1))

    monkeypatch.setattr(paired, "stream_once", fake_stream)
    setups = [paired.PairedSetup("A", "a", "m"), paired.PairedSetup("B", "b", "m")]
    res = paired.run_paired(lambda stack: setups, [5, 6, 7], 8, rounds=2, log=lambda _m: None, story="s",
                            shorts=[[1], [2]], ttft_labels={"A", "B"})
    assert res["ttft"] == {"A": [1.0, 1.0], "B": [0.5, 0.5]}
    assert res["prompt_ttft"] == {"A": [0.5, 0.5], "B": [0.25, 0.25]}


def test_cpu_accounting_names_every_route_process_and_charges_the_stream() -> None:
    """`dgr bench --only cpu` reads the right processes (the tracker and both nodes, each charged CPU for a
    stream), measures a floor for each node's layers, and reports both."""
    from dgr.backends.base import LayerRange
    from dgr.bench import cpu
    from dgr.testing.harness import LocalRoute

    with LocalRoute(backend="stub", nodes=2) as route:
        procs = cpu._processes(route)
        assert list(procs) == ["tracker", "node0", "node1"] and len(set(procs.values())) == 3
        run = cpu._measure(route, "stub", 1)
    assert run["errors"] == 0 and run["tokens"] == cpu.TOKENS
    assert all(run["cpu_ms_per_token"][name] > 0 for name in ("tracker", "node0", "node1"))
    assert set(run["computing"]) == {"node0", "node1"} and all(0 < v < 1 for v in run["computing"].values())
    floor = cpu._floor("stub", [LayerRange(0, 15), LayerRange(15, 30)], None, 1)
    assert set(floor) == {"node0", "node1"} and all(v > 0 for v in floor.values())
    text = "\n".join(cpu.markdown({"topology": "ring", "tokens": cpu.TOKENS,
                                   "setups": {"stub": {"backend": "stub", "runs": [run]}},
                                   "floor": {"stub": {"1": floor}}}))
    assert f"| stub | 1 | {run['tok_s']:.1f} |" in text


def test_the_stub_ceiling_rates_one_session_and_many_and_charges_each_process(monkeypatch) -> None:
    """`dgr bench --only ceiling` (scaled down): every round streams one session and then several at once on a
    2-node stub ring, each run delivers every token it asked for, and each process is charged CPU for it."""
    from dgr.bench import ceiling

    monkeypatch.setattr(ceiling, "ROUNDS", 2)
    monkeypatch.setattr(ceiling, "ONE_TOKENS", 32)
    monkeypatch.setattr(ceiling, "MANY", 4)
    monkeypatch.setattr(ceiling, "MANY_TOKENS", 16)
    res = ceiling.run_ceiling(lambda _: None)
    assert len(res["rounds"]) == 2
    for r in res["rounds"]:
        assert (r["one"]["tokens"], r["many"]["tokens"]) == (32, 64) and r["many"]["errors"] == 0
        for run in (r["one"], r["many"]):
            assert list(run["cpu_us_per_token"]) == ["tracker", "node0", "node1", "client"]
            assert all(run["cpu_us_per_token"][p] >= 0 for p in run["cpu_us_per_token"]) and run["tok_s"] > 0
    assert res["one_pass"] == (res["one_tok_s"] >= ceiling.ONE_TARGET)
    text = "\n".join(ceiling.markdown(res))
    assert f"| 4 sessions | 2 | {res['rounds'][1]['many']['tok_s']:.0f} |" in text
    assert f"4 sessions: median {res['many_tok_s']:.0f} tok/s in all against a target of 3000" in text


def test_the_threads_bench_decodes_in_each_of_its_cases(model_path) -> None:
    from dgr.bench.threads import CASES, _case

    rows = {label: rates for case in CASES for label, rates in _case(case, 1, 2, 1).items()}
    assert len(rows) == 4 and all(len(r) == 1 and r[0] > 0 for r in rows.values())
