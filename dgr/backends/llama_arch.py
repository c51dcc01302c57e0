"""Which GGUF architectures a llama.cpp layer range may run, and why the others may not.

A range runs through the layer-range API of dgr's patched libllama
(dgr.backends.clib): the loader creates only the range's tensors from
the unmodified file, every builder computes layers [a, b) with the file's
numbering, input work (embedding scaling, position embeddings, input norms)
runs only on the range that starts at layer 0, and a range that stops early
returns the residual stream before the output norm. So no rule here says how
to split an architecture, only which ones dgr admits.

The list of what may be split is libllama's own: the patch series opts each
architecture in (`llm_arch_supports_layer_range`, read through
`llama_arch_supports_layer_range`) where a test proves its split, and loading
a range of any other fails with its reason. dgr keeps no copy of it. What
dgr adds, and what decides what it admits, is its certification:

- `CERTIFIED`: the families checked on real files or hand-made tiny models
  (tests/test_llama_shard.py, tests/test_families.py,
  tests/test_gemma3_270m.py, tests/test_dsv4_route.py);
- `tiny_certified()`: the architectures of the tiny-model table
  (dgr.testing.arch_table) that libllama opts in: tests/test_certify.py
  splits each, made by libllama itself, at every boundary of its table and
  requires the whole model's bits (hybrids also cut into stages of one
  layer kind); dgr.bench.certify reports every architecture
  (docs/perf/certify/);
- `REFUSED`: architectures that do not split today, each with its reason, as
  dgr.bench.certify found it; libllama refuses them too (tests/test_certify.py);
- any other architecture is refused as not yet certified.

`shard_rule` is called by `dgr up` before it starts any process and by each
node at start, so a refusal is a clear error, never a crash in llama.cpp.

Left out: loading (dgr.backends.llama_engine), the planner's per-family
pricing (dgr.plan.rules).
"""

from __future__ import annotations

from dgr.backends.clib import arch_takes_ranges
from dgr.errors import CallerError, Reason

__all__ = ["CERTIFIED", "REFUSED", "shard_rule", "tiny_certified"]

# architecture -> what its certification covers (tests/test_families.py builds a tiny model of each)
CERTIFIED: dict[str, str] = {
    "llama": "Llama 2/3, Mistral, SmolLM (the default model), Mixtral-style experts; tied output",
    "qwen2": "optional Q/K/V biases",
    "qwen3": "per-head Q/K norms",
    "qwen3moe": "qwen3's layers with a routed mixture of experts; a 3-node dgr up answers as one node",
    "phi3": "fused QKV and gate+up; long/short RoPE factors",
    "gemma": "sqrt(n_embd) input scaling on the head only",
    "gemma2": "sliding-window layers by global index (period 2); input scaling on the head only",
    "gemma3": "sliding-window layers by global index (period 6) with their own RoPE base; gemma-3-270m",
    "deepseek4": "DeepSeek-V4's real tensor layout: a 4 x n_embd seam (mHC), hash-routed layers fed the token ids "
    "beside the hidden states, window/CSA/HCA layers, MTP on the tail; split at every boundary, and a 3-node dgr up "
    "answers as one node (tests/test_dsv4_route.py)",
}

_STREAMS = ("its residual stream is several streams (hyper-connections), and dgr's patch series gives only deepseek4's "
            "builder the wider seam")
_PER_LAYER = "its layers read per-layer token embeddings computed from the token ids before the first layer"
REFUSED: dict[str, str] = {
    "glm5-next": _STREAMS,
    "hy_v4": _STREAMS,
    "qwen4exp": _STREAMS,
    "gemma3n": _PER_LAYER + ", and its layers share KV across the model",
    "gemma4": _PER_LAYER,
    "talkie": "every layer reads the input embedding again (embd_skip): a second stream",
    "rwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "arwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "kimi-k3": "its attention residuals bank earlier layers' inputs (resi_stack) and mix them into later layers: "
    "a growing second stream",
    "cogvlm": "its builder picks the text or vision expert by whether the batch holds tokens",
    "hrm_text": "its caches alias layers across the model's cycles",
    "graniteswitch": "its input path picks adapter tokens before the first layer",
    "dflash": "a draft model fed by its target's hidden states",
    "eagle3": "a draft model fed by its target's hidden states",
    "rwkv6qwen2": "its whole tiny model crashes in llama.cpp itself (SIGSEGV when the graph is reserved), so no split "
    "can be compared with it",
    "t5": "an encoder-decoder: the decoder's layers read the encoder's output",
    "t5encoder": "an encoder",
    "bert": "an encoder",
}


def tiny_certified() -> frozenset[str]:
    """The architectures of the tiny-model table (dgr.testing.arch_table) that libllama loads ranges of:
    tests/test_certify.py splits each at every boundary of its table and requires the whole model's bits."""
    from dgr.testing.arch_table import ARCHS  # data only; deferred so that a node imports it when it checks

    return frozenset(a for a in ARCHS if a not in REFUSED and arch_takes_ranges(a))


def shard_rule(arch: str) -> str:
    """What a layer range of `arch` is certified by: libllama must load ranges of it (its own gate) and dgr's
    certification must cover it.

    Raises:
        CallerError(MODEL_LOAD_FAILED): `arch` is refused (the message gives
        the reason) or not certified yet; `--backend llama` serves it whole.
    """
    from dgr.testing.arch_table import ARCHS

    takes = arch_takes_ranges(arch)
    if takes and arch in CERTIFIED:
        return CERTIFIED[arch]
    if takes and arch in ARCHS and arch not in REFUSED:
        return "its tiny model splits bit for bit at every tested boundary (tests/test_certify.py)"
    why = REFUSED.get(arch) or (
        "no test compares its splits with the whole model yet (tests/test_certify.py certifies each family)" if takes
        else "the installed libllama does not load a layer range of it")
    raise CallerError(
        Reason.MODEL_LOAD_FAILED,
        f"architecture {arch!r} cannot be split into layer ranges: {why} (see spec/layer-ranges.md for the "
        "certified architectures; --backend llama serves it whole)",
    )
