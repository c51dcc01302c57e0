"""Layer ranges on a GPU backend: llama.cpp's Vulkan, on whatever Vulkan device this build sees.

- Split equals whole on the device, bit for bit, for families of every kind (dense, MoE, sliding window,
  hybrid, recurrent, MLA, DeepSeek-V4's wide seam): the certification (dgr.bench.certify) with every layer of
  every stage on the GPU (DGR_CERTIFY_GPU=1), in a child process so that a crash fails a test, not the run;
  with Vulkan's op fusion off, and with it on (the default), where a cut changes what it can fuse.
- A mixed route: the default model's first half on the GPU, its second half on the CPU, against the whole
  model on the CPU: the same greedy tokens, and the logits' distance measured beside the whole model's on
  the GPU (two backends round differently: GPU.md).
- `--cpu-moe` on a MoE range: the routed experts are held in host memory, the rest on the device, and the
  answer is the device's own within rounding.
- `dgr up --gpu-layers all,0`: one node on the GPU, one on the CPU alone, answering, each node saying where its
  layers are, and the answer the same stages give chained in process with the route's cut.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np

from dgr.bench.certify import GPU_FAMILIES as FAMILIES, cases
SPLITS_PER_CASE = 2

_CERTIFY = """
import json, sys, tempfile
from pathlib import Path
from dgr.bench import certify
from dgr.testing.arch_table import ARCHS
for case in certify.cases():
    if case.arch not in sys.argv[2:] or case.mtp:
        continue
    with tempfile.TemporaryDirectory() as folder:
        whole = certify._whole(case.arch, case.moe, case.mtp, Path(folder))
        splits = ARCHS[case.arch].splits[:int(sys.argv[1])] if whole["result"] == "ok" else []
        per = [{**certify._split(Path(folder), list(b)), "split": list(b)} for b in splits]
    print("CASE " + json.dumps({"case": case.name, "whole": whole, "per_split": per}), flush=True)
"""


def test_the_build_sees_a_vulkan_device():
    from dgr.backends.placement import devices

    seen = devices()
    assert seen and all(d["name"].startswith("Vulkan") for d in seen), seen
    print(seen)


def _certify(**env: str) -> dict[str, object]:
    """The families' certification with every layer on the device: case -> [(split, result, max_diff)], or the
    whole model's failure."""
    out = subprocess.run([sys.executable, "-c", _CERTIFY, str(SPLITS_PER_CASE), *FAMILIES], capture_output=True,
                         text=True, timeout=1500, check=False, env=_env(DGR_CERTIFY_GPU="1", **env))
    got = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("CASE ")]
    assert out.returncode == 0, f"died after {[g['case'] for g in got][-1:]}: {out.stderr[-2000:]}"
    assert [g["case"] for g in got] == [c.name for c in cases() if c.arch in FAMILIES and not c.mtp]
    report = {g["case"]: [(s["split"], s["result"], s.get("max_diff")) for s in g["per_split"]] or g["whole"]
              for g in got}
    for name, r in report.items():
        print(name, r)
    assert len({c.split("+")[0] for c in report}) >= 10
    assert all(isinstance(r, list) and len(r) == SPLITS_PER_CASE for r in report.values()), report
    return report


def test_split_equals_whole_on_the_gpu_bit_for_bit_for_families_of_every_kind():
    """With Vulkan's op fusion off, a range computes on the device exactly what the whole model does there."""
    report = _certify(GGML_VK_DISABLE_FUSION="1")
    assert {n: r for n, r in report.items() if any(x[1] != "certified" for x in r)} == {}


def test_with_fusion_on_a_cut_changes_only_the_rounding_of_what_vulkan_fuses_across_it():
    """Vulkan's default fuses ops across a layer boundary (the expert sums and the residual add of MoE layers,
    the SSM's output) where the whole model has the next layer in the same graph; a range ends its graph
    there. Dense, sliding-window, MLA and DeepSeek-V4 ranges stay bit for bit; the others differ in the
    seventh digit at most (measured: 5.8e-7 on the logits of qwen3moe's (2, 4) split)."""
    report = _certify()
    for name in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "deepseek4"):
        assert all(x[1] == "certified" for x in report[name]), (name, report[name])
    worst = max(x[2] for r in report.values() for x in r)
    print(f"largest logit difference of a split on Vulkan with fusion: {worst:.3g}")
    assert worst < 1e-5


