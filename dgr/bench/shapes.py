"""Random-weight GGUF files with the shape of bigger models, for honest timings.

SmolLM2-135M decodes a token in about 20 ms, beside which every per-hop cost
looks large. A file with a 1B-parameter llama's shape costs what such a model
costs to run; its text is meaningless, so benchmarks use `ignore_eos` and a
fixed token count. The tokenizer is the default model's, copied, so prompts
tokenize the same way on every setup (`vocab_from` names another file that
holds it: `write_vocab_gguf` makes one of 1.6 MB where the 98 MB default model
cannot travel, as to a GPU machine: gpu/README.md).

Files are written once (gguf-py) and cached by shape. A Q4_0 matrix is
random blocks, not quantized normal draws: uniform 4-bit codes under one
scale, a weight's standard deviation 0.02 as before. Its cost to run is
the same (a quantized matmul reads every block whatever it holds), and an
8B shape is written in seconds where numpy's quantizer took minutes.
A shape with `experts` is a mixture-of-experts llama (Mixtral's layout in
llama.cpp: a router and stacked expert FFNs in place of the dense FFN).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import gguf
import numpy as np

from dgr.gguf_meta import read_header
from dgr.models import default_model_path

__all__ = ["built_models_dir", "LlamaShape", "LLAMA_1B", "LLAMA_8B", "OLMOE_7B", "SHAPES", "random_llama_gguf",
           "write_vocab_gguf"]


@attrs.frozen
class LlamaShape:
    name: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # the dense FFN's width, or each expert's
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_0
    experts: int = 0  # routed experts per layer (0: a dense FFN)
    experts_used: int = 0  # experts each token goes through

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self, vocab: int = 49152) -> int:
        """Weights in the file (norms left out): the blocks, and the token embedding that is the output head too."""
        kv = self.kv_heads * self.head_dim
        ffn = 3 * self.hidden * self.ffn * max(1, self.experts) + self.hidden * self.experts
        return self.n_layers * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + ffn) + vocab * self.hidden


# Llama-3.2-1B's blocks (16 x 2048, 32 heads, 8 KV heads, FFN 8192) with SmolLM2's 49,152-token vocabulary.
LLAMA_1B = LlamaShape("random-llama-1b", n_layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192)
# Llama-3.1-8B's blocks (32 x 4096, 32 heads, 8 KV heads, FFN 14336), the same vocabulary: 7.2B weights, 4.1 GB.
LLAMA_8B = LlamaShape("random-llama-8b", n_layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336)
# OLMoE-1B-7B's blocks (16 x 2048, 16 heads, 64 experts of FFN 1024, 8 used a token) as a llama MoE: 6.8B weights
# of which 1.2B a token, 3.8 GB, 3.6 of them experts (what --cpu-moe keeps in host memory).
OLMOE_7B = LlamaShape("random-olmoe-7b", n_layers=16, hidden=2048, heads=16, kv_heads=16, ffn=1024, experts=64,
                      experts_used=8)
SHAPES = {s.name: s for s in (LLAMA_1B, LLAMA_8B, OLMOE_7B)}
_STD = 0.02  # a weight's standard deviation


def built_models_dir() -> Path:
    """Where the bench keeps the models it builds (random shapes, the draft model): never downloaded."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgr" / "models"


def random_llama_gguf(shape: LlamaShape = LLAMA_1B, log=lambda msg: None, vocab_from: Path | None = None) -> Path:
    """The cached file for shape, written on first use (6 s for 1B parameters in Q4_0 on one busy core here, 7 times that for 8B);
    its tokenizer copied from `vocab_from` (default: the default model)."""
    path = built_models_dir() / f"{shape.name}-{shape.quant.name.lower()}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} (random weights, {shape.n_layers} x {shape.hidden})")
    tmp = path.with_suffix(f".part{os.getpid()}")  # two writers of one shape do not share a file
    _write(shape, tmp, vocab_from or default_model_path())
    tmp.replace(path)
    return path


def _tokenizer_fields(w: gguf.GGUFWriter, src_path: Path) -> int:
    """Copy the tokenizer of `src_path` into `w`; its vocabulary size."""
    src = read_header(src_path)  # not gguf-py's reader: 9 s on this 49k-token vocabulary
    for key, (vtype, sub) in src.value_types.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, src.fields[key], gguf.GGUFValueType(vtype),
                            sub_type=None if sub is None else gguf.GGUFValueType(sub))
    return len(src.fields["tokenizer.ggml.tokens"])


def write_vocab_gguf(dest: Path, src: Path | None = None) -> Path:
    """A GGUF that holds only the tokenizer of `src` (default: the default model), for `vocab_from`."""
    w = gguf.GGUFWriter(str(dest), "llama")
    w.add_name("tokenizer only")
    _tokenizer_fields(w, src or default_model_path())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _random_q4_0(rng: np.random.Generator, rows: tuple[int, ...], cols: int) -> np.ndarray:
    """Random Q4_0 blocks for a matrix of `rows` x `cols`: uint8 [*rows, cols / 32 * 18].

    A block is an f16 scale d and 32 4-bit codes q, each weight (q - 8) d; uniform codes have a standard
    deviation of sqrt(255 / 12) d, so d = _STD / 4.61.
    """
    per_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0][1]  # 18 bytes: 2 of scale, 16 of codes
    blocks = rng.integers(0, 256, size=(*rows, cols // 32, per_block), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(_STD / np.sqrt(255 / 12)).tobytes(), dtype=np.uint8)
    return blocks.reshape(*rows, cols // 32 * per_block)


def _write(shape: LlamaShape, path: Path, vocab_from: Path) -> None:
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
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0))
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
    vocab = _tokenizer_fields(w, vocab_from)
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(0)
    kv = shape.kv_heads * shape.head_dim

    def matrix(name: str, rows: int, cols: int, stack: int = 0) -> None:
        # numpy (rows, cols) = ggml ne [cols, rows]: `rows` outputs of `cols` inputs; `stack` experts of them
        lead = (stack, rows) if stack else (rows,)
        if shape.quant == gguf.GGMLQuantizationType.Q4_0:
            w.add_tensor(name, _random_q4_0(rng, lead, cols), raw_dtype=shape.quant)
            return
        a = (rng.standard_normal((*lead, cols), dtype=np.float32) * _STD).astype(np.float32)
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
        if shape.experts:  # the router in F32, as converted checkpoints keep it
            router = rng.standard_normal((shape.experts, shape.hidden), dtype=np.float32) * _STD
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router.astype(np.float32))
        suffix, n = ("_exps", shape.experts) if shape.experts else ("", 0)
        matrix(f"blk.{i}.ffn_gate{suffix}.weight", shape.ffn, shape.hidden, n)
        matrix(f"blk.{i}.ffn_up{suffix}.weight", shape.ffn, shape.hidden, n)
        matrix(f"blk.{i}.ffn_down{suffix}.weight", shape.hidden, shape.ffn, n)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
