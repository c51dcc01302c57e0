"""Certify architectures for layer ranges: split tiny random models, compare bit for bit with the whole.

    python -m dgr.bench.certify [--arch REGEX] [--out FILE] [--timeout S] [--keep DIR] [--tile-mrope-positions]
                                [--jobs N]

For each architecture in dgr.testing.arch_table.ARCHS (and the MoE variant
of those where it is optional, named ARCH+moe, and with an MTP layer where the
table has that variant, ARCH+mtp), in a temporary folder:
1. a child process writes the tiny GGUF (made by libllama itself), loads it
   whole with LlamaEngine, and greedy-decodes N_NEW tokens after a prompt of
   N_PROMPT token ids, keeping each step's logits;
2. for each split of ARCHS[arch].splits, another child loads the stages
   [0, b1) [b1, b2) ... [bk, n_layer) from the same file through the
   layer-range API, chains them (token ids into the first stage, each later
   stage takes the hidden states the previous one returned) and decodes the
   same way; its tokens and logits must equal the whole model's exactly;
   a later stage also takes the token ids where the model's layers read
   them (DeepSeek-V4). The whole model's seam is recorded: its width, the
   token-id sideband, and positions per hidden-state row (M-RoPE: 4).

Every load and decode runs in a child, one at a time, each bounded by a
timeout, because llama.cpp may abort. Per case the result is:
- certified: at every split the same tokens and max |diff| of the logits 0.0;
- differs: some split decodes other tokens or logits (max |diff| given);
- fails: a range was refused or its decode failed with an error (the reason);
- crashes: a range's process died (exit code and llama.cpp's last lines);
- timeout: a child ran past --timeout;
- no-whole: the whole tiny model does not load or decode (not a range
  problem: the architecture's tiny model is not constructible here);
- unbuildable: llama.cpp could not make the model from the metadata;
- nonfinite: splits equal the whole, but its logits are not finite, so the
  check means little.
Prints a table (each split as BOUNDS:ok|diff|fail|crash|timeout)
and writes every detail as JSON to --out.

--tile-mrope-positions is a diagnostic for M-RoPE models (qwen2vl, qwen3vl,
qwen35, glm4 with rope sections, ...): llama.cpp reads the positions of a
hidden-state batch section-major, n_pos_per_embd (4) per row, while
LlamaEngine gives one per row; with this flag the split children hand
llama.cpp each row's position repeated for every section (what a token batch
broadcasts), to show whether that is all that differs.

--jobs N certifies N cases at once (each still one child at a time); the GPU
runs (DGR_CERTIFY_GPU=1, gpu/device-run.sh) use it, where every child pays for
a device context. GPU_FAMILIES are the families the GPU tiers certify.

Left out: real checkpoints and quantized weights (tests/test_families.py and
the audits do those), batches of several sequences, chunked prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = ["Case", "GPU_FAMILIES", "cases", "certify_here", "main", "run_case"]

N_PROMPT = 24
N_NEW = 8
N_CTX_SEQ = 256
TIMEOUT_S = 120.0
SEED = 0
# what the GPU tiers certify (tests_gpu on Vulkan, gpu/device-run.sh on CUDA): dense, SWA by global index, MoE,
# hybrid (attention + recurrent), recurrent, DeepSeek-V4 (4 x n_embd seam, token ids), fused QKV, MLA
GPU_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "granitehybrid", "mamba",
                "deepseek2", "deepseek4")
_SEVERITY = ["certified", "nonfinite", "differs", "fails", "timeout", "crashes", "no-whole", "unbuildable"]


@attrs.frozen
class Case:
    """One model to certify: an architecture, dense or MoE, with or without an MTP layer; named ARCH, or ARCH+moe
    where MoE is optional, or ARCH+mtp."""

    arch: str
    moe: bool
    name: str
    mtp: bool = False


def cases(pattern: str | None = None) -> list[Case]:
    """Every case of the table, in table order; `pattern` (a regex) searched in the case name."""
    from dgr.testing.arch_table import ARCHS

    out: list[Case] = []
    for arch, spec in ARCHS.items():
        variants = {"no": [False], "only": [True], "optional": [False, True]}[spec.moe]
        for moe in variants:
            name = f"{arch}+moe" if moe and spec.moe == "optional" else arch
            for mtp in (False, True) if spec.mtp else (False,):
                full = name + "+mtp" if mtp else name
                if pattern is None or re.search(pattern, full):
                    out.append(Case(arch, moe, full, mtp))
    return out


# -- the children -----------------------------------------------------------------------------------
def _prompt(n_vocab: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, n_vocab, N_PROMPT, dtype=np.int32)  # int32 [N_PROMPT]


def _greedy(engines: list[Any], prompt: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Chain the stages over the prompt, then decode N_NEW tokens greedily; logits float32 [N_NEW, n_vocab]."""

    def step(tokens: np.ndarray, pos: int) -> np.ndarray:
        x = None
        for i, e in enumerate(engines):
            if len(engines) > 1:
                _stage(f"decode {e.layer_start}:{e.layer_start + e.n_layer} at position {pos}")
            # a later stage takes the token ids too where the model's layers read them (DeepSeek-V4)
            x = e.eval(0, pos, tokens if i == 0 or e.takes_tokens else None, None if i == 0 else x)
        return x  # float32 [n_vocab]

    logits = step(prompt, 0)
    kept, tokens, pos = [], [], len(prompt)
    for _ in range(N_NEW):
        kept.append(logits)
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == N_NEW:
            break
        logits = step(np.array([tokens[-1]], np.int32), pos)
        pos += 1
    return tokens, np.stack(kept)


