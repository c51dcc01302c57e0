"""Llama, Qwen 2 and Qwen 3 transformer layers [a, b) in plain PyTorch, weights from a GGUF file.

Why it exists: dgr's reference backend. It is small enough to read in one
sitting and proves the cache semantics the real backends must keep: each
shard holds a preallocated KV cache per session, written in place at
positions the caller passes in, so a position is computed once and never
again.

Theory, in the gpt-fast spirit: float32 everywhere, one `forward` over
[n] positions starting at `pos0`. The head shard owns the embedding, the
tail shard the final norm and output head; any shard may be both. A
session's KVCache holds K and V as [n_local_layers, n_kv_heads,
max_positions, head_dim] each; `forward` writes rows [pos0, pos0 + n) and
attends over rows [0, pos0 + n).

Rules that make it agree with llama.cpp:
- RoPE rotates *consecutive pairs* (x[2i], x[2i+1]). llama.cpp's converter
  permutes the HF Q/K weights so that its "normal" rope (LLM_ARCH_LLAMA,
  LLAMA_ROPE_TYPE_NORM) works on pairs; the GGUF weights are used as they are,
  so HF's rotate_half layout would be wrong here.
- Angle of pair i at position p: p * freq_scale * base^(-2i/rope_dims) / ff[i],
  where freq_scale = 1/rope.scaling.factor for linear scaling and ff are the
  optional `rope_freqs.weight` factors (Llama 3). Dims past rope_dims pass
  through unrotated, as in ggml_rope.
- Qwen 2 and 3 use llama.cpp's NEOX rope (LLAMA_ROPE_TYPE_NEOX,
  src/llama-model.cpp llama_model_rope_type): it rotates (x[i], x[i + r/2]),
  the halves, as HF does; their GGUF weights are not permuted.
- Qwen 2 adds Q/K/V biases (src/models/qwen2.cpp); Qwen 3 RMS-normalises each
  query and key head before RoPE (src/models/qwen3.cpp:88-95).
- Query head h reads KV head h // (n_heads // n_kv_heads).
- RMSNorm: x * rsqrt(mean(x^2) + eps) * w.
- Layer il of the file is layer il of the model: the reference follows
  llama.cpp's numbering (blk.{il}), so a shard [a, b) reads blk.a..b-1.

Left out, and refused at load with MODEL_LOAD_FAILED: YaRN and longrope
scaling, biases outside Qwen 2's Q/K/V, mixture of experts, and
architectures other than llama, qwen2 and qwen3 (Gemma's input scaling,
sliding windows and soft-capping, Phi 3's fused tensors: llama.cpp runs them,
the reference does not yet).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import dequantize
from torch import Tensor, nn

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import (ARCHITECTURE_KEY, GgufHeader, arch_key, field, is_tied, layer_of, layer_tensor_name,
                           read_header, tensor_data)

__all__ = ["KVCache", "ModelArgs", "ShardModel", "apply_rope", "load_shard"]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@attrs.frozen
class ModelArgs:
    """Hyperparameters of the whole model, read from GGUF metadata."""

    arch: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_base: float
    rope_dims: int  # leading dims of each head that RoPE rotates
    rope_freq_scale: float  # 1 / linear scaling factor
    attn_scale: float
    context_length: int
    vocab_size: int
    rope_neox: bool = False  # rotate halves (qwen2, qwen3), not consecutive pairs (llama)
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3

    @classmethod
    def from_gguf(cls, reader: GgufHeader) -> ModelArgs:
        """Raises: CallerError(MODEL_LOAD_FAILED) on a model this file cannot run."""
        arch = field(reader, ARCHITECTURE_KEY)
        if arch not in SUPPORTED_ARCHS:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"torch backend runs {SUPPORTED_ARCHS}, not {arch!r}")

        def meta(key: str, default: Any = None) -> Any:
            value = field(reader, arch_key(arch, key), default)
            if value is None:
                raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF lacks {arch}.{key}")
            return value

        if int(meta("expert_count", 0)) > 0:
            raise CallerError(Reason.MODEL_LOAD_FAILED, "torch backend has no mixture-of-experts layers")
        # llama.cpp applies the factor for "none" and "linear" alike: freq_scale = 1/factor.
        scaling = meta("rope.scaling.type", "linear")
        if scaling not in ("none", "linear"):
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"torch backend has no {scaling!r} rope scaling")
        factor = float(meta("rope.scaling.factor", meta("rope.scale_linear", 0.0)))
        dim, n_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
        head_dim = int(meta("attention.key_length", dim // n_heads))
        vocab = field(reader, arch_key(arch, "vocab_size")) or len(reader.fields["tokenizer.ggml.tokens"])
        return cls(
            arch=arch,
            n_layers=int(meta("block_count")),
            dim=dim,
            ffn_dim=int(meta("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
            rope_base=float(meta("rope.freq_base", 10000.0)),
            rope_dims=int(meta("rope.dimension_count", head_dim)),
            rope_freq_scale=1.0 / factor if factor > 0 else 1.0,
            attn_scale=float(meta("attention.scale", 0.0)) or 1.0 / math.sqrt(head_dim),
            context_length=int(meta("context_length")),
            vocab_size=int(vocab),
            rope_neox=arch in ("qwen2", "qwen3"),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )


@attrs.define(eq=False)
class KVCache:
    """One session's keys and values for a shard's layers, preallocated, written in place."""

    k: Tensor  # [n_local_layers, n_kv_heads, max_positions, head_dim]
    v: Tensor  # same

    @classmethod
    def empty(cls, args: ModelArgs, n_layers: int, max_positions: int) -> KVCache:
        shape = (n_layers, args.n_kv_heads, max_positions, args.head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape))

    @staticmethod
    def bytes_for(args: ModelArgs, n_layers: int, max_positions: int) -> int:
        return 2 * n_layers * max_positions * args.n_kv_heads * args.head_dim * 4

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # [n, dim] -> [n, dim]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, neox: bool = False) -> Tensor:
    """Rotate pairs of the first rope_dims dims: consecutive (NORM rope) or halves (NEOX rope).

    x: [n, heads, head_dim]; cos, sin: [n, rope_dims // 2]
    """
    n, heads, _ = x.shape
    r = 2 * cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, r/2]
    if neox:
        x0, x1 = x[..., : r // 2], x[..., r // 2 : r]  # [n, h, r/2]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos, x[..., r:]), dim=-1)  # [n, h, head_dim]
    pairs = x[..., :r].reshape(n, heads, r // 2, 2)  # [n, h, r/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [n, h, r/2]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)  # [n, h, r]
    return torch.cat((rotated, x[..., r:]), dim=-1)  # [n, h, head_dim]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor, pos0: int, cos: Tensor, sin: Tensor, mask: Tensor,
                k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x: [n, dim]; mask: [n, T] with T = pos0 + n; k_cache, v_cache: [KV, max_positions, hd]
        a, n = self.args, x.shape[0]
        kv, group, hd = a.n_kv_heads, a.n_heads // a.n_kv_heads, a.head_dim
        q = self.wq(x).view(n, a.n_heads, hd)  # [n, H, hd]
        k = self.wk(x).view(n, kv, hd)  # [n, KV, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before RoPE
        q = apply_rope(q, cos, sin, a.rope_neox)
        k = apply_rope(k, cos, sin, a.rope_neox)
        v = self.wv(x).view(n, kv, hd)  # [n, KV, hd]
        end = pos0 + n
        k_cache[:, pos0:end] = k.transpose(0, 1)  # written in place: never computed again
        v_cache[:, pos0:end] = v.transpose(0, 1)
        # Query head h reads KV head h // group. Stacking each KV head's queries
        # (h = kv * group + g) lets attention read the cache as it is, with no
        # per-step copy of K and V repeated to H heads.
        q = q.view(n, kv, group, hd).permute(1, 2, 0, 3).reshape(kv, group * n, hd)  # [KV, g*n, hd]
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :end], v_cache[:, :end],  # [KV, g*n | T | T, hd]
            attn_mask=mask.repeat(group, 1), scale=a.attn_scale,  # [g*n, T]
        )  # [KV, g*n, hd]
        out = out.view(kv, group, n, hd).permute(2, 0, 1, 3).reshape(n, a.n_heads * hd)  # [n, H*hd]
        return self.wo(out)  # [n, dim]


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:  # [n, dim] -> [n, dim]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, pos0: int, cos: Tensor, sin: Tensor, mask: Tensor,
                k_cache: Tensor, v_cache: Tensor) -> Tensor:  # [n, dim] -> [n, dim]
        h = x + self.attention(self.attention_norm(x), pos0, cos, sin, mask, k_cache, v_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class ShardModel(nn.Module):
    """Layers [layers.start, layers.stop), plus the embedding on the head and norm/output on the tail."""

    def __init__(self, args: ModelArgs, layers: LayerRange) -> None:
        super().__init__()
        self.args, self.span = args, layers
        self.is_head, self.is_tail = layers.start == 0, layers.stop == args.n_layers
        # given its weight, Embedding skips its random init: torch's normal_ costs about 1.8 s on first use,
        # even on the meta device, and load_shard replaces every weight anyway
        self.tok_embeddings = (nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
                               if self.is_head else None)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(len(layers)))
        self.norm = RMSNorm(args.dim, args.norm_eps) if self.is_tail else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if self.is_tail else None
        # 1/ff per rotated pair; ones unless the GGUF has rope_freqs.weight (Llama 3).
        self.register_buffer("rope_inv_ff", torch.ones(args.rope_dims // 2))

    def new_cache(self, max_positions: int) -> KVCache:
        return KVCache.empty(self.args, len(self.layers), max_positions)

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:  # pos: [n] -> cos, sin: [n, rope_dims/2]
        a = self.args
        i = torch.arange(a.rope_dims // 2, dtype=torch.float64)
        inv_freq = a.rope_freq_scale * a.rope_base ** (-2.0 * i / a.rope_dims) * self.rope_inv_ff.double()
        angles = pos.double()[:, None] * inv_freq[None, :]  # [n, r/2]
        return angles.cos().float(), angles.sin().float()

    def forward(self, x: Tensor, pos0: int, cache: KVCache) -> Tensor:
        """x: token ids int64 [n] on the head, else hidden float32 [n, dim]. Returns hidden [n, dim]."""
        n = x.shape[0]
        pos = torch.arange(pos0, pos0 + n)  # [n]
        mask = torch.arange(pos0 + n)[None, :] <= pos[:, None]  # [n, T]: causal over cached + new
        cos, sin = self.rope(pos)
        h = self.tok_embeddings(x) if self.is_head else x  # [n, dim]
        for i, layer in enumerate(self.layers):
            h = layer(h, pos0, cos, sin, mask, cache.k[i], cache.v[i])
        return h

    def logits(self, h: Tensor) -> Tensor:  # tail only: [n, dim] -> [n, vocab]
        return self.output(self.norm(h))


def _gguf_names(layers: LayerRange, is_head: bool, is_tail: bool, args: ModelArgs) -> dict[str, str]:
    """GGUF tensor name -> ShardModel parameter name, for this shard only."""
    names = {"rope_freqs.weight": "rope_inv_ff"}
    if is_head:
        names["token_embd.weight"] = "tok_embeddings.weight"
    if is_tail:
        names["output_norm.weight"] = "norm.weight"
        names["output.weight"] = "output.weight"
    per_block = {
        "attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
        "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
        "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    }
    if args.qk_norm:
        per_block |= {"attn_q_norm": "attention.q_norm", "attn_k_norm": "attention.k_norm"}
    for j, i in enumerate(range(layers.start, layers.stop)):
        for src, dst in per_block.items():
            names[layer_tensor_name(i, f"{src}.weight")] = f"layers.{j}.{dst}.weight"
        if args.qkv_bias:
            for src in ("q", "k", "v"):
                names[layer_tensor_name(i, f"attn_{src}.bias")] = f"layers.{j}.attention.w{src}.bias"
    return names


def load_shard(path: str | Path, layers: LayerRange) -> ShardModel:
    """Build the shard for `layers`, dequantizing only its own tensors to float32.

    Raises:
        CallerError(MODEL_LOAD_FAILED): unsupported model, range past the last
        layer, or tensors missing or of the wrong shape.
    """
    reader = read_header(path)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    args = ModelArgs.from_gguf(reader)
    if layers.stop > args.n_layers:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"layers {layers} exceed the model's {args.n_layers}")
    with torch.device("meta"):
        model = ShardModel(args, layers)
    wanted = _gguf_names(layers, model.is_head, model.is_tail, args)
    tied = model.is_tail and is_tied(t.name for t in reader.tensors)
    state: dict[str, Tensor] = {"rope_inv_ff": torch.ones(args.rope_dims // 2)}
    for t in reader.tensors:
        qkv_bias = args.qkv_bias and t.name.split(".")[2:3] in (["attn_q"], ["attn_k"], ["attn_v"])
        if layer_of(t.name) is not None and t.name.endswith(".bias") and not qkv_bias:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"torch backend has no biases ({t.name})")
        if t.name not in wanted and not (tied and t.name == "token_embd.weight"):
            continue
        qtype = gguf.GGMLQuantizationType[t.type]
        weight = torch.from_numpy(np.array(dequantize(tensor_data(file, t), qtype), dtype=np.float32))
        if t.name == "rope_freqs.weight":
            weight = 1.0 / weight
        if t.name in wanted:
            state[wanted[t.name]] = weight
        if tied and t.name == "token_embd.weight":
            state["output.weight"] = weight  # one tensor even when this shard is head and tail
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF lacks tensors for {missing[:4]}")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF tensors do not fit the model: {exc}") from None
    return model.eval().requires_grad_(False)
