"""Which GGUF architectures a llama.cpp layer range may run, and why the others may not.

A range runs through the layer-range API of dgr's patched libllama
(dgr.backends.clib): the loader creates only the range's tensors from
the unmodified file, every builder computes layers [a, b) with the file's
numbering, input work (embedding scaling, position embeddings, input norms)
runs only on the range that starts at layer 0, and a range that stops early
returns the residual stream before the output norm. So no rule here says how
to split an architecture; this module only says which ones may be split:

- `CERTIFIED`: the families checked on real files or hand-made tiny models
  (tests/test_llama_shard.py, tests/test_families.py,
  tests/test_gemma3_270m.py, tests/test_dsv4_route.py);
- `TINY_CERTIFIED`: architectures whose tiny random model, made by libllama
  itself from one metadata table (dgr.testing.arch_models), splits at every
  boundary of its table bit for bit like the whole model
  (tests/test_certify.py runs them all; dgr.bench.certify reports every
  architecture, docs/perf/certify/);
  hybrids included, cut into stages of one layer kind too;
- `REFUSED`: architectures that do not split today, each with its reason,
  as dgr.bench.certify found it;
- any other architecture is refused as not yet certified.

libllama holds the same line itself: the patch series opts each certified
architecture in (`llm_arch_supports_layer_range`), and loading a range of any
other fails with its reason (tests/test_certify.py). This module says why, and
what dgr admits.

`shard_rule` is called by `dgr up` before it starts any process and by each
node at start, so a refusal is a clear error, never a crash in llama.cpp.

Left out: loading (dgr.backends.llama_engine), the planner's per-family
pricing (dgr.plan.rules).
"""

from __future__ import annotations

from dgr.errors import CallerError, Reason

__all__ = ["CERTIFIED", "REFUSED", "TINY_CERTIFIED", "shard_rule"]

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

# every variant (dense, MoE) of the table's tiny model split bit for bit at each boundary (tests/test_certify.py);
# hybrids at stages of one layer kind too
TINY_CERTIFIED: frozenset[str] = frozenset({
    "afmoe", "apertus", "arcee", "arctic", "baichuan", "bailingmoe", "bailingmoe2", "bailingmoe3", "bitnet",
    "bloom", "chatglm", "codeshell", "cohere2", "cohere2moe", "command-r", "dbrx", "deci", "deepseek",
    "deepseek2", "deepseek32", "deepseek4", "dots1", "dots3note", "ernie4_5", "ernie4_5-moe", "exaone",
    "exaone-moe", "exaone4", "falcon", "falcon-h1", "gemma", "gemma2", "gemma3", "glm-dsa", "glm4", "glm4moe",
    "gpt-oss", "gpt2", "gptneox", "granite", "granite_swa", "granitehybrid", "granitemoe", "grok", "grovemoe",
    "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais", "jais2", "jamba", "kimi-linear",
    "laguna", "lfm2", "lfm2moe", "llama", "llama4", "maincoder", "mamba", "mamba2", "maple", "mellum", "mimo2",
    "minicpm", "minicpm3", "minimax-01", "minimax-m2", "minimax-m3", "mistral3", "mistral4", "mpt",
    "muse-glimmer", "nanbeige", "nemotron", "nemotron_h", "nemotron_h_moe", "olmo", "olmo2", "olmoe", "openelm",
    "orion", "paddleocr", "pangu-embedded", "phi2", "phi3", "phimoe", "plamo", "plamo2", "plamo3", "plm",
    "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "qwen3vl",
    "qwen3vlmoe", "refact", "rwkv6", "seed_oss", "smallthinker", "smollm3", "spark2_5", "stablelm", "starcoder",
    "starcoder2", "step35", "xverse",
})

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
    "t5": "an encoder-decoder: the decoder's layers read the encoder's output",
    "t5encoder": "an encoder",
    "bert": "an encoder",
}


def shard_rule(arch: str) -> str:
    """What a layer range of `arch` is certified by.

    Raises:
        CallerError(MODEL_LOAD_FAILED): `arch` is refused (the message gives
        the reason) or not certified yet; `--backend llama` serves it whole.
    """
    if arch in CERTIFIED:
        return CERTIFIED[arch]
    if arch in TINY_CERTIFIED:
        return "its tiny model splits bit for bit at every tested boundary (tests/test_certify.py)"
    why = REFUSED.get(
        arch,
        "no test compares its splits with the whole model yet (tests/test_certify.py certifies each family)",
    )
    n = len(CERTIFIED.keys() | TINY_CERTIFIED)
    raise CallerError(
        Reason.MODEL_LOAD_FAILED,
        f"architecture {arch!r} cannot be split into layer ranges: {why} ({n} architectures are certified for "
        "ranges, see spec/layer-ranges.md; --backend llama serves it whole)",
    )

