"""One private libtorrent session, driven from trio: its settings, its alerts, its lifetime.

One job: hold a libtorrent session so that trio never blocks on it.
dgr.artifact.torrent seeds and fetches through it.

Rules:
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
  session calls go through `in_thread`, which looks the method up inside the
  worker thread, never a bound method of the session.
- libtorrent is imported lazily, by `libtorrent()` only: importing
  dgr.artifact must not need the wheel.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from dgr.errors import CallerError, Reason

__all__ = ["AlertTally", "Swarm", "endpoint_key", "in_thread", "libtorrent", "one_port", "open_swarm",
           "session_settings"]

# How long one wait for alerts may block a worker thread; also the worst
# extra latency of a cancellation.
_ALERT_WAIT_MS = 100


def libtorrent() -> Any:
    """The libtorrent module.

    Raises:
        CallerError(INTERNAL): the wheel is not installed.
    """
    try:
        import libtorrent
    except ImportError:  # pragma: no cover - depends on the environment
        raise CallerError(Reason.INTERNAL, "libtorrent is not installed: pip install libtorrent (PyPI, 2.x)") from None
    return libtorrent


def session_settings(listen: str, *, upload_rate_limit: int = 0, outgoing: str = "") -> dict[str, Any]:
    """libtorrent settings for a private swarm listening on one interface (none for `listen=""`), its
    connections out leaving from `outgoing` ("": where the system routes them).

    All of it goes to the session constructor: applied later, a default
    session would already have started DHT, LSD, UPnP and NAT-PMP on every
    interface.
    """
    lt = libtorrent()
    cat = lt.alert_category
    return {
        "listen_interfaces": listen,
        "outgoing_interfaces": outgoing,
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
        # block and piece progress name the peer asked for each block (AlertTally.asked); the queue holds
        # a pump interval's blocks even at several GB/s of 16 KiB blocks (a lost alert stops convictions)
        "alert_mask": cat.error | cat.status | cat.storage | cat.peer | cat.block_progress | cat.piece_progress,
        "alert_queue_size": 100_000,
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



def endpoint_key(host: str, port: int) -> str:
    """A peer as the tally names it: HOST:PORT, an IPv6 host unbracketed."""
    return f"{host}:{port}"


@attrs.define
class AlertTally:
    """What the alerts told us, copied out of them.

    libtorrent bans a peer that was the only sender of a piece that failed its hash, and also one
    whose trust fell (2 points per failed piece it sent blocks of, 1 back per piece passed): an honest
    seeder that shared pieces with a corrupt one can be banned with it, mostly when hashing lags behind
    the transfer (`python -m dgr.bench.corrupt_seeder --busy 6` counts it). `corrupt` holds only what
    is proven: a peer that was the only one asked for any block of a piece, since the piece was last
    had, when it failed. Requests, not arrivals, are counted: a block's arrival goes unannounced when
    its peer was disconnected before it reached the disk.
    """

    hash_failures: list[int] = attrs.Factory(list)
    banned: list[str] = attrs.Factory(list)  # libtorrent's bans, an endpoint per ban (repeats included)
    corrupt: list[str] = attrs.Factory(list)  # endpoints proven to have sent bad data, once each
    asked: dict[int, set[str]] = attrs.Factory(dict)  # piece -> who was asked for its blocks since it was had
    unknown: set[int] = attrs.Factory(set)  # pieces holding blocks from before this session: never proof
    asked_lost: bool = False  # alerts were dropped: a peer asked may be missing, so no one is convicted after
    removed: int = 0
    flushed: int = 0
    checked: int = 0
    resume: list[bytes] = attrs.Factory(list)
    resume_failed: list[str] = attrs.Factory(list)
    error: str | None = None

    def failed(self, piece: int) -> None:
        """`piece` failed its hash: the only peer ever asked for its blocks, if one was, is corrupt."""
        self.hash_failures.append(piece)
        asked = self.asked.get(piece, set())
        if len(asked) == 1 and piece not in self.unknown and not self.asked_lost:
            if (peer := next(iter(asked))) not in self.corrupt:
                self.corrupt.append(peer)


@attrs.define
class Swarm:
    ses: Any
    tally: AlertTally = attrs.Factory(AlertTally)

    async def pump(self) -> None:
        """Wait up to _ALERT_WAIT_MS for alerts and record them."""
        await trio.to_thread.run_sync(in_thread, self, "wait_for_alert", _ALERT_WAIT_MS)
        lt = libtorrent()
        t = self.tally
        for a in self.ses.pop_alerts():
            if isinstance(a, lt.block_downloading_alert):
                t.asked.setdefault(int(a.piece_index), set()).add(endpoint_key(*a.endpoint))
            elif isinstance(a, lt.piece_finished_alert):
                t.asked.pop(int(a.piece_index), None)
                t.unknown.discard(int(a.piece_index))
            elif isinstance(a, lt.hash_failed_alert):
                t.failed(int(a.piece_index))
            elif isinstance(a, lt.peer_ban_alert):
                t.banned.append(endpoint_key(*a.endpoint))
            elif isinstance(a, lt.alerts_dropped_alert):
                t.asked_lost = True
            elif isinstance(a, lt.torrent_removed_alert):
                t.removed += 1
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
        lt = libtorrent()
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


def in_thread(swarm: Swarm, method: str, *args: Any) -> Any:
    """Call a session method from a worker thread, holding the session only in this frame."""
    return getattr(swarm.ses, method)(*args)


@contextlib.asynccontextmanager
async def open_swarm(listen: str, *, upload_rate_limit: int = 0, outgoing: str = "") -> AsyncIterator[Swarm]:
    lt = libtorrent()
    settings = session_settings(one_port(listen), upload_rate_limit=upload_rate_limit, outgoing=outgoing)
    swarm = Swarm(await trio.to_thread.run_sync(lt.session, settings))
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
