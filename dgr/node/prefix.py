"""The node's prefix cache: KV of ended Route Sessions, kept for the next turn.

Contract:
- A prefix is named by a hash chain over its token ids in blocks, and each of
  its positions by a mark (dgr.seam.keys, shared with the tracker, which
  computes them; a node, which on a non-head shard never sees token ids, only
  compares them). Two chains that agree on key i agree on every token before
  block i's end.
- Reuse is exact to the token. An offer carries the
  prompt's chain and its marks; an entry holds its chain, the marks of its
  leading positions the node was offered (`head`), and those of its positions
  after its last whole block (`tail`). Two sequences agree up to the first
  position whose marks differ; a position whose mark an entry lacks (an
  answer's whole blocks, which closes do not mark) ends the match there, so
  a match is never longer than what both sides named.
- An entry is the KV of one ended session's first `positions` positions
  (`len(chain) * BLOCK_TOKENS + len(tail) // MARK_BYTES`). `match` finds the
  longest common prefix with any entry; an entry that is a prefix of a newly
  added one is superseded (dropped), so a conversation keeps one entry, its
  latest turn.
- Least recently used entries go first, when the bytes exceed `max_bytes` and
  whenever a live session needs the slot (`lru`): a kept prefix never makes a
  live session wait or be refused.
- A node names what it keeps to its tracker (`advertised`: the last block key
  of each entry, the most recently used first, at most `MAX_ADVERTISED`), so
  that routing by prefix survives the tracker's restart. The tracker believes
  a name only once a session routed for it shows it held
  (dgr.tracker.affinity); and only the tracker can name a prompt's prefix,
  whose root no node is told (dgr.seam.keys).

Theory: `PrefixCache` is bookkeeping only. The backend holds the KV under the
entry's id (dgr.backends.base: keep_prefix, open_from_prefix, drop_prefix);
the node's service calls both in its scheduler's thread, one job at a time,
so the cache and the backend never disagree. Every method that frees an entry
returns its id, and the caller frees the backend's copy.

Left out: I/O, time (LRU is by use order, not age), which route holds what
(the tracker's business), and whether the backend can cut a kept sequence
short (the service asks it, and where a memory cannot drop positions, as a
recurrent or SWA one, opens empty instead).
"""

from __future__ import annotations

import collections
from typing import Sequence

import attrs

from dgr.seam.keys import BLOCK_TOKENS, MARK_BYTES, MAX_ADVERTISED

__all__ = ["Kept", "PrefixCache"]

