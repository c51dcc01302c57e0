"""Which GGUF architectures a llama.cpp layer range may run, and what each range needs.

The whole-model `llama` backend runs any architecture the vendored llama.cpp
loads: it needs no layer tricks. A *range* of layers (`llama_shard`) does, and
each trick depends on the architecture's graph builder (src/models/*.cpp in
llama-cpp-python 0.3.36's vendored llama.cpp). For every architecture on the
proven list, `SHARD_RULES` records what was read there:
- `layer_output`: the name the builder gives the residual stream after layer
  il (`cb(cur, NAME, il)`, named `NAME-{il}`), which a non-tail shard captures;
- `input_node`: a node that transforms `batch.embd` input (Gemma and Gemma 2
  scale it by sqrt(n_embd) whatever the input is); a non-head shard writes its
  hidden states into that node after it is computed, so the residual stream
  enters the first layer exactly as it left the previous shard;
- `swa_pattern`: the (period, dense_first) default that the loader's
  `load_swa_pattern` applies by *local* layer index; a shard file then carries
  the source's per-layer pattern as an array, sliced to its range, which the
  loader reads instead (src/llama-model.cpp:3434-3441), so every split keeps
  each layer's sliding-window kind and RoPE base;
- `typed_by_layers`: layer counts at which the loader switches a hparam by
  model size (Gemma 2/3 27B use another attention scale), which a shard's own
  block_count must not gain or lose.

Everything else is refused at node start by `shard_rule`, naming the
architecture and what is missing (`REFUSED` gives the reason for the known
cases). The table in spec/llama-layer-boundary.md cites the source lines.

Left out: loading (dgr.backends.llama_engine), writing shard files
(dgr.backends.shardfile).
"""

from __future__ import annotations

import math

import attrs

from dgr.errors import CallerError, Reason

__all__ = ["REFUSED", "SHARD_RULES", "ShardRule", "check_split", "shard_rule", "swa_layers"]


@attrs.frozen
class ShardRule:
    """What a layer range of one architecture needs (see the module docstring)."""

    arch: str
    source: str  # vendored file:lines the rule rests on
    layer_output: str = "l_out"
    input_node: str | None = None
    swa_pattern: tuple[int, bool] | None = None  # (default period, dense_first) of load_swa_pattern
    typed_by_layers: tuple[int, ...] = ()  # block counts with a different f_attention_scale
    notes: str = ""


SHARD_RULES: dict[str, ShardRule] = {
    r.arch: r
    for r in (
        ShardRule(
            "llama",
            "src/models/llama.cpp:108 (input unscaled), :224 (l_out), :37-46 (tied output), :66 (rope_freqs), "
            ":79-82 + :196-216 (experts)",
            notes="Llama 2/3, Mistral, SmolLM, Mixtral (experts are per-layer tensors); rope_freqs kept as a global tensor",
        ),
        ShardRule(
            "qwen2",
            "src/models/qwen2.cpp:62 (input unscaled), :130 (l_out), :38 + src/llama-model.cpp:3428-3430 (QKV bias)",
            notes="optional Q/K/V biases are per-layer tensors",
        ),
        ShardRule(
            "qwen3",
            "src/models/qwen3.cpp:62 (input unscaled), :138 (l_out), :39-40 (Q/K norms)",
            notes="per-head Q/K RMS norms are per-layer tensors",
        ),
        ShardRule(
            "phi3",
            "src/models/phi3.cpp:76 (input unscaled), :169 (l_out), :13-24 (SWA off), :45-54 (fused QKV/up, "
            "global rope factors)",
            notes="fused attn_qkv and gate+up; rope_factors_long/short are global tensors",
        ),
        ShardRule(
            "gemma",
            "src/models/gemma.cpp:49-50 (sqrt(n_embd) on every input), :118 (l_out), :20 (tied output)",
            input_node="inp_scaled",
        ),
        ShardRule(
            "gemma2",
            "src/models/gemma2.cpp:68-69 (sqrt(n_embd) on every input), :149 (l_out), :4-6 (SWA, period 2), "
            ":25-27 (27B attention scale by layer count), src/llama-model.cpp:2329-2335 (RoPE base by is_swa)",
            input_node="inp_scaled",
            swa_pattern=(2, False),
            typed_by_layers=(46,),
        ),
        ShardRule(
            "gemma3",
            "src/models/gemma3.cpp:91 (token input only scaled), :193 (l_out), :4-9 (SWA, period 6, "
            "rope.freq_base_swa), :29-31 (27B attention scale by layer count), "
            "src/llama-model.cpp:2329-2335 (RoPE base by is_swa)",
            swa_pattern=(6, False),
            typed_by_layers=(62,),
        ),
    )
}

