"""A node's Model Artifact: check or fetch the layers it serves, seed them, answer proofs.

`dgr node --manifest M` serves only what it verified against M:
- With a local file (--model, or the default model): the header, the served
  layers and the global tensors the range loads (GlobalNeed.COMPUTE:
  token_embd on the head, the output tensors on the tail, shared ones
  everywhere) are hashed and compared with M before anything is loaded or
  advertised. A mismatch refuses to start, naming the layers.
- With --fetch: the node asks the tracker for peers that proved layers of M
  (GET /v1/artifacts/{id}/peers), downloads from all of them only the pieces
  holding the header, its layers and the globals its range loads (dgr.artifact.torrent.fetch)
  into MODEL_DIR/<file name> as a sparse file with resume data, and fetch
  verifies them. The manifest's sha256 is then recorded as that file's
  digest (dgr.digest.remember_sha256): the holes would hash to something else.
  The node then loads its range straight from that partial file through the
  layer-range API, which reads only the range's tensors, never the holes.
- While serving: the file is seeded on HOST:seed_port (a whole file lazily,
  libtorrent hashing each piece the first time it sends it; a partial one
  with the pieces its resume data lists), the claim {manifest_id, seed} goes
  into the registration, and the tracker's challenges are answered from the
  file in a worker thread.

Progress goes to stderr: a bar on a terminal, one line a second otherwise.
Left out: widening a partial file to more layers while serving.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from dgr.artifact.constants import GlobalNeed
from dgr.artifact.manifest import Manifest
from dgr.artifact.proof import Challenge, answer_challenge
from dgr.security.tls import TlsTrust
from dgr.artifact.torrent import resume_path_for
from dgr.artifact.verify import verify_file
from dgr.backends.base import Compute, LayerRange
from dgr.errors import CallerError, PeerError, Reason
from dgr.serve import run_until_signal
from dgr.progress import LineProgress, Progress, say, terminal_progress

__all__ = [
    "NodeArtifact",
    "node_progress",
    "say",
    "verify_local",
    "fetch_layers",
    "seed_artifact",
    "default_model_dir",
    "prepare_node_artifact",
    "PEERS_POLL_S",
]

PEERS_POLL_S = 0.5


@contextlib.contextmanager
def node_progress() -> Iterator[Progress]:
    """A rich bar when stderr is a terminal, else LineProgress."""
    if sys.stderr.isatty():
        with terminal_progress() as bar:
            yield bar
    else:
        yield LineProgress(emit=say)


def default_model_dir(manifest: Manifest) -> Path:
    """Where --fetch puts the file without --model-dir: beside the digest cache, one folder per manifest."""
    from dgr.digest import cache_dir

    return cache_dir().parent / "artifacts" / manifest.id[:16]


@attrs.define
class NodeArtifact:
    """The artifact a node serves from: manifest, file, layers, and what it took to get here."""

    manifest: Manifest
    path: Path
    layers: LayerRange
    partial: bool  # a sparse download: only the needed pieces are present
    seed: str | None = None  # HOST:PORT once seeding
    seed_status: dict[str, Any] = attrs.field(factory=dict)
    timings: dict[str, float] = attrs.field(factory=dict)
    fetch: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    proof: dict[str, Any] = attrs.field(factory=dict)  # as the tracker last reported it
    limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(2))
    started_at: float = attrs.field(factory=time.monotonic)  # when the node started preparing it
    prepared_at: float = attrs.field(factory=time.monotonic)  # when the file was ready to load

    def age(self) -> float:
        return time.monotonic() - self.started_at

    def claim(self) -> dict[str, Any]:
        """The registration's `artifact` field."""
        return {"manifest_id": self.manifest.id, "seed": self.seed}

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a possession challenge from the file. Blocking: run it in a worker thread.

        Raises:
            CallerError(INVALID_REQUEST | ARTIFACT_MISMATCH | MODEL_LOAD_FAILED)
        """
        challenge = Challenge.from_json(body)
        return answer_challenge(self.path, self.manifest, challenge).to_json()

    def check_backend(self, backend: Compute) -> None:
        """Refuse a backend that does not serve this artifact's layers of this file; note the load time.

        Raises:
            CallerError(ARTIFACT_MISMATCH): the backend's file digest or layers are not the artifact's.
        """
        self.timings["load_s"] = time.monotonic() - self.prepared_at
        if backend.info.digest != self.manifest.file.sha256:
            raise CallerError(
                Reason.ARTIFACT_MISMATCH,
                f"{self.path} holds verified layers {self.layers}, but its sha256 {backend.info.digest[:12]} is not "
                f"manifest {self.manifest.id[:12]}'s {self.manifest.file.sha256[:12]}: the file differs elsewhere",
            )
        if backend.layers != self.layers:
            raise CallerError(Reason.ARTIFACT_MISMATCH, f"backend serves {backend.layers}, verified {self.layers}")
        say(f"loaded {backend.name} layers {self.layers} in {self.timings['load_s']:.2f} s")

    def status(self) -> dict[str, Any]:
        return {
            "manifest_id": self.manifest.id,
            "file": str(self.path),
            "file_name": self.manifest.file.name,
            "layers": str(self.layers),
            "partial": self.partial,
            "seed": self.seed,
            "seed_status": self.seed_status,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "fetch": self.fetch,
            "verify": self.verify,
            "proof": self.proof,
        }


def verify_local(manifest: Manifest, path: Path, layers: LayerRange) -> NodeArtifact:
    """Check the header, layers and globals of a local file against the manifest before serving it.

    A file with resume data beside it is a partial download from an earlier
    --fetch: its digest is recorded as the manifest's (see the module docstring).

    Raises:
        CallerError(ARTIFACT_MISMATCH): the file is another model, or tensors differ (named).
        CallerError(MODEL_LOAD_FAILED): missing, not GGUF, or truncated.
    """
    started = time.perf_counter()
    say(f"verifying layers {layers} of {path.name} against manifest {manifest.id[:12]}")
    with node_progress() as progress:
        report = verify_file(path, manifest, layers, need=GlobalNeed.COMPUTE, progress=progress)
    report.raise_for_mismatch()
    seconds = time.perf_counter() - started
    partial = resume_path_for(path).is_file()
    if partial:
        from dgr.digest import remember_sha256

        remember_sha256(path, manifest.file.sha256)
    say(f"verified layers {layers}: {report.bytes_checked / 1e6:.1f} MB in {seconds:.2f} s")
    art = NodeArtifact(manifest=manifest, path=path, layers=layers, partial=partial)
    art.verify = report.to_json()
    art.timings["verify_s"] = seconds
    return art


async def _peers(client: httpx.AsyncClient, manifest: Manifest) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/artifacts/{manifest.id}/peers")
    if r.status_code == 404:
        raise CallerError(
            Reason.NOT_FOUND,
            f"the tracker does not know manifest {manifest.id[:12]} ({manifest.file.name}): start it with --manifest",
        )
    r.raise_for_status()
    return [p for p in r.json()["peers"] if p.get("seed")]


async def _wait_for_peers(tracker: str, manifest: Manifest, tls: TlsTrust = TlsTrust()) -> list[dict[str, Any]]:
    """Peers that seed the manifest, once there is at least one; the caller's scope bounds the wait."""
    waiting = False
    async with httpx.AsyncClient(base_url=tracker, timeout=5.0, verify=tls.tracker_verify(tracker)) as client:
        while True:
            try:
                peers = await _peers(client, manifest)
            except httpx.HTTPError as exc:
                peers = []
                if not waiting:
                    say(f"tracker {tracker} not reachable yet ({type(exc).__name__}); retrying")
                    waiting = True
            if peers:
                return peers
            if not waiting:
                say(f"no peer seeds manifest {manifest.id[:12]} yet; waiting")
                waiting = True
            await trio.sleep(PEERS_POLL_S)


