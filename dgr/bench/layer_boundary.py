"""Layer-boundary benchmark: the full model against in-process llama.cpp shards.

    python -m dgr.bench.layer_boundary            # speed table
    python -m dgr.bench.layer_boundary --costs    # also the costs of each hack (spec/llama-layer-boundary.md)

Speed: the same prompt (~300 tokens) and the same threads for the single-node
model (LlamaBackend) and for 2 (15:15) and 3 (10:10:10) shards chained in one
process (dgr.pipeline). Setups run interleaved, rep after rep, so a noisy
machine slows them alike; the ratio is the median over reps of
shards / full, taken within each rep. "steady" decode speed comes from the
10th percentile of single step times over all reps: on a shared machine the
least disturbed steps are the best estimate of the cost itself.

Costs (--costs), the figures in spec/llama-layer-boundary.md:
- the cb_eval callback: ask-phase calls per decode (counted), and its parts
  measured apart (C -> Python round trip, name compare, address compare);
- where a 15:15 split's extra decode time goes: each stage alone, then
  interleaved as in the pipeline;
- the early stop: head shard 0:15 decode with and without it, and how often
  the captured node moved (capture misses);
- prefill of the head shard by n_batch, and the logits buffer each reserves;
- memory: each setup in its own process, RSS after a prefill and 8 decodes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dgr.backends.base import LayerRange
from dgr.backends.gguf_text import llama_lib
from dgr.backends.llama import LlamaBackend
from dgr.backends.llama_engine import ggml_lib
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.models import default_model_path
from dgr.pipeline import Pipeline

__all__ = ["main"]

SPLITS = {"full": None, "2 shards 15:15": [(0, 15), (15, 30)], "3 shards 10:10:10": [(0, 10), (10, 20), (20, 30)]}
STORY = (
    "The lighthouse keeper kept a log of every ship that passed the point, the weather, the colour "
    "of the sea at dawn and the birds that rested on the rail. "
)


def prompt_ids(backend: LlamaBackend, n: int) -> list[int]:
    """A chat prompt of about n tokens, the same every run."""
    text = STORY * max(1, n // 30)
    ids = backend.tokenize(
        backend.render_chat([{"role": "user", "content": text + "Summarise the log."}]),
        add_special=True,
        parse_special=True,
    )
    return ids


def build(model: Path, split: list[tuple[int, int]] | None, threads: int, n_ctx: int) -> Pipeline:
    if split is None:
        return Pipeline([LlamaBackend(model, n_threads=threads, n_ctx=n_ctx, max_sessions=1)])
    return Pipeline(
        [LlamaShardBackend(model, LayerRange(a, b), n_threads=threads, n_ctx=n_ctx, max_sessions=1) for a, b in split]
    )


def run_once(p: Pipeline, ids: list[int], n_decode: int) -> dict[str, Any]:
    """Prefill and decode tok/s by wall clock, each decode step's seconds, and the tokens."""
    p.open("bench", len(ids) + n_decode + 1)
    try:
        t0 = time.perf_counter()
        logits = p.prefill("bench", ids)
        t1 = time.perf_counter()
        toks, steps = [], []
        pos = len(ids)
        for _ in range(n_decode):
            s0 = time.perf_counter()
            tok = int(np.argmax(logits))
            toks.append(tok)
            logits = p.decode("bench", tok, pos)
            pos += 1
            steps.append(time.perf_counter() - s0)
        t2 = time.perf_counter()
    finally:
        p.close("bench")
    return {"prefill": len(ids) / (t1 - t0), "decode": n_decode / (t2 - t1), "steps": steps, "tokens": toks}


