"""Which GGUF architectures a llama.cpp layer range may run, and why the others may not.

A range runs through the layer-range API of dgr's patched libllama
(dgr.backends.llama_range): the loader creates only the range's tensors from
the unmodified file, every builder computes layers [a, b) with the file's
numbering, input work (embedding scaling, position embeddings, input norms)
runs only on the range that starts at layer 0, and a range that stops early
returns the residual stream before the output norm. So no rule here says how
to split an architecture; this module only says which ones may be split:

- `CERTIFIED`: architectures whose splits tests/test_families.py (and the
  default model's tests) check against the whole model, token for token and
  with logits max |diff| 0.0;
- `REFUSED`: architectures the API cannot split today, each with its reason:
  the seam between their layers is more than one row of n_embd floats
  (several residual streams, per-layer token inputs, a second stream), or
  their builder is not range-aware in the patch series;
- any other architecture is refused as not yet certified: the API may well
  run it, but no test has compared its splits with the whole model.

`shard_rule` is called by `dgr up` before it starts any process and by each
node at start, so a refusal is a clear error, never a crash in llama.cpp.

Left out: loading (dgr.backends.llama_engine), the planner's per-family
pricing (dgr.plan.rules).
"""

from __future__ import annotations

from dgr.errors import CallerError, Reason

__all__ = ["CERTIFIED", "REFUSED", "shard_rule"]

# architecture -> what its certification covers (tests/test_families.py builds a tiny model of each)
CERTIFIED: dict[str, str] = {
    "llama": "Llama 2/3, Mistral, SmolLM (the default model), Mixtral-style experts; tied output",
    "qwen2": "optional Q/K/V biases",
    "qwen3": "per-head Q/K norms",
    "phi3": "fused QKV and gate+up; long/short RoPE factors",
    "gemma": "sqrt(n_embd) input scaling on the head only",
    "gemma2": "sliding-window layers by global index (period 2); input scaling on the head only",
    "gemma3": "sliding-window layers by global index (period 6) with their own RoPE base; gemma-3-270m",
}

_STREAMS = "the residual stream between its layers is several streams (hyper-connections), not one row of n_embd"
_PER_LAYER = "its layers read per-layer token embeddings computed from the token ids before the first layer"
_NOT_RANGED = "its graph builder does not loop over the layer range in the patch series (llama/patches/)"
REFUSED: dict[str, str] = {
    "deepseek4": _STREAMS + " (hc_mult x n_embd), and hash-routed layers need the token ids",
    "glm5-next": _STREAMS,
    "hy_v4": _STREAMS,
    "qwen4exp": _STREAMS,
    "gemma3n": _PER_LAYER + ", and its layers carry several AltUp streams",
    "gemma4": _PER_LAYER,
    "talkie": "every layer reads the input embedding again (embd_skip): a second stream",
    "rwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "arwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "graniteswitch": "its input path picks adapter tokens before the first layer",
    "dflash": "a draft model fed by its target's hidden states",
    "eagle3": "a draft model fed by its target's hidden states",
    "t5": "an encoder-decoder: the decoder's layers read the encoder's output",
    "t5encoder": "an encoder",
    "bert": "an encoder",
    "hrm_text": _NOT_RANGED + " (hierarchical cycles over the layers)",
    "phimoe": _NOT_RANGED,
    "granitemoe": _NOT_RANGED,
    "lfm2moe": _NOT_RANGED,
    "minicpm": _NOT_RANGED,
    "mamba": _NOT_RANGED,
    "mamba2": _NOT_RANGED,
    "rwkv6": _NOT_RANGED,
}


def shard_rule(arch: str, *, nextn_layers: int = 0) -> str:
    """What a layer range of `arch` is certified for (a line of `CERTIFIED`).

    Raises:
        CallerError(MODEL_LOAD_FAILED): `arch` is refused (the message gives
        the reason) or not certified yet; `--backend llama` serves it whole.
    """
    del nextn_layers  # multi-token-prediction layers load with the range that ends at the last layer
    certified = ", ".join(sorted(CERTIFIED))
    if arch in CERTIFIED:
        return CERTIFIED[arch]
    why = REFUSED.get(
        arch,
        "no test compares its splits with the whole model yet (tests/test_families.py certifies each family)",
    )
    raise CallerError(
        Reason.MODEL_LOAD_FAILED,
        f"architecture {arch!r} cannot be split into layer ranges: {why} (certified for ranges: {certified}; "
        "--backend llama serves it whole)",
    )
