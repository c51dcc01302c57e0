"""`dgr artifact ...`: manifest, verify, seed and fetch Model Artifacts.

A node loads its layer range straight from the (possibly sparse, partially
fetched) full GGUF through the layer-range API, so no shard file is written.

Thin: every subcommand parses its arguments, calls the library function and
turns typed errors into exit codes. Exit 0 is success, 1 a file that does not
match its manifest (the tensors are named on stderr), 2 any other refusal.
Progress bars go to stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dgr.artifact.constants import GlobalNeed
from dgr.progress import terminal_progress
from dgr.backends.base import layers_arg
from dgr.errors import CallerError, DgrError, Reason

__all__ = ["register"]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_ERROR = 2


def register(subparsers: Any) -> None:
    """Add `artifact` and its subcommands to a dgr argparse subparsers object."""
    art = subparsers.add_parser("artifact", help="Model Artifact manifests, verification and transfer")
    sub = art.add_subparsers(dest="artifact_command", required=True)

    p = sub.add_parser("manifest", help="hash a GGUF and write its manifest (JSON)")
    p.add_argument("model", type=Path, help="the GGUF file")
    p.add_argument("-o", "--out", type=Path, help="manifest path (default: stdout)")
    p.add_argument("--piece-length", type=int, default=None, help="BitTorrent piece length (default: by file size)")
    p.add_argument("--torrent", type=Path, default=None, help="also write the v2 .torrent here")
    p.set_defaults(func=_cmd_manifest)

    p = sub.add_parser("verify", help="check a GGUF, or only some layers, against a manifest")
    p.add_argument("model", type=Path)
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--layers", type=layers_arg, default=None, help="A:B, only layers [A, B) plus header and globals")
    p.add_argument("--globals", choices=[g.value for g in GlobalNeed], default=GlobalNeed.COMPUTE.value)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("seed", help="serve a GGUF (whole or partial) to fetchers until interrupted")
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--port", type=int, required=True, help="listen port (0: any)")
    p.add_argument("--listen", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--check", choices=["lazy", "full"], default="lazy", help="lazy: hash pieces as uploaded")
    p.set_defaults(func=_cmd_seed)

    p = sub.add_parser("fetch", help="download only the pieces layers A:B need, from given peers")
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--layers", type=layers_arg, required=True)
    p.add_argument("--peer", action="append", required=True, help="HOST:PORT of a seeder; repeatable")
    p.add_argument("--out", type=Path, required=True, help="the (sparse) GGUF to write")
    p.add_argument("--interface", default="", help="the address to connect from (default: the system's route); "
                   "a fetch dials its peers and listens on nothing")
    p.add_argument(
        "--globals",
        choices=[g.value for g in GlobalNeed],
        default=GlobalNeed.COMPUTE.value,
        help="compute (default): only the global tensors the range loads (the layer-range API: token_embd on "
        "the head, the output tensors on the tail); loader: every global tensor",
    )
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.set_defaults(func=_cmd_fetch)


def _fail(exc: DgrError) -> int:
    print(f"error ({exc.reason.value}): {exc.message}", file=sys.stderr)
    return EXIT_MISMATCH if exc.reason is Reason.ARTIFACT_MISMATCH else EXIT_ERROR


def _cmd_manifest(args: argparse.Namespace) -> int:
    from dgr.artifact.build import build_manifest

    try:
        with terminal_progress() as progress:
            m = build_manifest(args.model, piece_length=args.piece_length, progress=progress)
    except DgrError as exc:
        return _fail(exc)
    if args.out is None:
        sys.stdout.write(m.dumps())
    else:
        m.save(args.out)
    if args.torrent is not None:
        args.torrent.write_bytes(m.torrent_bytes())
    print(
        f"manifest {m.id} for {m.file.name}: {m.model.architecture}, {m.model.block_count} layers, "
        f"{len(m.tensors)} tensors, {m.torrent.piece_count} pieces of {m.torrent.piece_length} bytes, "
        f"v2 info-hash {m.torrent.info_hash_v2}",
        file=sys.stderr,
    )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from dgr.artifact.manifest import Manifest
    from dgr.artifact.verify import verify_file

    try:
        m = Manifest.load(args.manifest)
        with terminal_progress() as progress:
            report = verify_file(args.model, m, args.layers, need=GlobalNeed(args.globals), progress=progress)
    except DgrError as exc:
        return _fail(exc)
    for line in report.lines():
        print(line)
    mb = report.bytes_checked / 1e6
    print(f"checked {mb:.1f} MB in {report.seconds:.2f} s ({mb / max(report.seconds, 1e-9):.0f} MB/s)", file=sys.stderr)
    try:
        report.raise_for_mismatch()
    except CallerError as exc:
        return _fail(exc)
    return EXIT_OK


def _cmd_seed(args: argparse.Namespace) -> int:
    import trio

    from dgr.artifact.manifest import Manifest
    from dgr.artifact.torrent import SeedCheck, SeedInfo, resume_path_for, seed

    try:
        m = Manifest.load(args.manifest)
    except DgrError as exc:
        return _fail(exc)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            info: SeedInfo = await nursery.start(
                lambda task_status: seed(
                    m,
                    args.model,
                    listen=f"{args.listen}:{args.port}",
                    check=SeedCheck(args.check),
                    resume=resume_path_for(args.model),
                    task_status=task_status,
                )
            )
            print(
                f"seeding {m.file.name} ({info.pieces_have}/{m.torrent.piece_count} pieces) on "
                f"{args.listen}:{info.port}, v2 info-hash {info.info_hash_v2}; Ctrl-C to stop",
                file=sys.stderr,
            )

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return EXIT_OK
    except DgrError as exc:
        return _fail(exc)
    return EXIT_OK


def _cmd_fetch(args: argparse.Namespace) -> int:
    import math

    import trio

    from dgr.artifact.manifest import Manifest
    from dgr.artifact.torrent import FetchResult, TransferStatus, fetch

    try:
        m = Manifest.load(args.manifest)
    except DgrError as exc:
        return _fail(exc)

    async def main() -> FetchResult:
        with terminal_progress() as progress:
            progress.start(f"fetching layers {args.layers}", None)

            def show(st: TransferStatus) -> None:
                progress.update(st.bytes_done, st.bytes_wanted, f"layers {args.layers}: {st.peers} peers")

            with trio.fail_after(args.timeout if args.timeout else math.inf):
                return await fetch(
                    m,
                    args.layers,
                    args.out,
                    args.peer,
                    need=GlobalNeed(args.globals),
                    interface=args.interface,
                    on_status=show,
                )

    try:
        result = trio.run(main)
    except trio.TooSlowError:
        print(
            f"error: fetch timed out after {args.timeout} s; resume data kept, run again to continue", file=sys.stderr
        )
        return EXIT_ERROR
    except DgrError as exc:
        return _fail(exc)
    mb = result.payload_bytes / 1e6
    print(
        f"fetched layers {result.layers} into {result.dest}: {len(result.pieces_fetched)} of "
        f"{len(result.pieces_wanted)} pieces this run, {mb:.1f} MB in {result.seconds:.2f} s, "
        f"{len(result.hash_failures)} hash failures, verified {len(result.report.results)} tensor groups",
        file=sys.stderr,
    )
    return EXIT_OK
