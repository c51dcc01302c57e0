"""The node's KV operations: a session's KV opened (from a kept prefix or empty) and closed (kept or freed).

Every method here runs in the scheduler's thread (dgr.node.scheduler), in the same job as the backend
calls it decides, so the prefix cache and the backend never disagree.

Prefix cache (dgr.node.prefix): a session closed normally with the hash chain of the tokens in its KV
(`keep`) and the marks of its positions past the last whole block (`tail`) leaves its KV behind as a
kept prefix; an open that offers a chain and marks starts from the longest kept prefix matching it,
to the token, cut to the positions shared:
- it takes the kept KV over when it shares all its whole blocks (a conversation's next turn) or no
  slot is free, else starts from a copy;
- a memory that cannot drop the positions past them opens empty.

A kept prefix holds a sequence slot that no live session holds: an open that finds no free slot evicts
the least recently used prefix first, so the capacity check (live sessions only, dgr.sessions) is the
only refusal. Kept prefixes are counted apart from live sessions (`prefix_bytes`).

Prefix Snapshots (dgr.node.snapshot): a kept prefix with whole blocks is also written to disk, and at
start every matching snapshot is loaded into a free slot.
"""

from __future__ import annotations

import logging

import attrs

from dgr.backends.base import ShardBackend
from dgr.errors import CallerError, Reason
from dgr.node.prefix import Kept, PrefixCache
from dgr.seam.keys import BLOCK_TOKENS, MARK_BYTES
from dgr.node.snapshot import SnapshotDir

__all__ = ["NodeKV"]

log = logging.getLogger("dgr.node")


@attrs.define
class NodeKV:
    """The backend's sessions' KV and the kept prefixes beside them; called in the scheduler's thread only."""

    backend: ShardBackend
    # kept prefixes; None where the backend cannot keep them or the node keeps none (--prefix-cache-mb 0)
    prefix: PrefixCache | None = attrs.field(factory=PrefixCache)
    snapshots: SnapshotDir | None = None  # --snapshot-dir: kept prefixes written to disk, reloaded at start
    prefix_bytes: int = 0  # kept prefixes' bytes as of the last job that changed them

    def __attrs_post_init__(self) -> None:
        if self.prefix is not None and not self.backend.prefix_capable:
            self.prefix = None  # this backend holds no KV beyond a session's life
        if self.prefix is None or not self.backend.snapshot_capable:
            self.snapshots = None

    def open(self, sid: str, max_positions: int, chain: list[str], lane: int | None = None,
             marks: bytes = b"") -> int:
        """Open `sid` on the longest kept prefix of `chain` and `marks`, or empty; its positions.

        A prompt that shares every whole block of the kept prefix (the same conversation's next turn)
        takes the kept KV over, trimmed to the positions shared: no copy (llama.cpp copies a whole
        sequence's buffer, every --ctx position), and the session's close keeps the longer prefix.
        A prompt that shares less (a common system prompt) gets a copy trimmed to what it shares,
        and the prefix stays for others, while a slot is free; without one it takes the KV over too.
        Where the memory cannot drop positions (recurrent, SWA), a trim it refuses opens empty.
        An empty open without a free slot evicts least recently used prefixes until one is free.
        """
        backend, cache, reused = self.backend, self.prefix, 0
        try:
            kept, positions = cache.match(chain, marks) if cache is not None else (None, 0)
            if kept is not None:
                if self.snapshots is not None and kept.chain:
                    self.snapshots.touch(kept.chain[-1])  # used: the last of the folder to be evicted
                take = positions >= len(kept.chain) * BLOCK_TOKENS or backend.free_slots() <= 0
                if take:
                    cache.remove(kept.id)
                opened = False
                try:
                    backend.open_from_prefix(sid, max_positions, kept.id, positions, take, lane)
                    opened = True
                except CallerError as exc:
                    if exc.reason is not Reason.INVALID_REQUEST:
                        raise
                    # the memory cannot drop the kept positions past the shared blocks: open empty instead
                    log.debug("session %s: prefix not reused: %s", sid, exc.message)
                finally:
                    if take and not opened:
                        backend.drop_prefix(kept.id)  # the cache forgot it: its slot must not stay taken
                if opened:
                    return positions
            while cache is not None and backend.free_slots() <= 0 and cache.entries:
                backend.drop_prefix(cache.evict())
            backend.open_session(sid, max_positions, lane=lane)
            return reused
        finally:
            self.prefix_bytes = backend.prefix_bytes()

    def load_snapshots(self) -> None:
        """At start: every matching snapshot into a free slot, as a kept prefix."""
        snaps, cache, backend = self.snapshots, self.prefix, self.backend
        for snap in snaps.scan():
            if backend.free_slots() <= 0:
                break
            if cache.holds(snap.chain):
                continue
            key = cache.new_id()
            try:
                nbytes = backend.import_prefix(key, snap.read(), snap.positions)
            except CallerError as exc:
                snaps.refused.append({"file": f"{snap.chain[-1]}.json", "code": exc.reason.value,
                                      "message": exc.message})
                if exc.reason is Reason.SNAPSHOT_MISMATCH:  # not the bytes, or positions, its manifest says
                    snaps.discard(snap.chain[-1])
                continue
            for d in cache.add(Kept(key, snap.chain, nbytes, tail=snap.tail)):
                backend.drop_prefix(d)
            snaps.loaded += 1
            snaps.touch(snap.chain[-1])
        self.prefix_bytes = backend.prefix_bytes()
        for r in snaps.refused:
            log.warning("prefix snapshot %s refused (%s): %s", r["file"], r["code"], r["message"])

    def close(self, sid: str, have: int, keep: list[str], tail: bytes = b"", head: bytes = b"") -> None:
        """Close `sid`, which holds `have` positions, keeping the positions of its KV that `keep` and `tail` name.

        `keep` names whole blocks and `tail` marks the positions after them; `head` is what its open
        was offered (the marks of its prompt's positions). Only positions the session holds are kept.
        """
        backend, cache = self.backend, self.prefix
        blocks = min(len(keep), have // BLOCK_TOKENS)
        tail = tail[: (have - blocks * BLOCK_TOKENS) * MARK_BYTES] if blocks == len(keep) else b""
        positions = blocks * BLOCK_TOKENS + len(tail) // MARK_BYTES
        if cache is None or positions == 0:
            backend.close_session(sid)
            return
        try:
            key = cache.new_id()
            try:
                nbytes = backend.keep_prefix(sid, key, positions)
            except CallerError as exc:  # a memory that cannot drop positions (recurrent, DeepSeek-V4): keep nothing
                log.debug("session %s: no prefix kept: %s", sid, exc.message)
                return
            chain = tuple(keep[:blocks])
            dropped = cache.add(Kept(key, chain, nbytes, head=head[: positions * MARK_BYTES], tail=tail))
            for d in dropped:
                backend.drop_prefix(d)
            if self.snapshots is not None and chain and key not in dropped:
                try:
                    data = backend.export_prefix(key)
                    if not self.snapshots.write(chain, data, tail):
                        log.info("prefix snapshot of %d bytes not written: over --snapshot-max-mb", len(data))
                except OSError as exc:  # the prefix is kept in memory all the same
                    log.warning("could not write a prefix snapshot to %s: %s", self.snapshots.root, exc)
        finally:
            backend.close_session(sid)  # a no-op once kept; frees the slot if keeping failed
            self.prefix_bytes = backend.prefix_bytes()
