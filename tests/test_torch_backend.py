"""The torch reference backend on the real default model.

- Chains of 2 and 3 shards give the same greedy tokens as one shard over all layers.
- Each shard computes each position once per session; the recompute baseline does O(n^2).
- KV memory is preallocated per session, reported, and freed on close.
- Against llama.cpp: teacher-forced top-1 agreement >= 98% over ~512 tokens of English.

Prompts for the non-llama tests are built from whole-word entries of the GGUF
vocabulary, so they need no tokenizer.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools

import gguf
import numpy as np
import pytest
import torch

from dgr.backends.base import LayerRange
from dgr.backends.torch_backend import TorchBackend
from dgr.backends.torch_model import load_shard
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import read_header
from dgr.models import default_model_path
from dgr.pipeline import Pipeline

N_NEW = 32


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def vocab(path) -> list[str]:
    return read_header(path).fields["tokenizer.ggml.tokens"]


@pytest.fixture(scope="module")
def prompt(vocab) -> list[int]:
    ids = {t: i for i, t in enumerate(vocab)}
    words = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", ".", "ĠThe", "Ġcapital", "Ġof", "ĠItaly", "Ġis"]
    return [ids[w] for w in words]


def chain(path, cuts: list[int], **kw) -> list[TorchBackend]:
    return [TorchBackend(path, LayerRange(a, b), **kw) for a, b in itertools.pairwise(cuts)]


@pytest.fixture(scope="module")
def single(path):
    return chain(path, [0, 30])


@pytest.fixture(scope="module")
def two(path):
    return chain(path, [0, 12, 30])


def run_chain(shards, sid: str, pos0: int, ids: list[int]) -> np.ndarray:
    """Push ids at positions [pos0, pos0 + len) through the chain; the tail's logits [vocab]."""
    x = np.array(ids, dtype=np.int32)
    for s in shards:
        x = s.forward(sid, pos0, x if s.is_head else None, None if s.is_head else x, want_logits=True)
    return x


def greedy(shards, prompt: list[int], n_new: int, sid: str = "g") -> tuple[list[int], list[int]]:
    """Greedy decode through dgr.pipeline; (new tokens, positions computed per shard)."""
    pipe = Pipeline(shards)
    pipe.open(sid, len(prompt) + n_new)
    try:
        tokens = [int(np.argmax(pipe.prefill(sid, prompt)))]
        while len(tokens) < n_new:
            tokens.append(int(np.argmax(pipe.decode(sid, tokens[-1], len(prompt) + len(tokens) - 1))))
        return tokens, [s.positions_computed(sid) for s in shards]
    finally:
        pipe.close(sid)


def greedy_recompute(shards, prompt: list[int], n_new: int, sid: str = "r") -> tuple[list[int], list[int]]:
    """The baseline: every step resends the whole sequence from position 0."""
    for s in shards:
        s.open_session(sid, len(prompt) + n_new)
    try:
        seq = list(prompt)
        for _ in range(n_new):
            seq.append(int(np.argmax(run_chain(shards, sid, 0, seq))))
        return seq[len(prompt):], [s.positions_computed(sid) for s in shards]
    finally:
        for s in shards:
            s.close_session(sid)


@pytest.fixture(scope="module")
def reference(single, prompt):
    return greedy(single, prompt, N_NEW)


def test_model_is_sane(reference, vocab):
    tokens, _ = reference
    assert vocab[tokens[0]] == "ĠRome"


@pytest.mark.parametrize("cuts", [[0, 12, 30], [0, 7, 19, 30]], ids=["2-shard", "3-shard"])
def test_chains_match_single_shard(request, path, prompt, reference, cuts):
    shards = request.getfixturevalue("two") if cuts == [0, 12, 30] else chain(path, cuts)
    tokens, computed = greedy(shards, prompt, N_NEW)
    assert tokens == reference[0]
    # every shard saw every position exactly once: prompt + each fed-back token
    assert computed == [len(prompt) + N_NEW - 1] * len(shards)


def test_logits_do_not_depend_on_chunking(single, prompt):
    """The cache is right: one prefill, chunks and one token at a time agree."""
    (s,) = single
    outs = []
    for chunks in ([prompt], [prompt[:5], prompt[5:]], [[t] for t in prompt]):
        s.open_session("c", len(prompt))
        pos = 0
        for c in chunks:
            logits = run_chain(single, "c", pos, c)
            pos += len(c)
        outs.append(logits)
        s.close_session("c")
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-3)
    np.testing.assert_allclose(outs[2], outs[0], atol=2e-3)


def test_no_recompute_whatever_the_steps(two, prompt):
    for n_new in (1, 8, 20):
        _, computed = greedy(two, prompt, n_new)
        assert computed == [len(prompt) + n_new - 1] * 2


