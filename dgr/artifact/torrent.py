"""Move a Model Artifact, or only some layers of it, over BitTorrent v2 with libtorrent.

A node that will serve layers [A, B) needs the GGUF header and those layers'
tensors, not the whole file. `fetch` downloads exactly the pieces covering
them (every other piece has priority 0) from peers given by address, keeps a
sparse partial file plus libtorrent resume data so an interrupted fetch goes
on where it stopped, and checks every needed tensor against the manifest
before returning. `seed` serves a file, whole or partial, to such fetchers.

Rules:
- The .torrent is built from the manifest alone (Manifest.torrent_bytes), and
  libtorrent's own v2 info-hash must equal the manifest's, or nothing starts.
- Each call runs one private libtorrent session of dgr.artifact.swarm (its
  rules: no discovery, one interface, trio never blocks on libtorrent).
- Timeouts are the caller's cancel scopes. A cancelled fetch still saves its
  resume data (shielded, bounded) before its session goes.

Left out: peer discovery (the tracker will hand out peers), DHT, encryption.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from dgr.artifact import swarm as _swarm
from dgr.artifact.constants import GlobalNeed
from dgr.artifact.manifest import Manifest
from dgr.artifact.swarm import AlertTally, Swarm, endpoint_key, in_thread, open_swarm
from dgr.artifact.verify import VerifyReport, verify_file
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, PeerError, Reason

__all__ = [
    "PeerAddr",
    "SeedCheck",
    "TransferStatus",
    "SeedInfo",
    "FetchResult",
    "torrent_info",
    "seed",
    "fetch",
    "resume_path_for",
]

# Bounds on the bookkeeping a cancelled or finished fetch does in its finally.
_FLUSH_TIMEOUT_S = 10.0
_RESUME_SAVE_INTERVAL_S = 5.0
# How often a fetch dials again the given peers it is not connected to.
_REDIAL_INTERVAL_S = 1.0


@attrs.frozen
class PeerAddr:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "PeerAddr":
        """'HOST:PORT' or '[V6]:PORT'.

        Raises:
            CallerError(INVALID_REQUEST)
        """
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CallerError(Reason.INVALID_REQUEST, f"peer must look like HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def key(self) -> str:
        """As the alerts name it (AlertTally)."""
        return endpoint_key(self.host, self.port)


class SeedCheck(enum.Enum):
    """How a seeder learns which pieces its file holds."""

    # Claim every piece and let libtorrent hash each piece the first time it
    # uploads it (libtorrent's seed_mode). Instant start; for complete files
    # already checked with verify_file.
    LAZY = "lazy"
    # Hash the whole file before serving; serve only pieces that match. For
    # partial files without resume data. About 650 MB/s on one core.
    FULL = "full"


@attrs.frozen
class TransferStatus:
    """One progress report from seed or fetch."""

    state: str  # libtorrent's torrent state name
    pieces_have: int
    pieces_wanted: int  # fetch: pieces the layer range needs; seed: pieces held
    bytes_wanted: int
    bytes_done: int
    payload_down: int  # payload bytes received this session
    payload_up: int
    rate_down: int  # bytes/s
    rate_up: int
    peers: int
    hash_failures: int


@attrs.frozen
class SeedInfo:
    """What `seed` reports once it serves: where it listens and what."""

    port: int
    info_hash_v2: str
    pieces_have: int


@attrs.frozen
class FetchResult:
    dest: Path
    layers: LayerRange
    pieces_wanted: tuple[int, ...]
    pieces_fetched: tuple[int, ...]  # completed by this call (not from an earlier, interrupted one)
    pieces_have: tuple[int, ...]  # every piece the file holds now, wanted or not
    hash_failures: tuple[int, ...]  # piece index per failed hash check, repeats included
    banned_peers: tuple[str, ...]  # libtorrent's bans: its trust rule may name an honest peer (AlertTally)
    corrupt_peers: tuple[str, ...]  # proven: each was the only peer asked for a piece that failed (AlertTally)
    pardons: int  # times libtorrent had banned every peer not proven corrupt, and the torrent was added again
    payload_bytes: int  # payload received by this call, redundant and failed bytes included
    seconds: float  # the whole call: session start, file check, transfer, final verify
    transfer_seconds: float  # from connecting to peers to the last wanted piece
    report: VerifyReport


def resume_path_for(dest: Path) -> Path:
    return dest.with_name(dest.name + ".resume")


def torrent_info(manifest: Manifest) -> Any:
    """libtorrent's torrent_info for the manifest, checked against the manifest's info-hash.

    Raises:
        CallerError(ARTIFACT_MISMATCH): libtorrent computes another v2 info-hash
            or piece count than the manifest states.
    """
    lt = _swarm.libtorrent()
    ti = lt.torrent_info(manifest.torrent_bytes())
    theirs = str(ti.info_hashes().v2)
    if theirs != manifest.torrent.info_hash_v2 or ti.num_pieces() != manifest.torrent.piece_count:
        raise CallerError(
            Reason.ARTIFACT_MISMATCH,
            f"libtorrent's v2 info-hash {theirs} / {ti.num_pieces()} pieces differ from manifest "
            f"{manifest.id[:12]}'s {manifest.torrent.info_hash_v2} / {manifest.torrent.piece_count}",
        )
    return ti



def _flags_active(atp: Any) -> None:
    lt = _swarm.libtorrent()
    # Torrents start paused and auto-managed; auto-management would cap how
    # many run at once (LIBTORRENT.md, pitfall 2).
    atp.flags = atp.flags & ~lt.torrent_flags.paused & ~lt.torrent_flags.auto_managed


def _redial(h: Any, addrs: Sequence[PeerAddr], tally: AlertTally, since: int) -> None:
    """Dial each given peer that is neither connected, nor proven corrupt, nor banned since the
    torrent was last added (`since`: an index into the tally's bans).

    The peers a fetch is given are the artifact's known seeders; a refused or
    dropped connection to one is worth retrying at once rather than after
    libtorrent's public-swarm back-off.
    """
    shut = {endpoint_key(*p.ip) for p in h.get_peer_info()} | set(tally.corrupt) | set(tally.banned[since:])
    for a in addrs:
        if a.key not in shut:
            h.connect_peer((a.host, a.port))


async def _add(swarm: Swarm, manifest: Manifest, dest: Path, resume: Path, wanted: set[int]) -> Any:
    """The fetch's torrent, added (from its resume data where there is some) and checked, its bans
    lifted: resume data keeps libtorrent's, an honest peer's with them (`_Pardon`)."""
    atp = _add_params(manifest, dest, resume)
    atp.banned_peers = []
    atp.piece_priorities = [1 if i in wanted else 0 for i in range(manifest.torrent.piece_count)]
    checked = swarm.tally.checked
    h = await trio.to_thread.run_sync(in_thread, swarm, "add_torrent", atp)
    await swarm.until(lambda: swarm.tally.checked > checked)
    return h


@attrs.define
class _Pardon:
    """Lifting libtorrent's bans of peers not proven corrupt, by adding the torrent again.

    libtorrent's bans live in the torrent's peer list, which only a new torrent clears (the bindings
    have no clear_peers). Without this, a fetch whose honest seeder was banned beside a corrupt one
    waited for its timeout.
    """

    count: int = 0
    since: int = 0  # the tally's bans from this index on are the current torrent's
    pieces: int = -1  # pieces had at the last pardon: another needs progress since
    payload: int = 0  # payload the torrents before the current one received

    def due(self, addrs: Sequence[PeerAddr], tally: AlertTally, pieces: int) -> bool:
        """Every given peer not proven corrupt is banned, and pieces came in since the last pardon."""
        unproven = {a.key for a in addrs} - set(tally.corrupt)
        return bool(unproven) and unproven <= set(tally.banned[self.since:]) and pieces > self.pieces

    async def grant(self, swarm: Swarm, h: Any, resume: Path, add: Callable[[], Any]) -> Any:
        """Save what `h` has, remove it, and add it again (`add`); the new handle."""
        with trio.move_on_after(_FLUSH_TIMEOUT_S):
            await swarm.save_resume(h, resume)
        st = h.status()
        self.count, self.pieces, self.payload = self.count + 1, int(st.num_pieces), self.payload + int(
            st.total_payload_download)
        removed = swarm.tally.removed
        swarm.ses.remove_torrent(h)
        await swarm.until(lambda: swarm.tally.removed > removed)
        self.since = len(swarm.tally.banned)
        return await add()


def _status(h: Any, tally: AlertTally, wanted: int) -> TransferStatus:
    st = h.status()
    return TransferStatus(
        state=str(st.state).rsplit(".", 1)[-1],
        pieces_have=int(st.num_pieces),
        pieces_wanted=wanted,
        bytes_wanted=int(st.total_wanted),
        bytes_done=int(st.total_wanted_done),
        payload_down=int(st.total_payload_download),
        payload_up=int(st.total_payload_upload),
        rate_down=int(st.download_payload_rate),
        rate_up=int(st.upload_payload_rate),
        peers=int(st.num_peers),
        hash_failures=len(tally.hash_failures),
    )


def _add_params(manifest: Manifest, path: Path, resume: Path | None) -> Any:
    """add_torrent_params for manifest's file at path, from resume data when there is some."""
    lt = _swarm.libtorrent()
    ti = torrent_info(manifest)
    atp = None
    if resume is not None and resume.is_file() and path.is_file():
        try:
            atp = lt.read_resume_data(resume.read_bytes())
        except RuntimeError:
            atp = None  # unreadable resume data: libtorrent re-hashes the file instead
        if atp is not None and str(atp.info_hashes.v2) != manifest.torrent.info_hash_v2:
            atp = None  # resume data of another torrent: ignore it
    if atp is None:
        atp = lt.add_torrent_params()
    atp.ti = ti
    atp.save_path = str(path.parent)
    if path.name != manifest.file.name:
        atp.renamed_files = {0: path.name}
    _flags_active(atp)
    return atp


async def seed(
    manifest: Manifest,
    path: str | Path,
    *,
    listen: str = "127.0.0.1:0",
    check: SeedCheck = SeedCheck.LAZY,
    resume: Path | None = None,
    upload_rate_limit: int = 0,
    on_status: Callable[[TransferStatus], None] | None = None,
    status_interval: float = 1.0,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the pieces of manifest's file held at path until cancelled.

    Calls task_status.started(SeedInfo) once it listens and knows its pieces.
    With resume data (e.g. left by `fetch`), no hashing is needed; without it,
    `check` decides. A partial file never downloads anything here: every piece
    has priority 0.

    Raises:
        CallerError(ARTIFACT_MISMATCH): libtorrent's info-hash differs from the manifest's.
        CallerError(MODEL_LOAD_FAILED): the file is missing or libtorrent reports a disk error.
    """
    lt = _swarm.libtorrent()
    p = Path(path)
    if not p.is_file():
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"nothing to seed: {p} is not a file")
    async with open_swarm(listen, upload_rate_limit=upload_rate_limit) as swarm:
        port = await swarm.listen_port()
        atp = _add_params(manifest, p, resume)
        has_resume = bool(atp.have_pieces)
        if check is SeedCheck.LAZY and not has_resume:
            # Any piece priority would take the torrent out of seed mode, and
            # a seed wants nothing anyway.
            atp.flags |= lt.torrent_flags.seed_mode
        else:
            # Serve what is held, download nothing.
            atp.piece_priorities = [0] * manifest.torrent.piece_count
        h = await trio.to_thread.run_sync(in_thread, swarm, "add_torrent", atp)
        await swarm.until(lambda: swarm.tally.checked > 0)
        held = int(h.status().num_pieces)
        task_status.started(SeedInfo(port=port, info_hash_v2=manifest.torrent.info_hash_v2, pieces_have=held))
        next_report = 0.0
        while True:
            swarm.raise_on_error()
            await swarm.pump()
            now = time.monotonic()
            if on_status is not None and now >= next_report:
                on_status(_status(h, swarm.tally, held))
                next_report = now + status_interval


async def fetch(
    manifest: Manifest,
    layers: LayerRange,
    dest: str | Path,
    peers: Sequence[PeerAddr | str],
    *,
    need: GlobalNeed = GlobalNeed.COMPUTE,
    interface: str = "",
    resume: Path | None = None,
    on_status: Callable[[TransferStatus], None] | None = None,
    status_interval: float = 0.5,
) -> FetchResult:
    """Download the header and the tensors of layers (plus the globals `need` names) into dest.

    Only the pieces covering those bytes are wanted. dest becomes a sparse file
    of the full size; resume data goes to `resume` (default dest + '.resume')
    every few seconds, on completion and on cancellation, so a later call
    fetches only what is missing. Returns after every needed tensor matched
    the manifest.

    Raises:
        CallerError(ARTIFACT_MISMATCH): libtorrent's info-hash differs from the
            manifest's, or a needed tensor still differs after download.
        CallerError(INVALID_REQUEST): layers outside the model, or no peers.
        CallerError(MODEL_LOAD_FAILED): a disk error libtorrent reports.
    """
    started = time.perf_counter()
    dest = Path(dest)
    resume = resume or resume_path_for(dest)
    addrs = [a if isinstance(a, PeerAddr) else PeerAddr.parse(a) for a in peers]
    if not addrs:
        raise CallerError(Reason.INVALID_REQUEST, "fetch needs at least one peer")
    wanted = manifest.needed_pieces(layers, need)
    wanted_set = set(wanted)
    dest.parent.mkdir(parents=True, exist_ok=True)

    # The fetch only dials the peers it was given, and listens on nothing: a seeder it banned for
    # corrupt pieces could otherwise dial back in from a new port, a new peer to libtorrent, and go on
    # sending them (seeders dial a downloader they know of), muddling which peer sent what.
    async with open_swarm("", outgoing=interface) as swarm:
        # Peers only after the check, so `held_before` is what an earlier
        # (interrupted) fetch left: resume data or a re-hash of the file.
        add = functools.partial(_add, swarm, manifest, dest, resume, wanted_set)
        h = await add()
        # blocks an earlier fetch left in a piece came from peers no alert here names
        swarm.tally.unknown = {int(p["piece_index"]) for p in h.get_download_queue()}
        pardon = _Pardon()
        try:
            held_before = {i for i in wanted if h.have_piece(i)}
            connected = time.perf_counter()
            next_redial = 0.0
            next_report = 0.0
            next_save = time.monotonic() + _RESUME_SAVE_INTERVAL_S
            while True:
                swarm.raise_on_error()
                st = h.status()
                # the totals count a piece once it passed its hash, have_piece once it is on disk too
                complete = (st.total_wanted > 0 and st.total_wanted_done == st.total_wanted
                            and all(h.have_piece(i) for i in wanted))
                now = time.monotonic()
                if on_status is not None and (complete or now >= next_report):
                    on_status(_status(h, swarm.tally, len(wanted)))
                    next_report = now + status_interval
                if complete:
                    break
                if now >= next_redial:
                    if pardon.due(addrs, swarm.tally, st.num_pieces):
                        h = await pardon.grant(swarm, h, resume, add)
                    _redial(h, addrs, swarm.tally, pardon.since)
                    next_redial = now + _REDIAL_INTERVAL_S
                if now >= next_save:
                    # Bounded: a missed checkpoint only costs a re-hash after a crash.
                    with trio.move_on_after(_FLUSH_TIMEOUT_S):
                        await swarm.save_resume(h, resume)
                    next_save = time.monotonic() + _RESUME_SAVE_INTERVAL_S
                await swarm.pump()
            transfer_seconds = time.perf_counter() - connected
            payload = pardon.payload + int(h.status().total_payload_download)
        finally:
            # Shielded so a cancelled fetch still records its pieces; bounded,
            # and giving up is safe: without resume data the next fetch
            # re-hashes the partial file and still fetches only what is missing.
            with trio.move_on_after(_FLUSH_TIMEOUT_S, shield=True):
                if h.is_valid():  # not while a pardon has it removed
                    await swarm.save_resume(h, resume)

        have = tuple(i for i in range(manifest.torrent.piece_count) if h.have_piece(i))
        missing = wanted_set - set(have)
        if missing:
            raise PeerError(
                Reason.NODE_ERROR,
                f"libtorrent reported completion but {len(missing)} wanted pieces are missing",
            )
        fetched = tuple(sorted(wanted_set - held_before))
        failures = tuple(swarm.tally.hash_failures)
        banned = tuple(swarm.tally.banned)
        corrupt = tuple(swarm.tally.corrupt)

    report = await trio.to_thread.run_sync(lambda: verify_file(dest, manifest, layers, need=need))
    report.raise_for_mismatch()
    return FetchResult(
        dest=dest,
        layers=layers,
        pieces_wanted=tuple(wanted),
        pieces_fetched=fetched,
        pieces_have=have,
        hash_failures=failures,
        banned_peers=banned,
        corrupt_peers=corrupt,
        pardons=pardon.count,
        payload_bytes=payload,
        seconds=time.perf_counter() - started,
        transfer_seconds=transfer_seconds,
        report=report,
    )