def speed(args: argparse.Namespace) -> None:
    pipes = {name: build(args.model, split, args.threads, args.n_ctx) for name, split in SPLITS.items()}
    ids = prompt_ids(pipes["full"].stages[0], args.prompt_tokens)
    for p in pipes.values():  # warm-up: page in weights, build graphs
        run_once(p, ids[:32], 4)
    res: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": [], "steps": []} for name in pipes}
    tokens: dict[str, list[int]] = {}
    names = list(pipes)
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate the order
            r = run_once(pipes[name], ids, args.decode)
            res[name]["prefill"].append(r["prefill"])
            res[name]["decode"].append(r["decode"])
            res[name]["steps"].extend(r["steps"])
            tokens[name] = r["tokens"]

    def ratio(name: str, k: str) -> float:
        return statistics.median(a / b for a, b in zip(res[name][k], res["full"][k]))

    def steady(name: str) -> float:  # tok/s at the 10th percentile of step times: the least disturbed steps
        return 1.0 / float(np.percentile(res[name]["steps"], 10))

    print(f"model {args.model.name}, {len(ids)}-token prompt, {args.decode} decode steps, "
          f"{args.threads} thread(s), {args.reps} reps, load average {os.getloadavg()[0]:.2f}")
    print(f"{'':20s} {'prefill tok/s':>15s}  {'decode tok/s':>15s}  {'decode, steady':>15s}")
    print(f"{'setup':20s} {'median':>8s} {'ratio':>6s}  {'median':>8s} {'ratio':>6s}  {'tok/s':>8s} {'ratio':>6s}  same tokens")
    for name in names:
        r = res[name]
        print(
            f"{name:20s} {statistics.median(r['prefill']):8.1f} {ratio(name, 'prefill'):6.3f}  "
            f"{statistics.median(r['decode']):8.1f} {ratio(name, 'decode'):6.3f}  "
            f"{steady(name):8.1f} {steady(name) / steady('full'):6.3f}  {tokens[name] == tokens['full']}"
        )
    print("(ratio: median over reps of shards/full within the same rep. steady: from the 10th percentile of\n"
          " single decode-step times over all reps, the steps least disturbed by other work on a shared machine.)")


# -- costs ---------------------------------------------------------------------


def callback_cost(args: argparse.Namespace) -> None:
    """What the Python cb_eval costs per decode: calls x (C -> Python round trip + ask body).

    A difference of decode times is lost in this machine's noise (+-1 ms), so
    the parts are measured apart, each as the best of several repeats:
    - calls per decode: counted, for the full model and for the head shard;
    - the C -> Python round trip: libc qsort calling a ctypes comparator
      (two pointer arguments; cb_eval has three scalars, much the same work);
    - the ask body: the Python function called directly, name read and
      compare against an int compare.
    """
    import timeit

    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.shardfile import shard_path

    g = ggml_lib()
    name_off = g.ggml_get_name(0x1000) - 0x1000
    fake = ctypes.create_string_buffer(name_off + 64)
    fake[name_off : name_off + 9] = b"attn_norm"
    t_addr = ctypes.addressof(fake)
    target = b"l_out-14\0"
    string_at = ctypes.string_at
    known = [t_addr + 8]

    def ask_name(t: int, ask: bool, _u: int) -> bool:  # looking for the node by name
        return string_at(t + name_off, 9) == target

    def ask_address(t: int, ask: bool, _u: int) -> bool:  # once its address is known (dgr)
        if known[0]:
            return t == known[0]
        return False

    def ask_false(t: int, ask: bool, _u: int) -> bool:
        return False

    body = {}
    for label, fn in [("return False", ask_false), ("compare name", ask_name), ("compare address (dgr)", ask_address)]:
        body[label] = min(timeit.repeat(lambda fn=fn: fn(t_addr, True, 0), number=200_000, repeat=7)) / 200_000

    libc = ctypes.CDLL(None)
    cmp_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    n_cmp = [0]

    def count_cmp(a: int, b: int) -> int:
        n_cmp[0] += 1
        return 0

    def cmp(a: int, b: int) -> int:
        return 0

    items = (ctypes.c_int64 * 4096)()
    libc.qsort(items, 4096, 8, cmp_type(count_cmp))
    c_cmp = cmp_type(cmp)
    trip = min(timeit.repeat(lambda: libc.qsort(items, 4096, 8, c_cmp), number=5, repeat=7)) / (5 * n_cmp[0])
    trip -= body["return False"]  # the comparator's own body

    # calls per decode: every node of the full graph; the head shard stops after l_out-{n-1}
    calls = {}
    lib = llama_lib()
    for label, path, hidden in [
        ("full model", args.model, False),
        ("head shard 0:15", shard_path(args.model, LayerRange(0, 15)), True),
    ]:
        e = LlamaEngine.load(path, hidden_out=hidden, n_threads=args.threads, n_seq_max=1, n_ctx_seq=256)
        count = [0]
        cbt = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
        name_target = f"l_out-{e.n_layer - 1}".encode() + b"\0"

        def counting(t: int, ask: bool, _u: int, count=count, name_target=name_target, hidden=hidden) -> bool:
            if ask:
                count[0] += 1
                return hidden and string_at(t + name_off, len(name_target)) == name_target
            return False

        cb = cbt(counting)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch, cp.cb_eval = 256, args.threads, args.threads, cb
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as LlamaEngine does
        ctx = lib.llama_init_from_model(e._model, cp)
        batch = lib.llama_batch_init(1, 0, 1)
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 100, 0, 1, 0, 1
        lib.llama_decode(ctx, batch)
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        e.close()
        calls[label] = count[0]

    print(f"\ncb_eval cost (best of 7 repeats each): C -> Python round trip {1e9 * trip:.0f} ns per call")
    print(f"{'ask body':24s} {'ns/call':>8s} " + " ".join(f"{k + ' (' + str(v) + ' calls)':>28s}" for k, v in calls.items()))
    for label, t in body.items():
        per = [f"{1000 * n * (trip + t):25.3f} ms" for n in calls.values()]
        print(f"{label:24s} {1e9 * t:8.0f} " + " ".join(per))
    print("(ms per decode step = calls x (round trip + body))")


