"""Every architecture certified for layer ranges splits bit for bit, on a tiny model libllama makes itself.

For each architecture libllama opts in to layer ranges that dgr's tiny-model
table holds (dgr.backends.llama_arch.tiny_certified), and each
variant of its tiny model (dense, MoE) in dgr.testing.arch_models: the model
is written from the one metadata table, decoded whole (8 greedy tokens after
24 prompt ids), then cut at every boundary of its table (one inside any
layer-pattern period, one next to a change of layer kind; a hybrid's stages
of one layer kind) and
chained through the layer-range API; tokens and every step's logits must
equal the whole model's exactly. One child process runs them all in process
(dgr.bench.certify.certify_here), so a crash fails this test, not the worker.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dgr.backends import llama_arch
from dgr.bench.certify import cases

pytestmark = [pytest.mark.llama]

_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from dgr.bench.certify import cases, certify_here
names = set(sys.argv[1:])
for case in cases():
    if case.arch in names:
        with tempfile.TemporaryDirectory() as folder:
            got = certify_here(case, Path(folder))
        print("CASE " + json.dumps({"case": case.name, **got}), flush=True)
"""


def test_at_least_seventy_architectures_are_certified():
    assert len(llama_arch.CERTIFIED.keys() | llama_arch.tiny_certified()) >= 70


def test_libllama_gate_and_dgr_agree():
    """libllama's list is the one list: it opts in every family dgr certified and none that dgr refuses, and every
    architecture it opts in is in dgr's table, so that the certification below splits it."""
    from dgr.backends.clib import arch_takes_ranges
    from dgr.testing.arch_table import ARCHS

    assert all(arch_takes_ranges(a) for a in llama_arch.CERTIFIED)
    assert not [a for a in llama_arch.REFUSED if arch_takes_ranges(a)]
    assert llama_arch.tiny_certified() == {a for a in ARCHS if a not in llama_arch.REFUSED}


def test_every_certified_architecture_splits_bit_for_bit():
    names = sorted(llama_arch.tiny_certified())
    want = [c.name for c in cases() if c.arch in names]
    out = subprocess.run([sys.executable, "-c", _SCRIPT, *names], capture_output=True, text=True, timeout=300,
                         check=False)
    got = {r["case"]: r for r in (json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CASE "))}
    assert out.returncode == 0, f"died after {list(got)[-1:]}: {out.stderr[-1500:]}"
    assert sorted(got) == sorted(want)
    bad = {name: [(s["split"], s["result"], s.get("max_diff")) for s in r["per_split"] if s["result"] != "certified"]
           or r["whole"] for name, r in got.items()
           if r["whole"]["result"] != "ok" or any(s["result"] != "certified" for s in r["per_split"])}
    print(f"{len(got)} cases of {len(names)} architectures split bit for bit at every boundary")
    assert bad == {}
    assert all(len(r["per_split"]) >= 2 for r in got.values())


_GATE = """
import sys, tempfile
from pathlib import Path
from dgr.backends.llama_engine import LlamaEngine
from dgr.errors import CallerError
from dgr.testing.arch_models import write_arch_gguf
for arch in sys.argv[1:]:
    with tempfile.TemporaryDirectory() as folder:
        path = write_arch_gguf(arch, Path(folder) / "model.gguf")
        LlamaEngine.load(path, layers=None, n_threads=1, n_seq_max=1, n_ctx_seq=64).close()
        try:
            LlamaEngine.load(path, layers=(0, 1), n_threads=1, n_seq_max=1, n_ctx_seq=64).close()
            print("LOADED " + arch, flush=True)
        except CallerError as e:
            print("REFUSED " + arch + " " + e.message.replace(chr(10), " "), flush=True)
"""


def test_libllama_refuses_a_range_of_an_architecture_that_has_not_opted_in():
    """The gate is libllama's own (llm_arch_supports_layer_range): a range of an architecture dgr refuses fails to
    load with libllama's reason, while the whole model loads; a range of a certified one loads."""
    refused = ["talkie", "rwkv7", "arwkv7", "kimi-k3", "cogvlm"]
    out = subprocess.run([sys.executable, "-c", _GATE, *refused, "llama"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-1500:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "LOADED llama"
    assert len(lines) == len(refused) + 1
    for arch, line in zip(refused, lines):
        assert line.startswith(f"REFUSED {arch} "), line
        assert f"architecture {arch} does not support loading a layer range" in line, line
