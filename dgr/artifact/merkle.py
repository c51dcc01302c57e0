"""BEP 52 merkle trees over 16 KiB blocks: piece hashes, roots, proof paths.

BitTorrent v2 hashes each file as a binary SHA-256 merkle tree whose leaves
are the hashes of its 16 KiB blocks (the last block hashes only the bytes that
exist). Leaves past the end of the file are 32 zero bytes, and the leaf count
is padded to a power of two. The "piece layer" is the tree level where each
node covers one piece; a piece hash is the root of that piece's subtree, the
last piece padded with zero leaves like the rest.

A file no larger than one piece has no piece layer in a torrent; its tree has
next_pow2(blocks) leaves and its one "piece hash" is the file's root. dgr
treats that root as the single piece hash so every file has a piece layer.

Pure functions over bytes; no I/O. Used by the manifest (hashing), the
possession proofs (paths) and the tests (against libtorrent).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from dgr.artifact.constants import BLOCK_SIZE
from dgr.errors import CallerError, Reason

__all__ = [
    "ZERO_LEAF",
    "pad_hash",
    "next_pow2",
    "piece_count",
    "block_count",
    "leaves_per_piece",
    "subtree_root",
    "root_from_piece_hashes",
    "block_hashes",
    "proof_path",
    "root_from_path",
    "PieceHasher",
]

ZERO_LEAF = b"\x00" * 32


def _h(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def pad_hash(depth: int) -> bytes:
    """Root of a subtree of 2**depth zero leaves."""
    if depth == 0:
        return ZERO_LEAF
    below = pad_hash(depth - 1)
    return _h(below + below)


def piece_count(file_size: int, piece_length: int) -> int:
    return -(-file_size // piece_length)


def block_count(file_size: int) -> int:
    return -(-file_size // BLOCK_SIZE)


def leaves_per_piece(file_size: int, piece_length: int) -> int:
    """Leaves under one piece hash: piece_length/16 KiB, or fewer for a one-piece file."""
    if file_size > piece_length:
        return piece_length // BLOCK_SIZE
    return next_pow2(block_count(file_size))


def subtree_root(leaves: Sequence[bytes], width: int) -> bytes:
    """Root over leaves padded with zero leaves to width (a power of two)."""
    if width & (width - 1) or len(leaves) > width:
        raise CallerError(Reason.INVALID_REQUEST, f"{len(leaves)} leaves do not fit a tree of {width}")
    level = list(leaves) + [ZERO_LEAF] * (width - len(leaves))
    while len(level) > 1:
        level = [_h(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def root_from_piece_hashes(piece_hashes: Sequence[bytes], file_size: int, piece_length: int) -> bytes:
    """The file's "pieces root" from its piece layer."""
    if len(piece_hashes) != piece_count(file_size, piece_length):
        raise CallerError(Reason.INVALID_REQUEST, "piece layer length does not match the file size")
    if len(piece_hashes) == 1:
        return piece_hashes[0]
    # Pieces past the end are whole subtrees of zero leaves.
    depth = (piece_length // BLOCK_SIZE).bit_length() - 1
    level = list(piece_hashes) + [pad_hash(depth)] * (next_pow2(len(piece_hashes)) - len(piece_hashes))
    while len(level) > 1:
        level = [_h(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def block_hashes(piece: bytes | memoryview) -> list[bytes]:
    """Leaf hashes of the 16 KiB blocks of one piece's bytes (no padding)."""
    view = memoryview(piece)
    return [_h(view[i : i + BLOCK_SIZE]) for i in range(0, len(view), BLOCK_SIZE)]


def proof_path(leaves: Sequence[bytes], index: int, width: int) -> list[bytes]:
    """Sibling hashes from leaf `index` up to the root of a width-leaf subtree."""
    if not 0 <= index < len(leaves):
        raise CallerError(Reason.INVALID_REQUEST, f"leaf {index} is outside the {len(leaves)} leaves given")
    level = list(leaves) + [ZERO_LEAF] * (width - len(leaves))
    path: list[bytes] = []
    i = index
    while len(level) > 1:
        path.append(level[i ^ 1])
        level = [_h(level[j] + level[j + 1]) for j in range(0, len(level), 2)]
        i //= 2
    return path


def root_from_path(leaf: bytes, index: int, path: Sequence[bytes]) -> bytes:
    """Climb from a leaf with its sibling path; bit k of index says left (0) or right (1)."""
    node = leaf
    for k, sibling in enumerate(path):
        node = _h(sibling + node) if (index >> k) & 1 else _h(node + sibling)
    return node


class PieceHasher:
    """Streams 16 KiB-aligned bytes in and collects piece hashes.

    Feed it the file front to back in chunks whose sizes are multiples of
    BLOCK_SIZE (only the last may be shorter); `finish()` returns the piece
    layer. Holds at most one piece's leaves, so a 700 GB file costs 32 bytes
    per piece, not per block.
    """

    def __init__(self, file_size: int, piece_length: int) -> None:
        self.file_size = file_size
        self.piece_length = piece_length
        self.width = leaves_per_piece(file_size, piece_length)
        self._per_piece = min(self.width, piece_length // BLOCK_SIZE)
        self._leaves: list[bytes] = []
        self._pieces: list[bytes] = []
        self._seen = 0
        self._ragged = False

    def update(self, chunk: bytes | memoryview) -> None:
        if self._ragged:
            raise CallerError(Reason.INTERNAL, "PieceHasher fed after a short chunk")
        view = memoryview(chunk)
        if len(view) % BLOCK_SIZE:
            self._ragged = True
        for i in range(0, len(view), BLOCK_SIZE):
            self._leaves.append(_h(view[i : i + BLOCK_SIZE]))
            if len(self._leaves) == self._per_piece:
                self._pieces.append(subtree_root(self._leaves, self.width))
                self._leaves = []
        self._seen += len(view)

    def finish(self) -> list[bytes]:
        if self._seen != self.file_size:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED,
                f"hashed {self._seen} bytes but the file should have {self.file_size}",
            )
        if self._leaves:
            self._pieces.append(subtree_root(self._leaves, self.width))
            self._leaves = []
        return self._pieces
