"""The GPU run of issue 53, step by step: what gpu/device-run.sh calls on a machine with a GPU (gpu/README.md).

    python -m dgr.bench.gpu_run cmake-args [--cuda-archs 90]
    python -m dgr.bench.gpu_run check --out FILE [--cpu]
    python -m dgr.bench.gpu_run shapes --vocab GGUF [--models 1b,8b,moe] [--done FILE] [--cpu]
    python -m dgr.bench.gpu_run certify --out FILE [--jobs N] [--families A,B] [--cpu]
    python -m dgr.bench.gpu_run mixed --vocab GGUF --out FILE [--threads N] [--cpu]
    python -m dgr.bench.gpu_run bench --vocab GGUF --out FILE [--llama-server PATH] [--deadline-s S] [--cpu]
    python -m dgr.bench.gpu_run summary --dir DIR

Each step reuses the bench's own parts and writes JSON as it goes:
- `cmake-args`: the Makefile's flags for `make install GPU=cuda` (llama/build.sh takes them as they are, so the
  wheel's cache key is the Makefile's own), read from the Makefile, not restated here.
- `check`: what a route imports (a dependency missing on the machine fails here, named), the Python,
  llama-cpp-python, the devices this build sees, the GPU and nvcc; exits 1 when a GPU run's build sees no CUDA
  device (nothing after it would mean anything).
- `shapes`: the random GGUFs of dgr.bench.shapes (the 1B and 8B llamas, the OLMoE-shaped MoE), their tokenizer
  from `--vocab` (the default model does not travel: 98 MB).
- `certify`: dgr.bench.certify's cases of GPU_FAMILIES with every layer on the GPU (DGR_CERTIFY_GPU=1), split
  against whole, with CUDA's op fusion on and off (GGML_CUDA_DISABLE_FUSION=1).
- `mixed`: the 1B shape in process, decoded greedily whole on the CPU, whole on the GPU, cut in two on the GPU,
  and its head on the GPU with its tail on the CPU: the tokens, and each logit distance (two backends round
  differently: ../shared/GPU.md).
- `bench`: per model, every setup up at once and measured in alternating rounds (dgr.bench.paired): dgr's routes
  of 1, 2 and 3 nodes sharing the GPU, a GPU head + CPU tail route, `--cpu-moe` on the MoE, beside
  `llama-server -ngl 99` on the same GPU; decode tok/s, the cold TTFT of the whole prompt (no prefix reuse, no
  prompt cache) and of a short prompt no round has seen, and each process's GPU memory (nvidia-smi). A model's
  rows are written as soon as it is done; a rerun skips the models already in --out; a model that cannot end
  before --deadline-s is not started; a setup that does not start is reported and the others measured; it
  exits 3 unless every model is in --out.
- `summary`: the run as Markdown, for docs/perf (docs/perf/README.md says where it goes).

`--cpu` runs every step on the CPU with tiny shapes: the plumbing, checked where there is no GPU. `--tiny` takes
the tiny shapes on the GPU the build sees (Mesa's lavapipe here, with GGML_VK_VISIBLE_DEVICES=0 and the Vulkan
build): the GPU placements' plumbing (every layer on the device, a GPU head + CPU tail, --cpu-moe).

Left out: building (gpu/device-run.sh, llama/build.sh), and the ledger entry itself (a person writes it from
summary.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs

__all__ = ["BenchSetup", "cuda_cmake_args", "main", "setups_for", "summary"]

_ROOT = Path(__file__).resolve().parents[2]
_CARRY_COMMIT = _ROOT / ".gpu-carry" / "commit.txt"  # gpu/carry.sh: the commit, where .git does not travel
STORY = ("The lighthouse keeper kept a log of every ship that passed the point, the weather, the colour of the "
         "sea at dawn and the birds that rested on the rail. ")


def _log(msg: str) -> None:
    print(f"[gpu-run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- cmake-args -------------------------------------------------------------------------------------
def cuda_cmake_args(makefile: Path, archs: str) -> str:
    """LLAMA_PY_CMAKE_ARGS as the Makefile has it with GPU=cuda CUDA_ARCHS=`archs`, one space between flags."""
    text = makefile.read_text()
    text = re.sub(r"\\\n\s*", " ", text)  # continued lines
    base = re.search(r"^LLAMA_CMAKE_ARGS := (.+)$", text, re.M).group(1).split()
    py = re.search(r"^LLAMA_PY_CMAKE_ARGS := (.+)$", text, re.M).group(1).split()
    cuda = re.search(r"^else ifeq \(\$\(GPU\),cuda\)\nLLAMA_PY_CMAKE_ARGS \+= (.+)$", text, re.M).group(1).split()
    flags = [f for f in py if f != "$(LLAMA_CMAKE_ARGS)"]
    if len(flags) + 1 != len(py):
        raise ValueError("the Makefile's LLAMA_PY_CMAKE_ARGS no longer starts from LLAMA_CMAKE_ARGS")
    out = " ".join([*base, *flags, *cuda]).replace("$(CUDA_ARCHS)", archs)
    if "$(" in out:
        raise ValueError(f"a Makefile variable left in the CUDA flags: {out}")
    return out


# -- check ------------------------------------------------------------------------------------------
def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"


def _commit() -> str:
    from dgr.bench.measure import tree_commit

    found = tree_commit()
    if found == "unknown" and _CARRY_COMMIT.is_file():
        return _CARRY_COMMIT.read_text().strip() + " (gpu/carry.sh's record: no .git here)"
    return found


_SERVING = ("dgr.cli", "dgr.up", "dgr.serve", "dgr.tracker", "dgr.backends.llama_shard", "dgr.testing.harness")


def _check(out: Path, cpu: bool) -> int:
    import importlib
    import importlib.metadata

    for name in _SERVING:  # what a route imports: a dependency missing on the machine shows here, named
        importlib.import_module(name)
    from dgr.backends.placement import devices

    info = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit(), "python": sys.version,
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"), "cpu_count": os.cpu_count(),
        "devices": devices(),
        "gpu": _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
        "nvcc": _run_text(["nvcc", "--version"]).splitlines()[-1:],
    }  # fmt: skip
    out.write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    if not cpu and not any(d["name"].startswith("CUDA") for d in info["devices"]):
        _log("this build sees no CUDA device")
        return 1
    return 0


# -- shapes -----------------------------------------------------------------------------------------
def _models(tiny: bool) -> dict[str, Any]:
    """The shapes a run measures, by the short name the results use (`tiny`: the dry run's, or a software GPU's)."""
    from dgr.bench.shapes import LLAMA_1B, LLAMA_8B, OLMOE_7B, LlamaShape

    if tiny:  # the plumbing only: seconds to write, milliseconds a token
        return {"1b": LlamaShape("gpurun-tiny-dense", n_layers=4, hidden=256, heads=4, kv_heads=2, ffn=512),
                "moe": LlamaShape("gpurun-tiny-moe", n_layers=4, hidden=256, heads=4, kv_heads=2, ffn=128,
                                  experts=8, experts_used=2)}
    return {"1b": LLAMA_1B, "8b": LLAMA_8B, "moe": OLMOE_7B}


def _model_path(key: str, vocab: Path, tiny: bool) -> Path:
    from dgr.bench.shapes import random_llama_gguf

    return random_llama_gguf(_models(tiny)[key], log=_log, vocab_from=vocab)


# -- certify ----------------------------------------------------------------------------------------
_FUSION_OFF = {"GGML_CUDA_DISABLE_FUSION": "1", "GGML_VK_DISABLE_FUSION": "1"}


def _certify(out: Path, jobs: int, cpu: bool, families: tuple[str, ...] | None = None) -> None:
    """GPU_FAMILIES (or `families`) split against whole with every layer on the GPU, op fusion on and off; one
    JSON for both."""
    from dgr.bench import certify

    pattern = "^(" + "|".join(families or certify.GPU_FAMILIES) + r")(\+moe)?$"  # no MTP variants, as on Vulkan
    runs: dict[str, Any] = {}
    saved = dict(os.environ)
    try:
        for label, env in (("fusion on", {}), ("fusion off", _FUSION_OFF)):
            os.environ.clear()
            os.environ.update(saved, **env, **({} if cpu else {"DGR_CERTIFY_GPU": "1"}))
            _log(f"certify, {label}")
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                certify.main(["--arch", pattern, "--out", f.name, "--jobs", str(jobs)])
                runs[label] = json.loads(Path(f.name).read_text())
            out.write_text(json.dumps({"on_gpu": not cpu, "runs": runs}, indent=1))
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- mixed ------------------------------------------------------------------------------------------
def _mixed(model: Path, out: Path, cpu: bool, threads: int) -> None:
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.placement import Placement
    from dgr.bench.certify import _greedy, _prompt
    from dgr.gguf_meta import read_header

    n_layer = read_header(model).n_layer
    cut = n_layer // 2
    cpu_p, gpu_p = Placement(), (Placement() if cpu else Placement(gpu_layers=-1))

    def decode(stages: list[tuple[tuple[int, int] | None, Placement]]) -> tuple[list[int], Any]:
        engines = []
        try:
            for layers, p in stages:
                engines.append(LlamaEngine.load(model, layers=layers, n_threads=threads, n_seq_max=1,
                                                n_ctx_seq=256, placement=p))
            return _greedy(engines, _prompt(engines[0].n_vocab))
        finally:
            for e in engines:
                e.close()

    runs = {
        "whole on the CPU": decode([(None, cpu_p)]),
        "whole on the GPU": decode([(None, gpu_p)]),
        "cut in two on the GPU": decode([((0, cut), gpu_p), ((cut, n_layer), gpu_p)]),
        "GPU head + CPU tail": decode([((0, cut), gpu_p), ((cut, n_layer), cpu_p)]),
    }
    import numpy as np

    def dist(a: str, b: str) -> float:
        return float(np.max(np.abs(runs[a][1] - runs[b][1])))

    res = {
        "model": model.name, "n_layer": n_layer, "cut": cut, "on_gpu": not cpu,
        "tokens": {k: v[0] for k, v in runs.items()},
        "max_logit_diff": {
            "GPU cut in two vs whole on the GPU": dist("cut in two on the GPU", "whole on the GPU"),
            "GPU head + CPU tail vs whole on the CPU": dist("GPU head + CPU tail", "whole on the CPU"),
            "whole on the GPU vs whole on the CPU": dist("whole on the GPU", "whole on the CPU"),
        },
        "logit_spread": float(np.ptp(runs["whole on the CPU"][1])),
    }  # fmt: skip
    res["split_equals_whole_on_gpu"] = res["max_logit_diff"]["GPU cut in two vs whole on the GPU"] == 0.0
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


# -- bench ------------------------------------------------------------------------------------------
@attrs.frozen
class BenchSetup:
    """One setup of a model's paired rounds: a dgr route (`backend`, `nodes`, `gpu_layers` as dgr up takes it,
    `cpu_moe`) or, with `server`, llama-server with `server_flags`."""

    label: str
    server: bool = False
    server_flags: tuple[str, ...] = ()
    backend: str = "llama_shard"
    nodes: int = 2
    gpu_layers: str = "all"
    cpu_moe: bool = False


def setups_for(moe: bool, cpu: bool) -> list[BenchSetup]:
    """A model's setups, the baseline first: every ratio is taken against it. On the CPU (--cpu, the dry run)
    nothing offloads: no -ngl, no --cpu-moe, no mixed route."""
    where, gl = ("CPU", "0") if cpu else ("GPU", "all")
    # llama.cpp's flash attention stays off, as dgr's engine has it (llama_engine: its rounding differs)
    server = ("llama-server", ("-fa", "off")) if cpu else ("llama-server -ngl 99", ("-ngl", "99", "-fa", "off"))
    out = [BenchSetup(server[0], server=True, server_flags=server[1])]
    if moe:
        out.append(BenchSetup(f"dgr 2-node ring, {where}", gpu_layers=gl))
        if not cpu:
            out += [BenchSetup(f"{server[0]} --cpu-moe", server=True, server_flags=(*server[1], "--cpu-moe")),
                    BenchSetup("dgr 2-node ring, GPU, --cpu-moe", gpu_layers=gl, cpu_moe=True)]
        return out
    out += [BenchSetup(f"dgr llama, 1 node, {where}", backend="llama", nodes=1, gpu_layers=gl),
            BenchSetup(f"dgr 2-node ring, {where}", gpu_layers=gl),
            BenchSetup(f"dgr 3-node ring, {where}", nodes=3, gpu_layers=gl)]
    if not cpu:
        out.append(BenchSetup("dgr 2-node ring, GPU head + CPU tail", gpu_layers="all,0"))
    return out


@attrs.frozen
class _Running:
    setup: BenchSetup
    api: str
    model: str
    pids: tuple[int, ...]
    layers: tuple[str, ...] = ()


def _start(s: BenchSetup, model: Path, threads: int, ctx: int, server_bin: Path, stack: ExitStack) -> _Running:
    """Start one setup and wait until it serves; its close goes on `stack`."""
    if s.server:
        from dgr.bench.peers import LlamaServer, PeerTools

        tools = PeerTools(server_bin, server_bin, "local")  # only the server is used
        srv = stack.enter_context(LlamaServer(tools, str(model), threads, ctx, extra=s.server_flags))
        return _Running(s, srv.api, "x", (srv.child.popen.pid,))
    import httpx

    from dgr.testing.harness import LocalRoute

    extra = ("--model", str(model), "--threads", str(threads), "--ctx", str(ctx), "--prefill-chunk", "512",
             "--max-sessions", "2", "--no-prefix-reuse", "--gpu-layers", s.gpu_layers,
             *(("--cpu-moe",) if s.cpu_moe else ()))
    route = stack.enter_context(LocalRoute(backend=s.backend, nodes=s.nodes, extra=extra, ready_timeout_s=600,
                                           busy_poll_ms=None))  # the product's default
    name = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
    nodes = route.node_table()
    return _Running(s, route.api, name, (route.proc.pid, *(n["pid"] for n in nodes if n.get("pid"))),
                    tuple(sorted(f"{n['node']} {n['layers']}" for n in nodes)))


def _gpu_memory() -> dict[int, float]:
    """MiB of GPU memory per process, as nvidia-smi lists them (empty where there is none)."""
    text = _run_text(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            out[int(parts[0])] = float(parts[1]) if parts[1].replace(".", "").isdigit() else 0.0
    return out


def _prompt_ids(model: Path, n: int) -> list[int]:
    from dgr.backends.gguf_text import GgufText

    ids = GgufText.load(model).tokenize(STORY * (n // 20 + 2), add_special=True, parse_special=False)
    return ids[:n]


def _bench_model(key: str, model: Path, cfg: argparse.Namespace, server_bin: Path) -> dict[str, Any]:
    from dgr.bench.paired import PairedSetup, ratios, run_paired

    moe = bool(_models(cfg.tiny)[key].experts)
    plan = setups_for(moe, cfg.cpu)
    ctx = cfg.prompt_tokens + cfg.decode_tokens + 64
    prompt = _prompt_ids(model, cfg.prompt_tokens)
    text = _prompt_ids(model, cfg.short_tokens * (cfg.rounds + 1))
    n = cfg.short_tokens
    shorts = [text[:1] + text[1 + r * n:(r + 1) * n] for r in range(cfg.rounds)]  # BOS, then a slice no round shares
    running: dict[str, _Running] = {}
    info: dict[str, dict[str, Any]] = {}
    gpu_used: dict[str, float | None] = {}
    errors: dict[str, str] = {}

    def setups(stack: ExitStack) -> list[PairedSetup]:
        # Every setup starts at once (loading is most of a start); each one's close goes on the caller's stack.
        # A child started from a worker thread dies when that thread ends (PR_SET_PDEATHSIG: dgr.procs,
        # dgr.testing.launcher), so the workers live until every setup is closed: the pool's shutdown is the
        # stack's first entry, run last; and the route launcher is started from this thread.
        from dgr.testing.launcher import prestart

        prestart()
        pool = ThreadPoolExecutor(len(plan), thread_name_prefix="gpu-run-start")
        stack.callback(pool.shutdown)

        def one(s: BenchSetup) -> _Running | str:
            own = ExitStack()
            try:
                t0 = time.monotonic()
                run = _start(s, model, cfg.threads, ctx, server_bin, own)
            except Exception as exc:  # noqa: BLE001 (whatever stops a setup: reported, and the others measured)
                own.close()
                return f"{type(exc).__name__}: {str(exc)[-1500:]}"
            stack.push(own.pop_all())  # ExitStack.push from worker threads: list appends, one at a time (GIL)
            _log(f"{key}: {s.label} up in {time.monotonic() - t0:.1f} s")
            return run

        for s, got in zip(plan, pool.map(one, plan)):
            if isinstance(got, str):
                errors[s.label] = got
                _log(f"{key}: {s.label} did not start: {got[:300]}")
            else:
                running[s.label] = got
        memory = _gpu_memory()  # empty where nvidia-smi lists no process (or there is none)
        used = _run_text(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        gpu_used["MiB, every setup up"] = float(used) if used.replace(".", "").isdigit() else None
        for label, run in running.items():
            by_pid = {pid: memory[pid] for pid in run.pids if pid in memory}
            info[label] = {"setup": attrs.asdict(run.setup), "nodes": list(run.layers), "gpu_mib": by_pid,
                           "gpu_mib_total": sum(by_pid.values()) if memory else None}
        no_cache = {"cache_prompt": False}  # llama-server's prompt cache would answer the repeated prompt
        return [PairedSetup(label, r.api, r.model, no_cache if r.setup.server else None)
                for label, r in running.items()]

    labels, base = [s.label for s in plan], plan[0].label
    t0 = time.monotonic()
    paired = run_paired(setups, prompt, cfg.decode_tokens, cfg.rounds, _log, STORY, shorts=shorts,
                        ttft_labels=set(labels))
    table = tuple((f"{label} / {base}", label, base, 0.0) for label in labels[1:])
    # --cpu-moe against --cpu-moe too: the experts' CPU time is in both
    servers_moe = [s.label for s in plan if s.server and "--cpu-moe" in s.server_flags]
    table += tuple((f"{s.label} / {m}", s.label, m, 0.0) for s in plan if s.cpu_moe for m in servers_moe)
    return {
        "model": model.name, "shape": _shape_json(_models(cfg.tiny)[key]), "seconds": round(time.monotonic() - t0, 1),
        "baseline": base, "setups": info, "gpu_used": gpu_used, "errors": errors, "threads": cfg.threads, "prompt_tokens": len(prompt),
        "decode_tokens": cfg.decode_tokens, "short_tokens": n, "rounds": cfg.rounds,
        "decode_tok_s": paired["rates"], "prompt_ttft_s": paired["prompt_ttft"], "short_ttft_s": paired["ttft"],
        "decode_ratio": _medians(ratios(paired["rates"], table)),
        "prompt_ttft_ratio": _medians(ratios(paired["prompt_ttft"], table)),
        "short_ttft_ratio": _medians(ratios(paired["ttft"], table)),
    }  # fmt: skip


def _shape_json(shape: Any) -> dict[str, Any]:
    return {**attrs.asdict(shape, filter=lambda a, _v: a.name != "quant"), "quant": shape.quant.name,
            "params": shape.params()}


def _medians(r: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {"median": v["median"], "per_round": v["per_round"]} for k, v in r.items()}


def _bench(cfg: argparse.Namespace) -> int:
    out = Path(cfg.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    results.setdefault("models", {})
    results.update(commit=_commit(), device=_run_text(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
                   if not cfg.cpu else "cpu (dry run)")
    if cfg.llama_server:
        server_bin = Path(cfg.llama_server)
    else:
        from dgr.bench.peers import ensure_tools

        server_bin = ensure_tools(_log).server  # the CPU build of the dry run
    deadline = time.monotonic() + cfg.deadline_s
    # the least a model takes here, all its setups started and measured: skip one that cannot end in time
    least = {"1b": 60, "8b": 120, "moe": 100} if not cfg.tiny else {}
    for key in cfg.models.split(","):
        if key in results["models"]:
            _log(f"{key}: already measured")
            continue
        left = deadline - time.monotonic()
        if left < least.get(key, 0):
            _log(f"{key}: skipped, {left:.0f} s left")
            results.setdefault("skipped", {})[key] = f"{left:.0f} s left of the deadline"
            continue
        model = _model_path(key, Path(cfg.vocab), cfg.tiny)
        _log(f"{key}: {model.name}")
        try:
            results["models"][key] = _bench_model(key, model, cfg, server_bin)
        except Exception:  # noqa: BLE001 (a model whose rounds broke: its traceback kept, the next model measured)
            results.setdefault("failed", {})[key] = traceback.format_exc()[-3000:]
            _log(f"{key}: failed:\n{results['failed'][key]}")
        else:
            for k in ("skipped", "failed"):
                results.get(k, {}).pop(key, None)
        out.write_text(json.dumps(results, indent=1))
        _log(f"{key}: written to {out}")
    out.write_text(json.dumps(results, indent=1))
    # not every model measured: the step is not done, and a rerun measures the rest
    return 0 if all(k in results["models"] for k in cfg.models.split(",")) else 3


# -- summary ----------------------------------------------------------------------------------------
def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _med(xs: list[float] | None) -> float | None:
    xs = [x for x in xs or [] if x]
    return statistics.median(xs) if xs else None


def summary(folder: Path) -> str:
    """The run's figures as Markdown, from the JSON files the steps wrote into `folder`."""
    env, cert, mixed, bench = (_load(folder / n) for n in ("env.json", "certify.json", "mixed.json", "bench.json"))
    lines = ["# GPU run (issue 53)", ""]
    if env:
        lines += [f"- **Device:** {env.get('gpu')}; {', '.join(d['name'] + ' ' + d['description'] for d in env['devices'])}",
                  f"- **Commit:** {env.get('commit')}; **started:** {env.get('started')}; llama-cpp-python "
                  f"{env.get('llama_cpp_python')} (dgr's patches), Python {env.get('python', '').split()[0]}, "
                  f"{env.get('cpu_count')} cores; nvcc: {' '.join(env.get('nvcc') or [])}"]
    if cert:
        lines += ["", f"## Split == whole, every layer on the {'GPU' if cert.get('on_gpu') else 'CPU (dry run)'}", "",
                  "| case | " + " | ".join(cert["runs"]) + " |", "|---|" + "---|" * len(cert["runs"])]
        names = [c["case"] for c in next(iter(cert["runs"].values()))["cases"]]
        for name in names:
            cells = []
            for run in cert["runs"].values():
                c = next((c for c in run["cases"] if c["case"] == name), None)
                if c is None:
                    cells.append("not run")
                    continue
                diff = "" if c.get("max_diff") is None else f" ({c['max_diff']:.3g})"
                cells.append(f"{c['result']}{diff}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [""] + [f"{label}: {sum(c['result'] == 'certified' for c in run['cases'])} of {len(run['cases'])} "
                         f"certified in {run['seconds']} s" for label, run in cert["runs"].items()]
    if mixed:
        lines += ["", f"## One model cut on the GPU, and a GPU head + CPU tail ({mixed['model']}, cut at "
                  f"{mixed['cut']} of {mixed['n_layer']})", ""]
        lines += [f"- {k}: largest logit difference {v:.4g}" for k, v in mixed["max_logit_diff"].items()]
        lines += [f"- logits' spread (max - min, whole on the CPU): {mixed['logit_spread']:.4g}",
                  f"- greedy tokens: {json.dumps(mixed['tokens'])}"]
    for key, m in ((bench or {}).get("models") or {}).items():
        s = m["shape"]
        lines += ["", f"## {m['model']}: {s['n_layers']} x {s['hidden']}, {s['params'] / 1e9:.2f}B weights"
                  + (f", {s['experts']} experts ({s['experts_used']} used)" if s.get("experts") else "")
                  + f"; {m['rounds']} paired rounds, {m['threads']} threads a process",
                  "", f"Prompt {m['prompt_tokens']} tokens, {m['decode_tokens']} decoded, short prompt "
                  f"{m['short_tokens']}; medians over rounds; ratios are medians of each round's ratio to "
                  f"{m['baseline']}.",
                  "", "| setup | decode tok/s | ratio | TTFT prompt s | ratio | TTFT short s | GPU MiB | nodes |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, info in m["setups"].items():
            r = f"{label} / {m['baseline']}"
            dr, tr = (m[k].get(r, {}).get("median") for k in ("decode_ratio", "prompt_ttft_ratio"))
            lines.append(f"| {label} | {_fmt(_med(m['decode_tok_s'].get(label)))} | {_fmt(dr, '.2f')} | "
                         f"{_fmt(_med(m['prompt_ttft_s'].get(label)), '.3f')} | {_fmt(tr, '.2f')} | "
                         f"{_fmt(_med(m['short_ttft_s'].get(label)), '.3f')} | {_fmt(info.get('gpu_mib_total'), '.0f')} | "
                         f"{'; '.join(info.get('nodes') or [])} |")
        for r, v in m["decode_ratio"].items():
            if not r.endswith(f" / {m['baseline']}"):
                tr = m["prompt_ttft_ratio"].get(r, {}).get("median")
                lines.append(f"- {r}: decode {v['median']:.2f}, prompt TTFT {_fmt(tr, '.2f')}")
        if (m.get("gpu_used") or {}).get("MiB, every setup up") is not None:
            lines.append(f"- GPU memory used with every setup up: {m['gpu_used']['MiB, every setup up']:.0f} MiB")
        lines += [f"- {label} did not start: {err[:300]}" for label, err in m.get("errors", {}).items()]
    for key, why in ((bench or {}).get("skipped") or {}).items():
        lines.append(f"- {key}: not measured ({why})")
    for key, why in ((bench or {}).get("failed") or {}).items():
        lines.append(f"- {key}: failed: {why.strip().splitlines()[-1][:300]}")
    return "\n".join(lines) + "\n"


# -- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.bench.gpu_run", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("cmake-args")
    p.add_argument("--cuda-archs", default="90")
    p = sub.add_parser("check")
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true")
    p = shapes_p = sub.add_parser("shapes")
    p.add_argument("--vocab", required=True)
    p.add_argument("--models", default=None, help="comma-separated keys (default: all of the run's)")
    p.add_argument("--done", default=None, help="a file to touch once every shape is written")
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("certify")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--families", default=None, help="comma-separated architectures (default: GPU_FAMILIES)")
    p.add_argument("--cpu", action="store_true")
    p = mixed_p = sub.add_parser("mixed")
    p.add_argument("--vocab", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--cpu", action="store_true")
    p = bench_p = sub.add_parser("bench")
    p.add_argument("--vocab", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--llama-server", default=None, help="the binary (default: dgr.bench.peers' CPU build)")
    p.add_argument("--models", default=None, help="comma-separated: 1b,8b,moe (default: all of the run's)")
    p.add_argument("--threads", type=int, default=8, help="threads of each process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--short-tokens", type=int, default=50)
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no model that cannot end by then")
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("summary")
    p.add_argument("--dir", required=True)
    for p in (shapes_p, mixed_p, bench_p):
        p.add_argument("--tiny", action="store_true", help="the dry run's tiny shapes on whatever device (--cpu: the CPU)")
    args = ap.parse_args(argv)
    if hasattr(args, "tiny"):
        args.tiny = args.tiny or args.cpu

    if args.cmd == "cmake-args":
        print(cuda_cmake_args(_ROOT / "Makefile", args.cuda_archs))
        return 0
    if args.cmd == "check":
        return _check(Path(args.out), args.cpu)
    if args.cmd == "shapes":
        for key in (args.models or ",".join(_models(args.tiny))).split(","):
            print(_model_path(key, Path(args.vocab), args.tiny), flush=True)
        if args.done:
            Path(args.done).touch()
        return 0
    if args.cmd == "certify":
        _certify(Path(args.out), args.jobs, args.cpu, tuple(args.families.split(",")) if args.families else None)
        return 0
    if args.cmd == "mixed":
        _mixed(_model_path("1b", Path(args.vocab), args.tiny), Path(args.out), args.cpu, args.threads)
        return 0
    if args.cmd == "bench":
        args.models = args.models or ",".join(_models(args.tiny))
        return _bench(args)
    text = summary(Path(args.dir))
    (Path(args.dir) / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
