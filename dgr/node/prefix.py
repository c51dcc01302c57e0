"""The node's prefix cache: KV of ended Route Sessions, kept for the next turn.

Contract:
- A prefix is named by a hash chain over its token ids in blocks of
  `BLOCK_TOKENS`: block i's key is H(key of block i-1 || the block's token ids
  as little-endian int32), and block 0 chains from a root that mixes in the
  model's digest and an isolation scope (by default the API key's hash). The
  tracker computes the chain from the tokens it has; a node, which on a
  non-head shard never sees token ids, only compares keys. Two chains that
  agree on key i agree on every token before block i's end.
- Only whole blocks are kept and reused, so every node of a route can agree on
  a prefix length from keys alone.
- An entry is the KV of one ended session's first `len(chain) * BLOCK_TOKENS`
  positions. `match` finds the longest prefix of a candidate chain held by any
  entry; an entry whose chain is a prefix of a newly added one is superseded
  (dropped), so a conversation keeps one entry, its latest turn.
- Least recently used entries go first, when the bytes exceed `max_bytes` and
  whenever a live session needs the slot (`lru`): a kept prefix never makes a
  live session wait or be refused.

Theory: `PrefixCache` is bookkeeping only. The backend holds the KV under the
entry's id (dgr.backends.base: keep_prefix, open_from_prefix, drop_prefix);
the node's service calls both in its scheduler's thread, one job at a time,
so the cache and the backend never disagree. Every method that frees an entry
returns its id, and the caller frees the backend's copy.

Left out: I/O, time (LRU is by use order, not age), and which route holds
what (the tracker's business).
"""

from __future__ import annotations

import collections
import hashlib
import struct
from typing import Sequence

import attrs

from dgr.seam.wire import BLOCK_TOKENS, KEY_HEX

__all__ = ["BLOCK_TOKENS", "KEY_HEX", "Kept", "PrefixCache", "block_chain", "prefix_root", "valid_chain"]

_DOMAIN = b"dgr-prefix-v1"


def prefix_root(model_digest: str, scope: str) -> str:
    """The key block 0 chains from: one per model file and isolation scope ('' when shared)."""
    h = hashlib.sha256(_DOMAIN + b"\0" + model_digest.encode() + b"\0" + scope.encode())
    return h.hexdigest()[:KEY_HEX]


def block_chain(tokens: Sequence[int], root: str, block: int = BLOCK_TOKENS) -> list[str]:
    """The keys of every whole block of `tokens`, in order; a partial last block has none."""
    keys, prev = [], bytes.fromhex(root)
    for i in range(0, len(tokens) - block + 1, block):
        part = tokens[i : i + block]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(part)}i", *part)).digest()[: KEY_HEX // 2]
        keys.append(prev.hex())
    return keys


def valid_chain(chain: object, limit: int) -> bool:
    """True for a list of at most `limit` keys of KEY_HEX lowercase hex digits (checks wire input)."""
    return (isinstance(chain, list) and len(chain) <= limit
            and all(isinstance(k, str) and len(k) == KEY_HEX and all(c in "0123456789abcdef" for c in k)
                    for k in chain))


@attrs.frozen
class Kept:
    """One cached prefix: `len(chain)` blocks of KV held by the backend under `id`."""

    id: str
    chain: tuple[str, ...]
    nbytes: int

    @property
    def positions(self) -> int:
        return len(self.chain) * BLOCK_TOKENS


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

    def match(self, chain: Sequence[str]) -> tuple[Kept | None, int]:
        """The most recently used entry holding the longest prefix of `chain`, and that prefix's blocks.

        Counts a hit or a miss and marks the entry used; (None, 0) when no block matches.
        """
        for n in range(len(chain), 0, -1):
            ids = self._index.get(chain[n - 1])
            if ids:
                best = max(ids, key=list(self.entries).index)  # most recently used
                self.entries.move_to_end(best)
                self.hits += 1
                self.reused_tokens += n * BLOCK_TOKENS
                return self.entries[best], n
        if chain:
            self.misses += 1
        return None, 0

    def holds(self, chain: Sequence[str]) -> bool:
        """True when some entry holds all of `chain` (its last key names every block before it); counts nothing."""
        return bool(chain) and bool(self._index.get(chain[-1]))

    def add(self, kept: Kept) -> list[str]:
        """Hold `kept`; return the ids dropped for it (superseded, then over budget), `kept.id` possibly among them."""
        dropped = []
        for old in list(self.entries.values()):
            n = len(old.chain)
            if n <= len(kept.chain) and kept.chain[n - 1] == old.chain[-1]:
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
