"""What `dgr plan` charges a range, against what llama.cpp allocates for it, family by family.

    python -m dgr.bench.costs [--arch REGEX] [--llama-1b] [--out FILE]

For each certified architecture's tiny model (dgr.testing.arch_models, the
models tests/test_certify.py splits), cut at the first boundary of its table,
each range is loaded as a `llama_shard` node loads it (2 sessions of 512
positions, llama.cpp's default full-size sliding-window caches), and compared
with dgr.plan's charge for the same range (dgr.plan.layout_from_gguf, from the
file's header alone):
- weights: `llama_model_size` of the range against the plan's layer and
  global tensor bytes (experts, MLA projections, MTP layers, tied outputs);
- state: the KV caches, recurrent states and DeepSeek-V4 compressor states
  llama.cpp logs (MiB to 2 decimals) against the plan's KV terms per layer
  kind (full and sliding attention, MLA latent rows, SSM and delta-net
  state).
llama.cpp's compute buffer is printed beside the plan's, which is fitted to
real model sizes (dgr.plan.rules), not to tiny ones. `--llama-1b` also checks
the 1B-parameter llama shape of dgr.bench.shapes (Q8_0, random weights), cut
in two and in three. Prints a table; exits 1 when a weight differs, or a
state differs beyond the log's rounding.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CTX", "SEQS", "check_case", "check_file", "logged_state", "main"]

CTX, SEQS = 512, 2
# Each logged size is rounded to 0.01 MiB.
_ROUND = 0.005 * 2**20
_STATE_LINES = (
    r"llama_kv_cache: size = +([\d.]+) MiB",
    r"llama_memory_recurrent: +\w+ RS buffer size = +([\d.]+) MiB",
    r"llama_dsv4_comp_state: +\w+ ratio .* size = +([\d.]+) MiB",
)


def logged_state(log: str) -> tuple[float, int]:
    """Bytes of every cache and state llama.cpp logged, and how many lines (for the rounding bound)."""
    sizes = [float(x) for pattern in _STATE_LINES for x in re.findall(pattern, log)]
    return sum(sizes) * 2**20, len(sizes)


def check_case(arch: str, moe: bool, folder: Path, mtp: bool = False) -> list[dict[str, Any]]:
    """One row per range of the case's first split: llama.cpp's bytes and the plan's."""
    from dgr.testing.arch_models import write_arch_gguf
    from dgr.testing.arch_table import ARCHS

    return check_file(write_arch_gguf(arch, folder / "model.gguf", moe=moe, mtp=mtp), ARCHS[arch].splits[0])


def check_file(path: Path, cuts: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per range of `path` cut at `cuts`: llama.cpp's bytes and the plan's."""
    from dgr.backends import clib
    from dgr.backends.base import LayerRange
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.plan import PlanParams, layout_from_gguf, shard_cost
    from dgr.plan.sizes import Node

    layout = layout_from_gguf(path)
    bounds = [0, *cuts, layout.n_layers]
    lib = clib.llama_lib()
    rows = []
    for a, b in zip(bounds, bounds[1:]):
        clib._LOG = collections.deque(maxlen=100_000)  # the sizes come before dgr's usual last 40 lines
        e = LlamaEngine.load(path, layers=(a, b), n_threads=1, n_seq_max=SEQS, n_ctx_seq=CTX)
        try:
            log = "".join(clib._LOG)
            held = int(lib.llama_model_size(e._model))
            params = PlanParams(context=CTX, sessions=SEQS, swa_full=True, ubatch=e.n_batch)
        finally:
            e.close()
        state, lines = logged_state(log)
        compute = sum(float(x) for x in re.findall(r"CPU compute buffer size = +([\d.]+) MiB", log)) * 2**20
        cost = shard_cost(layout, params, Node("n", 0), LayerRange(a, b))
        planned_w = cost.weight_bytes + cost.global_bytes
        rows.append({
            "range": f"{a}:{b}", "weights": held, "planned_weights": planned_w,
            "state": state, "planned_state": cost.kv_bytes, "state_bound": lines * _ROUND,
            "kinds": sorted(cost.kv_by_kind), "compute": compute, "planned_compute": cost.compute_bytes,
            "ok": held == planned_w and abs(state - cost.kv_bytes) <= lines * _ROUND,
        })  # fmt: skip
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    from dgr.backends import llama_arch
    from dgr.bench.certify import cases

    ap = argparse.ArgumentParser(prog="python -m dgr.bench.costs", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=None, help="regex searched in the case names (ARCH or ARCH+moe)")
    ap.add_argument("--llama-1b", action="store_true", help="also the 1B llama shape (dgr.bench.shapes)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    certified = llama_arch.tiny_certified()
    todo = [c for c in cases(args.arch) if c.arch in certified]
    print(f"{'case':18} {'range':6} {'weights':>11} {'planned':>11}  {'state MiB':>9} {'planned':>8}  "
          f"{'compute MiB':>11} {'planned':>8}  kinds")
    records, bad = {}, 0
    runs: list[tuple[str, Any]] = [(c.name, c) for c in todo]
    if args.llama_1b:
        runs += [("llama-1b 2-way", (8,)), ("llama-1b 3-way", (6, 12))]
    for name, what in runs:
        if isinstance(what, tuple):
            from dgr.bench.shapes import random_llama_gguf

            rows = check_file(random_llama_gguf(), what)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = check_case(what.arch, what.moe, Path(tmp), what.mtp)
        records[name] = rows
        for r in rows:
            mark = "" if r["ok"] else "  DIFFERS"
            bad += not r["ok"]
            print(f"{name:18} {r['range']:6} {r['weights']:>11,} {r['planned_weights']:>11,}  "
                  f"{_mib(r['state'])} {_mib(r['planned_state'])}  {_mib(r['compute']):>11} "
                  f"{_mib(r['planned_compute'])}  {','.join(r['kinds'])}{mark}", flush=True)
    n = sum(len(r) for r in records.values())
    print(f"\n{n} ranges of {len(records)} cases: {n - bad} priced as llama.cpp holds them, {bad} not")
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