def split_overhead(args: argparse.Namespace) -> None:
    """Where a 15:15 split's extra decode time goes: each stage alone, then the two interleaved."""
    full = LlamaBackend(args.model, n_threads=args.threads, n_ctx=1024, max_sessions=1)
    head = LlamaShardBackend(args.model, LayerRange(0, 15), n_threads=args.threads, n_ctx=1024, max_sessions=1)
    tail = LlamaShardBackend(args.model, LayerRange(15, 30), n_threads=args.threads, n_ctx=1024, max_sessions=1)
    ids = np.arange(1000, 1300, dtype=np.int32)
    tok = np.array([7], np.int32)
    times: dict[str, list[float]] = {k: [] for k in ("whole model", "head 0:15 alone", "tail 15:30 alone", "head then tail")}
    for _ in range(max(args.reps, 8)):
        for b in (full, head, tail):
            b.close_session("s")
            b.open_session("s", 1024)
        full.forward("s", 0, ids, None, True)
        tail.forward("s", 0, None, head.forward("s", 0, ids, None, True), True)
        h = None
        for i in range(32):  # positions 300..331 for each setup alike
            t = time.perf_counter()
            full.forward("s", 300 + i, tok, None, True)
            times["whole model"].append(time.perf_counter() - t)
        for i in range(32):
            t = time.perf_counter()
            h = head.forward("s", 300 + i, tok, None, True)
            times["head 0:15 alone"].append(time.perf_counter() - t)
        for i in range(32):
            t = time.perf_counter()
            tail.forward("s", 300 + i, None, h, True)
            times["tail 15:30 alone"].append(time.perf_counter() - t)
        for i in range(32):
            t = time.perf_counter()
            tail.forward("s", 332 + i, None, head.forward("s", 332 + i, tok, None, True), True)
            times["head then tail"].append(time.perf_counter() - t)
    p10 = {k: 1000 * float(np.percentile(v, 10)) for k, v in times.items()}
    base = p10["whole model"]
    print("\n15:15 split, decode step ms (10th percentile of single steps):")
    for k, v in p10.items():
        print(f"{k:20s} {v:8.3f}")
    print(f"{'head + tail alone':20s} {p10['head 0:15 alone'] + p10['tail 15:30 alone']:8.3f}  "
          f"({(p10['head 0:15 alone'] + p10['tail 15:30 alone']) / base:.3f} x whole)")
    print(f"{'interleaved':20s} {p10['head then tail']:8.3f}  ({p10['head then tail'] / base:.3f} x whole)")
    for b in (full, head, tail):
        b.close()


def rss_child(args: argparse.Namespace) -> None:
    """In a fresh process: load one setup, prefill, decode, print RSS as JSON."""
    def status() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
        return out

    before = status()
    if args.rss_child == "full":
        b = LlamaBackend(args.model, n_threads=args.threads, n_ctx=args.n_ctx, max_sessions=1)
    else:
        b = LlamaShardBackend(args.model, LayerRange.parse(args.rss_child), n_threads=args.threads, n_ctx=args.n_ctx, max_sessions=1)
    loaded = status()
    b.open_session("s", args.n_ctx)
    n = args.prompt_tokens
    if b.is_head:
        b.forward("s", 0, np.arange(1000, 1000 + n, dtype=np.int32), None, True)
    else:
        b.forward("s", 0, None, np.random.default_rng(0).standard_normal((n, b.info.seam_width), np.float32), True)
    for i in range(8):
        if b.is_head:
            b.forward("s", n + i, np.array([7], np.int32), None, True)
        else:
            b.forward("s", n + i, None, np.zeros((1, b.info.seam_width), np.float32), True)
    after = status()
    print(json.dumps({"before": before, "loaded": loaded, "after": after, "engine_file_size": b.engine.path.stat().st_size,
                      "kv_alloc": b.engine.kv_bytes_per_position() * b.engine.n_ctx_seq}))


