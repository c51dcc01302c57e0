"""What a node that serves a layer range costs to start and to hold, measured in a fresh process.

    python -m dgr.bench.ranges --layers 5:10            # the 1B-shape model's middle third
    python -m dgr.bench.ranges --model PATH --layers A:B --out FILE

One child process per run builds `LlamaShardBackend(model, A:B)` with a fresh
cache folder, the way `dgr node` starts, and reports:
- ready_s: from the constructor's call until it returns (a first start: a
  cached digest, no cached derived file; with --cold, from an empty page
  cache as well, so the model is read from disk);
- written_mib: what the start wrote to the cache folder (a derived shard file,
  before the layer-range API);
- model_buffer_mib: llama.cpp's own model buffer sizes, from its load log;
- llama_model_size_mib: the bytes of tensors llama.cpp holds for the range,
  beside layer_bytes_mib, the bytes of the range's own blk.* tensors in the
  file: equal when it holds no token_embd and no output head;
- rss_mib / rss_file_mib / rss_anon_mib: the process's resident memory after
  loading and after a 64-token prefill and 8 decode steps through the range.

The script uses only the backend's constructor and `forward`, so the same
file measures a checkout from before the layer-range API: run it by path with
that checkout on PYTHONPATH (and its llama-cpp-python's libraries on
LLAMA_CPP_LIB_PATH) to get the "before" figures: `--checkout DIR --lib-path DIR`.

    python -m dgr.bench.ranges --paired-decode CHECKOUT [--lib-path DIR] [--rounds 10]

starts `dgr up --backend llama_shard --nodes 2 --threads 1` twice, from this
tree and from CHECKOUT (with DIR as its llama-cpp-python libraries), keeps
both up, and in each round streams one 128-token completion from each in
turn: the two routes' decode tok/s, round by round, and the median ratio.
Alternation keeps the VM's drift out of the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["measure", "main"]


def _status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssFile", "RssAnon"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _child(model: str, start: int, stop: int, cache: str) -> dict:
    os.environ["DGR_CACHE_DIR"] = cache
    import numpy as np

    import dgr
    from dgr.backends import clib
    from dgr.backends.base import LayerRange
    from dgr.backends.llama_shard import LlamaShardBackend
    try:
        from dgr.digest import file_sha256
    except ImportError:  # a checkout from before the layer-range API
        from dgr.backends.shardfile import file_sha256

    file_sha256(model)  # a node start reads the digest from its cache: not part of ready_s
    import collections

    clib._LOG = collections.deque(maxlen=1 << 20)  # keep the whole load log: the buffer sizes are in it
    t0 = time.perf_counter()
    shard = LlamaShardBackend(model, LayerRange(start, stop), n_threads=1, n_ctx=256, max_sessions=1)
    ready = time.perf_counter() - t0
    loaded = _status()
    log = "".join(clib._LOG)
    buffers = {name: float(mib) for name, mib in re.findall(r"(\S+) model buffer size =\s*([\d.]+) MiB", log)}
    shard.open_session("s", 128)
    n_embd = shard.info.hidden_size
    if start == 0:
        h = shard.forward("s", 0, np.arange(1, 65, dtype=np.int32), None, False)
    else:
        h = shard.forward("s", 0, None, np.random.default_rng(0).standard_normal((64, n_embd), np.float32), False)
    for pos in range(64, 72):
        if start == 0:
            h = shard.forward("s", pos, np.array([7], np.int32), None, False)
        else:
            h = shard.forward("s", pos, None, np.zeros((1, n_embd), np.float32), False)
    used = _status()
    written = sum(p.stat().st_size for p in Path(cache).rglob("*.gguf"))
    model_size = clib.llama_lib().llama_model_size(shard.engine._model) / 2**20  # stock and patched alike
    shard.close()
    return {
        "dgr": str(Path(dgr.__file__).parent),
        "layers": f"{start}:{stop}",
        "ready_s": round(ready, 3),
        "written_mib": round(written / 2**20, 1),
        "model_buffer_mib": buffers,
        "llama_model_size_mib": round(model_size, 1),
        "rss_mib_loaded": round(loaded["VmRSS"], 1),
        "rss_mib": round(used["VmRSS"], 1),
        "rss_file_mib": round(used["RssFile"], 1),
        "rss_anon_mib": round(used["RssAnon"], 1),
        "output_shape": list(np.shape(h)),
    }


def _drop_page_cache() -> None:
    """Empty Linux's page cache (root only), so the next start reads the model from disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def measure(model: str, start: int, stop: int, *, python: str = sys.executable, env: dict | None = None,
            cold: bool = False) -> dict:
    """One fresh child process: build the range, load, compute; its figures. `cold`: from an empty page cache."""
    with tempfile.TemporaryDirectory(prefix="dgr-ranges-") as cache:
        if cold:
            _drop_page_cache()
        out = subprocess.run(
            [python, str(Path(__file__).resolve()), "--child", model, str(start), str(stop), cache],
            capture_output=True, text=True, timeout=900, env=env, check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _route(env: dict[str, str], model: str | None, cwd: str | None = None) -> tuple[subprocess.Popen, str]:
    """`dgr up --backend llama_shard --nodes 2 --threads 1` on an ephemeral port: the process and its API URL."""
    cmd = [sys.executable, "-m", "dgr", "up", "--backend", "llama_shard", "--nodes", "2", "--threads", "1",
           "--port", "0", "--ctx", "1024", *(("--model", model) if model else ())]
    # `python -m` imports from the working directory first: run each tree's dgr from its own
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    seen = []
    for line in proc.stdout or ():
        if line.startswith("dgr up: serving the OpenAI API at "):
            return proc, line.split(" at ", 1)[1].split()[0]
        seen.append(line)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"dgr up did not become ready: {cmd}: {''.join(seen[-20:])}")