async def fetch_layers(
    manifest: Manifest,
    layers: LayerRange,
    tracker: str,
    model_dir: Path,
    *,
    timeout_s: float | None = None,
    tls: TlsTrust = TlsTrust(),
) -> NodeArtifact:
    """Fetch the header, layers and globals from the tracker's peers; verify; record the digest.

    Raises:
        CallerError(NOT_FOUND): the tracker does not know the manifest.
        CallerError(ARTIFACT_MISMATCH): fetched tensors still differ from the manifest.
        PeerError(NODE_ERROR): no peer, or not every needed piece, within timeout_s.
    """
    from dgr.artifact.torrent import TransferStatus, fetch
    from dgr.digest import remember_sha256

    manifest.check_layers(layers)
    dest = model_dir / manifest.file.name
    wanted = manifest.needed_pieces(layers, GlobalNeed.COMPUTE)
    plen = manifest.torrent.piece_length
    started = time.perf_counter()
    peers_seen = 0
    with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as scope:
        peers = await _wait_for_peers(tracker, manifest, tls)
        peers_at = time.perf_counter()
        say(
            f"fetching layers {layers} of {manifest.file.name} (header, {len(layers)} layers, the globals the range loads: "
            f"{len(wanted)} of {manifest.torrent.piece_count} pieces, <= {len(wanted) * plen / 1e6:.1f} MB) "
            f"from {len(peers)} peers: {', '.join(p['node'] + '@' + p['seed'] for p in peers)}"
        )
        with node_progress() as progress:
            progress.start(f"fetching layers {layers}", None)

            def show(st: TransferStatus) -> None:
                nonlocal peers_seen
                peers_seen = max(peers_seen, st.peers)
                progress.update(st.bytes_done, st.bytes_wanted, f"fetching layers {layers} from {st.peers} peers")

            result = await fetch(
                manifest, layers, dest, [p["seed"] for p in peers],
                need=GlobalNeed.COMPUTE, on_status=show,
            )
    if scope.cancelled_caught:
        raise PeerError(
            Reason.NODE_ERROR,
            f"fetching layers {layers} of manifest {manifest.id[:12]} did not finish within {timeout_s:g} s "
            "(no peer, or no peer holding some needed piece); the partial file and its resume data are kept",
        )
    remember_sha256(dest, manifest.file.sha256)
    seconds = time.perf_counter() - peers_at
    say(
        f"fetched and verified layers {layers}: {len(result.pieces_fetched)} pieces, "
        f"{result.payload_bytes / 1e6:.1f} MB in {result.transfer_seconds:.2f} s "
        f"({seconds:.2f} s with session start and verify), {len(result.hash_failures)} hash failures"
    )
    art = NodeArtifact(manifest=manifest, path=dest, layers=layers, partial=True)
    art.fetch = {
        "peers": [p["node"] for p in peers],
        "peers_connected_max": peers_seen,
        "pieces_wanted": list(result.pieces_wanted),
        "pieces_fetched": list(result.pieces_fetched),
        "pieces_have": list(result.pieces_have),
        "payload_bytes": result.payload_bytes,
        "hash_failures": len(result.hash_failures),
        "banned_peers": list(result.banned_peers),
        "corrupt_peers": list(result.corrupt_peers),
        "pardons": result.pardons,
        "transfer_s": round(result.transfer_seconds, 4),
    }
    art.verify = result.report.to_json()
    art.timings["peer_wait_s"] = peers_at - started
    art.timings["fetch_s"] = seconds
    return art