def _load(path: Path, layers: tuple[int, int] | None) -> Any:
    """Layers `layers` of the model at `path`; every layer on the GPU where DGR_CERTIFY_GPU=1 (`make test-gpu`
    certifies split against whole there, each side on the same device)."""
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.placement import Placement

    placement = Placement(gpu_layers=-1) if os.environ.get("DGR_CERTIFY_GPU") == "1" else Placement()
    return LlamaEngine.load(path, layers=layers, n_threads=1, n_seq_max=1, n_ctx_seq=N_CTX_SEQ, placement=placement)


def _emit(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def _stage(name: str) -> None:
    print(f"STAGE {name}", flush=True)


def _child_whole(arch: str, moe: bool, mtp: bool, folder: Path) -> None:
    _emit(_whole(arch, moe, mtp, folder))


def _whole(arch: str, moe: bool, mtp: bool, folder: Path) -> dict[str, Any]:
    """Build the tiny model and decode it whole: writes ref.npz next to the GGUF."""
    from dgr.backends.clib import llama_lib
    from dgr.errors import DgrError
    from dgr.testing.arch_models import write_arch_gguf

    path = folder / "model.gguf"
    _stage("build")
    try:
        write_arch_gguf(arch, path, moe=moe, mtp=mtp, seed=SEED)
    except (RuntimeError, ValueError) as e:
        return {"result": "unbuildable", "detail": str(e)}
    _stage("whole")
    try:
        e = _load(path, None)
        try:
            tokens, logits = _greedy([e], _prompt(e.n_vocab))
            seam = {"n_embd": llama_lib().llama_model_n_embd(e._model), "token_ids": e.seam_tokens,
                    "positions": e.n_pos_per_row}
        finally:
            e.close()
        # what crosses a boundary of this model, as libllama reports it for a range that ends early
        head = _load(path, (0, 1))
        seam["width"] = head.n_embd_out
        head.close()
    except DgrError as exc:
        return {"result": "no-whole", "detail": exc.message}
    np.savez(folder / "ref.npz", tokens=np.array(tokens), logits=logits)
    return {
        "result": "ok",
        "tokens": tokens,
        "seam": seam,
        "finite": bool(np.isfinite(logits).all()),
        "spread": float(np.nanmax(logits) - np.nanmin(logits)) if np.isfinite(logits).any() else 0.0,
    }  # fmt: skip


def _tile_positions() -> None:
    """Make LlamaEngine give a hidden-state batch its positions section-major, GGML_MROPE_SECTIONS times."""
    import ctypes

    from dgr.backends.llama_engine import LlamaEngine

    orig = LlamaEngine._llama_batch
    keep: list[np.ndarray] = []

    def batch(self: LlamaEngine, n: int, embd: np.ndarray | None) -> Any:
        b = orig(self, n, embd)
        if embd is not None:
            keep[:] = [np.tile(self._batch.pos[:n], 4).astype(np.int32)]  # int32 [4 * n]
            b.pos = keep[0].ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        return b

    LlamaEngine._llama_batch = batch  # type: ignore[method-assign]


def _child_split(folder: Path, bounds: list[int]) -> None:
    if os.environ.get("DGR_CERTIFY_TILE_POSITIONS") == "1":
        _tile_positions()
    _emit(_split(folder, bounds))


def _split(folder: Path, bounds: list[int]) -> dict[str, Any]:
    """Decode through the stages cut at `bounds` and compare with ref.npz."""
    from dgr.gguf_meta import read_header
    from dgr.errors import DgrError

    path = folder / "model.gguf"
    ref = np.load(folder / "ref.npz")
    n_layer = read_header(path).n_layer
    edges = [0, *bounds, n_layer]
    engines: list[Any] = []
    try:
        for a, b in zip(edges, edges[1:]):
            _stage(f"load {a}:{b}")
            engines.append(_load(path, (a, b)))
        _stage("decode")
        tokens, logits = _greedy(engines, _prompt(engines[0].n_vocab))
    except DgrError as exc:
        return {"result": "fails", "detail": f"{exc.reason.value}: {exc.message}"}
    finally:
        for e in engines:
            e.close()
    want = ref["logits"]
    same_tokens = tokens == [int(t) for t in ref["tokens"]]
    identical = logits.shape == want.shape and bool(np.array_equal(logits, want, equal_nan=True))
    with np.errstate(invalid="ignore"):
        diff = float(np.nanmax(np.abs(logits - want))) if logits.shape == want.shape else float("inf")
    return {
        "result": "certified" if identical and same_tokens else "differs",
        "max_diff": diff,
        "same_tokens": same_tokens,
        "tokens": tokens,
    }  # fmt: skip


def certify_here(case: Case, folder: Path) -> dict[str, Any]:
    """Case `case` in this process, no child and no timeout: for a gate over cases known not to crash.

    Returns {"whole": ..., "per_split": [...]} as the children report them.
    """
    from dgr.testing.arch_table import ARCHS

    whole = _whole(case.arch, case.moe, case.mtp, folder)
    if whole["result"] != "ok":
        return {"whole": whole, "per_split": []}
    return {"whole": whole, "per_split": [{**_split(folder, list(b)), "split": list(b)} for b in ARCHS[case.arch].splits]}


# -- the parent -------------------------------------------------------------------------------------
def _run_child(args: list[str], timeout: float, tile: bool = False) -> dict[str, Any]:
    """Run this module as a child; its RESULT, or what killed it."""
    env = dict(os.environ, DGR_LLAMA_LOG="1", GGML_NO_BACKTRACE="1", OMP_NUM_THREADS="1")
    if tile:
        env["DGR_CERTIFY_TILE_POSITIONS"] = "1"
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dgr.bench.certify", *args],
            capture_output=True, text=True, timeout=timeout, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stages = re.findall(r"^STAGE (.*)$", out, re.M)
        return {"result": "timeout", "stage": stages[-1] if stages else "", "detail": f"over {timeout:.0f} s",
                "seconds": round(time.monotonic() - t0, 2)}  # fmt: skip
    stages = re.findall(r"^STAGE (.*)$", proc.stdout, re.M)
    results = re.findall(r"^RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode == 0 and results:
        got = json.loads(results[-1])
    else:
        got = {"result": "crashes", "exit": _exit_name(proc.returncode), "detail": _last_lines(proc.stderr)}
    got["stage"] = stages[-1] if stages else ""
    got["seconds"] = round(time.monotonic() - t0, 2)
    return got


def _exit_name(code: int) -> str:
    """An exit status as the report shows it: SIGSEGV for -11, else the number."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return str(code)


def _last_lines(stderr: str, n: int = 3) -> str:
    """llama.cpp's last meaningful lines: an abort message, or the log just before the process died."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().strip(".") and "set_abort_callback" not in ln]
    keep = [ln for ln in lines if re.search(r"error|GGML_ASSERT|GGML_ABORT|abort|failed|what\(\)|terminate", ln, re.I)]
    text = " | ".join((keep or lines)[-n:])
    return re.sub(r"\S*/vendor/llama\.cpp/", "", text)[-600:]


def run_case(
    case: Case, root: Path, timeout: float = TIMEOUT_S, tile: bool = False, keep: bool = False
) -> dict[str, Any]:
    """Build, decode whole and decode every split of one case; the record for the report.

    The case's GGUF is written under `root` and removed at the end unless `keep`.
    """
    try:
        return _run_case(case, root, timeout, tile)
    finally:
        if not keep:
            shutil.rmtree(root / _folder_name(case), ignore_errors=True)


def _folder_name(case: Case) -> str:
    return case.name.replace("+", "_")


def _run_case(case: Case, root: Path, timeout: float, tile: bool) -> dict[str, Any]:
    from dgr.testing.arch_table import ARCHS

    spec = ARCHS[case.arch]
    folder = root / _folder_name(case)
    folder.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {
        "case": case.name, "arch": case.arch, "moe": case.moe, "mtp": case.mtp, "n_layer": spec.n_layer,
        "splits": [list(s) for s in spec.splits],
        "why": spec.why, "expect": spec.expect, "tiled_positions": tile,
    }  # fmt: skip
    whole = _run_child(["--child-whole", case.arch, "1" if case.moe else "0", "1" if case.mtp else "0", str(folder)],
                       timeout)
    rec["whole"] = whole
    if whole["result"] != "ok":
        # a crash while building is "unbuildable", while loading or decoding whole "no-whole"
        res = whole["result"]
        if res in ("crashes", "timeout"):
            res = "unbuildable" if whole.get("stage") == "build" else "no-whole"
        how = whole["result"] + (f" ({whole['exit']})" if "exit" in whole else "")
        rec.update(result=res, max_diff=None, detail=f"{how}: {whole.get('detail', '')}".strip())
        return rec
    per: list[dict[str, Any]] = []
    for bounds in spec.splits:
        got = _run_child(["--child-split", str(folder), ",".join(map(str, bounds))], timeout, tile)
        got["split"] = list(bounds)
        per.append(got)
    rec["per_split"] = per
    worst = max(per, key=lambda p: _SEVERITY.index(p["result"]))
    res = worst["result"]
    if res == "certified" and not whole.get("finite", True):
        res = "nonfinite"
    diffs = [p["max_diff"] for p in per if p.get("max_diff") is not None]
    rec["max_diff"] = max(diffs) if diffs else None
    rec["result"] = res
    if res in ("fails", "crashes", "timeout"):
        where = f"split {'|'.join(map(str, worst['split']))} at {worst.get('stage', '')}"
        rec["detail"] = f"{where}: exit {worst.get('exit')}: {worst.get('detail', '')}" if res == "crashes" \
            else f"{where}: {worst.get('detail', '')}"  # fmt: skip
    elif res == "differs":
        bad = [p for p in per if p["result"] == "differs"]
        rec["detail"] = "; ".join(
            f"split {'|'.join(map(str, p['split']))}: max diff {p['max_diff']:.3g}"
            + ("" if p["same_tokens"] else ", other tokens")
            for p in bad
        )
    else:
        rec["detail"] = f"tokens {whole['tokens']}" + ("" if whole.get("finite", True) else " (non-finite logits)")
    return rec


_SHORT = {"certified": "ok", "differs": "diff", "fails": "fail", "crashes": "crash", "timeout": "timeout"}


def _marks(runs: list[dict[str, Any]] | None, bounds: list[list[int]]) -> str:
    """Each split as BOUNDS:outcome, or just the bounds when it did not run."""
    if not runs:
        return " ".join("|".join(map(str, b)) for b in bounds)
    return " ".join("|".join(map(str, p["split"])) + ":" + _SHORT.get(p["result"], p["result"]) for p in runs)


def _table(records: list[dict[str, Any]]) -> str:
    rows = [("case", "layers", "splits", "result", "max |diff|", "detail")]
    for r in records:
        diff = "" if r.get("max_diff") is None else f"{r['max_diff']:.3g}"
        splits = _marks(r.get("per_split"), r["splits"])
        rows.append((r["case"], str(r["n_layer"]), splits, r["result"], diff, r.get("detail", "")[:160]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child-whole"]:  # --child-whole ARCH MOE MTP FOLDER
        _child_whole(argv[1], argv[2] == "1", argv[3] == "1", Path(argv[4]))
        return 0
    if argv[:1] == ["--child-split"]:  # --child-split FOLDER B1,B2,...
        _child_split(Path(argv[1]), [int(b) for b in argv[2].split(",")])
        return 0
    ap = argparse.ArgumentParser(prog="python -m dgr.bench.certify", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default=None, help="regex searched in the case names (ARCH or ARCH+moe)")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds each child may run")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write the tiny GGUFs here and keep them")
    ap.add_argument("--tile-mrope-positions", action="store_true",
                    help="diagnostic: give hidden-state batches their positions once per M-RoPE section")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="cases certified at once")
    args = ap.parse_args(argv)
    todo = cases(args.arch)
    if not todo:
        print(f"no case matches {args.arch!r}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dgr-certify-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)

        def one(case: Case) -> dict[str, Any]:
            rec = run_case(case, root, args.timeout, args.tile_mrope_positions, keep=bool(args.keep))
            diff = "" if rec.get("max_diff") is None else f" (max |diff| {rec['max_diff']:.3g})"
            print(f"{case.name}: {rec['result']}{diff}", file=sys.stderr, flush=True)
            return rec

        # threads only wait on children; map keeps the table's order
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            records = list(pool.map(one, todo))
    elapsed = time.monotonic() - t0
    print(_table(records))
    counts = {k: sum(r["result"] == k for r in records) for k in _SEVERITY}
    print(f"\n{len(records)} cases in {elapsed:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if args.out:
        Path(args.out).write_text(json.dumps({"seconds": round(elapsed, 1), "cases": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
