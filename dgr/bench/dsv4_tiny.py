"""Check the DeepSeek-V4 layout against llama.cpp itself, on a tiny random deepseek4 GGUF.

No DeepSeek-V4 weights are needed: `write_dsv4_gguf` writes the planner's
fixture layout (dgr.specgen.dsv4_layout) at toy sizes as a GGUF of random
tensors that dgr's llama.cpp loads and runs. `TINY` keeps what makes the
model hard to split: 4 residual streams across every layer boundary (mHC),
hash routing by token id in layers 0 to 2, window-only, CSA and HCA layers,
routed and shared experts, and one MTP layer after the trunk; it carries the
tiny models' tokenizer and chat template, so dgr serves it
(tests/test_dsv4_route.py). Loading it checks, on this machine:

1. names and shapes: llama.cpp refuses a file with a missing, misshapen or
   extra tensor, so a clean load means the fixture's tensor list is the one
   its deepseek4 loader creates;
2. KV per layer kind: the cache sizes llama.cpp logs against
   dgr.plan.rules's KV terms for the same model, with swa_full on and off;
3. layer ranges (llama.cpp patch 0009): the seam width and token-id
   sideband llama.cpp reports, what each range holds against the planner's
   charge, and every split at each layer boundary against the whole model
   (tests/test_dsv4_route.py asserts the same).

    python -m dgr.bench.dsv4_tiny

Prints a report; exits 1 if a check fails.
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

import gguf

from typing import Any

from dgr.backends.base import LayerRange
from dgr.plan import PlanParams, shard_cost
from dgr.plan.sizes import Node
from dgr.plan.sources import layout_from_json
from dgr.specgen import dsv4_layout as mk
from dgr.testing.reference import split_greedy
from dgr.testing.tiny_gguf import vocab_size, word_rows, write_layout_gguf

__all__ = ["EXTRA", "TINY", "main", "write_dsv4_gguf"]

CTX, SEQS = 1024, 2

# The tiny model, which tests/test_dsv4_route.py splits across nodes:
TINY = mk.Dims(
    hidden=64, vocab=vocab_size(), layers=6, heads=4, head_dim=128, rope_dim=16, q_lora=32, o_lora=16, o_groups=2,
    experts=4, experts_used=2, experts_shared=1, ff_exp=32, idx_heads=2, idx_dim=128, idx_topk=8,
    window=16, hc=4, hash_layers=3, context=4096, mtp=1,
)  # fmt: skip

# What llama.cpp's deepseek4 loader reads beyond the layout's metadata.
EXTRA = {
    "attention.layer_norm_rms_epsilon": 1e-6,
    "rope.freq_base": 10000.0,
    "attention.compress_rope_freq_base": 160000.0,
    "hyper_connection.epsilon": 1e-6,
    "hyper_connection.sinkhorn_iterations": 20,
    "expert_weights_scale": 1.5,
    "expert_weights_norm": True,
    "expert_gating_func": 4,  # sqrtsoftplus
    "swiglu_clamp_exp": 10.0,
    "leading_dense_block_count": 0,
}

# Everything f32 but the hash table; the planner is checked on structure, not on quant types.
TYPES = {role: "F32" for role in mk.RECIPES["q8_0"]["types"]} | {"hash": "I32"}


def write_dsv4_gguf(path: str | Path, d: mk.Dims = TINY) -> dict[str, Any]:
    """The layout at dims `d`, as a random GGUF; returns the layout priced as written (recipe "f32").

    With the tiny vocabulary (d.vocab == vocab_size()) the file gets its tokenizer, and the output
    rows of control and byte pieces are scaled down, so that greedy text is words.
    """
    vocab = d.vocab == vocab_size()
    rows = word_rows()[:, None] if vocab else 1.0  # numpy [vocab, 1]

    def value(name: str, role: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
        if role == "hash":
            return rng.integers(0, d.experts, shape, dtype=np.int32)
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        data = rng.standard_normal(shape) * 0.2  # large enough that every layer moves the greedy tokens
        if name == "output.weight":
            data = data * rows
        return data.astype(np.float32)

    return write_layout_gguf(mk.layout(d), path, extra=EXTRA, types=TYPES, value=value, vocab=vocab)


def main() -> int:
    from dgr.backends import clib
    from dgr.backends.llama_engine import LlamaEngine

    lib = clib.llama_lib()
    # dgr keeps only llama.cpp's last 40 log lines; the cache sizes come earlier than that.
    clib._LOG = collections.deque(maxlen=100_000)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dsv4-tiny.gguf"
        data = write_dsv4_gguf(path)
        n_tensors = len(gguf.GGUFReader(path).tensors)
        print(f"tiny deepseek4 GGUF: {TINY.layers} layers and {TINY.mtp} MTP layer, ratios {TINY.ratios}, "
              f"{TINY.hash_layers} hash-routed, {n_tensors} tensors")

        # 1. names and shapes: llama.cpp loads exactly this tensor list, and computes with it.
        clib._LOG.clear()
        e = LlamaEngine.load(path, n_threads=1, n_seq_max=SEQS, n_ctx_seq=CTX)
        log = "".join(clib._LOG)
        logits = e.eval(0, 0, np.arange(40, dtype=np.int32) % TINY.vocab, None)
        ok = logits is not None and bool(np.isfinite(logits).all()) and float(np.ptp(logits)) > 0
        print(f"1. llama.cpp loads the fixture's tensor list and computes finite logits: {'yes' if ok else 'NO'}")
        failures += not ok

        # 2. KV per layer kind: llama.cpp's logged cache sizes against the planner's terms, with
        # dgr's engine as it is (llama.cpp's default swa_full=true) and with swa_full=false.
        layout = layout_from_json(data, recipe="f32")
        failures += _kv_check(log, layout, e.n_batch, swa_full=True)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max, cparams.n_batch, cparams.n_ubatch = CTX * SEQS, SEQS, e.n_batch, e.n_batch
        cparams.kv_unified, cparams.swa_full, cparams.n_threads, cparams.n_threads_batch = False, False, 1, 1
        clib._LOG.clear()
        ctx = lib.llama_init_from_model(e._model, cparams)
        failures += _kv_check("".join(clib._LOG), layout, e.n_batch, swa_full=False)
        lib.llama_free(ctx)

        # 3. layer ranges: the seam llama.cpp reports, what each range holds, every split against the whole.
        head = LlamaEngine.load(path, layers=(0, 2), n_threads=1, n_seq_max=1, n_ctx_seq=64)
        width, tokens = head.n_embd_out, head.seam_tokens
        head.close()
        print(f"3. seam between layers: {width} floats (= {width // TINY.hidden} x {TINY.hidden}), "
              f"token ids beside it: {'yes' if tokens else 'NO'}")
        failures += (width, tokens) != (TINY.hc * TINY.hidden, True)
        e.close()
        params = PlanParams(context=CTX, sessions=SEQS)
        for a, b in ((0, 2), (2, 4), (4, TINY.layers), (0, TINY.layers)):
            r = LlamaEngine.load(path, layers=(a, b), n_threads=1, n_seq_max=1, n_ctx_seq=64)
            held = lib.llama_model_size(r._model)
            r.close()
            cost = shard_cost(layout, params, Node("n", 0), LayerRange(a, b))
            want = cost.weight_bytes + cost.global_bytes
            print(f"   range {a}:{b} holds {held:,} B of tensors, the planner charges {want:,} B: "
                  f"{'same' if held == want else 'DIFFERENT'}")
            failures += held != want
        prompt = list((np.arange(40) * 7 + 300) % TINY.vocab)
        ref = split_greedy(path, [TINY.layers], prompt, 16, n_threads=1, n_ctx=256, max_sessions=1)
        for sizes in ([1] * TINY.layers, [2, 2, 2], [4, 2], [3, 3]):
            got = split_greedy(path, sizes, prompt, 16, n_threads=1, n_ctx=256, max_sessions=1)
            diff = max(float(np.abs(x - y).max()) for x, y in zip(ref.logits, got.logits))
            same = got.tokens == ref.tokens and diff == 0.0
            print(f"   split {sizes}: tokens {'equal' if got.tokens == ref.tokens else 'DIFFER'}, "
                  f"logits max |diff| {diff}")
            failures += not same
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


def _kv_check(log: str, layout, ubatch: int, *, swa_full: bool) -> int:
    """Print llama.cpp's logged cache sizes next to the planner's; return the number that differ."""
    planned: dict[str, int] = {}
    for layer in layout.layers:
        for term in layer.kv:
            planned[term.name] = planned.get(term.name, 0) + SEQS * term.nbytes(CTX, "f16", ubatch, swa_full)
    sizes = _mib_all(log, r"llama_kv_cache: size = +([\d.]+) MiB \( *\d+ cells, +\d+ layers")
    raw = _mib(log, rf"llama_kv_cache: size = +([\d.]+) MiB \( *\d+ cells, +{TINY.layers} layers")
    logged = {
        "raw_k (window)": raw,
        "csa_k+indexer_k+hca_k": sum(sizes) - raw,
        "compressor states": sum(_mib_all(log, r"llama_dsv4_comp_state: +\w+ ratio .* size = +([\d.]+) MiB")),
    }
    want = {
        "raw_k (window)": planned.get("raw_k", 0),
        "csa_k+indexer_k+hca_k": sum(planned.get(k, 0) for k in ("csa_k", "indexer_k", "hca_k")),
        "compressor states": sum(planned.get(k, 0) for k in ("csa_state", "indexer_state", "hca_state")),
    }
    print(f"2. KV at context {CTX} x {SEQS} sequences, f16, swa_full={swa_full} (llama.cpp log vs dgr.plan.rules):")
    bad = 0
    for k, v in want.items():
        same = abs(logged[k] * 2**20 - v) < 0.006 * 2**20  # the log rounds to 0.01 MiB
        bad += not same
        print(
            f"   {k:<22} llama.cpp {logged[k]:8.2f} MiB   planner {v / 2**20:8.2f} MiB   {'same' if same else 'DIFFERENT'}"
        )
    return bad


def _mib(log: str, pattern: str) -> float:
    m = re.search(pattern, log)
    return float(m.group(1)) if m else 0.0


def _mib_all(log: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, log)]


if __name__ == "__main__":
    sys.exit(main())
