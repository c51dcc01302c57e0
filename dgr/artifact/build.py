"""Build a Model Artifact manifest from a GGUF file: read its tensor table, hash it once.

Rules:
- The GGUF's header is read by dgr.gguf_meta (names, roles and keys are
  that module's too).
- The file is read once: one streaming pass feeds the whole-file hash, the
  header hash, every tensor hash and the BEP 52 merkle leaves.

Left out: the schema and its checks (dgr.artifact.manifest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import attrs

from dgr.artifact import merkle
from dgr.artifact.bencode import bencode
from dgr.artifact.constants import HASH_CHUNK, SCHEMA_VERSION, TORRENT_META_VERSION, PieceSize
from dgr.artifact.manifest import Manifest, choose_piece_length, layer_digest, merge_spans, piece_runs, pieces_of
from dgr.artifact.sections import (
    FileInfo,
    HeaderInfo,
    LayerEntry,
    ModelIdentity,
    TensorEntry,
    TorrentInfo,
    torrent_info_dict,
)
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import (
    ARCHITECTURE_KEY,
    NAME_KEY,
    arch_key,
    field,
    is_tied,
    layer_of,
    read_header,
    require_field,
    tensor_role,
)
from dgr.progress import NullProgress, Progress

__all__ = ["GgufLayout", "build_manifest", "read_gguf_layout"]


# -- reading the GGUF ----------------------------------------------------------------


@attrs.frozen
class _TensorLayout:
    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    size: int


@attrs.frozen
class GgufLayout:
    """What gguf-py tells us about a file, before any hashing."""

    model: ModelIdentity
    gguf_version: int
    alignment: int
    kv_count: int
    data_offset: int
    tensors: tuple[_TensorLayout, ...]  # offset order


def read_gguf_layout(path: str | Path) -> GgufLayout:
    """Read metadata and the tensor table (dgr.gguf_meta.read_header).

    Raises:
        CallerError(MODEL_LOAD_FAILED): not GGUF, unreadable, truncated, or
            missing the architecture keys a manifest needs.
    """
    p = Path(path)
    reader = read_header(p)
    arch = require_field(reader, ARCHITECTURE_KEY, p)
    vocab = field(reader, arch_key(arch, "vocab_size"))
    if vocab is None:
        tokens = field(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has neither {arch}.vocab_size nor a token list: {p}")
        vocab = len(tokens)
    hidden = int(require_field(reader, arch_key(arch, "embedding_length"), p))
    model = ModelIdentity(
        architecture=str(arch),
        name=str(field(reader, NAME_KEY) or ""),
        block_count=int(require_field(reader, arch_key(arch, "block_count"), p)),
        hidden_size=hidden,
        # The seam carries the residual stream, hidden_size floats per token,
        # for every architecture dgr splits today (see PRD: seams proportional
        # to hidden_size).
        seam_width=hidden,
        vocab_size=int(vocab),
        context_length=int(require_field(reader, arch_key(arch, "context_length"), p)),
    )
    tensors = tuple(
        sorted(
            (
                _TensorLayout(name=t.name, type=t.type, shape=t.shape, offset=t.offset, size=t.n_bytes)
                for t in reader.tensors
            ),
            key=lambda t: t.offset,
        )
    )
    return GgufLayout(
        model=model,
        gguf_version=int(require_field(reader, "GGUF.version", p)),
        alignment=int(reader.alignment),
        kv_count=int(require_field(reader, "GGUF.kv_count", p)),
        data_offset=int(reader.data_offset),
        tensors=tensors,
    )


# -- hashing -------------------------------------------------------------------------


@attrs.frozen
class _Digests:
    file: str
    header: str
    tensors: dict[str, str]
    pieces: list[bytes]


def _hash_file(
    path: Path, size: int, header_len: int, tensors: Sequence[_TensorLayout], piece_length: int, progress: Progress
) -> _Digests:
    """One front-to-back read feeding every hash the manifest holds."""
    whole = hashlib.sha256()
    header = hashlib.sha256()
    pieces = merkle.PieceHasher(size, piece_length)
    order = sorted(tensors, key=lambda t: t.offset)
    states = [hashlib.sha256() for _ in order]
    first_open = 0  # first tensor (offset order) not yet fully read
    pos = 0
    progress.start(f"hashing {path.name}", size)
    with path.open("rb", buffering=0) as f:
        while pos < size:
            chunk = f.read(min(HASH_CHUNK, size - pos))
            if not chunk:
                raise CallerError(Reason.MODEL_LOAD_FAILED, f"{path} ended at byte {pos}; expected {size}")
            view = memoryview(chunk)
            end = pos + len(view)
            whole.update(view)
            pieces.update(view)
            if pos < header_len:
                header.update(view[: min(header_len, end) - pos])
            j = first_open
            while j < len(order) and order[j].offset < end:
                t = order[j]
                lo, hi = max(t.offset, pos), min(t.offset + t.size, end)
                if hi > lo:
                    states[j].update(view[lo - pos : hi - pos])
                j += 1
            while first_open < len(order) and order[first_open].offset + order[first_open].size <= end:
                first_open += 1
            pos = end
            progress.advance(len(view))
    return _Digests(
        file=whole.hexdigest(),
        header=header.hexdigest(),
        tensors={t.name: s.hexdigest() for t, s in zip(order, states, strict=True)},
        pieces=pieces.finish(),
    )


def build_manifest(path: str | Path, *, piece_length: int | None = None, progress: Progress | None = None) -> Manifest:
    """Read a GGUF with gguf-py, hash it once, and return its manifest.

    Raises:
        CallerError(MODEL_LOAD_FAILED): missing, not GGUF, truncated or corrupt.
        CallerError(INVALID_REQUEST): a piece_length that is not 16 KiB * 2^k.
    """
    progress = progress or NullProgress()
    p = Path(path)
    progress.start(f"reading GGUF metadata of {p.name}", None)
    layout = read_gguf_layout(p)
    size = p.stat().st_size
    last_end = max((t.offset + t.size for t in layout.tensors), default=layout.data_offset)
    if last_end > size:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"GGUF {p} is truncated: its tensors end at byte {last_end} but the file has {size}",
        )
    plen = piece_length or choose_piece_length(size)
    if plen < PieceSize.MIN or plen & (plen - 1):
        raise CallerError(Reason.INVALID_REQUEST, f"piece length {plen} is not 16 KiB * 2^k")

    digests = _hash_file(p, size, layout.data_offset, layout.tensors, plen, progress)
    tied = is_tied(t.name for t in layout.tensors)
    entries = tuple(
        TensorEntry(
            name=t.name,
            layer=layer_of(t.name),
            role=tensor_role(t.name, tied=tied, arch=layout.model.architecture),
            type=t.type,
            shape=t.shape,
            offset=t.offset,
            size=t.size,
            sha256=digests.tensors[t.name],
        )
        for t in layout.tensors
    )
    n_layers = layout.model.block_count
    stray = sorted({e.layer for e in entries if e.layer is not None and not 0 <= e.layer < n_layers})
    if stray:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED, f"GGUF {p} has tensors of layers {stray} beyond block_count {n_layers}"
        )
    layers = []
    for i in range(n_layers):
        members = [e for e in entries if e.layer == i]
        ranges = merge_spans((e.offset, e.end) for e in members)
        layers.append(
            LayerEntry(
                index=i,
                tensors=tuple(sorted((e.name for e in members), key=lambda n: n.encode("utf-8"))),
                ranges=tuple(ranges),
                size=sum(e.size for e in members),
                sha256=layer_digest((e.name, e.sha256) for e in members),
                pieces=tuple(piece_runs(pieces_of(ranges, plen))),
            )
        )
    file = FileInfo(name=p.name, size=size, sha256=digests.file)
    root = merkle.root_from_piece_hashes(digests.pieces, size, plen)
    torrent = TorrentInfo(
        meta_version=TORRENT_META_VERSION,
        piece_length=plen,
        piece_count=len(digests.pieces),
        pieces_root=root.hex(),
        piece_hashes=tuple(h.hex() for h in digests.pieces),
        info_hash_v2=hashlib.sha256(bencode(torrent_info_dict(file, plen, root))).hexdigest(),
    )
    manifest = Manifest(
        schema=int(SCHEMA_VERSION),
        model=layout.model,
        file=file,
        header=HeaderInfo(
            gguf_version=layout.gguf_version,
            alignment=layout.alignment,
            tensor_count=len(layout.tensors),
            kv_count=layout.kv_count,
            length=layout.data_offset,
            sha256=digests.header,
        ),
        tensors=entries,
        layers=tuple(layers),
        torrent=torrent,
    )
    return manifest.with_id()
