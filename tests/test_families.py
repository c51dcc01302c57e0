"""Every certified model family, on tiny random-weight GGUFs written here (no download).

For each family in dgr.backends.llama_arch.CERTIFIED (llama, qwen2, qwen3,
qwen3moe, phi3, gemma, gemma2, gemma3), and a Mixtral-like llama with 4
experts:
- in process, 2- and 3-way layer splits loaded straight from the file through
  the layer-range API give the single node's greedy tokens and bit-identical
  logits (max |diff| 0.0), with a prompt longer than the sliding window of
  gemma2/gemma3; the splits cut inside their local/global period, and the
  gemmas' input scaling runs only on the head;
- a control: one ulp of difference in the seam's last row changes the tail's
  logits, so the 0.0 above is a real check;
- through real `dgr up --backend llama` processes, greedy text equals
  llama-cpp-python's own `create_completion` on the same file;
- a real 2-node `dgr up --backend llama_shard` on gemma3 picks a split inside
  its period and answers as llama-cpp-python does, and a 3-node one on
  qwen3moe answers through the OpenAI client as one `llama` node does;
- the torch reference, split in llama.cpp's numbering, matches llama.cpp on
  f32 weights for llama, qwen2 and qwen3;
- refusals: architectures refused or not certified for ranges are refused at
  node start, naming the architecture and why;
- the planner prices gemma3's local layers as a window and its global layers
  as full context.
"""

from __future__ import annotations

import gguf
import numpy as np
import openai
import pytest

from dgr.backends import llama_arch
from dgr.backends.base import LayerRange, Step
from dgr.backends.llama import LlamaBackend
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.errors import CallerError, Reason
from dgr.pipeline import Pipeline
from dgr.testing.harness import LocalRoute
from dgr.testing.reference import split_greedy
from dgr.testing.tiny_gguf import FAMILIES, tiny_prompt, write_tiny_gguf

pytestmark = [pytest.mark.llama, pytest.mark.serial]

