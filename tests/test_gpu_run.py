"""The GPU run's parts that need no GPU (gpu/device-run.sh, dgr.bench.gpu_run; gpu/README.md): the CUDA build
takes the Makefile's flags, the benchmark's setups are issue 53's, the scripts parse, and the summary renders the
figures a run writes. The whole run, on the CPU, is `bash gpu/device-run.sh --dry-run` (about a minute)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.bench import gpu_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_the_cuda_build_takes_the_makefiles_flags() -> None:
    """gpu_run reads them from the Makefile (make may be missing on a GPU machine); make prints the same."""
    made = subprocess.run(["make", "-s", "--no-print-directory", "print-llama-cmake-args", "GPU=cuda",
                           "CUDA_ARCHS=90"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert gpu_run.cuda_cmake_args(ROOT / "Makefile", "90") == made
    assert "-DGGML_CUDA=ON" in made and "-DCMAKE_CUDA_ARCHITECTURES=90" in made


def test_the_gpu_setups_are_routes_sharing_the_gpu_beside_llama_server() -> None:
    dense = gpu_run.setups_for(moe=False, cpu=False)
    base = dense[0]
    assert base.server and base.label == "llama-server -ngl 99" and "-ngl" in base.server_flags
    assert base.server_flags[base.server_flags.index("-fa") + 1] == "off"  # as dgr's engine
    routes = {(s.backend, s.nodes, s.gpu_layers) for s in dense if not s.server}
    assert {("llama", 1, "all"), ("llama_shard", 2, "all"), ("llama_shard", 3, "all"),
            ("llama_shard", 2, "all,0")} == routes  # ... and a GPU head with a CPU tail
    moe = gpu_run.setups_for(moe=True, cpu=False)
    assert [s.label for s in moe if s.cpu_moe or "--cpu-moe" in s.server_flags] == \
        ["llama-server -ngl 99 --cpu-moe", "dgr 2-node ring, GPU, --cpu-moe"]


def test_the_dry_run_offloads_nothing() -> None:
    for moe in (False, True):
        for s in gpu_run.setups_for(moe=moe, cpu=True):
            assert (s.server or s.gpu_layers == "0") and not s.cpu_moe and "-ngl" not in s.server_flags
            assert "GPU" not in s.label


def test_the_scripts_parse() -> None:
    for script in ("gpu/device-run.sh", "gpu/carry.sh", "llama/build.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_the_summary_shows_each_steps_figures(tmp_path) -> None:
    (tmp_path / "env.json").write_text(json.dumps({
        "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04", "devices": [{"name": "CUDA0", "description": "H100"}],
        "commit": "abc", "started": "now", "llama_cpp_python": "0.3.36", "python": "3.12.3 (main)", "cpu_count": 16,
        "nvcc": ["Build cuda_13.0"]}))
    case = {"case": "llama", "result": "certified", "max_diff": 0.0}
    (tmp_path / "certify.json").write_text(json.dumps({"on_gpu": True, "runs": {
        "fusion on": {"seconds": 9.0, "cases": [case]}, "fusion off": {"seconds": 8.0, "cases": [case]}}}))
    (tmp_path / "mixed.json").write_text(json.dumps({
        "model": "random-llama-1b-q4_0.gguf", "cut": 8, "n_layer": 16, "tokens": {"whole on the CPU": [1, 2]},
        "max_logit_diff": {"GPU head + CPU tail vs whole on the CPU": 0.25}, "logit_spread": 3.5}))
    label, base = "dgr 2-node ring, GPU", "llama-server -ngl 99"
    (tmp_path / "bench.json").write_text(json.dumps({"models": {"8b": {
        "model": "random-llama-8b-q4_0.gguf", "shape": {"n_layers": 32, "hidden": 4096, "params": 7.18e9},
        "rounds": 3, "threads": 8, "prompt_tokens": 256, "decode_tokens": 128, "short_tokens": 50,
        "baseline": base, "errors": {"dgr 3-node ring, GPU": "RouteTimeout: ..."},
        "setups": {base: {"gpu_mib_total": 5000.0, "nodes": []},
                   label: {"gpu_mib_total": 6000.0, "nodes": ["node0 0:16", "node1 16:32"]}},
        "decode_tok_s": {base: [150.0, 152.0, 151.0], label: [120.0, 121.0, 119.0]},
        "prompt_ttft_s": {base: [0.05] * 3, label: [0.07] * 3}, "short_ttft_s": {base: [0.02] * 3, label: [0.03] * 3},
        "decode_ratio": {f"{label} / {base}": {"median": 0.8, "per_round": [0.8] * 3}},
        "prompt_ttft_ratio": {f"{label} / {base}": {"median": 1.4, "per_round": [1.4] * 3}}}},
        "skipped": {"moe": "40 s left of the deadline"}}))
    text = gpu_run.summary(tmp_path)
    assert "NVIDIA H100" in text and "| llama | certified (0) | certified (0) |" in text
    assert "GPU head + CPU tail vs whole on the CPU: largest logit difference 0.25" in text
    assert f"| {label} | 120.0 | 0.80 | 0.070 | 1.40 | 0.030 | 6000 | node0 0:16; node1 16:32 |" in text
    assert "dgr 3-node ring, GPU did not start" in text and "moe: not measured (40 s left" in text
