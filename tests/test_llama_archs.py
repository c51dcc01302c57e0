"""llama.cpp's own per-architecture test, extended by dgr's patch series, passes on the patched source dgr ships.

`make install` builds tests/test-llama-archs.cpp from the same patched llama.cpp as the wheel (llama/build.sh)
into the virtual environment. It makes a tiny random model of every architecture and, with the series, splits
each one libllama opts in to layer ranges at one and at two boundaries, chains the stages and requires the whole
model's logits bit for bit (a prompt of two ubatches and a decode step); every other architecture must refuse to
load a range. This test runs it and reads its table: the split column must agree with libllama's gate, as dgr
reads it (dgr.backends.clib.arch_takes_ranges).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.backends.clib import arch_takes_ranges

pytestmark = [pytest.mark.llama]

_BIN = Path(sys.executable).parent / "test-llama-archs"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_every_opted_in_architecture_splits_bit_for_bit_in_upstreams_harness():
    assert _BIN.exists(), f"{_BIN} is missing: run `make install`, which builds it with the wheel (llama/build.sh)"
    # upstream's test gives each context 4 threads; its OpenMP team is held to one (20.6 s alone against 22.8 s
    # with 4 on 2 cores, and no spinning threads beside the other test worker: 56 s under make test with 4)
    out = subprocess.run([str(_BIN), "-s", "42"], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    text = _ANSI.sub("", out.stdout + out.stderr)
    assert out.returncode == 0, text[-3000:]
    assert re.search(r"Summary: all \d+ test\(s\) passed", text), text[-3000:]
    header = next(line for line in text.splitlines() if "Model arch." in line)
    col = [c.strip() for c in header.split("|")].index("Ranges")
    ranges: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > col and cells[1] and not set(cells[1]) <= {"-"} and cells[1] != "Model arch.":
            ranges.setdefault(cells[1], set()).add(cells[col].split()[0] if cells[col] else "")
    split = sorted(a for a, s in ranges.items() if "OK" in s)
    refused = sorted(a for a, s in ranges.items() if "refused" in s)
    print(f"{len(split)} architectures split bit for bit, {len(refused)} refuse a range")
    assert not [a for a, s in ranges.items() if "FAIL" in s]
    assert len(split) >= 100
    assert [a for a in split if not arch_takes_ranges(a)] == []
    assert [a for a in refused if arch_takes_ranges(a)] == []