N_NEW = 24
N_LAYER = 6
WINDOW = 8
GEMMA_HEAD = 32
SPLITS = ([3, 3], [1, 2, 3])  # gemma3's period is 6 and gemma2's 2: both cut inside them


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("dgr-cache")
    mp.setenv("DGR_CACHE_DIR", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    # Gemma 2/3 heads are wider than n_embd / n_head, as in the real ones (256 against 1152 / 4)
    out = {
        arch: str(write_tiny_gguf(root / f"tiny-{arch}.gguf", arch, n_layer=N_LAYER, sliding_window=WINDOW, seed=i,
                                  head_dim=GEMMA_HEAD if arch in ("gemma2", "gemma3") else 0))
        for i, arch in enumerate(FAMILIES)
    }
    out["llama+moe"] = str(write_tiny_gguf(root / "tiny-llama-moe.gguf", "llama", n_layer=N_LAYER, n_expert=4, seed=9))
    return out


def _greedy(stages, prompt):
    try:
        return Pipeline(stages).generate_greedy(prompt, N_NEW, keep_logits=True)
    finally:
        for s in stages:
            s.close()


@pytest.fixture(scope="module")
def reference(models):
    """Per family: the prompt ids and the single node's greedy decode with logits."""
    out = {}
    for arch, path in models.items():
        full = LlamaBackend(path, n_threads=1, n_ctx=256, max_sessions=1)
        prompt = full.tokenize(tiny_prompt(), add_special=True, parse_special=False)
        out[arch] = (prompt, _greedy([full], prompt))
    return out


def test_families_are_the_certified_list():
    # deepseek4's tiny model, with the real tensor layout, is dgr.bench.dsv4_tiny's (tests/test_dsv4_route.py)
    assert set(FAMILIES) | {"deepseek4"} == set(llama_arch.CERTIFIED)


@pytest.mark.parametrize("arch", [*FAMILIES, "llama+moe"])
def test_splits_equal_single_node(arch, models, reference):
    prompt, ref = reference[arch]
    assert len(prompt) > 4 * WINDOW  # past every sliding window of the tiny gemmas
    assert len(set(ref.tokens)) > 2  # a real continuation, not one token repeated
    for sizes in SPLITS:
        got = split_greedy(models[arch], sizes, prompt, N_NEW, n_threads=1, n_ctx=256, max_sessions=1)
        diff = float(np.max(np.abs(got.logits - ref.logits)))
        print(f"{arch} split {sizes}: max |diff| over {N_NEW} steps: {diff}")
        assert got.tokens == ref.tokens, sizes
        assert diff == 0.0, sizes


def test_one_ulp_in_the_seam_changes_the_answer(models, reference):
    """The control for the 0.0 above: the tail's logits see the smallest change of its input."""
    prompt, _ = reference["gemma3"]
    head, tail = (LlamaShardBackend(models["gemma3"], LayerRange(a, b), n_threads=1, n_ctx=256, max_sessions=2)
                  for a, b in ((0, 3), (3, N_LAYER)))
    try:
        for sid in ("a", "b"):
            head.open_session(sid, len(prompt))
            tail.open_session(sid, len(prompt))
        seam = head.forward("a", 0, np.array(prompt, np.int32), None, False)  # float32 [n, 64]
        assert np.array_equal(seam, head.forward("b", 0, np.array(prompt, np.int32), None, False))
        nudged = seam.copy()
        # one ulp up in every value of the last position (one value alone may round away in the next norm)
        nudged[-1] = np.nextafter(nudged[-1], np.float32(np.inf))
        want, got = tail.forward("a", 0, None, seam, True), tail.forward("b", 0, None, nudged, True)
        assert not np.array_equal(want, got)
    finally:
        head.close()
        tail.close()


def test_kv_bytes_follow_the_head_width(models, reference):
    prompt, _ = reference["gemma3"]
    tail = LlamaShardBackend(models["gemma3"], LayerRange(0, N_LAYER), n_threads=1, n_ctx=256, max_sessions=1)
    try:
        tail.open_session("s", len(prompt))
        tail.forward("s", 0, np.array(prompt, np.int32), None, True)
        # 6 layers x 2 KV heads x (K 32 + V 32) x f16, per position
        assert tail.kv_bytes() == len(prompt) * N_LAYER * 2 * (GEMMA_HEAD + GEMMA_HEAD) * 2
    finally:
        tail.close()


def _tiny_header_only(path, arch: str, **ints) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_context_length(16)
    w.add_embedding_length(8)
    for k, v in ints.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("arch", "says"),
    [
        ("glm5-next", "several streams"),
        ("gemma3n", "per-layer token embeddings"),
        ("talkie", "a second stream"),
        ("kimi-k3", "attention residuals"),
        ("rwkv6qwen2", "crashes in llama.cpp itself"),
        ("chameleon", "libllama does not load a layer range of it"),
    ],
)
def test_uncertified_architectures_are_refused_at_node_start(tmp_path, arch, says):
    path = tmp_path / f"{arch}.gguf"
    _tiny_header_only(path, arch)
    with pytest.raises(CallerError) as e:
        LlamaShardBackend(path, LayerRange(0, 2))
    assert e.value.reason is Reason.MODEL_LOAD_FAILED
    assert f"'{arch}'" in e.value.message and says in e.value.message
    assert "--backend llama serves it whole" in e.value.message


def test_plan_prices_local_and_global_layers(models):
    from dgr.plan import layout_from_gguf

    layout = layout_from_gguf(models["gemma3"])
    kinds = [layer.kind for layer in layout.layers]
    assert kinds == ["swa"] * 5 + ["attn"]
    assert all(t.window == WINDOW for t in layout.layers[0].kv)
    assert all(t.every == 1 for t in layout.layers[5].kv)
    g2 = [layer.kind for layer in layout_from_gguf(models["gemma2"]).layers]
    assert g2 == ["swa", "attn"] * 3
    assert {layer.kind for layer in layout_from_gguf(models["qwen3"]).layers} == {"attn"}


# -- real processes ------------------------------------------------------------------


def _client(route: LocalRoute) -> openai.OpenAI:
    return openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0, timeout=120, http_client=route.http)


def _route(model: str, backend: str, nodes: int) -> LocalRoute:
    return LocalRoute(backend=backend, nodes=nodes, extra=("--model", model, "--ctx", "256", "--threads", "1"),
                      ready_timeout_s=120)


