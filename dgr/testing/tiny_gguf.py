"""Tiny random-weight GGUF models of each family llama.cpp runs, written in the test itself.

No weights come from a hub: `write_tiny_gguf(path, arch)` writes a model of a
few layers with gguf-py's writer, the metadata and tensor names the vendored
llama.cpp loader requires for `arch` (src/models/{arch}.cpp,
load_arch_hparams / load_arch_tensors), a SentencePiece ("llama") vocabulary
of a few hundred pieces with byte fallback, a chat template, and the FFN
weights in Q8_0 (gguf.quants), the rest f32. Such a model decodes in
milliseconds, and its random weights make every layer matter to the logits.

Gemma 2 and 3 get a sliding window shorter than a test prompt, so that a
split which shifted their local/global layer pattern would change the answer.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

__all__ = ["FAMILIES", "TinySpec", "tiny_prompt", "vocab_size", "word_rows", "write_layout_gguf", "write_tiny_gguf"]

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma", "gemma2", "gemma3")

_WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "it", "that", "ship", "wind", "bird", "keeper", "wrote",
    "down", "every", "passed", "point", "rail", "on", "sea", "light", "house", "night", "day", "what",
)
_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@attrs.frozen
class TinySpec:
    """The shape of a tiny model. head_dim: n_embd / n_head unless given (Gemma's is wider)."""

    arch: str
    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    head_dim: int = 0
    context: int = 512
    sliding_window: int = 8  # gemma2 / gemma3 only
    n_expert: int = 0  # llama: a Mixtral-like mixture of experts, 2 used per token; qwen3moe: 4 unless given
    gain: float = 3.0  # scale of each layer's output weights: layers, not the token's own embedding, decide
    swa_period: int | None = None  # gemma2 / gemma3: write this period (default: the loader's own)
    seed: int = 0


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: <unk>, control tokens (Phi 3's loader needs <|endoftext|>), 256 byte pieces, characters, then words; scores favour longer pieces."""
    control = ["<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tokens = ["<unk>", *control] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * len(control) + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    chars = ["\u2581"] + [c for c in string.ascii_letters + string.digits + string.punctuation]
    # SentencePiece merges two pieces only into a piece of the vocabulary: keep every prefix of a word
    words = {p[:k] for w in _WORDS for p in ("\u2581" + w, w) for k in range(2, len(p) + 1)}
    pieces = chars + sorted(words, key=lambda p: (len(p), p))
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 + len(p) * 10.0 - i * 0.001)
    return tokens, scores, [int(t) for t in types]


def vocab_size() -> int:
    """The number of tokens of the tiny models' vocabulary."""
    return len(_vocab()[0])


def word_rows() -> np.ndarray:
    """A scale per token, 1 for word pieces and 0.05 for control and byte pieces: output rows so scaled make
    greedy text words, valid UTF-8 that every detokenizer agrees on, with no early end of generation."""
    return np.where(np.array(_vocab()[2]) == int(gguf.TokenType.NORMAL), 1.0, 0.05)


def _add_vocab(w: gguf.GGUFWriter) -> None:
    """The tiny SentencePiece vocabulary and chat template, as GGUF tokenizer metadata."""
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(_TEMPLATE)


def tiny_prompt(n_words: int = 60) -> str:
    """A prompt of about 1.5 tokens a word: longer than any sliding window of a tiny model."""
    words = [_WORDS[(i * 7) % len(_WORDS)] for i in range(n_words)]
    return "The keeper wrote: " + " ".join(words) + ". What"


def write_tiny_gguf(path: str | Path, arch: str, **kw) -> Path:
    """Write a tiny random model of family `arch` (one of FAMILIES) to `path`."""
    spec = TinySpec(arch, **kw)
    if arch not in FAMILIES:
        raise ValueError(f"no tiny model for {arch!r}; families: {FAMILIES}")
    if arch == "qwen3moe" and not spec.n_expert:
        spec = attrs.evolve(spec, n_expert=4)  # qwen3's layers with a routed mixture of experts
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    n_vocab, d, hd = vocab_size(), spec.n_embd, spec.head_dim or spec.n_embd // spec.n_head
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.context)
    w.add_embedding_length(d)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10000.0)  # gemma3: its global layers
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if spec.n_expert:
        if arch not in ("llama", "qwen3moe"):
            raise ValueError("tiny mixtures of experts are written for llama and qwen3moe only")
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(2)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(spec.n_ff)  # else n_ff / n_expert_used (src/models/qwen3moe.cpp:50)
    if arch.startswith("gemma") or spec.head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(spec.sliding_window)
        if spec.swa_period is not None:
            w.add_sliding_window_pattern(spec.swa_period)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(10_000.0)  # its local layers
    _add_vocab(w)

    def f32(name: str, shape: tuple[int, ...], scale: float, rows: np.ndarray | None = None) -> None:
        data = rng.standard_normal(shape) * scale
        if rows is not None:
            data *= rows[:, None]
        w.add_tensor(name, data.astype(np.float32))

    def q8(name: str, shape: tuple[int, ...], scale: float) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    # numpy shapes are [rows, cols] = ggml's {cols, rows}: a weight of ggml {n_in, n_out} is [n_out, n_in]
    embd_scale = 1.0 / np.sqrt(d) if arch.startswith("gemma") else 1.0  # gemma scales the lookup by sqrt(n_embd)
    rows = word_rows()
    f32("token_embd.weight", (n_vocab, d), embd_scale, rows)
    norm("output_norm.weight", d)
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe", "phi3"):  # the others tie the output to token_embd
        f32("output.weight", (n_vocab, d), 1.0 / np.sqrt(d), rows)
    s_in, s_ff = 1.0 / np.sqrt(d), 1.0 / np.sqrt(spec.n_ff)
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", d)
        if arch == "phi3":
            f32(b + "attn_qkv.weight", (q_dim + 2 * kv_dim, d), s_in)
        else:
            f32(b + "attn_q.weight", (q_dim, d), s_in)
            f32(b + "attn_k.weight", (kv_dim, d), s_in)
            f32(b + "attn_v.weight", (kv_dim, d), s_in)
        if arch == "qwen2":
            f32(b + "attn_q.bias", (q_dim,), 0.1)
            f32(b + "attn_k.bias", (kv_dim,), 0.1)
            f32(b + "attn_v.bias", (kv_dim,), 0.1)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            norm(b + "attn_q_norm.weight", hd)
            norm(b + "attn_k_norm.weight", hd)
        f32(b + "attn_output.weight", (d, q_dim), spec.gain / np.sqrt(q_dim))
        if arch in ("gemma2", "gemma3"):
            w.add_tensor(b + "post_attention_norm.weight", (spec.gain * (1 + 0.1 * rng.standard_normal(d))).astype(np.float32))
            w.add_tensor(b + "post_ffw_norm.weight", (spec.gain * (1 + 0.1 * rng.standard_normal(d))).astype(np.float32))
        norm(b + "ffn_norm.weight", d)
        if spec.n_expert:  # llama.cpp's src/models/llama.cpp:79-82 and src/models/qwen3moe.cpp:40-54
            f32(b + "ffn_gate_inp.weight", (spec.n_expert, d), s_in)
            q8(b + "ffn_gate_exps.weight", (spec.n_expert, spec.n_ff, d), s_in)
            q8(b + "ffn_up_exps.weight", (spec.n_expert, spec.n_ff, d), s_in)
            q8(b + "ffn_down_exps.weight", (spec.n_expert, d, spec.n_ff), spec.gain * s_ff)
            continue
        if arch == "phi3":
            q8(b + "ffn_up.weight", (2 * spec.n_ff, d), s_in)
        else:
            q8(b + "ffn_gate.weight", (spec.n_ff, d), s_in)
            q8(b + "ffn_up.weight", (spec.n_ff, d), s_in)
        q8(b + "ffn_down.weight", (d, spec.n_ff), spec.gain * s_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _random_value(name: str, role: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if "norm" in name:
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)


def write_layout_gguf(
    data: Mapping[str, Any],
    path: str | Path,
    *,
    extra: Mapping[str, Any] | None = None,
    types: Mapping[str, str] | None = None,
    value: Callable[[str, str, list[int], np.random.Generator], np.ndarray] = _random_value,
    vocab: bool = False,
) -> dict[str, Any]:
    """A layout JSON (dgr-layout/1) at its own sizes, as a GGUF of random tensors, for llama.cpp to load.

    `extra` adds `{arch}.*` metadata llama.cpp needs and a layout does not
    carry; `value(name, role, numpy shape, rng)` makes each tensor (default:
    ones for norms, small normal noise otherwise). Returns the layout with its
    one recipe, "f32" (every role F32 unless `types` says otherwise), so
    `layout_from_json(returned, recipe="f32")` prices this very file. With
    `vocab`, the file gets the tiny models' tokenizer and chat template (its
    layout's vocab_size must be `vocab_size()`), so that dgr can serve it.
    """
    arch = data["architecture"]
    types = dict(types or {role: "F32" for recipe in data["recipes"].values() for role in recipe["types"]})
    data = dict(data) | {"recipes": {"f32": {"description": "probe", "types": types}}, "default_recipe": "f32"}
    w = gguf.GGUFWriter(str(path), arch=arch)
    meta = dict(data["metadata"]) | {f"{arch}.{k}": v for k, v in (extra or {}).items()}
    for key, v in meta.items():
        if key == "general.architecture":
            continue  # GGUFWriter writes it
        if isinstance(v, list):
            w.add_array(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        else:
            w.add_uint32(key, v)
    if vocab:
        _add_vocab(w)
    else:
        w.add_string("tokenizer.ggml.model", "no_vocab")
    n_all = meta[f"{arch}.block_count"]
    rng = np.random.default_rng(0)
    for group in data["tensor_groups"]:
        spec = group["layers"]
        layers = [None] if spec == "global" else range(n_all) if spec == "all" else spec
        for il in layers:
            for t in group["tensors"]:
                name = t["name"].format(i=il) if il is not None else t["name"]
                w.add_tensor(name, value(name, t["role"], list(reversed(t["shape"])), rng))  # numpy order: ne0 last
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data

