"""Check `dgr plan` against the memory real llama.cpp shards take.

For the default model split into 1, 2 and 3 shards, each shard runs in a
fresh process the way a dgr llama_shard node holds it: dgr's node stack
imported, the shard's layer range loaded straight from the full GGUF through
the layer-range API (dgr.backends.llama_engine, the whole model through
llama.cpp's own loader) with one sequence per session, a full-ubatch
prefill and a few decode steps per session. The process's VmRSS is then
compared with the planner's total for the same node (dgr.plan.shard_cost).

It also prints the two constants the planner takes from here: the RSS of a
node process before any model (LLAMA_CPU_RUNTIME_BYTES) and llama.cpp's
"CPU compute buffer size" line (dgr.plan.rules.gguf_compute_rule).

    python -m dgr.bench.plan_overhead [--context 2048] [--sessions 2]

Not a test: it needs llama-cpp-python and takes a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dgr.backends.base import LayerRange
from dgr.models import default_model_path
from dgr.plan import (
    LLAMA_CPU_RUNTIME_BYTES,
    Node,
    PlanParams,
    format_size,
    plan_even,
    shard_cost,
)
from dgr.plan.sources import layout_from_gguf

__all__ = ["main", "run_shard"]

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, numpy as np
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
import dgr.node.app, dgr.node.run  # the node stack, as a real node has it
from dgr.backends import clib
from dgr.backends.llama_engine import LlamaEngine
clib.llama_lib()
base = rss()
path, a, b, n_layers, ctx, sessions = sys.argv[1], *map(int, sys.argv[2:7])
is_head = a == 0
layers = None if (a, b) == (0, n_layers) else (a, b)  # the whole model through llama.cpp's own loader
e = LlamaEngine.load(path, layers=layers, n_threads=1, n_seq_max=sessions, n_ctx_seq=ctx)
if e.hidden_out != (b < n_layers):
    raise SystemExit(f'hidden_out {e.hidden_out} for layers {a}:{b} of {n_layers}')
rng = np.random.default_rng(0)
def feed(seq, pos, n):
    if is_head:
        e.eval(seq, pos, rng.integers(0, e.n_vocab, n, dtype=np.int32), None)
    else:
        e.eval(seq, pos, None, rng.standard_normal((n, e.n_embd)).astype(np.float32))
for s in range(sessions):
    feed(s, 0, e.n_batch)  # a full batch (= ubatch here), so the compute buffer is really used
    for k in range(8):
        feed(s, e.n_batch + k, 1)
lines = [l.strip() for l in clib._LOG if "compute buffer size" in l]
print(json.dumps({"base": base, "rss": rss(), "compute_log": lines[-1] if lines else ""}))
"""


def run_shard(path: Path, layers: LayerRange, n_layers: int, ctx: int, sessions: int) -> dict:
    """Load `layers` of the full GGUF at `path` in a fresh node-like process; its RSS and compute-buffer log line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [str(path), str(layers.start), str(layers.stop), str(n_layers), str(ctx), str(sessions)]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=False, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shard {layers} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()

    model = default_model_path()
    layout = layout_from_gguf(model)
    params = PlanParams(context=args.context, sessions=args.sessions)
    print(f"model {model.name}, context {args.context} x {args.sessions} sessions, KV f16, n_threads 1")
    print(f"{'shards':<7}{'layers':<8}{'planned':>12}{'RSS':>12}{'RSS/plan':>10}  compute buffer (llama.cpp log)")
    bases, ratios = [], []
    for k in args.shards:
        for r in plan_even(layout, k):
            got = run_shard(model, r, layout.n_layers, args.context, args.sessions)  # r from the full file
            want = shard_cost(layout, params, Node("n", 0), r).total_bytes
            bases.append(got["base"])
            ratios.append(got["rss"] / want)
            compute = re.sub(r".*=\s*", "", got["compute_log"])
            print(
                f"{k:<7}{r!s:<8}{format_size(want):>12}{format_size(got['rss']):>12}{got['rss'] / want:>10.3f}  {compute}"
            )
    print(
        f"node process before any model: {format_size(min(bases))} to {format_size(max(bases))} "
        f"(LLAMA_CPU_RUNTIME_BYTES = {format_size(LLAMA_CPU_RUNTIME_BYTES)})"
    )
    print(f"RSS/plan: {min(ratios):.3f} to {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