def _create_completion(path: str) -> dict:
    """llama-cpp-python's own greedy completion of the tiny prompt: the reference."""
    from llama_cpp import Llama

    direct = Llama(path, n_ctx=256, n_threads=1, n_threads_batch=1, n_batch=512, verbose=False, seed=0)
    try:
        return direct.create_completion(tiny_prompt(), max_tokens=N_NEW, temperature=0.0, top_k=1)
    finally:
        direct.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_dgr_up_llama_equals_create_completion(arch, models):
    out = _create_completion(models[arch])
    with _route(models[arch], "llama", 1) as r:
        listed = _client(r).models.list().data
        resp = _client(r).completions.create(model=listed[0].id, prompt=tiny_prompt(), max_tokens=N_NEW,
                                             temperature=0)
    assert resp.choices[0].text == out["choices"][0]["text"]
    assert len(resp.choices[0].text) > N_NEW  # words, not nothing
    assert resp.usage.completion_tokens == out["usage"]["completion_tokens"]
    assert resp.usage.prompt_tokens == out["usage"]["prompt_tokens"]


def test_dgr_up_two_nodes_on_gemma3(models):
    out = _create_completion(models["gemma3"])
    with _route(models["gemma3"], "llama_shard", 2) as r:
        layers = sorted(n["layers"] for n in r.node_table())
        model_id = _client(r).models.list().data[0].id
        got = _client(r).completions.create(model=model_id, prompt=tiny_prompt(), max_tokens=N_NEW, temperature=0)
    print(f"dgr up --nodes 2 on gemma3 ({N_LAYER} layers, period 6): {layers}")
    assert layers == ["0:3", "3:6"]  # inside the period: each range keeps the file's layer numbering
    assert got.choices[0].text == out["choices"][0]["text"]
    assert got.usage.prompt_tokens > 4 * WINDOW


def test_dgr_up_three_nodes_on_qwen3moe_answers_as_one_node(models):
    """A mixture of experts through the OpenAI client: 3 llama_shard nodes answer as 1 llama node."""
    question = [{"role": "user", "content": tiny_prompt()}]

    def ask(backend: str, nodes: int) -> tuple[str, list[str], int]:
        with _route(models["qwen3moe"], backend, nodes) as r:
            layers = sorted(n["layers"] for n in r.node_table())
            client = _client(r)
            resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=question,
                                                  max_tokens=N_NEW, temperature=0)
            return resp.choices[0].message.content, layers, resp.usage.completion_tokens

    split, layers, n_split = ask("llama_shard", 3)
    whole, _, n_whole = ask("llama", 1)
    print(f"dgr up --nodes 3 on tiny qwen3moe {layers}: {split!r}")
    assert len(layers) == 3
    assert (split, n_split) == (whole, n_whole) and n_whole == N_NEW


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_torch_reference_follows_llama_cpp(arch, models, reference, tmp_path):
    """The torch reference, split 3:3 in llama.cpp's layer numbering, against llama.cpp on f32 weights and KV."""
    import ctypes

    import llama_cpp
    import torch

    from dgr.backends.torch_model import load_shard

    prompt, _ = reference[arch]
    f32 = tmp_path / "f32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 0  # LLAMA_FTYPE_ALL_F32: llama.cpp dequantizes the Q8_0 tensors itself
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(models[arch].encode(), str(f32).encode(), ctypes.byref(params)) == 0
    f32_kv = int(gguf.GGMLQuantizationType.F32)
    llm = llama_cpp.Llama(str(f32), n_ctx=256, n_batch=512, logits_all=True, n_threads=1, n_threads_batch=1,
                          verbose=False, type_k=f32_kv, type_v=f32_kv)
    try:
        llm.eval(prompt)
        ref = np.array(llm.scores[: len(prompt)])  # [n, vocab]
    finally:
        llm.close()
    head, tail = load_shard(models[arch], LayerRange(0, 3)), load_shard(models[arch], LayerRange(3, N_LAYER))
    with torch.inference_mode():
        h = head(torch.tensor(prompt), 0, head.new_cache(len(prompt)))  # [n, 64]
        ours = tail.logits(tail(h, 0, tail.new_cache(len(prompt)))).numpy()  # [n, vocab]
    print(f"torch vs llama.cpp ({arch}, f32): max |logit diff| {np.abs(ours - ref).max():.2e}")
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))
    np.testing.assert_allclose(ours, ref, atol=2e-3)


