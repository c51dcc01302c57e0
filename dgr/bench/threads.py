"""Why a node calls its backend from one thread: decode speed once a second thread has decoded too.

    python -m dgr.bench.threads [--threads 2] [--tokens 64] [--reps 3] [--out FILE]

Each case runs in a fresh process, on the default model whole (`LlamaBackend` with `--threads`
llama.cpp threads), `--reps` runs of `--tokens` decodes:
- plain: from thread A; then one token from thread B, which lives on; then from A again.
- to_thread: each decode through `trio.to_thread.run_sync` (how a node called its backend before
  dgr.node.backend_thread), each run begun beside another `to_thread` call that holds trio's idle
  worker, as an artifact piece or a name lookup on a node would.
- scheduler: the same, each decode through a node's `StepScheduler`.

llama.cpp's OpenMP keeps one team of threads per calling thread, and libgomp stops spinning at
barriers once it manages more threads than the machine has cores (dgr.node.backend_thread): with 2
threads on 2 cores, A's second runs and the to_thread runs after the first are slower, the
scheduler's are not.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import trio

from dgr.backends.base import Step
from dgr.backends.llama import LlamaBackend
from dgr.models import default_model_path
from dgr.node.scheduler import StepScheduler

__all__ = ["main"]

CASES = ("plain", "to_thread", "scheduler")


def _open(backend: LlamaBackend) -> list[int]:
    """A session "s" with a 10-token prompt; its next position, in a list the decodes advance.

    Called from the thread that decodes first: the process's first OpenMP team is that thread's.
    """
    backend.open_session("s", backend.n_ctx)
    backend.forward("s", 0, np.arange(100, 110, dtype=np.int32), None, True)
    return [10]


def _decode(backend: LlamaBackend, pos: list[int]) -> None:
    step = Step("s", pos[0], np.array([1000 + pos[0] % 1000], np.int32), None, True, decode=True)
    backend.forward_batch([step])[0].unwrap()
    pos[0] += 1


def _plain(backend: LlamaBackend, tokens: int, reps: int) -> dict[str, list[float]]:
    calls: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()

    def thread_a() -> None:  # its first call makes the prefill: the process's first OpenMP team
        pos.append(_open(backend)[0])
        done.put(None)
        while (n := calls.get()) is not None:
            t = time.perf_counter()
            for _ in range(n):
                _decode(backend, pos)
            done.put(n / (time.perf_counter() - t))

    pos: list[int] = []
    threading.Thread(target=thread_a, daemon=True).start()
    done.get()
    runs = []
    for _ in range(reps):
        calls.put(tokens)
        runs.append(done.get())
    decoded, finish = threading.Event(), threading.Event()

    def thread_b() -> None:  # decodes once, then lives on (a thread's OpenMP team goes with it)
        _decode(backend, pos)
        decoded.set()
        finish.wait()

    threading.Thread(target=thread_b, daemon=True).start()
    decoded.wait()
    for _ in range(reps):
        calls.put(tokens)
        runs.append(done.get())
    calls.put(None)
    finish.set()
    return {"thread A alone": runs[:reps], "thread A after B decoded 1 token": runs[reps:]}


async def _beside(backend: LlamaBackend, tokens: int, reps: int, scheduled: bool) -> list[float]:
    scheduler = StepScheduler(backend)
    rates = []
    async with trio.open_nursery() as nursery:
        if scheduled:
            await nursery.start(scheduler.run)
            pos = await scheduler.call(lambda: _open(backend))
        else:
            pos = await trio.to_thread.run_sync(_open, backend)
        for _ in range(reps):
            async with trio.open_nursery() as beside:
                beside.start_soon(trio.to_thread.run_sync, time.sleep, 0.05)  # holds trio's idle worker
                await trio.sleep(0)
                t = time.perf_counter()
                for _ in range(tokens):
                    if scheduled:
                        step = Step("s", pos[0], np.array([1000 + pos[0] % 1000], np.int32), None, True,
                                    decode=True)
                        pos[0] += 1
                        await scheduler.forward(step, lambda out: out)
                    else:
                        await trio.to_thread.run_sync(_decode, backend, pos)
                rates.append(tokens / (time.perf_counter() - t))
        nursery.cancel_scope.cancel()
    return rates


def _case(case: str, threads: int, tokens: int, reps: int) -> dict[str, list[float]]:
    backend = LlamaBackend(default_model_path(), n_threads=threads, n_ctx=4096)
    if case == "plain":
        return _plain(backend, tokens, reps)
    return {f"{case}, beside other to_thread calls": trio.run(_beside, backend, tokens, reps, case == "scheduler")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the figures to this file")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case, args.threads, args.tokens, args.reps)))
        return 0
    lines = [f"python -m dgr.bench.threads, {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"{default_model_path().name}, {args.threads} llama.cpp threads, {args.tokens} decodes a run, tok/s:"]
    print("\n".join(lines), flush=True)
    for case in CASES:
        out = subprocess.run([sys.executable, "-m", "dgr.bench.threads", "--case", case, "--threads",
                              str(args.threads), "--tokens", str(args.tokens), "--reps", str(args.reps)],
                             check=True, capture_output=True, text=True).stdout
        for label, rates in json.loads(out.strip().splitlines()[-1]).items():
            lines.append(f"  {label}: {', '.join(f'{r:.1f}' for r in rates)}")
            print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