def early_stop_cost(args: argparse.Namespace) -> None:
    """Head shard 0:15 decode time when the graph stops after l_out-14, and when it runs on to the LM head."""
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.shardfile import shard_path

    path = shard_path(args.model, LayerRange(0, 15))
    stop = LlamaEngine.load(path, hidden_out=True, n_threads=args.threads, n_seq_max=1, n_ctx_seq=1024)
    run_on = LlamaEngine.load(path, hidden_out=False, n_threads=args.threads, n_seq_max=1, n_ctx_seq=1024)
    steps, reps = 32, max(3 * args.reps, 15)
    cpu: dict[str, list[float]] = {"stop after l_out-14 (dgr)": [], "run on to the LM head": []}
    engines = dict(zip(cpu, [stop, run_on]))
    for rep in range(reps):
        for k, e in engines.items():
            c0 = time.thread_time()
            for i in range(steps):
                e.eval(0, e.positions(0), np.array([100 + i], np.int32), None, want_logits=True)
            cpu[k].append((time.thread_time() - c0) / steps)
        if stop.positions(0) > 900:
            stop.seq_rm(0)
            run_on.seq_rm(0)
    print(f"\nhead shard 0:15 decode, cpu ms/step (best of {reps} x {steps}):")
    for k, v in cpu.items():
        print(f"{k:28s} {1000 * min(v):8.3f}")
    print(f"the early stop saves {1 - min(cpu['stop after l_out-14 (dgr)']) / min(cpu['run on to the LM head']):.1%} of the head's work")
    # prefills of other shapes between decodes: the captured node must not move
    graphs = reps * steps
    for n in (10, 365, 600, 1):
        stop.seq_rm(0)
        stop.eval(0, 0, np.arange(100, 100 + n, dtype=np.int32), None)
        stop.eval(0, n, np.array([7], np.int32), None)
        graphs += -(-n // stop.n_batch) + 1
    print(f"capture misses (chunks recomputed because l_out-14 moved): {stop.capture_misses()} in {graphs} graphs")
    stop.close()
    run_on.close()


def prefill_batch_cost(args: argparse.Namespace) -> None:
    """Head shard 0:15: prefill speed and the logits buffer it reserves, by n_batch."""
    from dgr.backends.llama_engine import LlamaEngine
    from dgr.backends.shardfile import shard_path

    path = shard_path(args.model, LayerRange(0, 15))
    ids = np.arange(100, 612, dtype=np.int32)
    print("\nhead shard 0:15, 512-token prefill by n_batch (every row an output):")
    print(f"{'n_batch':>8s} {'tok/s per CPU s (best of 3)':>28s} {'logits buffer MiB':>18s}")
    for nb in (64, 128, 256, 512):
        e = LlamaEngine.load(path, hidden_out=True, n_threads=args.threads, n_seq_max=1, n_ctx_seq=1024, n_batch=nb)
        best = 0.0
        for _ in range(3):
            e.seq_rm(0)
            c0 = time.thread_time()
            e.eval(0, 0, ids, None)
            best = max(best, len(ids) / (time.thread_time() - c0))
        print(f"{nb:8d} {best:28.1f} {nb * e.n_vocab * 4 / (1 << 20):18.1f}")
        e.close()


def memory_cost(args: argparse.Namespace) -> None:
    mib = 1 / (1 << 20)
    print(f"\nmemory per process ({args.prompt_tokens}-token prefill + 8 decodes, n_ctx {args.n_ctx}), MiB:")
    print(f"{'setup':8s} {'file':>7s} {'RSS file':>9s} {'RSS anon':>9s} {'anon after load':>16s} {'anon prefill':>13s} {'KV alloc':>9s}")
    for setup in ["full", "0:15", "15:30", "0:10", "10:20", "20:30"]:
        out = subprocess.run(
            [sys.executable, "-m", "dgr.bench.layer_boundary", "--rss-child", setup, "--model", str(args.model), "--threads", str(args.threads),
             "--n-ctx", str(args.n_ctx), "--prompt-tokens", str(args.prompt_tokens)],
            capture_output=True, text=True, check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        a = r["after"]
        print(
            f"{setup:8s} {r['engine_file_size'] * mib:7.1f} {a['RssFile'] * mib:9.1f} {a['RssAnon'] * mib:9.1f} "
            f"{(r['loaded']['RssAnon'] - r['before']['RssAnon']) * mib:16.1f} "
            f"{(a['RssAnon'] - r['loaded']['RssAnon']) * mib:13.1f} {r['kv_alloc'] * mib:9.1f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--costs", action="store_true", help="also measure the cost of each hack")
    ap.add_argument("--costs-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    if args.rss_child:
        rss_child(args)
        return 0
    if not args.costs_only:
        speed(args)
    if args.costs or args.costs_only:
        split_overhead(args)
        callback_cost(args)
        early_stop_cost(args)
        prefill_batch_cost(args)
        memory_cost(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
