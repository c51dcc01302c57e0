"""The sections of a Model Artifact manifest: one frozen record per JSON object, read with its fields checked.

One job: each section's record and its JSON form (`to_json`, `from_json`):
the model's identity, the file, the GGUF header, each tensor, each layer, and
the BitTorrent v2 description, with the BEP 52 info dictionary the info-hash
is taken over (`torrent_info_dict`). dgr.artifact.manifest puts them together
and checks that they agree with each other.

Rules: reading refuses a missing field, a field of the wrong type (a bool is
never an int here) and a file name that is not one plain path component, each
with CallerError(ARTIFACT_MISMATCH) (`bad_manifest`). No floats: every number
is an int, so the canonical encoding is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import attrs

from dgr.artifact.constants import TORRENT_META_VERSION
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role

__all__ = [
    "FileInfo",
    "HeaderInfo",
    "LayerEntry",
    "ModelIdentity",
    "TensorEntry",
    "TorrentInfo",
    "bad_manifest",
    "need_field",
    "torrent_info_dict",
]


def bad_manifest(message: str) -> CallerError:
    """The error of a manifest that is ill-formed or whose parts disagree."""
    return CallerError(Reason.ARTIFACT_MISMATCH, f"invalid manifest: {message}")


def need_field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """data[key], which must be there and of `kind` (never a bool).

    Raises:
        CallerError(ARTIFACT_MISMATCH)
    """
    if key not in data:
        raise bad_manifest(f"missing field {key!r}")
    value = data[key]
    # bool is an int; no manifest field is a bool.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise bad_manifest(f"field {key!r} has the wrong type ({type(value).__name__})")
    return value


@attrs.frozen
class ModelIdentity:
    """Which model: what a tracker matches nodes and routes on."""

    architecture: str
    name: str  # general.name, "" when absent
    block_count: int
    hidden_size: int
    seam_width: int  # floats per token on the seam
    vocab_size: int
    context_length: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ModelIdentity":
        return cls(
            architecture=need_field(d, "architecture", str),
            name=need_field(d, "name", str),
            block_count=need_field(d, "block_count", int),
            hidden_size=need_field(d, "hidden_size", int),
            seam_width=need_field(d, "seam_width", int),
            vocab_size=need_field(d, "vocab_size", int),
            context_length=need_field(d, "context_length", int),
        )


def _plain_file_name(_instance: Any, _attribute: Any, name: str) -> None:
    """Refuse any file name that is not one plain path component.

    `dgr node --fetch` writes the file to `MODEL_DIR / file.name`, and a manifest
    can come from anyone: `../x`, `/etc/x`, `a/b`, `C:x` or a NUL would write
    elsewhere. Both separators are refused, whatever this machine's.

    Raises:
        CallerError(ARTIFACT_MISMATCH)
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\x00:")
            or PurePosixPath(name).name != name or PureWindowsPath(name).name != name):
        raise bad_manifest(f"file name {name!r} is not a plain file name")


@attrs.frozen
class FileInfo:
    name: str = attrs.field(validator=_plain_file_name)  # base name; also the file's name inside the torrent
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileInfo":
        return cls(name=need_field(d, "name", str), size=need_field(d, "size", int), sha256=need_field(d, "sha256", str))


@attrs.frozen
class HeaderInfo:
    """Bytes [0, length): GGUF magic, version, metadata, tensor infos, alignment padding."""

    gguf_version: int
    alignment: int
    tensor_count: int
    kv_count: int
    length: int  # = offset of the tensor data section
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "HeaderInfo":
        return cls(
            gguf_version=need_field(d, "gguf_version", int),
            alignment=need_field(d, "alignment", int),
            tensor_count=need_field(d, "tensor_count", int),
            kv_count=need_field(d, "kv_count", int),
            length=need_field(d, "length", int),
            sha256=need_field(d, "sha256", str),
        )