def _env(**extra: str) -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _greedy(engines, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Chain `engines` over `prompt`, then decode `n` tokens greedily; the logits float32 [n, n_vocab]."""
    out, rows, pos, ids = [], [], 0, prompt
    for _ in range(n + 1):
        x = None
        for e in engines:
            x = e.eval(0, pos, ids if x is None else None, x)
        rows.append(x)
        pos += len(ids)
        ids = [int(np.argmax(x))]
        out.append(ids[0])
    return out[:n], np.stack(rows[:n])


def test_a_route_half_on_the_gpu_half_on_the_cpu_answers_as_the_whole_model_on_the_cpu(model_path):
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.placement import Placement

    def load(layers, placement=Placement()):
        return LlamaEngine.load(model_path, layers=layers, n_threads=2, n_seq_max=1, n_ctx_seq=128,
                                placement=placement)

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]
    whole = load(None)
    want, want_logits = _greedy([whole], prompt, 8)
    whole.close()
    head, tail = load((0, 15), Placement(gpu_layers=-1)), load((15, 30))
    got, logits = _greedy([head, tail], prompt, 8)
    head.close(), tail.close()
    gpu = load(None, Placement(gpu_layers=-1))
    on_gpu, gpu_logits = _greedy([gpu], prompt, 8)
    gpu.close()
    diff, scale = (float(np.max(np.abs(x - want_logits))) for x in (logits, gpu_logits))
    print(f"against the whole model on the CPU, largest logit difference: GPU head + CPU tail {diff:.3f}, "
          f"the whole model on the GPU {scale:.3f}; tokens {got}, {on_gpu}, {want}")
    assert got == want == on_gpu


def _buffers(log: str) -> dict[str, float]:
    """llama.cpp's 'model buffer size' lines: buffer type -> MiB."""
    return {m[1]: float(m[2]) for m in re.finditer(r"(\S+) model buffer size = +([\d.]+) MiB", log)}


_MOE = """
import sys
import numpy as np
from pathlib import Path
from dgr.backends.llama_engine import LlamaEngine
from dgr.backends.placement import Placement
from dgr.testing.arch_models import write_arch_gguf
path = write_arch_gguf("qwen3moe", Path(sys.argv[1]), moe=True)
for cpu_moe in (False, True):
    print(f"LOAD cpu_moe={cpu_moe}", file=sys.stderr, flush=True)
    e = LlamaEngine.load(path, layers=(0, 2), n_threads=1, n_seq_max=1, n_ctx_seq=64,
                         placement=Placement(gpu_layers=-1, cpu_moe=cpu_moe))
    np.save(sys.argv[1] + f".{int(cpu_moe)}.npy", e.eval(0, 0, list(range(3, 27)), None))  # float32 [24, n_embd]
    e.close()
"""


def test_cpu_moe_keeps_a_moe_ranges_experts_in_host_memory(tmp_path):
    """llama.cpp's log says where each buffer went (DGR_LLAMA_LOG=1 echoes it)."""
    path = tmp_path / "moe.gguf"
    out = subprocess.run([sys.executable, "-c", _MOE, str(path)], capture_output=True, text=True, timeout=300,
                         check=False, env=_env(DGR_LLAMA_LOG="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    _, on_gpu, moe_cpu = (_buffers(part) for part in re.split(r"LOAD cpu_moe=\w+", out.stderr))
    print(f"every layer on the GPU: {on_gpu}; --cpu-moe: {moe_cpu}")
    host = lambda b: sum(v for k, v in b.items() if not k.startswith("Vulkan0"))  # noqa: E731 (CPU, Vulkan_Host)
    assert moe_cpu["Vulkan0"] < on_gpu["Vulkan0"], "the experts left the device"
    assert host(moe_cpu) > host(on_gpu), "and are held in host memory"
    assert re.search(r"blk\.1\.ffn_down_exps\.weight .* buffer type overridden", out.stderr)
    h_gpu, h_moe = (np.load(f"{path}.{k}.npy") for k in (0, 1))
    print(f"largest hidden-state difference, experts on the host against on the device: "
          f"{float(np.max(np.abs(h_moe - h_gpu))):.3g}")
    assert np.allclose(h_moe, h_gpu, rtol=1e-3, atol=1e-3)


def test_dgr_up_with_one_node_on_the_gpu_and_one_on_the_cpu_answers(model_path):
    """Real processes: `dgr up --gpu-layers all,0`. node0 holds its range on the Vulkan device, node1 on the CPU
    alone, and the route answers exactly as the same two stages chained in this process, cut where the route cut
    (the planner's 18:12 for SmolLM2, read from node0). On a GPU the cut matters, unlike on the CPU: which layers
    run on the device changes the rounding (lavapipe, this prompt: head 0:18 on the GPU "L'Étoile, la Cit", 0:15
    "L'Étoile, la Mar", every layer on the GPU "The capital of France is Paris.")."""
    from dgr.backends.gguf_text import GgufText
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.placement import Placement
    from dgr.testing.harness import LocalRoute

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "temperature": 0, "messages": messages}
    extra = ("--ctx", "512", "--threads", "1", "--gpu-layers", "all,0")
    with LocalRoute(backend="llama_shard", nodes=2, extra=extra, ready_timeout_s=300) as r:
        reply = r.http.post(f"{r.api}/chat/completions", json=body, headers=r.headers, timeout=300)
        assert reply.status_code == 200, reply.text
        got = reply.json()["choices"][0]["message"]["content"]
        statuses = [r.node_status(f"node{i}") for i in range(2)]
        gpu_node, cpu_node = (st["backend"] for st in statuses)
        # the devices' memory, from the node to its status, its heartbeats, the tracker's listing and /metrics
        listed = {n["node"]: n for n in r.node_table()}
        metrics = r.http.get(f"{r.url}/metrics", timeout=5, headers=r.headers).text
    cut = gpu_node["layers_loaded"][1]
    assert got
    assert gpu_node["placement"]["gpu_layers"] == "all" and gpu_node["devices"][0]["name"] == "Vulkan0", gpu_node
    assert cpu_node["placement"]["gpu_layers"] == 0 and cpu_node["devices"] == []
    assert [d["name"] for d in statuses[0]["devices"]] == ["Vulkan0"] and statuses[1]["devices"] == []
    assert [d["name"] for d in listed["node0"]["devices"]] == ["Vulkan0"] and listed["node1"]["devices"] == []
    assert 0 <= listed["node0"]["devices"][0]["memory_free"] <= listed["node0"]["devices"][0]["memory_total"]
    assert 'dgr_node_device_memory_total_bytes{device="Vulkan0",node="node0"}' in metrics
    assert 'node="node1"' not in "".join(line for line in metrics.splitlines() if line.startswith("dgr_node_device"))
    # after the route: this process's own Vulkan device is not inherited by the route's processes
    text = GgufText.load(model_path)
    ids, _ = text.tokenize_chat(messages)
    stages = [LlamaEngine.load(model_path, layers=layers, n_threads=1, n_seq_max=1, n_ctx_seq=512, placement=p)
              for layers, p in (((0, cut), Placement(gpu_layers=-1)), ((cut, 30), Placement()))]
    tokens, _ = _greedy(stages, ids, 8)
    for e in stages:
        e.close()
    want = b"".join(text.token_bytes(t) for t in tokens).decode("utf-8", "replace")
    print(f"route cut at {cut}: {got!r}; the same stages in process: {want!r}")
    assert got == want


_PARTIAL = """
import sys
from dgr.backends.llama_engine import LlamaEngine
from dgr.backends.placement import Placement
for layers, n in (((0, 15), 3), ((15, 30), 4), ((10, 20), -1), ((0, 15), 0)):
    print(f"LOAD {layers[0]} {layers[1]} {n}", file=sys.stderr, flush=True)
    LlamaEngine.load(sys.argv[1], layers=layers, n_threads=1, n_seq_max=1, n_ctx_seq=64,
                     placement=Placement(gpu_layers=n)).close()
"""


def test_gpu_layers_counts_a_ranges_own_layers_back_from_its_end(model_path):
    """`--gpu-layers N` offloads the last N layers of the node's range, by their global index; a range that holds
    the output counts it as one, as llama.cpp does for a whole model; 'all' is every layer of the range; 0 uses
    no device at all (llama.cpp would otherwise still send large batches' matmuls to it)."""
    out = subprocess.run([sys.executable, "-c", _PARTIAL, str(model_path)], capture_output=True, text=True,
                         timeout=300, check=False, env=_env(DGR_LLAMA_LOG="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    parts = re.split(r"LOAD (\d+) (\d+) (-?\d+)\n", out.stderr)[1:]
    for a, b, n, log in zip(parts[0::4], parts[1::4], parts[2::4], parts[3::4]):
        on_gpu = sorted(int(m) for m in re.findall(r"layer +(\d+) assigned to device Vulkan0", log))
        found = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
        offloaded = found.groups() if found else None
        print(a, b, n, on_gpu, offloaded)
        a, b, n = int(a), int(b), int(n)
        if n == 0:
            assert "using device Vulkan0" not in log and on_gpu == [], log[-2000:]
        elif (a, b, n) == (0, 15, 3):
            assert on_gpu == [12, 13, 14] and offloaded == ("3", "15")
        elif (a, b, n) == (15, 30, 4):  # the output is one of the 4: layers 27, 28, 29 and the head
            assert on_gpu == [27, 28, 29, 30] and offloaded == ("4", "16")
        else:
            assert on_gpu == list(range(10, 20)) and offloaded == ("10", "10")
