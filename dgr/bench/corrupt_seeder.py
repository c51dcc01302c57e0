"""`python -m dgr.bench.corrupt_seeder`: a fetch from a good seeder beside one whose disk rotted, many times.

Each run seeds the default model twice over loopback, one copy with a flipped byte in every piece a
fetch of layers 10:20 wants past the header, and fetches those layers from both. It counts what
libtorrent banned, what the fetch proved corrupt (dgr.artifact.swarm `AlertTally`), how often it lifted
libtorrent's bans (`pardons`), and whether every fetch completed. `--busy K` keeps K processes
spinning meanwhile: libtorrent's trust rule bans the good seeder mostly when hashing lags behind the
transfer, as on a loaded machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import trio

from dgr.artifact.build import build_manifest
from dgr.artifact.constants import GlobalNeed
from dgr.artifact.manifest import Manifest
from dgr.artifact.torrent import FetchResult, SeedCheck, fetch, seed
from dgr.backends.base import LayerRange
from dgr.models import default_model_path

__all__ = ["LAYERS", "rot", "main"]

LAYERS = LayerRange(10, 20)


def rot(manifest: Manifest, path: Path, pieces: set[int]) -> set[int]:
    """Flip one byte in each of `pieces` of the file at `path` that holds no header byte; those pieces."""
    header = set(range((manifest.header.length - 1) // manifest.torrent.piece_length + 1))
    rotten = pieces - header
    with path.open("r+b") as f:
        for i in sorted(rotten):
            start, _ = manifest.piece_span(i)
            f.seek(start + 7)
            byte = f.read(1)
            f.seek(start + 7)
            f.write(bytes([byte[0] ^ 0xFF]))
    return rotten


async def _once(manifest: Manifest, model: Path, tmp: Path, timeout_s: float) -> tuple[FetchResult | None, str, str]:
    """(the fetch's result, None if it outlasted `timeout_s`; the evil seeder's key; the good one's)."""
    bad = tmp / "bad" / model.name
    bad.parent.mkdir()
    shutil.copyfile(model, bad)
    async with trio.open_nursery() as nursery:
        good = await nursery.start(seed, manifest, model)
        # it hashes its file first (every piece good), then its disk rots
        evil = await nursery.start(lambda task_status: seed(manifest, bad, check=SeedCheck.FULL,
                                                            task_status=task_status))
        rot(manifest, bad, set(manifest.needed_pieces(LAYERS, GlobalNeed.COMPUTE)))
        keys = f"127.0.0.1:{evil.port}", f"127.0.0.1:{good.port}"
        with trio.move_on_after(timeout_s):
            result = await fetch(manifest, LAYERS, tmp / "node" / model.name, list(keys))
            nursery.cancel_scope.cancel()
            return result, *keys
        nursery.cancel_scope.cancel()
    return None, *keys


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.bench.corrupt_seeder", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--busy", type=int, default=0, help="processes kept spinning meanwhile")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a fetch may take before it counts as stuck")
    args = p.parse_args(argv)
    model = default_model_path()
    manifest = build_manifest(model)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    counts = dict.fromkeys(("stuck", "good banned", "good proven", "evil proven", "pardoned"), 0)
    seconds: list[float] = []
    try:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                result, evil, good = trio.run(_once, manifest, model, Path(d), args.timeout)
            if result is None:
                counts["stuck"] += 1
                continue
            seconds.append(result.seconds)
            counts["good banned"] += good in result.banned_peers
            counts["good proven"] += good in result.corrupt_peers
            counts["evil proven"] += evil in result.corrupt_peers
            counts["pardoned"] += result.pardons > 0
    finally:
        for s in spinners:
            s.kill()
    print(f"{args.runs} fetches of layers {LAYERS} from a good and a corrupt seeder, {args.busy} busy processes: "
          + ", ".join(f"{k} {v}" for k, v in counts.items())
          + (f"; median {statistics.median(seconds):.2f} s a fetch" if seconds else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