@attrs.frozen
class TensorEntry:
    name: str
    layer: int | None  # N for blk.N.*, None for a global tensor
    role: Role
    type: str  # ggml type name: F32, Q4_1, ...
    shape: tuple[int, ...]  # ggml order (ne0 first), as gguf-py reports it
    offset: int  # absolute byte offset in the file
    size: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "role": self.role.value,
            "type": self.type,
            "shape": list(self.shape),
            "offset": self.offset,
            "size": self.size,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorEntry":
        layer = d.get("layer")
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise bad_manifest("tensor layer must be an int or null")
        try:
            role = Role(need_field(d, "role", str))
        except ValueError:
            raise bad_manifest(f"unknown tensor role {d.get('role')!r}") from None
        shape = need_field(d, "shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise bad_manifest("tensor shape must be a list of ints")
        return cls(
            name=need_field(d, "name", str),
            layer=layer,
            role=role,
            type=need_field(d, "type", str),
            shape=tuple(shape),
            offset=need_field(d, "offset", int),
            size=need_field(d, "size", int),
            sha256=need_field(d, "sha256", str),
        )


@attrs.frozen
class LayerEntry:
    index: int
    tensors: tuple[str, ...]  # tensor names, in name order
    ranges: tuple[tuple[int, int], ...]  # [start, end) byte ranges of those tensors, merged where they touch
    size: int  # tensor bytes in the layer
    sha256: str  # layer_digest() of its tensors
    pieces: tuple[tuple[int, int], ...]  # [first, stop) piece index ranges covering `ranges`

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "tensors": list(self.tensors),
            "ranges": [list(r) for r in self.ranges],
            "size": self.size,
            "sha256": self.sha256,
            "pieces": [list(p) for p in self.pieces],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LayerEntry":
        def pairs(key: str) -> tuple[tuple[int, int], ...]:
            raw = need_field(d, key, list)
            if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in raw):
                raise bad_manifest(f"layer {key} must be a list of [start, stop] pairs")
            return tuple((p[0], p[1]) for p in raw)

        return cls(
            index=need_field(d, "index", int),
            tensors=tuple(need_field(d, "tensors", list)),
            ranges=pairs("ranges"),
            size=need_field(d, "size", int),
            sha256=need_field(d, "sha256", str),
            pieces=pairs("pieces"),
        )


@attrs.frozen
class TorrentInfo:
    """The BitTorrent v2 (BEP 52) description of the single file."""

    meta_version: int
    piece_length: int
    piece_count: int
    pieces_root: str  # hex
    piece_hashes: tuple[str, ...]  # hex, one per piece: the piece layer
    info_hash_v2: str  # hex sha256 of the bencoded info dict

    def to_json(self) -> dict[str, Any]:
        return {
            "meta_version": self.meta_version,
            "piece_length": self.piece_length,
            "piece_count": self.piece_count,
            "pieces_root": self.pieces_root,
            "piece_hashes": list(self.piece_hashes),
            "info_hash_v2": self.info_hash_v2,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TorrentInfo":
        hashes = need_field(d, "piece_hashes", list)
        if not all(isinstance(h, str) and len(h) == 64 for h in hashes):
            raise bad_manifest("piece_hashes must be 64-digit hex strings")
        return cls(
            meta_version=need_field(d, "meta_version", int),
            piece_length=need_field(d, "piece_length", int),
            piece_count=need_field(d, "piece_count", int),
            pieces_root=need_field(d, "pieces_root", str),
            piece_hashes=tuple(hashes),
            info_hash_v2=need_field(d, "info_hash_v2", str),
        )


def torrent_info_dict(file: FileInfo, piece_length: int, pieces_root: bytes) -> dict[str, Any]:
    """The BEP 52 info dictionary of a one-file v2 torrent, as libtorrent writes it."""
    return {
        "file tree": {file.name: {"": {"length": file.size, "pieces root": pieces_root}}},
        "meta version": TORRENT_META_VERSION,
        "name": file.name,
        "piece length": piece_length,
    }