@attrs.frozen
class Kept:
    """One cached prefix: `positions` positions of KV held by the backend under `id`.

    `chain` names its whole blocks; `head` marks its first positions (as far as its session was
    offered them) and `tail` those after its last whole block. An entry never changes, so what follows
    from these is drawn once, when it is made.
    """

    id: str
    chain: tuple[str, ...]
    nbytes: int
    head: bytes = b""
    tail: bytes = b""
    positions: int = attrs.field(init=False)  # its whole blocks' and its tail's

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "positions", len(self.chain) * BLOCK_TOKENS + len(self.tail) // MARK_BYTES)

    def mark(self, pos: int) -> bytes | None:
        """Position `pos`'s mark, or None where this entry was not told it."""
        if pos * MARK_BYTES + MARK_BYTES <= len(self.head):
            return self.head[pos * MARK_BYTES : (pos + 1) * MARK_BYTES]
        at = pos - len(self.chain) * BLOCK_TOKENS
        if 0 <= at < len(self.tail) // MARK_BYTES:
            return self.tail[at * MARK_BYTES : (at + 1) * MARK_BYTES]
        return None

    def common(self, marks: bytes, start: int) -> int:
        """Positions shared with a sequence of `marks` that agrees with this entry on its first `start`."""
        pos, end = start, min(self.positions, len(marks) // MARK_BYTES)
        while pos < end and self.mark(pos) == marks[pos * MARK_BYTES : (pos + 1) * MARK_BYTES]:
            pos += 1
        return pos

    def extends(self, other: "Kept") -> bool:
        """True when `other`'s positions are a prefix of this entry's (so this one supersedes it)."""
        n = len(other.chain)
        if n > len(self.chain) or (n and self.chain[n - 1] != other.chain[-1]) or other.positions > self.positions:
            return False
        base = n * BLOCK_TOKENS
        return all(self.mark(base + j) == other.tail[j * MARK_BYTES : (j + 1) * MARK_BYTES]
                   for j in range(len(other.tail) // MARK_BYTES))


@attrs.define
class PrefixCache:
    """Which prefixes a node keeps, in least-recently-used order. Pure bookkeeping."""

    max_bytes: int | None = None  # None: bounded only by the backend's free sequence slots
    entries: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # id -> Kept, LRU first
    _index: dict[str, dict[str, None]] = attrs.field(factory=dict)  # block key -> ids of entries holding it
    _next_id: int = 0
    hits: int = 0  # opens that reused a prefix
    misses: int = 0  # opens that offered a chain and found none of it
    evictions: int = 0  # entries dropped for space (budget or a live session's slot)
    superseded: int = 0  # entries dropped because a longer one of the same conversation replaced them
    reused_tokens: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.entries.values())

    def new_id(self) -> str:
        self._next_id += 1
        return f"p{self._next_id}"

    def match(self, chain: Sequence[str], marks: bytes = b"") -> tuple[Kept | None, int]:
        """The entry sharing the longest prefix with the sequence of `chain` and `marks`, and its positions.

        The longest run of whole blocks first (by key), then its positions into the next block (by
        mark); among equals, the most recently used. Counts a hit or a miss and marks the entry
        used; (None, 0) when nothing is shared.
        """
        order = {e: i for i, e in enumerate(self.entries)}
        for n in range(len(chain), -1, -1):
            ids = self._index.get(chain[n - 1]) if n else (self.entries if marks else None)
            if ids:
                start = n * BLOCK_TOKENS
                positions, best = max((self.entries[e].common(marks, start), order[e]) for e in ids)
                if positions == 0:
                    break
                kept = self.entries[list(self.entries)[best]]
                self.entries.move_to_end(kept.id)
                self.hits += 1
                self.reused_tokens += positions
                return kept, positions
        if chain or marks:
            self.misses += 1
        return None, 0

    def holds(self, chain: Sequence[str]) -> bool:
        """True when some entry holds all of `chain` (its last key names every block before it); counts nothing."""
        return bool(chain) and bool(self._index.get(chain[-1]))

    def add(self, kept: Kept) -> list[str]:
        """Hold `kept`; return the ids dropped for it (superseded, then over budget), `kept.id` possibly among them."""
        dropped = []
        for old in list(self.entries.values()):
            if kept.extends(old):
                self.remove(old.id)
                self.superseded += 1
                dropped.append(old.id)
        self.entries[kept.id] = kept
        for key in kept.chain:
            self._index.setdefault(key, {})[kept.id] = None
        while self.max_bytes is not None and self.nbytes > self.max_bytes and self.entries:
            dropped.append(self.evict())
        return dropped

    def remove(self, entry_id: str) -> Kept:
        """Forget an entry (its KV is being taken over or freed)."""
        kept = self.entries.pop(entry_id)
        for key in kept.chain:
            ids = self._index.get(key)
            if ids is not None:
                ids.pop(entry_id, None)
                if not ids:
                    del self._index[key]
        return kept

    def evict(self) -> str:
        """Drop the least recently used entry and return its id. Raises KeyError when empty."""
        entry_id = next(iter(self.entries))
        self.remove(entry_id)
        self.evictions += 1
        return entry_id

    def advertised(self, limit: int = MAX_ADVERTISED) -> list[str]:
        """The last block key of each entry that has one, the most recently used first, at most `limit`.

        A key names every block before it, so a tracker that sees it knows this node holds every
        prompt whose chain runs through it; an entry shorter than a block is not named.
        """
        out: list[str] = []
        for kept in reversed(self.entries.values()):
            if kept.chain and kept.chain[-1] not in out:
                out.append(kept.chain[-1])
                if len(out) >= limit:
                    break
        return out

    def to_json(self) -> dict[str, int | None]:
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "superseded": self.superseded,
            "reused_tokens": self.reused_tokens,
            "block_tokens": BLOCK_TOKENS,
        }