def test_recompute_baseline_is_quadratic(path, prompt, reference):
    (base,) = chain(path, [0, 30], recompute=True)
    n_new = 6
    tokens, computed = greedy_recompute([base], prompt, n_new)
    assert tokens == reference[0][:n_new]
    assert computed == [sum(len(prompt) + t for t in range(n_new))]  # vs len(prompt) + n_new - 1
    # it keeps no KV between calls, and refuses the real design's incremental step
    base.open_session("r", 64)
    assert base.kv_bytes() == 0
    with pytest.raises(CallerError) as e:
        base.forward("r", 3, np.array([1], np.int32), None, want_logits=False)
    assert e.value.reason is Reason.POSITION_DISCONTINUITY


def test_kv_bytes_reported_and_freed(two):
    head, tail = two
    assert head.kv_bytes() == tail.kv_bytes() == 0
    for s in two:
        s.open_session("kv", 256)
    # [layers, positions, n_kv_heads=3, head_dim=64] float32, for K and V
    assert head.session_kv_bytes("kv") == 2 * 12 * 256 * 3 * 64 * 4 == head.kv_bytes()
    assert tail.session_kv_bytes("kv") == 2 * 18 * 256 * 3 * 64 * 4 == tail.kv_bytes()
    assert head.kv_bytes_per_position() * 256 == head.kv_bytes()
    assert head.describe()["kv_bytes"] == head.kv_bytes()
    assert head.session_count() == 1
    for s in two:
        s.close_session("kv")
        s.close_session("kv")  # idempotent
    assert head.kv_bytes() == tail.kv_bytes() == 0
    assert head.session_count() == 0


def test_bad_calls_raise_and_change_nothing(two, prompt):
    head, tail = two
    head.open_session("b", 16)
    tail.open_session("b", 16)
    try:
        cases = [
            (lambda: head.open_session("b", 16), Reason.SESSION_EXISTS),
            (lambda: head.forward("nope", 0, np.array(prompt, np.int32), None, False), Reason.UNKNOWN_SESSION),
            (lambda: head.forward("b", 1, np.array(prompt, np.int32), None, False), Reason.POSITION_DISCONTINUITY),
            (lambda: head.forward("b", 0, np.array([49152], np.int32), None, False), Reason.BAD_FRAME),
            (lambda: head.forward("b", 0, np.zeros(17, np.int32), None, False), Reason.CONTEXT_LENGTH_EXCEEDED),
            (lambda: tail.forward("b", 0, None, np.zeros((2, 575), np.float32), True), Reason.WRONG_WIDTH),
            (lambda: tail.forward("b", 0, None, np.zeros((2, 576), np.float64), True), Reason.WRONG_DTYPE),
            (lambda: tail.forward("b", 0, None, None, True), Reason.BAD_FRAME),
            (lambda: head.open_session("big", 8193), Reason.CONTEXT_LENGTH_EXCEEDED),
        ]
        for call, reason in cases:
            with pytest.raises(CallerError) as e:
                call()
            assert e.value.reason is reason
        assert head.positions_computed("b") == tail.positions_computed("b") == 0
        # the session still works from position 0
        hidden = head.forward("b", 0, np.array(prompt, np.int32), None, False)
        assert hidden.shape == (len(prompt), 576) and hidden.dtype == np.float32
        assert tail.forward("b", 0, None, hidden, True).shape == (49152,)
        assert tail.forward("b", len(prompt), None, hidden[:1], False) is None
    finally:
        head.close_session("b")
        tail.close_session("b")


def test_capacity(two):
    head = two[0]
    sids = [f"cap{i}" for i in range(head.max_sessions())]
    try:
        for sid in sids:
            head.open_session(sid, 4)
        with pytest.raises(CallerError) as e:
            head.open_session("one-too-many", 4)
        assert e.value.reason is Reason.NODE_AT_CAPACITY
        head.close_session(sids[0])
        head.open_session("one-too-many", 4)
        assert head.session_count() == head.max_sessions()
    finally:
        for sid in sids + ["one-too-many"]:
            head.close_session(sid)


def test_digest_is_the_file_sha256(single, path):
    assert single[0].info.digest == hashlib.sha256(path.read_bytes()).hexdigest()


ENGLISH = """\
The lighthouse stood at the end of a narrow spit of land, where the river met the sea and the water \
turned from brown to green. For more than a hundred years it had warned ships away from the sandbanks \
that shifted with every storm. The first keeper was a retired sailor named Thomas Hale, who lived in \
the small stone cottage beside the tower with his wife and their three children. Every evening at \
sunset he climbed the one hundred and twelve steps to the lamp room, trimmed the wicks, polished the \
great glass lens, and lit the oil lamps that would burn until dawn. In the winter the wind howled \
around the tower so fiercely that the whole building seemed to tremble, and salt spray crusted the \
windows until they were nearly opaque.

Hale kept a logbook in which he recorded the weather, the ships that passed, and anything unusual \
that happened during the night. Most entries were short and plain: "Wind from the north-west, strong. \
Two fishing boats returned late. Lamp burned well." But some pages tell longer stories. In the autumn \
of one particularly bad year, he wrote about a cargo ship that ran aground on the outer bank during \
a gale. He and his eldest son rowed out in a small boat and brought back four sailors, cold and \
exhausted but alive. The rest of the crew were rescued the next morning when the storm had passed.

When electricity finally reached the coast, the oil lamps were replaced by a powerful electric light, \
and the keeper's job became much easier. Later still, the light was automated, and the last keeper \
left the cottage for good. For a few years the buildings stood empty, and the paint peeled from the \
walls. Then a group of local volunteers formed a society to restore the lighthouse. They repaired \
the roof, rebuilt the crumbling steps, and turned the cottage into a small museum. Today visitors \
can climb the tower on summer weekends, look out over the estuary, and read the old logbooks that \
the keepers left behind.

Scientists also use the site. A weather station on the roof measures wind speed, rainfall and \
temperature every ten minutes, and the data are sent to a national network that helps forecasters \
predict storms. Students from the nearby university come to study the birds that nest on the cliffs \
and the seals that rest on the sandbanks at low tide. In this way the lighthouse, which was built to \
keep people safe at sea, continues to serve the community in new ways, long after the last keeper \
climbed its stairs to light the lamp.
"""