# Architectures known not to run as a range, and why (the generic refusal covers the rest).
_EMBD_SCALE = (
    "f_embedding_scale multiplies batch.embd input too (src/llama-graph.cpp:2447-2452), and the builder names "
    "no capturable layer output or was not checked"
)
_NO_L_OUT = "its graph builder names no layer output (`l_out`) to capture"
_MTP = "multi-token-prediction layers sit after the last layer (src/llama-hparams.cpp:348-350) and need the tail's own graph"
REFUSED: dict[str, str] = {
    "granite": _EMBD_SCALE,
    "granitemoe": _EMBD_SCALE + "; " + _NO_L_OUT,
    "grok": _EMBD_SCALE,
    "minicpm": _EMBD_SCALE + "; " + _NO_L_OUT,
    "hrm_text": _EMBD_SCALE,
    "granitehybrid": _EMBD_SCALE,
    "graniteswitch": _EMBD_SCALE,
    "granite_swa": _EMBD_SCALE,
    "phimoe": _NO_L_OUT + " (src/models/phimoe.cpp)",
    "lfm2moe": _NO_L_OUT + " (src/models/lfm2moe.cpp)",
    "mistral4": _NO_L_OUT + " (src/models/mistral4.cpp)",
    "hunyuan-dense": _NO_L_OUT + " (src/models/hunyuan-dense.cpp)",
    "nemotron_h_moe": _NO_L_OUT + " (src/models/nemotron-h-moe.cpp)",
    "mamba": _NO_L_OUT + " (recurrent state, src/models/mamba-base.cpp)",
    "mamba2": _NO_L_OUT + " (recurrent state, src/models/mamba2.cpp)",
    "rwkv6": _NO_L_OUT + " (recurrent state)",
    "rwkv7": _NO_L_OUT + " (recurrent state)",
    "deepseek4": "DeepSeek-V4's compressed-attention caches and hash-routed layers need a CSA layer in every shard "
    "and the tail's MTP layers (spec/deepseek-v4-flash.md); " + _MTP,
    "glm4moe": _MTP,
    "qwen3next": _MTP,
    "mimo2": _MTP,
}


def shard_rule(arch: str, *, nextn_layers: int = 0) -> ShardRule:
    """The rule for a layer range of `arch`.

    Raises:
        CallerError(MODEL_LOAD_FAILED): `arch` is not on the proven list, or the
        file has multi-token-prediction layers; the message names the
        architecture and what is missing.
    """
    proven = ", ".join(sorted(SHARD_RULES))
    if nextn_layers > 0:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"architecture {arch!r} cannot be split into layer ranges: the file has {nextn_layers} "
            f"multi-token-prediction layer(s): {_MTP} (proven for ranges: {proven}; "
            "--backend llama serves it whole)",
        )
    rule = SHARD_RULES.get(arch)
    if rule is None:
        why = REFUSED.get(
            arch,
            "its graph builder was not checked for input scaling of batch.embd, the name of the layer-output "
            "node, and layer-index-dependent behaviour",
        )
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"architecture {arch!r} cannot be split into layer ranges: {why} (proven for ranges: {proven}; "
            "--backend llama serves it whole)",
        )
    return rule


def check_split(rule: ShardRule, n_layer: int, start: int, stop: int, *, n_embd: int, n_head: int, head_dim: int) -> None:
    """Refuse a range whose block count would switch a size-typed hparam (Gemma 2/3 27B).

    The loader picks f_attention_scale by the file's block_count
    (gemma2.cpp:25-27, gemma3.cpp:29-31): 1/sqrt(n_embd/n_head) for 27B,
    else 1/sqrt(head_dim). A shard of 27B would get the other one.

    Raises:
        CallerError(MODEL_LOAD_FAILED)
    """
    if not rule.typed_by_layers or n_head <= 0 or head_dim <= 0:
        return
    whole = (start, stop) == (0, n_layer)
    if whole or math.isclose(n_embd / n_head, head_dim):
        return
    if n_layer in rule.typed_by_layers or (stop - start) in rule.typed_by_layers:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"architecture {rule.arch!r}: llama.cpp sets the attention scale by block count "
            f"({rule.typed_by_layers}), so a {stop - start}-layer shard of this {n_layer}-layer model would "
            "compute with the wrong scale; serve it whole (--backend llama)",
        )


def swa_layers(rule: ShardRule, n_layer: int, pattern: object) -> list[bool] | None:
    """The source's per-layer sliding-window flags, as llama.cpp's load_swa_pattern derives them.

    `pattern` is the file's `{arch}.attention.sliding_window_pattern` value:
    an array (one flag per layer, used as is), an integer period, or None
    (the architecture's default period). None when the rule has no pattern.
    """
    if rule.swa_pattern is None:
        return None
    if isinstance(pattern, (list, tuple)):
        return [bool(x) for x in pattern]
    n_pattern, dense_first = rule.swa_pattern
    if pattern is not None:
        n_pattern = int(pattern)
    # src/llama-hparams.cpp:8-17, set_swa_pattern
    if dense_first:
        return [n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer)]
    return [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer)]
