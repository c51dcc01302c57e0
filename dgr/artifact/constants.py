"""Every constant of the Model Artifact format, in one place.

These numbers cross the disk (the manifest JSON) and the wire (BitTorrent,
possession proofs). Changing one changes manifest ids, so each lives here
once, with an explicit value, and spec/artifact-manifest.md is checked
against this module by tests/test_artifact_manifest.py.

Tensor roles (`Role`, `GLOBAL_ROLES`) are GGUF facts and live in dgr.gguf_meta.
"""

from __future__ import annotations

import enum

__all__ = [
    "SchemaVersion",
    "SCHEMA_VERSION",
    "MANIFEST_KIND",
    "BLOCK_SIZE",
    "PieceSize",
    "TARGET_PIECE_COUNT",
    "TORRENT_META_VERSION",
    "HASH_CHUNK",
    "GlobalNeed",
]


class SchemaVersion(enum.IntEnum):
    """Manifest schema versions. A reader refuses any version it does not list."""

    V1 = 1


SCHEMA_VERSION = SchemaVersion.V1
MANIFEST_KIND = "dgr.model-artifact"

# BEP 52 fixes the merkle leaf at 16 KiB; pieces are 16 KiB * 2^k.
BLOCK_SIZE = 16 * 1024


class PieceSize(enum.IntEnum):
    """Bounds on the BitTorrent piece length, in bytes."""

    MIN = 16 * 1024
    # 16 MiB keeps a 700 GB model at ~42k pieces (1.3 MB of piece layers),
    # well under libtorrent's 10 MB metadata limit for torrent_info(path).
    MAX = 16 * 1024 * 1024


# The piece length is the smallest power of two >= file_size / TARGET_PIECE_COUNT
# (clamped to PieceSize). Small pieces make layer ranges round up less and
# challenges finer; more pieces make the manifest and torrent larger.
# 2048 gives 64 KiB pieces for the 98 MB default model.
TARGET_PIECE_COUNT = 2048

TORRENT_META_VERSION = 2

# Streaming read size when hashing; a multiple of BLOCK_SIZE.
HASH_CHUNK = 4 * 1024 * 1024


class GlobalNeed(enum.Enum):
    """Which global (non-layer) tensors a layer range is said to need."""

    # Only the globals the layers compute with: token_embd for the head,
    # output_norm/output for the tail, shared ones (rope_freqs) for all.
    COMPUTE = "compute"
    # Every global, whatever the range: what a derived shard GGUF held before
    # libllama had a layer-range API. Nodes now fetch and verify COMPUTE (the
    # range API loads only those); this stays for `artifact verify/fetch
    # --globals loader`, to hold or check a whole set of globals.
    LOADER = "loader"
