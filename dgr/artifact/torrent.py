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
- Swarms are private: peers are added by ip:port only; DHT, local peer
  discovery, UPnP, NAT-PMP and uTP are off, there are no trackers, and the
  session listens on the one interface given (127.0.0.1 by default). A
  wildcard (0.0.0.0, ::) with port 0 gets one free port first (`one_port`):
  libtorrent listens on each local address separately, and with port 0 each
  would take a port of its own.
- libtorrent runs its own threads; trio never blocks on it. Alerts are waited
  for in `trio.to_thread.run_sync(ses.wait_for_alert, ...)` with a short
  timeout (not abandoned on cancel, so the session is never destroyed under a
  waiting thread), and copied at once since they die at the next pop.
  Sessions are destroyed in a worker thread (it can take 300 ms). For that,
  no frame on the trio side may hold the session when its owner drops it: a
  cancelled `to_thread` call's traceback keeps its function alive, so blocking
  session calls go through `_in_thread`, which looks the method up inside the
  worker thread, never a bound method of the session.
- Timeouts are the caller's cancel scopes. A cancelled fetch still saves its
  resume data (shielded, bounded) before its session goes.

Left out: peer discovery (the tracker will hand out peers), DHT, encryption.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from dgr.artifact.constants import GlobalNeed
from dgr.artifact.manifest import Manifest
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
    "session_settings",
    "one_port",
    "seed",
    "fetch",
    "resume_path_for",
]

# How long one wait for alerts may block a worker thread; also the worst
# extra latency of a cancellation.
_ALERT_WAIT_MS = 100
# Bounds on the bookkeeping a cancelled or finished fetch does in its finally.
_FLUSH_TIMEOUT_S = 10.0
_RESUME_SAVE_INTERVAL_S = 5.0
# How often a fetch dials again the given peers it is not connected to.
_REDIAL_INTERVAL_S = 1.0


def _lt() -> Any:
    # Imported lazily: importing dgr.artifact must not need the wheel.
    try:
        import libtorrent
    except ImportError:  # pragma: no cover - depends on the environment
        raise CallerError(Reason.INTERNAL, "libtorrent is not installed: pip install libtorrent (PyPI, 2.x)") from None
    return libtorrent


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
    banned_peers: tuple[str, ...]
    payload_bytes: int  # payload received by this call, redundant and failed bytes included
    seconds: float  # the whole call: session start, file check, transfer, final verify
    transfer_seconds: float  # from connecting to peers to the last wanted piece
    report: VerifyReport


def resume_path_for(dest: Path) -> Path:
    return dest.with_name(dest.name + ".resume")


def session_settings(listen: str, *, upload_rate_limit: int = 0) -> dict[str, Any]:
    """libtorrent settings for a private swarm listening on one interface.

    All of it goes to the session constructor: applied later, a default
    session would already have started DHT, LSD, UPnP and NAT-PMP on every
    interface.
    """
    lt = _lt()
    cat = lt.alert_category
    return {
        "listen_interfaces": listen,
        "enable_dht": False,
        "enable_lsd": False,
        "enable_upnp": False,
        "enable_natpmp": False,
        "dht_bootstrap_nodes": "",
        "enable_outgoing_utp": False,
        "enable_incoming_utp": False,
        "enable_ip_notifier": False,
        # Nodes of one machine (tests, `dgr up`) share an address.
        "allow_multiple_connections_per_ip": True,
        # A finished partial peer must stay connected: widening its range later
        # would otherwise stall (LIBTORRENT.md, pitfall 4).
        "close_redundant_connections": False,
        # Many nodes may pull from one seeder at once.
        "unchoke_slots_limit": -1,
        "upload_rate_limit": upload_rate_limit,
        # libtorrent waits 60 s (times its fail count) before dialling a
        # peer again, and forgets a peer after 3 failed dials: right for a
        # public swarm, but a seeder of ours that was briefly unreachable
        # (starting, restarting, a reset connection) then cost a fetch two
        # minutes. `fetch` also re-dials the peers it was given.
        "min_reconnect_time": 1,
        "max_failcount": 100,
        "alert_mask": cat.error | cat.status | cat.storage | cat.peer,
        "alert_queue_size": 10000,
    }


_WILDCARDS = {"0.0.0.0": socket.AF_INET, "::": socket.AF_INET6, "[::]": socket.AF_INET6}


