"""Artifact plane figures on the default model: manifest, verify, proofs, loopback fetch.

Run: python -m dgr.bench.artifact [--model PATH]. Prints one line per
figure. Everything runs on this machine over 127.0.0.1; the file is read
from the page cache after the first pass, so verify and fetch figures are
CPU/loopback bound, not disk bound.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import trio

from dgr.artifact.constants import GlobalNeed
from dgr.artifact.build import build_manifest
from dgr.artifact.proof import answer_challenge, check_answer, make_challenge
from dgr.artifact.torrent import fetch, seed
from dgr.artifact.verify import verify_file
from dgr.backends.base import LayerRange
from dgr.models import default_model_path

__all__ = ["main"]


class _StepTimer:
    """A Progress that records when each step starts, to time build_manifest's phases."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, float]] = []
        self.last = time.perf_counter()

    def start(self, description: str, total: int | None) -> None:
        self.starts.append((description, time.perf_counter()))

    def advance(self, amount: int) -> None:
        self.last = time.perf_counter()

    def update(self, completed: int, total: int | None = None, description: str | None = None) -> None:
        pass

    def seconds(self, prefix: str) -> float:
        ends = [t for _, t in self.starts[1:]] + [self.last]
        for (name, begin), end in zip(self.starts, ends, strict=True):
            if name.startswith(prefix):
                return end - begin
        raise KeyError(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    path = args.model or default_model_path()
    size_mb = path.stat().st_size / 1e6
    print(f"model: {path.name}, {size_mb:.1f} MB")

    steps = _StepTimer()
    t = time.perf_counter()
    m = build_manifest(path, progress=steps)
    build_s = time.perf_counter() - t
    hash_s = steps.seconds("hashing")
    print(
        f"manifest: {build_s:.2f} s total ({steps.seconds('reading'):.2f} s gguf-py metadata read, "
        f"{hash_s:.2f} s single-pass hashing = {size_mb / hash_s:.0f} MB/s), "
        f"{m.torrent.piece_count} pieces of {m.torrent.piece_length // 1024} KiB, {len(m.dumps()) / 1e3:.0f} kB JSON"
    )

    best = min(verify_file(path, m).seconds for _ in range(3))
    print(f"verify whole file: {best:.3f} s, {m.file.size / 1e6 / best:.0f} MB/s")
    mid = LayerRange(m.model.block_count // 3, 2 * m.model.block_count // 3)
    r = verify_file(path, m, mid)
    print(f"verify layers {mid}: {r.seconds:.3f} s for {r.bytes_checked / 1e6:.1f} MB")

    rng = random.Random(0)
    n = 500
    t = time.perf_counter()
    with path.open("rb") as f:
        for _ in range(n):
            c = make_challenge(m, mid, rng)
            ok = check_answer(m, c, answer_challenge(f, m, c)).ok
            if not ok:
                raise SystemExit("proof failed on the source file")
    print(f"proofs: {n / (time.perf_counter() - t):.0f} challenge+answer+check per s")

    async def transfers() -> None:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(seed, m, path)
            peer = f"127.0.0.1:{info.port}"
            with tempfile.TemporaryDirectory() as d:
                for layers, need in (
                    (mid, GlobalNeed.COMPUTE),
                    (LayerRange(0, m.model.block_count), GlobalNeed.LOADER),
                ):
                    res = await fetch(m, layers, Path(d) / f"{layers.start}-{layers.stop}.gguf", [peer], need=need)
                    mb = res.payload_bytes / 1e6
                    print(
                        f"loopback fetch layers {layers} ({need.value}): {mb:.1f} MB, "
                        f"transfer {res.transfer_seconds:.2f} s "
                        f"= {mb / res.transfer_seconds:.0f} MB/s; whole call {res.seconds:.2f} s "
                        f"(session start, check, final verify included)"
                    )
            nursery.cancel_scope.cancel()

    trio.run(transfers)


if __name__ == "__main__":
    main()
