"""`dgr plan`'s GPU placement against what llama.cpp allocates, buffer by buffer, on the device this build sees.

The tiny deepseek4 (dgr.bench.dsv4_tiny: window, CSA and HCA layers, hash routing, an MTP layer) and a tiny
qwen3moe (dgr.testing.arch_models) are each cut in two, and each range is loaded as a llama_shard node loads it
(LlamaEngine.load: 2 sessions of 256 positions, ubatch 512, deepseek4's window caches window-sized) with a
given `--gpu-layers`, with and without `--cpu-moe`, in a child process. llama.cpp's load log says which layers
it assigned to the device and how large each model, KV (and DeepSeek-V4 compressor-state) and compute buffer
is, by buffer type. Against it: dgr.plan.gpu.place for the same range, from the same file's header
(dgr.plan.sources.layout_from_gguf), at the same context, sessions and ubatch. Both are printed.

What must agree, and how closely (each logged size is rounded to 0.01 MiB: 0.005 MiB a line, inclusive: llama.cpp
prints 0.125 MiB as 0.12, so the logged sizes are read as exact decimals, not floats):
- the layers on the device: exactly the plan's slots (llama.cpp's "layer N assigned to device" lines);
- model: the plan's device and host bytes add up to llama_model_size (the bytes of the tensors the range
  holds) to the byte. The device's buffer is its tensors, each padded to the buffer type's alignment
  (ggml_backend_alloc_ctx_tensors_from_buft; Vulkan's minStorageBufferOffsetAlignment is at most 256 bytes
  by the Vulkan spec), so it lies between the plan's device bytes and those plus 256 bytes a tensor. The
  host's is the span of the file llama.cpp maps (CPU_Mapped), which holds the host tensors and whatever lies
  between them: at least the plan's host bytes;
- KV: the device's and the host's KV and state buffers, each equal to the plan's within the rounding;
- compute: the plan's compute rule is fitted to real models (dgr.plan.rules), not tiny ones, so here it is the
  same range's compute buffer on the CPU alone, measured in the same run; what is checked is how the plan
  shares it out. The device's buffer is planned as that rule (the same graph through the same allocator)
  plus, where an op reads a weight from host memory, ggml's op-offload allowance (a copy of the largest such
  weight and the graph's inputs again: an upper bound, dgr.plan.gpu's docstring says why); the host's as the
  rule while any layer stays there (an upper bound: its share of the graph), else the graph's inputs (a
  formula, dgr.plan.gpu.host_input_bytes). Bounds: the device's within [1/2, 11/10] of the plan + 0.25 MiB
  (the alignment of a graph's ~1,000 tensors, ops a backend hands back); the host's at most 11/10 of the rule
  + 0.25 MiB, and its inputs the formula's within 1/20 + the rounding; and with every layer on the device,
  what --cpu-moe adds to the device's buffer at most the allowance it adds to the plan (both lines' rounding
  aside): the copies share memory with activations, or repack them, as ggml-alloc's best fit places them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import attrs
import pytest

from dgr.backends.base import LayerRange
from dgr.plan import PlanParams
from dgr.plan.gpu import place
from dgr.plan.layout import ComputeRule
from dgr.plan.sources import layout_from_gguf

CTX, SEQS, UBATCH = 256, 2, 512
MIB = 2**20
ROUND = Fraction(MIB, 200)  # half the log's 0.01 MiB
ALIGN = 256  # the largest minStorageBufferOffsetAlignment the Vulkan spec allows

# (model, range, --gpu-layers): a partial head (its first layer on the host), a tail wholly on the device
# (output, MTP layer, layers), a head wholly on the device, and a tail with only its output and last layer there
RANGES = [("deepseek4", (0, 3), 2), ("deepseek4", (3, 6), -1), ("qwen3moe", (0, 3), -1), ("qwen3moe", (3, 6), 2)]
CASES = [{"model": m, "layers": list(r), "gpu_layers": g, "cpu_moe": moe, "swa_full": m != "deepseek4"}
         for m, r, g in RANGES for moe in (False, True)] + [
        {"model": m, "layers": list(r), "gpu_layers": 0, "cpu_moe": False, "swa_full": m != "deepseek4"}
         for m, r, _ in RANGES]  # fmt: skip

_CHILD = """
import collections, json, sys
from pathlib import Path
from dgr.backends import clib
from dgr.backends.llama_engine import LlamaEngine
from dgr.backends.placement import Placement
from dgr.bench.dsv4_tiny import write_dsv4_gguf
from dgr.testing.arch_models import write_arch_gguf
folder = Path(sys.argv[1])
files = {"deepseek4": folder / "deepseek4.gguf", "qwen3moe": folder / "qwen3moe.gguf"}
write_dsv4_gguf(files["deepseek4"])
write_arch_gguf("qwen3moe", files["qwen3moe"], moe=True)
lib = clib.llama_lib()
ctx, seqs = int(sys.argv[3]), int(sys.argv[4])
for case in json.loads(sys.argv[2]):
    clib._LOG = collections.deque(maxlen=200_000)  # the whole load log: the sizes come long before its end
    e = LlamaEngine.load(files[case["model"]], layers=tuple(case["layers"]), n_threads=1, n_seq_max=seqs,
                         n_ctx_seq=ctx, swa_full=case["swa_full"],
                         placement=Placement(gpu_layers=case["gpu_layers"], cpu_moe=case["cpu_moe"]))
    size, n_batch = int(lib.llama_model_size(e._model)), e.n_batch
    e.close()
    print("CASE " + json.dumps({**case, "model_size": size, "n_batch": n_batch, "log": "".join(clib._LOG)}),
          flush=True)
