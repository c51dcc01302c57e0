"""Random-weight GGUF files with the shape of bigger models, for honest timings.

SmolLM2-135M decodes a token in about 20 ms, beside which every per-hop cost
looks large. A file with a 1B-parameter llama's shape costs what such a model
costs to run; its text is meaningless, so benchmarks use `ignore_eos` and a
fixed token count. The tokenizer is the default model's, copied, so prompts
tokenize the same way on every setup.

Files are written once (gguf-py, numpy's quantizer) and cached by shape.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import gguf
import numpy as np

from dgr.gguf_meta import read_header
from dgr.models import default_model_path

__all__ = ["built_models_dir", "LlamaShape", "LLAMA_1B", "random_llama_gguf"]


@attrs.frozen
class LlamaShape:
    name: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Llama-3.2-1B's blocks (16 x 2048, 32 heads, 8 KV heads, FFN 8192) with SmolLM2's 49,152-token vocabulary.
LLAMA_1B = LlamaShape("random-llama-1b", n_layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192)


def built_models_dir() -> Path:
    """Where the bench keeps the models it builds (random shapes, the draft model): never downloaded."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgr" / "models"


def random_llama_gguf(shape: LlamaShape = LLAMA_1B, log=lambda msg: None) -> Path:
    """The cached file for shape, written on first use (about a minute for 1B parameters)."""
    path = built_models_dir() / f"{shape.name}-{shape.quant.name.lower()}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} (random weights, {shape.n_layers} x {shape.hidden})")
    tmp = path.with_suffix(".part")
    _write(shape, tmp)
    tmp.replace(path)
    return path


def _write(shape: LlamaShape, path: Path) -> None:
    src = read_header(default_model_path())  # not gguf-py's reader: 9 s on this 49k-token vocabulary
    vocab = len(src.fields["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{shape.name} (random weights, for timing only)")
    w.add_block_count(shape.n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0))
    for key, (vtype, sub) in src.value_types.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, src.fields[key], gguf.GGUFValueType(vtype),
                            sub_type=None if sub is None else gguf.GGUFValueType(sub))

    rng = np.random.default_rng(0)
    kv = shape.kv_heads * shape.head_dim

    def matrix(name: str, rows: int, cols: int) -> None:
        # numpy (rows, cols) = ggml ne [cols, rows]: `rows` outputs of `cols` inputs
        a = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, shape.quant), raw_dtype=shape.quant)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(shape.hidden, dtype=np.float32))

    matrix("token_embd.weight", vocab, shape.hidden)  # tied: llama.cpp uses it as the output head too
    for i in range(shape.n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", shape.hidden, shape.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_output.weight", shape.hidden, shape.hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