def one_port(listen: str) -> str:
    """`listen` (HOST:PORT), with one free port in place of 0 when HOST is a wildcard.

    libtorrent expands a wildcard into one listening socket per local
    address, and with port 0 each socket takes an ephemeral port of its
    own, while `listen_port()` reports only the first (loopback's). A node
    bound to 0.0.0.0 then announced a seed port that nothing listened on at
    its LAN address. A port free on the wildcard is free on every address,
    so libtorrent takes that one everywhere. (Another process could take it
    in between: libtorrent's listen_failed_alert then says so.)
    """
    host, _, port = listen.rpartition(":")
    family = _WILDCARDS.get(host)
    if port != "0" or family is None:
        return listen
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return f"{host}:{s.getsockname()[1]}"


def torrent_info(manifest: Manifest) -> Any:
    """libtorrent's torrent_info for the manifest, checked against the manifest's info-hash.

    Raises:
        CallerError(ARTIFACT_MISMATCH): libtorrent computes another v2 info-hash
            or piece count than the manifest states.
    """
    lt = _lt()
    ti = lt.torrent_info(manifest.torrent_bytes())
    theirs = str(ti.info_hashes().v2)
    if theirs != manifest.torrent.info_hash_v2 or ti.num_pieces() != manifest.torrent.piece_count:
        raise CallerError(
            Reason.ARTIFACT_MISMATCH,
            f"libtorrent's v2 info-hash {theirs} / {ti.num_pieces()} pieces differ from manifest "
            f"{manifest.id[:12]}'s {manifest.torrent.info_hash_v2} / {manifest.torrent.piece_count}",
        )
    return ti


# -- one libtorrent session, driven from trio ---------------------------------------------


@attrs.define
class _Tally:
    """What the alerts told us, copied out of them."""

    hash_failures: list[int] = attrs.Factory(list)
    banned: list[str] = attrs.Factory(list)
    flushed: int = 0
    checked: int = 0
    resume: list[bytes] = attrs.Factory(list)
    resume_failed: list[str] = attrs.Factory(list)
    error: str | None = None


@attrs.define
class _Swarm:
    ses: Any
    tally: _Tally = attrs.Factory(_Tally)

    async def pump(self) -> None:
        """Wait up to _ALERT_WAIT_MS for alerts and record them."""
        await trio.to_thread.run_sync(_in_thread, self, "wait_for_alert", _ALERT_WAIT_MS)
        lt = _lt()
        t = self.tally
        for a in self.ses.pop_alerts():
            if isinstance(a, lt.hash_failed_alert):
                t.hash_failures.append(int(a.piece_index))
            elif isinstance(a, lt.peer_ban_alert):
                t.banned.append("%s:%d" % tuple(a.endpoint))
            elif isinstance(a, lt.cache_flushed_alert):
                t.flushed += 1
            elif isinstance(a, lt.torrent_checked_alert):
                t.checked += 1
            elif isinstance(a, lt.save_resume_data_alert):
                t.resume.append(bytes(lt.write_resume_data_buf(a.params)))
            elif isinstance(a, lt.save_resume_data_failed_alert):
                t.resume_failed.append(a.message())
            elif isinstance(a, (lt.torrent_error_alert, lt.file_error_alert)):
                t.error = a.message()
            elif isinstance(a, lt.listen_failed_alert):
                t.error = a.message()

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.raise_on_error()
            await self.pump()

    def raise_on_error(self) -> None:
        if self.tally.error is not None:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"libtorrent: {self.tally.error}")

    async def listen_port(self) -> int:
        with trio.fail_after(10):
            await self.until(lambda: bool(self.ses.is_listening() and self.ses.listen_port()))
        return int(self.ses.listen_port())

    async def flush(self, h: Any) -> None:
        before = self.tally.flushed
        h.flush_cache()
        await self.until(lambda: self.tally.flushed > before)

    async def save_resume(self, h: Any, path: Path) -> None:
        """Flush, then save resume data atomically; bounded by the caller's scope."""
        lt = _lt()
        # Saving right after the last piece can record it as missing unless
        # the disk cache is flushed first (LIBTORRENT.md, pitfall 5).
        await self.flush(h)
        before_ok, before_bad = len(self.tally.resume), len(self.tally.resume_failed)
        h.save_resume_data(lt.torrent_handle.flush_disk_cache | lt.torrent_handle.save_info_dict)
        await self.until(lambda: len(self.tally.resume) > before_ok or len(self.tally.resume_failed) > before_bad)
        if len(self.tally.resume) > before_ok:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(self.tally.resume[-1])
            os.replace(tmp, path)
            self.tally.resume.clear()


