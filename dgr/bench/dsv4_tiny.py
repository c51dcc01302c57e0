"""Check the DeepSeek-V4 layout against llama.cpp itself, on a tiny random deepseek4 GGUF.

No DeepSeek-V4 weights are needed: dgr.specgen.dsv4_layout describes the
model with its sizes as parameters, so the same tensor list, at toy sizes,
becomes a GGUF with random data. Loading it in the llama.cpp that
llama-cpp-python ships checks, on this machine:

1. names and shapes: llama.cpp refuses a file with a missing, misshapen or
   extra tensor, so a clean load means the fixture's tensor list is the one
   its deepseek4 loader creates;
2. KV per layer kind: the cache sizes llama.cpp logs against
   dgr.plan.rules's KV terms for the same model;
3. what breaks for a layer range, loaded from the full file through the
   layer-range API (see spec/deepseek-v4-flash.md; dgr.backends.llama_arch
   refuses deepseek4 ranges): the width llama.cpp takes as embeddings input
   vs the width of the residual stream between layers; a range starting
   after the hash-routed layers; the residual a range outputs after its
   last layer; and ranges that lack a CSA or an HCA layer (each run in a
   child process, because llama.cpp kills the process).

    python -m dgr.bench.dsv4_tiny

Prints a report; exits 1 if a check fails.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import numpy as np

import gguf

from dgr.plan.sources import layout_from_json
from dgr.specgen import dsv4_layout as mk
from dgr.testing.tiny_gguf import write_layout_gguf

__all__ = ["kinds_probe", "main", "write_gguf"]

TINY = mk.Dims(
    hidden=64, vocab=256, layers=6, heads=4, head_dim=128, rope_dim=16, q_lora=32, o_lora=16, o_groups=2,
    experts=4, experts_used=2, experts_shared=1, ff_exp=32, idx_heads=2, idx_dim=128, idx_topk=8,
    window=16, hc=4, hash_layers=3, context=4096,
)  # fmt: skip
CTX, SEQS = 1024, 2

# Everything f32 but the hash table; the planner is checked on structure, not on quant types.
TYPES = {role: "F32" for role in mk.RECIPES["q8_0"]["types"]} | {"hash": "I32"}


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


def write_gguf(d: mk.Dims, path: Path) -> dict:
    """The fixture's layout at dims `d`, as a random GGUF; the hash-routing table holds expert ids."""

    def value(name: str, role: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
        if role == "hash":
            return rng.integers(0, d.experts, shape, dtype=np.int32)
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    return write_layout_gguf(mk.layout(d), path, extra=EXTRA, types=TYPES, value=value)


def main() -> int:
    from dgr.backends import gguf_text
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.errors import DgrError

    lib = gguf_text.llama_lib()
    # dgr keeps only llama.cpp's last 40 log lines; the cache sizes come earlier than that.
    gguf_text._LOG = collections.deque(maxlen=100_000)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dsv4-tiny.gguf"
        data = write_gguf(TINY, path)
        n_tensors = len(gguf.GGUFReader(path).tensors)
        print(f"tiny deepseek4 GGUF: {TINY.layers} layers, ratios {TINY.ratios}, {n_tensors} tensors")

        # 1. names and shapes: llama.cpp loads exactly this tensor list, and computes with it.
        gguf_text._LOG.clear()
        e = LlamaEngine.load(path, n_threads=1, n_seq_max=SEQS, n_ctx_seq=CTX)
        log = "".join(gguf_text._LOG)
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
        gguf_text._LOG.clear()
        ctx = lib.llama_init_from_model(e._model, cparams)
        failures += _kv_check("".join(gguf_text._LOG), layout, e.n_batch, swa_full=False)
        lib.llama_free(ctx)

        # 3. the layer-range technique.
        model = e._model
        n_in, n_out = lib.llama_model_n_embd_inp(model), lib.llama_model_n_embd_out(model)
        print(f"3. embeddings input width {n_in}, residual width between layers {n_out} (= {n_out // n_in} x {n_in})")
        failures += n_out != TINY.hc * TINY.hidden
        e.close()
    # Ranges of the full file, each in a child: deepseek4's builder is not range-aware in dgr's
    # patch series, and llama.cpp may kill the process.
    for hash_layers, a, b, what in (
        (TINY.hash_layers, 3, 6, "layers 3:6 of the full file (after the hash-routed layers)"),
        (0, 2, 4, "middle range 2:4 of a model without hash layers"),
        (TINY.hash_layers, 0, 4, "head range 0:4"),
    ):
        child = subprocess.run(
            [sys.executable, "-m", "dgr.bench.dsv4_tiny", "--range", str(hash_layers), str(a), str(b)],
            check=False,
            capture_output=True,
            text=True,
        )
        said = child.stdout.strip().splitlines()
        if child.returncode in (0, _UNEXPECTED):
            print(f"   {what}: " + "; ".join(said))
        else:
            print(f"   {what}: " + "".join(f"{x}; " for x in said) + f"the process dies (exit {child.returncode})")
        failures += child.returncode == _UNEXPECTED
    # Ranges that lack a CSA or an HCA layer, each run in a child: llama.cpp may kill the process.
    for layers, a, b, what in (
        (2, 0, 2, "window-only layers 0:2"),
        (3, 0, 3, "layers 0:3, no HCA"),
        (6, 3, 4, "one HCA layer 3:4"),
        (6, 2, 4, "layers 2:4, CSA and HCA"),
    ):
        child = subprocess.run(
            [sys.executable, "-m", "dgr.bench.dsv4_tiny", "--kinds", str(layers), str(a), str(b)],
            check=False,
            capture_output=True,
            text=True,
        )
        print(
            f"   a deepseek4 model/range of {what}: "
            + ("loads and runs" if child.returncode == 0 else f"the process dies (exit {child.returncode})")
        )
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


_UNEXPECTED = 3  # range_probe's exit status when a step succeeded that should not


def range_probe(hash_layers: int, a: int, b: int) -> int:
    """Load layers [a, b) of the tiny model from the full file through the layer-range API and feed them.

    Prints what happened, a line per step (flushed: llama.cpp may kill the process). Returns
    `_UNEXPECTED` if a step succeeded that should not (a range after the hash-routed layers loads,
    or a later range takes the residual at its full hyper-connection width), else 0.
    """
    from dgr.backends.gguf_text import llama_lib
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.errors import DgrError

    lib = llama_lib()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dsv4-tiny.gguf"
        write_gguf(attrs.evolve(TINY, hash_layers=hash_layers), path)
        try:
            e = LlamaEngine.load(path, layers=(a, b), n_threads=1, n_seq_max=1, n_ctx_seq=CTX)
        except DgrError as exc:
            why = re.search(r"error loading model: (.*)", exc.message)
            print(f"refused by llama.cpp: {why.group(1) if why else exc.message[:200]}", flush=True)
            return 0
        bad = 0
        if a == 0:
            try:
                out = e.eval(0, 0, np.arange(4, dtype=np.int32), None)
                print(f"residual output after its last layer: {None if out is None else out.shape}", flush=True)
            except DgrError as exc:
                print(f"residual output after its last layer: no ({exc.reason.value}: {exc.message})", flush=True)
        elif hash_layers:  # llama.cpp refused a shard after the hash-routed layers: not expected to load
            print("loads (unexpected)", flush=True)
            bad = _UNEXPECTED
        else:
            n_in, n_out = lib.llama_model_n_embd_inp(e._model), lib.llama_model_n_embd_out(e._model)
            pos = 0
            try:
                e.eval(0, pos, None, np.zeros((2, n_out), np.float32))
                print(f"given the {n_out}-wide residual: accepted (unexpected)", flush=True)
                bad, pos = _UNEXPECTED, 2
            except DgrError as exc:
                print(f"given the {n_out}-wide residual: refused ({exc.reason.value}: {exc.message})", flush=True)
            e.eval(0, pos, None, np.zeros((2, n_in), np.float32))
            print(f"given {n_in} values per position: runs (on {n_out // n_in} copies of one stream)", flush=True)
        e.close()
    return bad


def kinds_probe(layers: int, a: int, b: int) -> int:
    """Load layers [a, b) of a tiny model with no hash layers and run four positions through them.

    The range comes from the full file through the layer-range API; [0, layers) is the whole model.
    """
    from dgr.backends.llama_engine import LlamaEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dsv4-tiny.gguf"
        write_gguf(attrs.evolve(TINY, layers=layers, hash_layers=0), path)
        rng = None if (a, b) == (0, layers) else (a, b)
        e = LlamaEngine.load(path, layers=rng, n_threads=1, n_seq_max=1, n_ctx_seq=CTX)
        if a == 0:
            e.eval(0, 0, np.arange(4, dtype=np.int32), None)
        else:
            e.eval(0, 0, None, np.zeros((4, e.n_embd), np.float32))
        e.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kinds"]:
        sys.exit(kinds_probe(*map(int, sys.argv[2:5])))
    if sys.argv[1:2] == ["--range"]:  # --range HASH_LAYERS A B
        sys.exit(range_probe(*map(int, sys.argv[2:5])))
    sys.exit(main())