async def seed_artifact(art: NodeArtifact, host: str, port: int = 0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Seed the node's file until cancelled; sets art.seed once listening, then reports started."""
    from dgr.artifact.torrent import SeedCheck, SeedInfo, TransferStatus, seed

    resume = resume_path_for(art.path)

    def record(st: TransferStatus) -> None:
        art.seed_status = {"pieces": st.pieces_have, "payload_up": st.payload_up, "peers": st.peers,
                           "rate_up": st.rate_up}

    have_resume = resume.is_file()
    # A partial file without resume data must be hashed: claiming every piece
    # (lazy seed mode) would offer holes.
    check = SeedCheck.FULL if art.partial and not have_resume else SeedCheck.LAZY
    async with trio.open_nursery() as nursery:
        info: SeedInfo = await nursery.start(
            functools.partial(
                seed, art.manifest, art.path, listen=f"{host}:{port}", check=check,
                resume=resume if have_resume else None, on_status=record,
            )
        )
        art.seed = f"{host}:{info.port}"
        art.seed_status = {"pieces": info.pieces_have, "payload_up": 0, "peers": 0, "rate_up": 0}
        say(f"seeding {art.manifest.file.name} ({info.pieces_have}/{art.manifest.torrent.piece_count} pieces) "
            f"on {art.seed}")
        task_status.started()


def _run_interruptible(fn: Any, *args: Any) -> Any:
    """trio.run(fn, *args), cancelled cleanly by SIGINT or SIGTERM (a fetch then saves its resume data).

    Raises:
        CallerError(CANCELLED): a signal stopped it.
    """
    result = run_until_signal(fn, *args)
    if result is None:
        raise CallerError(Reason.CANCELLED, "interrupted before the artifact was ready; a partial fetch keeps its "
                                            "resume data and continues on the next start")
    return result


def prepare_node_artifact(
    manifest_path: str | Path | None,
    layers: LayerRange | None,
    *,
    backend: str,
    model: str | Path | None = None,
    fetch: bool = False,
    tracker: str | None = None,
    model_dir: str | Path | None = None,
    fetch_timeout_s: float | None = None,
    tls: TlsTrust | None = None,
) -> NodeArtifact:
    """What `dgr node --manifest M [--fetch]` does before loading its backend: verify or fetch.

    `layers` None means every layer of the manifest. With `fetch`, the layers
    come from `tracker`'s proven peers into `model_dir` (default: beside the
    digest cache), dialling them (it listens on nothing); otherwise `model` (or the
    backend's default model) is verified in place.

    Raises:
        CallerError(INVALID_REQUEST): flags that do not fit together.
        CallerError(NOT_FOUND | ARTIFACT_MISMATCH | MODEL_LOAD_FAILED | CANCELLED)
        PeerError(NODE_ERROR): the fetch timed out.
    """
    started = time.monotonic()
    if not manifest_path:
        raise CallerError(Reason.INVALID_REQUEST, "--fetch needs --manifest")
    if backend == "stub":
        raise CallerError(Reason.INVALID_REQUEST, "the stub backend has no weights to verify, fetch or prove")
    manifest = Manifest.load(manifest_path)
    layers = layers or LayerRange(0, manifest.model.block_count)
    manifest.check_layers(layers)
    if fetch:
        if model:
            raise CallerError(Reason.INVALID_REQUEST, "--fetch writes its own file: use --model-dir, not --model")
        if not tracker:
            raise CallerError(Reason.INVALID_REQUEST, "--fetch asks the tracker for peers: give --tracker")
        into = Path(model_dir) if model_dir else default_model_dir(manifest)
        art = _run_interruptible(
            functools.partial(fetch_layers, manifest, layers, tracker, into, timeout_s=fetch_timeout_s,
                              tls=tls or TlsTrust())
        )
    else:
        from dgr.backends.factory import resolve_model

        art = verify_local(manifest, resolve_model(backend, model), layers)
    art.started_at = started
    art.prepared_at = time.monotonic()
    how = " (the range loads straight from the file)" if backend == "llama_shard" else ""
    say(f"loading {backend} layers {layers} from {art.path.name}{how}")
    return art