def _in_thread(swarm: _Swarm, method: str, *args: Any) -> Any:
    """Call a session method from a worker thread, holding the session only in this frame."""
    return getattr(swarm.ses, method)(*args)


@contextlib.asynccontextmanager
async def _open_swarm(listen: str, *, upload_rate_limit: int = 0) -> AsyncIterator[_Swarm]:
    lt = _lt()
    settings = session_settings(one_port(listen), upload_rate_limit=upload_rate_limit)
    swarm = _Swarm(await trio.to_thread.run_sync(lt.session, settings))
    if upload_rate_limit:
        # libtorrent puts LAN and loopback peers in a peer class of their own that the
        # session-wide limit does not cover; a limit must hold for every peer
        local = swarm.ses.get_peer_class(swarm.ses.local_peer_class_id)
        local["upload_limit"] = upload_rate_limit
        swarm.ses.set_peer_class(swarm.ses.local_peer_class_id, local)
    try:
        yield swarm
    finally:

        def destroy() -> None:
            # Drop the only reference here, so libtorrent's blocking shutdown
            # (up to ~300 ms) runs in this worker thread, not on the trio loop.
            swarm.ses = None

        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(destroy)


def _flags_active(atp: Any) -> None:
    lt = _lt()
    # Torrents start paused and auto-managed; auto-management would cap how
    # many run at once (LIBTORRENT.md, pitfall 2).
    atp.flags = atp.flags & ~lt.torrent_flags.paused & ~lt.torrent_flags.auto_managed


def _redial(h: Any, addrs: Sequence[PeerAddr], tally: _Tally) -> None:
    """Dial each given peer that is neither connected nor banned.

    The peers a fetch is given are the artifact's known seeders; a refused or
    dropped connection to one is worth retrying at once rather than after
    libtorrent's public-swarm back-off.
    """
    connected = {"%s:%d" % tuple(p.ip) for p in h.get_peer_info()}
    for a in addrs:
        key = f"{a.host}:{a.port}"
        if key not in connected and key not in tally.banned:
            h.connect_peer((a.host, a.port))


def _status(h: Any, tally: _Tally, wanted: int) -> TransferStatus:
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
    lt = _lt()
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
    lt = _lt()
    p = Path(path)
    if not p.is_file():
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"nothing to seed: {p} is not a file")
    async with _open_swarm(listen, upload_rate_limit=upload_rate_limit) as swarm:
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
        h = await trio.to_thread.run_sync(_in_thread, swarm, "add_torrent", atp)
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
    listen: str = "127.0.0.1:0",
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

    async with _open_swarm(listen) as swarm:
        atp = _add_params(manifest, dest, resume)
        atp.piece_priorities = [1 if i in wanted_set else 0 for i in range(manifest.torrent.piece_count)]
        h = await trio.to_thread.run_sync(_in_thread, swarm, "add_torrent", atp)
        try:
            # Peers only after the check, so `held_before` is what an earlier
            # (interrupted) fetch left: resume data or a re-hash of the file.
            await swarm.until(lambda: swarm.tally.checked > 0)
            held_before = {i for i in wanted if h.have_piece(i)}
            connected = time.perf_counter()
            next_redial = 0.0
            next_report = 0.0
            next_save = time.monotonic() + _RESUME_SAVE_INTERVAL_S
            while True:
                swarm.raise_on_error()
                st = h.status()
                complete = st.total_wanted > 0 and st.total_wanted_done == st.total_wanted
                now = time.monotonic()
                if on_status is not None and (complete or now >= next_report):
                    on_status(_status(h, swarm.tally, len(wanted)))
                    next_report = now + status_interval
                if complete:
                    break
                if now >= next_redial:
                    _redial(h, addrs, swarm.tally)
                    next_redial = now + _REDIAL_INTERVAL_S
                if now >= next_save:
                    # Bounded: a missed checkpoint only costs a re-hash after a crash.
                    with trio.move_on_after(_FLUSH_TIMEOUT_S):
                        await swarm.save_resume(h, resume)
                    next_save = time.monotonic() + _RESUME_SAVE_INTERVAL_S
                await swarm.pump()
            transfer_seconds = time.perf_counter() - connected
            payload = int(h.status().total_payload_download)
        finally:
            # Shielded so a cancelled fetch still records its pieces; bounded,
            # and giving up is safe: without resume data the next fetch
            # re-hashes the partial file and still fetches only what is missing.
            with trio.move_on_after(_FLUSH_TIMEOUT_S, shield=True):
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
        payload_bytes=payload,
        seconds=time.perf_counter() - started,
        transfer_seconds=transfer_seconds,
        report=report,
    )