"""

_GPU_NAME = re.compile(r"^(Vulkan|CUDA)\d+$")  # the device's own buffer type; CPU_Mapped, Vulkan_Host, ... are host
_LINES = {
    "model": r"(\S+) model buffer size = +([\d.]+) MiB",
    "KV": r"(\S+) (?:KV|RS|DSV4 \w+ state) buffer size = +([\d.]+) MiB",
    "compute": r"(\S+) compute buffer size = +([\d.]+) MiB",
}


def _logged(log: str) -> dict[str, dict[str, tuple[Fraction, int]]]:
    """kind -> {"GPU" | "CPU": (bytes, lines)} from llama.cpp's buffer-size lines, each size as the exact decimal
    printed (a float's 0.12 MiB would fall short of 0.125 MiB - 0.005 MiB)."""
    out: dict[str, dict[str, tuple[Fraction, int]]] = {}
    for kind, pattern in _LINES.items():
        sides = {"GPU": (Fraction(0), 0), "CPU": (Fraction(0), 0)}
        for name, mib in re.findall(pattern, log):
            side = "GPU" if _GPU_NAME.match(name) else "CPU"
            b, n = sides[side]
            sides[side] = (b + Fraction(mib) * MIB, n + 1)
        out[kind] = sides
    return out


def _on_device(log: str) -> tuple[int, ...]:
    return tuple(sorted(int(i) for i, dev in re.findall(r"layer +(\d+) assigned to device (\w+)", log)
                        if _GPU_NAME.match(dev)))


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("plan-buffers")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), json.dumps(CASES), str(CTX), str(SEQS)],
                         capture_output=True, text=True, timeout=900, check=False, env=env)
    got = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CASE ")]
    assert out.returncode == 0 and len(got) == len(CASES), out.stderr[-3000:]
    return folder, got


def _mib(x: float | Fraction) -> str:
    return f"{float(x) / MIB:8.3f}"


def test_each_buffer_of_a_placed_range_is_what_the_plan_says(loads):
    rows, bad = compare(*loads)
    print("logged / planned, MiB:\n" + "\n".join(rows))
    assert bad == []