def test_dgr_up_refuses_unproven_architecture_before_any_process(tmp_path):
    import subprocess

    from dgr.procs import dgr_command

    path = tmp_path / "rwkv6qwen2.gguf"
    _tiny_header_only(path, "rwkv6qwen2")
    out = subprocess.run(dgr_command("up", "--backend", "llama_shard", "--nodes", "2", "--model", str(path)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "'rwkv6qwen2' cannot be split into layer ranges" in out.stderr
    assert "tracker at" not in out.stderr  # nothing started


@pytest.mark.parametrize("arch", [*FAMILIES, "llama+moe"])
def test_batched_decode_across_sessions_computes_what_each_alone_does(arch, models):
    """Three sessions' decode steps in one call give each session its own answer, stage by stage.

    Each stage gets the same inputs and the same KV both ways. The answers agree to rounding, not
    bit for bit: these tiny models have f32 and Q8_0 weights, whose CPU matmul (llamafile's sgemm)
    sums a several-row batch in another order than one row, and where a value sits on an f16
    rounding edge (the f16 KV cache, ggml's f16 GELU table) that last bit becomes one f16 step. The
    default model's Q4_1 weights take the one-row path either way and are bit-identical over whole
    answers (tests/test_batching.py). A row mixed up with another session's would differ everywhere
    by the values' own scale, so each row must sit far closer to its own session than to any other.
    """
    path = models[arch]
    mid = N_LAYER // 2

    def stages() -> list[LlamaShardBackend]:
        return [LlamaShardBackend(path, LayerRange(a, b), n_threads=1, n_ctx=128, max_sessions=4)
                for a, b in ((0, mid), (mid, N_LAYER))]

    batched, single = stages(), stages()
    try:
        prompts = {f"s{i}": batched[0].tokenize(tiny_prompt()[: 40 + 9 * i], add_special=True, parse_special=False)
                   for i in range(3)}
        for head, tail in (batched, single):
            for sid, prompt in prompts.items():
                head.open_session(sid, 96)
                tail.open_session(sid, 96)
                tail.forward(sid, 0, None, head.forward(sid, 0, np.array(prompt, np.int32), None, False), True)
        worst = 0.0
        # One step: after it the two ways hold KV that differs by rounding, which these random
        # models amplify step by step, so later steps would no longer compare like with like.
        for k in range(1):
            ids = {sid: np.array([(7 + 11 * k + len(p)) % 200 + 3], np.int32) for sid, p in prompts.items()}
            hidden = {sid: single[0].forward(sid, len(p) + k, ids[sid], None, False) for sid, p in prompts.items()}
            logits = {sid: single[1].forward(sid, len(p) + k, None, hidden[sid], True) for sid, p in prompts.items()}
            hs = batched[0].forward_batch([Step(sid, len(p) + k, ids[sid], None, False, True)
                                           for sid, p in prompts.items()])
            ls = batched[1].forward_batch([Step(sid, len(p) + k, None, hidden[sid], True, True)
                                           for sid, p in prompts.items()])
            for got, want in ((dict(zip(prompts, (h.unwrap() for h in hs))), hidden),
                              (dict(zip(prompts, (lg.unwrap() for lg in ls))), logits)):
                for sid in prompts:
                    own = float(np.mean(np.abs(got[sid] - want[sid])))
                    nearest_other = min(float(np.mean(np.abs(got[sid] - want[o]))) for o in prompts if o != sid)
                    scale = float(np.max(np.abs(want[sid])))
                    worst = max(worst, float(np.max(np.abs(got[sid] - want[sid]))) / scale)
                    assert own < 1e-2 * scale and own < 1e-2 * nearest_other, (sid, own, nearest_other, scale)
        print(f"{arch}: batched against one by one, largest difference {worst:.3g} of the values' scale")
        assert worst < 1e-2  # at most a few f16 steps
    finally:
        for s in (*batched, *single):
            s.close()
