"""LlamaBackend (the whole GGUF on one node) on the real default model.

- Greedy generation equals llama-cpp-python's own high-level `Llama` greedy output.
- Text: chat template, tokenizer, raw token bytes, end-of-generation.
- ModelInfo.digest is the file's sha256; describe() reports the build and the file.
- Sessions: typed errors for unknown, duplicate, out-of-order and over-capacity use.
- Bad model files (missing, directory, not GGUF, truncated, another architecture)
  give a CallerError naming the file, never a traceback from llama.cpp.
"""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from dgr.backends.base import LayerRange
from dgr.backends.llama import LlamaBackend
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.errors import CallerError, Reason
from dgr.models import default_model_path
from dgr.pipeline import Pipeline

pytestmark = pytest.mark.llama

N_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DGR_CACHE_DIR", str(tmp_path_factory.mktemp("dgr-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def backend(cache_dir):
    b = LlamaBackend(default_model_path(), n_threads=1, n_ctx=512, max_sessions=3)
    yield b
    b.close()


@pytest.fixture(scope="module")
def prompt(backend) -> list[int]:
    text = backend.render_chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    return backend.tokenize(text, add_special=True, parse_special=True)


def test_greedy_equals_llama_cpp_python(backend, prompt):
    from llama_cpp import Llama

    ours = Pipeline([backend]).generate_greedy(prompt, N_NEW).tokens
    ref_model = Llama(model_path=str(default_model_path()), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    try:
        ref = []
        for tok in ref_model.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            ref.append(tok)
            if len(ref) == N_NEW:
                break
    finally:
        ref_model.close()
    assert ours == ref
    assert len(set(ours)) > 4  # a real continuation, not one token repeated


def test_text(backend, prompt):
    text = backend.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt
    assert "<|im_start|>user\nHi<|im_end|>" in text
    ids = backend.tokenize("héllo wörld", add_special=False, parse_special=False)
    assert b"".join(backend.token_bytes(t) for t in ids).decode("utf-8") == "héllo wörld"
    (im_end,) = backend.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert backend.is_eog(im_end)
    assert not backend.is_eog(ids[0])
    # an emoji is split across tokens: the bytes, not text, are what each token has
    pieces = [backend.token_bytes(t) for t in backend.tokenize("🦊", add_special=False, parse_special=False)]
    assert b"".join(pieces) == "🦊".encode()


def test_model_info_and_describe(backend):
    path = default_model_path()
    info = backend.info
    assert info.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (info.architecture, info.n_layers, info.hidden_size, info.seam_width, info.vocab_size) == (
        "llama", 30, 576, 576, 49152
    )
    d = backend.describe()
    assert d["backend"] == "llama" and d["layers"] == "0:30"
    assert "q4_1" in d["quantization"] and d["file_size"] == path.stat().st_size
    assert "AVX" in d["llama_cpp_system_info"] and d["llama_cpp_python"]
    assert d["sha256"] == info.digest and d["threads"] == 1
    assert backend.is_head and backend.is_tail


def test_sessions(backend, prompt):
    ids = np.array(prompt, np.int32)
    backend.open_session("a", 64)
    try:
        with pytest.raises(CallerError) as e:
            backend.open_session("a", 64)
        assert e.value.reason is Reason.SESSION_EXISTS
        with pytest.raises(CallerError) as e:
            backend.forward("nope", 0, ids, None, True)
        assert e.value.reason is Reason.UNKNOWN_SESSION
        logits = backend.forward("a", 0, ids, None, True)
        assert logits.shape == (49152,) and logits.dtype == np.float32
        assert backend.positions_computed("a") == len(ids)
        assert backend.kv_bytes() == len(ids) * 30 * 2 * 192 * 2
        with pytest.raises(CallerError) as e:  # a gap: position len(ids) comes next
            backend.forward("a", len(ids) + 1, ids[:1], None, True)
        assert e.value.reason is Reason.POSITION_DISCONTINUITY
        with pytest.raises(CallerError) as e:
            backend.forward("a", len(ids), np.arange(64, dtype=np.int32), None, True)
        assert e.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED
        with pytest.raises(CallerError) as e:
            backend.forward("a", len(ids), np.array([49152], np.int32), None, True)
        assert e.value.reason is Reason.INVALID_REQUEST
        backend.open_session("b", 16)
        backend.open_session("c", 16)
        with pytest.raises(CallerError) as e:
            backend.open_session("d", 16)
        assert e.value.reason is Reason.NODE_AT_CAPACITY
        with pytest.raises(CallerError) as e:
            backend.open_session("d", 100_000)
        assert e.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    finally:
        for sid in "abc":
            backend.close_session(sid)
    backend.close_session("a")  # idempotent
    assert backend.session_count() == 0 and backend.kv_bytes() == 0


def _tiny_gguf(path, arch: str) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_refuses_what_llama_cpp_cannot_load(tmp_path):
    # any architecture is llama.cpp's call: a gemma file without its layers' tensors is refused by it
    path = tmp_path / "tiny-gemma.gguf"
    _tiny_gguf(path, "gemma")
    with pytest.raises(CallerError) as e:
        LlamaBackend(path)
    assert e.value.reason is Reason.MODEL_LOAD_FAILED
    assert str(path) in e.value.message and "'gemma'" in e.value.message


def test_shard_refuses_unproven_architecture(tmp_path):
    path = tmp_path / "tiny-chameleon.gguf"
    _tiny_gguf(path, "chameleon")
    with pytest.raises(CallerError) as e:
        LlamaShardBackend(path, LayerRange(0, 1))
    assert e.value.reason is Reason.MODEL_LOAD_FAILED
    assert "'chameleon'" in e.value.message and "libllama does not load a layer range" in e.value.message
    assert "certified architectures" in e.value.message


def test_refuses_bad_files(tmp_path):
    cases = {
        "missing.gguf": None,
        "dir.gguf": "dir",
        "notes.gguf": b"this is not a model\n",
        "truncated.gguf": b"GGUF\x03\x00\x00\x00\x01",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content == "dir":
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(CallerError) as e:
            LlamaBackend(path)
        assert e.value.reason is Reason.MODEL_LOAD_FAILED, name
        assert str(path) in e.value.message, name


def test_the_one_gguf_header_names_what_llama_cpp_loads(backend):
    """dgr.gguf_meta.GgufHeader's summary (architecture, trunk layers, width, training context, bytes by
    type, with ggml's type names) agrees with what llama.cpp reports of the same file once loaded."""
    from dgr.backends.clib import ggml_lib, llama_lib
    from dgr.gguf_meta import read_header

    header, lib, model = read_header(default_model_path()), llama_lib(), backend.engine._model
    assert (header.n_layer, header.n_embd, header.context_length) == (
        lib.llama_model_n_layer(model), lib.llama_model_n_embd(model), lib.llama_model_n_ctx_train(model))
    assert header.architecture == backend.info.architecture == "llama"
    names = {ggml_lib().ggml_type_name(int(gguf.GGMLQuantizationType[t.type])).decode() for t in header.tensors}
    assert set(header.tensor_types) == names and "q4_1" in names
    assert sum(header.tensor_types.values()) == sum(t.n_bytes for t in header.tensors) == lib.llama_model_size(model)