def compare(folder: Path, got: list[dict]) -> tuple[list[str], list[str]]:
    """A line per load, logged beside planned, and every check that failed."""
    layouts = {m: layout_from_gguf(folder / f"{m}.gguf") for m in ("deepseek4", "qwen3moe")}
    cpu_rule = {(c["model"], tuple(c["layers"])): _logged(c["log"])["compute"]["CPU"][0]
                for c in got if c["gpu_layers"] == 0}
    rows, bad, moe_copy = [], [], {}
    for c in got:
        layers, key = LayerRange(*c["layers"]), (c["model"], tuple(c["layers"]))
        assert c["n_batch"] == UBATCH
        # the range's own compute rule: its compute buffer on the CPU alone (see the module's docstring)
        layout = attrs.evolve(layouts[c["model"]], compute=ComputeRule(int(cpu_rule[key]), 0.0, "measured"))
        params = PlanParams(context=CTX, sessions=SEQS, ubatch=UBATCH, swa_full=c["swa_full"],
                            cpu_moe=c["cpu_moe"])
        pl = place(layout, params, layers, c["gpu_layers"])
        log = _logged(c["log"])
        name = f"{c['model']} {layers} --gpu-layers {pl.flag}{' --cpu-moe' if c['cpu_moe'] else ''}"
        on = _on_device(c["log"])
        checks = {"layers on the device": on == pl.on_gpu,
                  "model bytes held": c["model_size"] == pl.gpu.model + pl.cpu.model}
        gpu_model, gpu_lines = log["model"]["GPU"]
        slack = ALIGN * _device_tensors(folder / f"{c['model']}.gguf", pl.on_gpu, c["cpu_moe"])
        checks["device model"] = (pl.gpu.model - ROUND * gpu_lines <= gpu_model
                                  <= pl.gpu.model + slack + ROUND * gpu_lines)
        checks["host model"] = log["model"]["CPU"][0] >= pl.cpu.model - ROUND * log["model"]["CPU"][1]
        for side, planned in (("GPU", pl.gpu.kv), ("CPU", pl.cpu.kv)):
            b, n = log["KV"][side]
            checks[f"{side} KV"] = abs(b - planned) <= ROUND * n
        g_compute, h_compute = log["compute"]["GPU"][0], log["compute"]["CPU"][0]
        if pl.gpu_layers:
            checks["device compute"] = pl.gpu.compute / 2 - ROUND <= g_compute <= pl.gpu.compute * 1.1 + MIB / 4
        if pl.gpu_layers == pl.slots:  # the host keeps only the graph's inputs
            checks["host compute (inputs)"] = abs(h_compute - pl.cpu.compute) <= pl.cpu.compute / 20 + ROUND
            moe_copy[(key, c["cpu_moe"])] = (g_compute, pl.gpu.compute)
        else:
            checks["host compute"] = h_compute <= pl.cpu.compute * 1.1 + MIB / 4
        rows.append(f"{name:<44} device: model {_mib(gpu_model)} / {_mib(pl.gpu.model)}  KV "
                    f"{_mib(log['KV']['GPU'][0])} / {_mib(pl.gpu.kv)}  compute {_mib(g_compute)} / "
                    f"{_mib(pl.gpu.compute)}   host: model {_mib(log['model']['CPU'][0])} / {_mib(pl.cpu.model)}  "
                    f"KV {_mib(log['KV']['CPU'][0])} / {_mib(pl.cpu.kv)}  compute {_mib(h_compute)} / "
                    f"{_mib(pl.cpu.compute)}   layers {on} / {pl.on_gpu}  held {c['model_size']} / "
                    f"{pl.gpu.model + pl.cpu.model}")
        bad += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    # what --cpu-moe adds to the device's compute buffer with every layer there: at most the op-offload
    # allowance it adds to the plan (an expert tensor's copy and the graph's inputs again; an upper bound)
    for key in sorted({k for k, _ in moe_copy}):
        (with_moe, plan_moe), (without, plan_without) = moe_copy[(key, True)], moe_copy[(key, False)]
        added, planned = with_moe - without, plan_moe - plan_without
        rows.append(f"{key}: --cpu-moe adds {_mib(added)} MiB to the device's compute buffer, planned at most "
                    f"{_mib(planned)}")
        if not 0 < planned or added > planned + 2 * ROUND:
            bad.append(f"{key}: the experts' copy on the device is {float(added) / MIB:.3f} MiB, planned at most "
                       f"{planned / MIB:.3f}")
    return rows, bad


def _device_tensors(path: Path, on_gpu: tuple[int, ...], cpu_moe: bool) -> int:
    """How many tensors of the file can be in the device's buffer: those of its layers (less the experts
    with --cpu-moe), and every global but the token embedding when the output is there (an upper bound)."""
    from dgr.gguf_meta import layer_of, read_header
    from dgr.plan.gpu import is_cpu_moe_tensor

    tensors = read_header(path).tensors
    out = max((layer_of(t.name) or 0) for t in tensors) + 1 in on_gpu  # the output's index: n_layer_all
    return sum(1 for t in tensors
               if (layer_of(t.name) in on_gpu and not (cpu_moe and is_cpu_moe_tensor(t.name)))
               or (out and layer_of(t.name) is None and not t.name.startswith("token_embd.")))