def paired_decode(checkout: str, lib_path: str | None, model: str | None, rounds: int) -> dict:
    """This tree's 2-node llama_shard route against CHECKOUT's, measured in alternation."""
    import statistics

    import httpx

    from dgr.bench.measure import stream_once

    here = dict(os.environ)
    there = {**os.environ, "PYTHONPATH": checkout}
    if lib_path:
        there["LLAMA_CPP_LIB_PATH"] = lib_path
    prompt = "The keeper wrote down every ship that passed the point. " * 8
    procs = []
    try:
        urls = {}
        for name, env, cwd in (("after", here, None), ("before", there, checkout)):
            proc, api = _route(env, model, cwd)
            procs.append(proc)
            urls[name] = (api, httpx.get(f"{api}/models", timeout=10).json()["data"][0]["id"])
        for name, (api, mid) in urls.items():
            stream_once(api, mid, prompt, 16)  # warm: first graphs, page faults
        tps: dict[str, list[float]] = {"after": [], "before": []}
        for r in range(rounds):
            order = ("after", "before") if r % 2 else ("before", "after")
            for name in order:
                api, mid = urls[name]
                tps[name].append(round(stream_once(api, mid, prompt, 128).decode_tok_s, 2))
        ratios = [a / b for a, b in zip(tps["after"], tps["before"])]
        return {"rounds": rounds, "decode_tps": tps, "ratio_per_round": [round(x, 3) for x in ratios],
                "median_ratio": round(statistics.median(ratios), 3),
                "median_tps": {k: round(statistics.median(v), 2) for k, v in tps.items()}}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, start, stop, cache = argv[1], int(argv[2]), int(argv[3]), argv[4]
        print(json.dumps(_child(model, start, stop, cache)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the 1B-shape random llama of dgr bench --big)")
    ap.add_argument("--layers", default="5:10", help="A:B, the range to start (default: the 1B shape's middle third)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="empty the page cache before each start (root only)")
    ap.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    ap.add_argument("--paired-decode", metavar="CHECKOUT", help="2-node decode of this tree against CHECKOUT's")
    ap.add_argument("--checkout", help="measure the start of this checkout's dgr instead (its 'before' figures)")
    ap.add_argument("--lib-path", help="the checkout's llama-cpp-python libraries (LLAMA_CPP_LIB_PATH)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    if args.paired_decode:
        result = paired_decode(args.paired_decode, args.lib_path, args.model, args.rounds)
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.model is None:
        from dgr.bench.shapes import LLAMA_1B, random_llama_gguf

        args.model = str(random_llama_gguf(LLAMA_1B, log=lambda m: print(m, file=sys.stderr)))
    start, stop = (int(x) for x in args.layers.split(":"))
    from dgr.gguf_meta import read_header

    sizes = {t.name: int(t.n_bytes) for t in read_header(args.model).tensors}
    layer_bytes = sum(n for name, n in sizes.items()
                      if name.startswith("blk.") and start <= int(name.split(".")[1]) < stop)
    env = None
    if args.checkout:
        env = {**os.environ, "PYTHONPATH": args.checkout, **({"LLAMA_CPP_LIB_PATH": args.lib_path} if args.lib_path else {})}
    runs = [{**measure(args.model, start, stop, env=env, cold=args.cold), "cold": args.cold,
             "layer_bytes_mib": round(layer_bytes / 2**20, 1)}
            for _ in range(args.repeat)]
    for r in runs:
        print(json.dumps(r))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.pop(0)  # run by path: import dgr from PYTHONPATH or the install, not from beside this file
    raise SystemExit(main())
