"""What the Hot KV State saves: seam bytes and decode time per token, KV reuse vs full recompute.

Runs a chain of TorchBackend shards in one process (default 2 shards, one
seam) over prompts of 128, 512 and 2048 tokens, and prints one table:

- real design: prefill once, then each decode step sends one position over
  each seam and computes one position per shard; flat in context length;
- recompute baseline (`TorchBackend(recompute=True)`): each decode step
  resends the whole sequence over each seam and every shard recomputes it;
  grows with context length.

Seam bytes are the bytes of the float32 arrays one shard hands to the next
during a decode step, summed over the seams. The baseline replays the tokens
the real design generated, and the table says whether its greedy picks
matched. Prompts are seeded random token ids: the figures measure compute and
traffic, which do not depend on what the text says.

    python -m dgr.bench.torch_route --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np

from dgr.backends.base import LayerRange
from dgr.backends.torch_backend import TorchBackend
from dgr.models import default_model_path

__all__ = ["main"]


def step(shards: list[TorchBackend], sid: str, pos0: int, ids: list[int]) -> tuple[int, int]:
    """One call through the chain; returns (greedy token, seam bytes)."""
    x, seam = np.array(ids, dtype=np.int32), 0
    for s in shards:
        x = s.forward(sid, pos0, x if s.is_head else None, None if s.is_head else x, want_logits=True)
        if not s.is_tail:
            seam += x.nbytes  # float32 [n, W] handed to the next shard
    return int(np.argmax(x)), seam


def run_real(shards, prompt: list[int], n_steps: int) -> dict:
    for s in shards:
        s.open_session("real", len(prompt) + n_steps)
    t0 = time.perf_counter()
    tok, _ = step(shards, "real", 0, prompt)
    prefill_s = time.perf_counter() - t0
    seq, seams, times = prompt + [tok], [], []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        tok, seam = step(shards, "real", len(seq) - 1, seq[-1:])
        times.append(time.perf_counter() - t0)
        seams.append(seam)
        seq.append(tok)
    out = {
        "prefill_s": prefill_s,
        "seam": float(np.mean(seams)),
        "ms": 1e3 * float(np.median(times)),  # median: robust to a busy machine
        "computed_per_step": (shards[0].positions_computed("real") - len(prompt)) / n_steps,
        "kv": sum(s.session_kv_bytes("real") for s in shards),
        "tokens": seq[len(prompt):],
    }
    for s in shards:
        s.close_session("real")
    return out


def run_baseline(shards, prompt: list[int], real_tokens: list[int], n_steps: int) -> dict:
    """Decode steps 1..n_steps of the same sequence, each resending everything from position 0."""
    for s in shards:
        s.open_session("base", len(prompt) + n_steps + 1)
    seams, times, same = [], [], True
    for t in range(1, n_steps + 1):
        seq = prompt + real_tokens[:t]
        t0 = time.perf_counter()
        tok, seam = step(shards, "base", 0, seq)
        times.append(time.perf_counter() - t0)
        seams.append(seam)
        same &= tok == real_tokens[t]
    out = {
        "seam": float(np.mean(seams)),
        "ms": 1e3 * float(np.median(times)),  # median: robust to a busy machine
        "computed_per_step": shards[0].positions_computed("base") / n_steps,
        "kv": sum(s.session_kv_bytes("base") for s in shards),
        "same": same,
    }
    for s in shards:
        s.close_session("base")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--cuts", default="0,15,30", help="shard boundaries, e.g. 0,15,30 for two shards")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="128,512,2048")
    p.add_argument("--steps", type=int, default=8, help="decode steps, real design")
    p.add_argument("--baseline-steps", default="3,2,1", help="decode steps per length, baseline")
    args = p.parse_args(argv)

    model = args.model or default_model_path()
    cuts = [int(c) for c in args.cuts.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    base_steps = [int(n) for n in args.baseline_steps.split(",")]
    spans = [LayerRange(a, b) for a, b in itertools.pairwise(cuts)]
    real = [TorchBackend(model, r, n_threads=args.threads) for r in spans]
    base = [TorchBackend(model, r, n_threads=args.threads, recompute=True) for r in spans]
    vocab = real[0].info.vocab_size
    rng = np.random.default_rng(0)

    print(f"model {model.name}, shards {' '.join(map(str, spans))} ({len(spans) - 1} seam), "
          f"{args.threads} threads, float32")
    head = f"{'context':>7}  {'design':<9} {'seam B/step':>12} {'ms/token':>9} {'pos/step/shard':>14} " \
           f"{'KV B/session':>13} {'prefill s':>9}  note"
    print(head)
    print("-" * len(head))
    t_start = time.perf_counter()
    run_real(real, [100, 101, 102, 103], 1)  # warm-up: the first torch call pays one-time setup
    for n, k in zip(lengths, base_steps):
        prompt = rng.integers(100, vocab, n).tolist()
        r = run_real(real, prompt, args.steps)
        b = run_baseline(base, prompt, r["tokens"], k)
        print(f"{n:>7}  {'kv-reuse':<9} {r['seam']:>12,.0f} {r['ms']:>9.1f} {r['computed_per_step']:>14.1f} "
              f"{r['kv']:>13,} {r['prefill_s']:>9.2f}  {args.steps} steps")
        print(f"{n:>7}  {'recompute':<9} {b['seam']:>12,.0f} {b['ms']:>9.1f} {b['computed_per_step']:>14.1f} "
              f"{b['kv']:>13,} {'':>9}  {k} steps, same tokens: {'yes' if b['same'] else 'NO'}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
