"""Which GGUF architectures a llama.cpp layer range may run, and why the others may not.

A range runs through the layer-range API of dgr's patched libllama
(dgr.backends.llama_range): the loader creates only the range's tensors from
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
- `REFUSED`: architectures that do not split today, each with its reason,
  as dgr.bench.certify found it;
- `EVERY_KIND`: certified hybrids whose stages must each hold every layer
  kind (a stage of recurrent layers only, or without its architecture's
  special layers, dies in llama.cpp). Those whose layer kinds dgr reads from
  the file (`KIND_CHECKED`: gated delta-net and attention, dgr.gguf_meta) run
  where every range holds every kind (`check_every_kind`, at node start);
  the others are refused for ranges with that reason;
- any other architecture is refused as not yet certified.

`shard_rule` is called by `dgr up` before it starts any process and by each
node at start, so a refusal is a clear error, never a crash in llama.cpp.

Left out: loading (dgr.backends.llama_engine), the planner's per-family
pricing (dgr.plan.rules).
"""

from __future__ import annotations

from dgr.errors import CallerError, Reason
from dgr.gguf_meta import RECURRENT_HYBRID_ARCHS

__all__ = ["CERTIFIED", "EVERY_KIND", "KIND_CHECKED", "REFUSED", "TINY_CERTIFIED", "check_every_kind", "shard_rule"]

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

# every variant (dense, MoE) of the table's tiny model split bit for bit at each boundary (tests/test_certify.py)
TINY_CERTIFIED: frozenset[str] = frozenset({
    "afmoe", "apertus", "arcee", "arctic", "baichuan", "bailingmoe", "bailingmoe2", "bloom", "chatglm",
    "codeshell", "cohere2", "cohere2moe", "command-r", "dbrx", "deci", "deepseek", "deepseek2", "deepseek32",
    "deepseek4", "dots1", "ernie4_5", "ernie4_5-moe", "exaone", "exaone-moe", "exaone4", "falcon", "falcon-h1",
    "gemma", "gemma2", "gemma3", "glm-dsa", "glm4", "glm4moe", "gpt-oss", "gpt2", "gptneox", "granite",
    "granite_swa", "granitemoe", "grok", "grovemoe", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "hy_v3",
    "internlm2", "jais", "jais2", "laguna", "llama", "maincoder", "mamba", "mamba2", "mellum", "mimo2",
    "minicpm", "minicpm3", "minimax-m2", "minimax-m3", "mistral3", "mistral4", "mpt", "muse-glimmer",
    "nanbeige", "nemotron", "olmo", "olmo2", "olmoe", "openelm", "orion", "paddleocr", "pangu-embedded", "phi2",
    "phi3", "phimoe", "plamo", "plamo3", "plm", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe",
    "qwen3vlmoe", "refact", "seed_oss", "smollm3", "spark2_5", "stablelm", "starcoder", "starcoder2", "step35",
    "xverse",
})

# certified at the table's boundaries, where every stage holds every layer kind; other stages die in llama.cpp
EVERY_KIND: frozenset[str] = frozenset({
    "bailingmoe3", "dots3note", "granitehybrid", "kimi-linear", "lfm2", "lfm2moe", "llama4", "maple",
    "minimax-01", "nemotron_h", "nemotron_h_moe", "plamo2", "qwen35", "qwen35moe", "qwen3next", "smallthinker",
})

# the EVERY_KIND hybrids whose layer kinds dgr reads from the file (dgr.gguf_meta.is_recurrent_layer)
KIND_CHECKED: frozenset[str] = frozenset(RECURRENT_HYBRID_ARCHS)

_STREAMS = "the residual stream between its layers is several streams (hyper-connections), not one row of n_embd"
_PER_LAYER = "its layers read per-layer token embeddings computed from the token ids before the first layer"
_MISCOUNT = "its loader decides a layer's tensors from another tensor of that layer, so ranges miscount the file"
REFUSED: dict[str, str] = {
    "glm5-next": _STREAMS,
    "hy_v4": _STREAMS,
    "qwen4exp": _STREAMS,
    "gemma3n": _PER_LAYER + ", and its layers share KV across the model",
    "gemma4": _PER_LAYER,
    "talkie": "every layer reads the input embedding again (embd_skip): a second stream",
    "rwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "arwkv7": "every layer reads the first layer's value (v_first): a second stream",
    "qwen3vl": "its builder reads the token embedding's shape on every range (qwen3vl.cpp)",
    "bitnet": "its output head reads the token embedding directly (bitnet.cpp)",
    "jamba": _MISCOUNT + " (its MoE layers)",
    "kimi-k3": _MISCOUNT,
    "rwkv6": "its loader asserts on optional tensors of layers outside the range",
    "cogvlm": "its builder picks the text or vision expert by whether the batch holds tokens",
    "hrm_text": "its caches alias layers across the model's cycles",
    "graniteswitch": "its input path picks adapter tokens before the first layer",
    "dflash": "a draft model fed by its target's hidden states",
    "eagle3": "a draft model fed by its target's hidden states",
    "t5": "an encoder-decoder: the decoder's layers read the encoder's output",
    "t5encoder": "an encoder",
    "bert": "an encoder",
}
_EVERY_KIND_WHY = (
    "a stage that lacks one of its layer kinds (recurrent or attention, or its special layers) dies in llama.cpp, "
    "and dgr does not read this hybrid's layer kinds from the file yet, so node start cannot check a range's kinds "
    "(certified where every stage holds every kind: dgr.bench.certify)"
)


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
    if arch in KIND_CHECKED:
        return "its tiny model splits bit for bit where every stage holds every layer kind (check_every_kind)"
    why = _EVERY_KIND_WHY if arch in EVERY_KIND else REFUSED.get(
        arch,
        "no test compares its splits with the whole model yet (tests/test_certify.py certifies each family)",
    )
    n = len(CERTIFIED.keys() | TINY_CERTIFIED | KIND_CHECKED)
    raise CallerError(
        Reason.MODEL_LOAD_FAILED,
        f"architecture {arch!r} cannot be split into layer ranges: {why} ({n} architectures are certified for "
        "ranges, see spec/layer-ranges.md; --backend llama serves it whole)",
    )


def check_every_kind(arch: str, kinds: list[str], ranges: list[tuple[int, int]]) -> None:
    """Refuse a range of a KIND_CHECKED hybrid that lacks one of the model's layer kinds.

    `kinds` is each layer's kind, as dgr.gguf_meta reads them from the file. A
    stage without recurrent layers, or without attention layers, dies in
    llama.cpp (its memory of that kind has no buffer: GGML_ASSERT(buffer)).

    Raises:
        CallerError(MODEL_LOAD_FAILED): a range lacks a kind, naming it.
    """
    every = sorted(set(kinds))
    for start, stop in ranges:
        missing = sorted(set(every) - set(kinds[start:stop]))
        if missing:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED,
                f"architecture {arch!r}: layers {start}:{stop} hold no {' or '.join(missing)} layer; every range of "
                f"this hybrid must hold each of its layer kinds ({', '.join(every)}), or llama.cpp dies creating "
                "its memory",
            )
