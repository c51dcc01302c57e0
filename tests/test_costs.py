"""`dgr plan` prices each family's ranges as llama.cpp holds them (dgr.bench.costs, on the certified tiny models).

One family for each pricing rule: dense and expert weights, sliding windows, MLA latent rows with and
without an indexer, an indexer beside plain attention, Mamba-style SSM state (pure and hybrid, and a
hybrid's FFN-only layers), RWKV, LFM2's short convolutions, Kimi delta attention, MiniMax lightning
attention, gated delta nets, attention and SSM in one layer, DeepSeek-V4's caches, and the global tensors
whose side of a split is not obvious (position embeddings, a classifier head, LFM2's final norm, a
duplicated output, an MTP layer on the tail). Each range's tensor bytes must equal the plan's exactly, and its caches and states the
plan's within the rounding of llama.cpp's log. `python -m dgr.bench.costs` runs every certified family.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.llama]

FAMILIES = (
    "llama", "qwen3moe", "gemma3", "gpt-oss", "deepseek2", "deepseek32", "minimax-m3", "mamba2", "jamba",
    "nemotron_h", "rwkv6", "lfm2", "kimi-linear", "minimax-01", "qwen35", "falcon-h1", "gpt2", "qwen3",
    "codeshell", "deepseek4", "glm4moe",
)  # fmt: skip

_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from dgr.bench.certify import cases
from dgr.bench.costs import check_case
names = set(sys.argv[1:])
for case in cases():
    if case.arch in names:
        with tempfile.TemporaryDirectory() as folder:
            rows = check_case(case.arch, case.moe, Path(folder), case.mtp)
        print("CASE " + json.dumps({"case": case.name, "rows": rows}), flush=True)
"""


def test_every_pricing_rule_matches_what_llama_cpp_allocates():
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *FAMILIES], capture_output=True, text=True, timeout=240,
                         check=False)
    got = {r["case"]: r["rows"] for r in (json.loads(line[5:]) for line in out.stdout.splitlines()
                                          if line.startswith("CASE "))}
    assert out.returncode == 0, f"died after {list(got)[-1:]}: {out.stderr[-1500:]}"
    assert {name.split("+")[0] for name in got} == set(FAMILIES)
    bad = {name: [r for r in rows if not r["ok"]] for name, rows in got.items() if not all(r["ok"] for r in rows)}
    kinds = sorted({k for rows in got.values() for r in rows for k in r["kinds"]})
    print(f"{sum(len(r) for r in got.values())} ranges of {len(got)} cases priced as llama.cpp holds them; "
          f"kinds {kinds}")
    assert bad == {}
    assert {"attn", "swa", "mla", "ssm", "rwkv", "conv", "kda", "lightning", "delta", "ssm+attn", "ffn", "csa"} <= set(kinds)
