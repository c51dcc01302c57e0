"""Check the GLM-5.2 and Ornith layouts against the llama.cpp dgr ships, on tiny random GGUFs.

No weights are needed: dgr.specgen.audit_layouts writes each model's
tensor list from its sizes, so the same list at toy sizes becomes a GGUF
with random data (as dgr.bench.dsv4_tiny does for DeepSeek-V4-Flash). For
each of glm-dsa and qwen35moe this checks, in the llama.cpp of
llama-cpp-python:

1. the fixture's tensor list loads (llama.cpp refuses a missing, misshapen
   or extra tensor) and computes finite logits;
2. the cache sizes llama.cpp logs equal dgr.plan.rules's KV terms;
3. a head range, loaded from the full file through the layer-range API,
   outputs its residual after its last layer at hidden_size width; and
   whether a range of one layer kind loads from the full file and runs
   (glm-dsa: one that starts at a full-indexer layer; qwen35moe: ones of
   gated-delta-net layers only), each in a child process, because
   llama.cpp may kill it.

    python -m dgr.bench.audit_tiny

Prints a report; exits 1 if a check fails. Keys llama.cpp needs that the
planner does not (norm epsilons, RoPE sections) are added here only.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from dgr.plan.sources import layout_from_json
from dgr.specgen import audit_layouts as mk
from dgr.testing.tiny_gguf import write_layout_gguf

__all__ = ["check", "main"]

CTX, SEQS = 512, 2

GLM_TINY = mk.GLM | {
    "hidden": 64, "vocab": 256, "trunk": 10, "mtp": 0, "heads": 4, "q_lora": 32, "kv_lora": 32, "nope": 32,
    "rope": 16, "v_head": 32, "dense": 3, "ff_dense": 64, "experts": 4, "experts_used": 2, "ff_exp": 32,
    "idx_heads": 2, "idx_dim": 64, "idx_topk": 8,  # the indexer rotation is 64 wide at least
}  # fmt: skip
QWEN_TINY = mk.QWEN | {
    "hidden": 64, "vocab": 256, "layers": 8, "heads": 4, "kv_heads": 2, "head_dim": 32, "rope": 16,
    "lin_k_heads": 2, "lin_v_heads": 4, "lin_head": 16, "experts": 4, "experts_used": 2, "ff_exp": 32,
    "ff_shexp": 32,
}  # fmt: skip

EXTRA = {
    "glm-dsa": lambda g: {
        "attention.key_length": g["kv_lora"] + g["rope"],  # MLA as llama.cpp runs it: latent + rope
        "attention.value_length": g["kv_lora"],
        "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.layer_norm_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "expert_gating_func": 2,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
    },
    "qwen35moe": lambda q: {
        "context_length": 4096,  # the fixture leaves Ornith's unset: not verified
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "rope.dimension_sections": [q["rope"] // 4, q["rope"] // 4, q["rope"] // 2 - 2 * (q["rope"] // 4), 0],
    },
}


def _logged_kv_mib(log: str) -> float:
    """The KV and recurrent-state buffer sizes llama.cpp logged, summed (MiB)."""
    sizes = re.findall(r"(?:KV|RS) buffer size\s*=\s*([0-9.]+) MiB", log)
    return sum(float(s) for s in sizes)


def check(name: str, data: dict[str, Any], extra: dict[str, Any], tmp: Path) -> int:
    from dgr.backends import clib
    from dgr.backends.base import LayerRange
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.errors import DgrError

    failures = 0
    path = tmp / f"{name}.gguf"
    data = write_layout_gguf(data, path, extra=extra)
    n_tensors = len(gguf.GGUFReader(path).tensors)
    layout = layout_from_json(data, recipe="f32")
    print(f"tiny {data['architecture']} GGUF: {layout.n_layers} layers, kinds {sorted(layout.kinds())}, {n_tensors} tensors")
    clib._LOG.clear()
    try:
        e = LlamaEngine.load(path, n_threads=1, n_seq_max=SEQS, n_ctx_seq=CTX)
    except DgrError as exc:
        why = re.search(r"error loading model: (.*)", exc.message)
        print(f"1. llama.cpp loads the fixture's tensor list: NO ({why.group(1) if why else exc.message[-300:]})")
        return 1
    log = "".join(clib._LOG)
    try:
        logits = e.eval(0, 0, np.arange(40, dtype=np.int32) % 256, None)
        ok = logits is not None and bool(np.isfinite(logits).all()) and float(np.ptp(logits)) > 0
    except DgrError as exc:
        ok = False
        print(f"   eval failed: {exc.message[-300:]}")
    print(f"1. llama.cpp loads the fixture's tensor list and computes finite logits: {'yes' if ok else 'NO'}")
    failures += not ok
    want = sum(layer.kv_bytes(CTX, SEQS, "f16") for layer in layout.layers) / 2**20
    got = _logged_kv_mib(log)
    same = abs(got - want) < 0.01
    print(f"2. KV + state at context {CTX} x {SEQS} sequences, f16: llama.cpp {got:.2f} MiB, planner {want:.2f} MiB"
          f"  {'same' if same else 'DIFFERENT'}")  # fmt: skip
    if not same:
        print("   " + "\n   ".join(line for line in log.splitlines() if "buffer size" in line or "cells" in line))
    failures += not same
    e.close()
    starts = sorted(layout.shard_starts) if layout.shard_starts is not None else list(range(layout.n_layers))
    cut = next(s for s in starts if s >= 4)
    head = LayerRange(0, cut)
    what = f"3. head range {head} of the full file, residual output after its last layer"
    try:
        h = LlamaEngine.load(path, layers=(head.start, head.stop), n_threads=1, n_seq_max=1, n_ctx_seq=CTX)
        out = h.eval(0, 0, np.arange(4, dtype=np.int32), None)
        shape = None if out is None else out.shape
        print(f"{what}: {shape}")
        failures += shape != (4, layout.hidden_size)
        h.close()
    except DgrError as exc:
        print(f"{what}: no ({exc.reason.value}: {exc.message[-200:]})")
        failures += 1
    # Ranges of one layer kind only, each in a child: llama.cpp may kill the process.
    for a, b in _ONE_KIND[data["architecture"]]:
        child = subprocess.run(
            [sys.executable, "-m", "dgr.bench.audit_tiny", "--load", str(path), str(a), str(b)],
            check=False,
            capture_output=True,
            text=True,
        )
        kinds = sorted({layout.layers[i].kind for i in range(a, b)})
        why = re.findall(r"error loading model: (.*)", child.stderr)
        print(
            f"   layers {a}:{b} of the full file (kinds {kinds}): "
            + (
                "loads and runs"
                if child.returncode == 0
                else f"refused by llama.cpp: {why[-1]}"
                if why
                else f"the process dies (exit {child.returncode})"
            )
        )
    return failures


# glm-dsa: a middle range that starts at a full-indexer layer (what dgr's planner cuts), to see
# whether the layer-range API runs it (spec/glm-5.2.md task 2). qwen35moe: ranges of gated-delta-net
# layers only, which a planner without a constraint would produce.
_ONE_KIND = {"glm-dsa": [(6, 10)], "qwen35moe": [(0, 3), (4, 7)]}


def _load_and_run(path: Path, a: int, b: int) -> None:
    """Load layers [a, b) of the full GGUF at `path` through the layer-range API and run four positions."""
    from dgr.backends.llama_engine import LlamaEngine

    e = LlamaEngine.load(path, layers=(a, b), n_threads=1, n_seq_max=1, n_ctx_seq=CTX)
    if e.layer_start == 0:
        e.eval(0, 0, np.arange(4, dtype=np.int32), None)
    else:  # a later range takes the residual stream entering layer a
        e.eval(0, 0, None, np.zeros((4, e.n_embd), np.float32))
    e.close()


def main() -> int:
    if sys.argv[1:2] == ["--load"]:  # --load PATH A B
        _load_and_run(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    from dgr.backends import clib

    clib.llama_lib()
    clib._LOG = collections.deque(maxlen=100_000)  # the cache sizes come early in the log
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        failures += check("glm52-tiny", mk.glm_layout(GLM_TINY), EXTRA["glm-dsa"](GLM_TINY), Path(tmp))
        failures += check("ornith-tiny", mk.ornith_layout(QWEN_TINY), EXTRA["qwen35moe"](QWEN_TINY), Path(tmp))
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