@pytest.mark.llama
def test_text_is_delegated_to_gguf_text(llama_cpp, single, prompt):
    (s,) = single
    text = "The capital of France is Paris. The capital of Italy is"
    assert s.tokenize(text, add_special=False, parse_special=False) == prompt
    assert b"".join(s.token_bytes(t) for t in prompt) == text.encode()
    assert s.is_eog(2) and not s.is_eog(prompt[0])
    assert s.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def agreement(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || ours) of next-token distributions; logits [n, vocab]."""
    ours, ref = ours.astype(np.float64), ref.astype(np.float64)
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # [n]
    return float(np.mean(ours.argmax(-1) == ref.argmax(-1))), float(kl.mean())


@pytest.fixture(scope="module")
def llama_cpp():
    import llama_cpp  # a hard dependency: a broken build fails here

    return llama_cpp


@pytest.fixture(scope="module")
def english(llama_cpp, path):
    """The text as llama.cpp tokenizes it: 512 ids."""
    vocab_only = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    tokens = vocab_only.tokenize(ENGLISH.encode(), add_bos=False, special=False)[:512]
    assert len(tokens) == 512
    return tokens


@pytest.fixture(scope="module")
def torch_logits(path, english) -> np.ndarray:
    """Ours, teacher-forced over the whole text in one prefill: [512, vocab]."""
    model = load_shard(path, LayerRange(0, 30))
    with torch.inference_mode():
        h = model(torch.tensor(english), 0, model.new_cache(len(english)))  # [n, 576]
        return model.logits(h).numpy()  # [n, vocab]


def llama_logits(llama_cpp, model_path, tokens: list[int], **kw) -> np.ndarray:
    llm = llama_cpp.Llama(
        model_path=str(model_path), n_ctx=1024, n_batch=512, logits_all=True, n_threads=1, n_threads_batch=1,
        verbose=False, **kw
    )
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])  # [n, vocab]


@pytest.mark.llama
def test_agrees_with_llama_cpp(llama_cpp, path, english, torch_logits, capsys):
    """Against llama.cpp on the Q4_1 file as shipped.

    llama.cpp quantizes activations to 8 bits for its Q4_1/Q8_0 matmuls and
    keeps K/V in f16, so near-ties flip: measured 96.7% top-1, mean KL 0.0026
    nats. The exactness check is the f32 test below.
    """
    agree, kl = agreement(torch_logits, llama_logits(llama_cpp, path, english))
    with capsys.disabled():
        print(f"\ntorch vs llama.cpp (Q4_1), {len(english)} tokens: top-1 {agree:.2%}, mean KL {kl:.6f} nats")
    assert agree >= 0.95
    assert kl < 0.01


@pytest.mark.llama
def test_matches_llama_cpp_on_f32_weights(llama_cpp, path, english, torch_logits, tmp_path_factory, capsys):
    """Same weights, no quantized arithmetic: llama.cpp's own f32 copy of the file, f32 KV.

    This is what proves RoPE pairing, GQA grouping, norms and the tied head
    are exactly llama.cpp's: any layout mistake would move logits by far more
    than float rounding.
    """
    f32 = tmp_path_factory.mktemp("f32") / "model-f32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 0  # LLAMA_FTYPE_ALL_F32: llama.cpp dequantizes every tensor itself
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(f32).encode(), ctypes.byref(params)) == 0
    f32_kv = int(gguf.GGMLQuantizationType.F32)
    ref = llama_logits(llama_cpp, f32, english, type_k=f32_kv, type_v=f32_kv)
    f32.unlink()
    agree, kl = agreement(torch_logits, ref)
    with capsys.disabled():
        print(f"\ntorch vs llama.cpp (f32 weights, f32 KV): top-1 {agree:.2%}, mean KL {kl:.2e} nats, "
              f"max |logit diff| {np.abs(torch_logits - ref).max():.2e}")
    assert agree >= 0.998
    assert kl < 1e-6
    np.testing.assert_allclose(torch_logits, ref, atol=2e-3)
