"""The Model Artifact manifest: what a GGUF file is, tensor by tensor and piece by piece.

A manifest lets a node prove and a tracker check, from the manifest alone,
which layers of which model a file holds. It names the model (architecture,
block count, widths), the file (size, sha256), the GGUF header byte range, every
tensor (layer, type, shape, byte range, sha256), every layer (its byte ranges
and one digest), and the BitTorrent v2 description of the file (piece length,
piece hashes, pieces root, info-hash), so the same bytes can be fetched from a
swarm layer range by layer range and checked against the same hashes.

Rules:
- Building one from a GGUF is dgr.artifact.build; this module is the schema,
  its canonical encoding, and the checks a loaded manifest must pass.
- The manifest id is sha256 of the canonical JSON (sorted keys, no whitespace,
  ASCII) of every field but `id`. Loading a manifest recomputes the id, the
  layer digests, the pieces root and the info-hash, and refuses a manifest
  whose parts disagree.
- No floats in the manifest: every number is an int, so the canonical
  encoding is exact.

Left out: verifying a file (verify.py), proofs (proof.py), moving bytes
(torrent.py). The schema is documented in spec/artifact-manifest.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import attrs

from dgr.artifact import merkle
from dgr.artifact.bencode import bencode
from dgr.artifact.constants import (
    MANIFEST_KIND,
    TARGET_PIECE_COUNT,
    TORRENT_META_VERSION,
    GlobalNeed,
    PieceSize,
    SchemaVersion,
)
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role
from dgr.seam.types import ModelInfo

__all__ = [
    "ModelIdentity",
    "FileInfo",
    "HeaderInfo",
    "TensorEntry",
    "LayerEntry",
    "TorrentInfo",
    "Manifest",
    "choose_piece_length",
    "canonical_json",
    "layer_digest",
    "merge_spans",
    "piece_runs",
    "pieces_of",
    "torrent_info_dict",
]


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII only: the bytes the manifest id hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def choose_piece_length(file_size: int) -> int:
    """Smallest 16 KiB * 2^k >= file_size / TARGET_PIECE_COUNT, within PieceSize."""
    want = -(-file_size // TARGET_PIECE_COUNT)
    length = int(PieceSize.MIN)
    while length < want and length < PieceSize.MAX:
        length *= 2
    return length


def layer_digest(tensors: Iterable[tuple[str, str]]) -> str:
    """sha256 over name || 0x00 || raw sha256, for each (name, hex digest) in name order."""
    h = hashlib.sha256()
    for name, digest in sorted(tensors, key=lambda t: t[0].encode("utf-8")):
        h.update(name.encode("utf-8") + b"\x00" + bytes.fromhex(digest))
    return h.hexdigest()


def _bad_manifest(message: str) -> CallerError:
    return CallerError(Reason.ARTIFACT_MISMATCH, f"invalid manifest: {message}")


def _need(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise _bad_manifest(f"missing field {key!r}")
    value = data[key]
    # bool is an int; no manifest field is a bool.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _bad_manifest(f"field {key!r} has the wrong type ({type(value).__name__})")
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
            architecture=_need(d, "architecture", str),
            name=_need(d, "name", str),
            block_count=_need(d, "block_count", int),
            hidden_size=_need(d, "hidden_size", int),
            seam_width=_need(d, "seam_width", int),
            vocab_size=_need(d, "vocab_size", int),
            context_length=_need(d, "context_length", int),
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
        raise _bad_manifest(f"file name {name!r} is not a plain file name")


@attrs.frozen
class FileInfo:
    name: str = attrs.field(validator=_plain_file_name)  # base name; also the file's name inside the torrent
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileInfo":
        return cls(name=_need(d, "name", str), size=_need(d, "size", int), sha256=_need(d, "sha256", str))


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
            gguf_version=_need(d, "gguf_version", int),
            alignment=_need(d, "alignment", int),
            tensor_count=_need(d, "tensor_count", int),
            kv_count=_need(d, "kv_count", int),
            length=_need(d, "length", int),
            sha256=_need(d, "sha256", str),
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
            raise _bad_manifest("tensor layer must be an int or null")
        try:
            role = Role(_need(d, "role", str))
        except ValueError:
            raise _bad_manifest(f"unknown tensor role {d.get('role')!r}") from None
        shape = _need(d, "shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise _bad_manifest("tensor shape must be a list of ints")
        return cls(
            name=_need(d, "name", str),
            layer=layer,
            role=role,
            type=_need(d, "type", str),
            shape=tuple(shape),
            offset=_need(d, "offset", int),
            size=_need(d, "size", int),
            sha256=_need(d, "sha256", str),
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
            raw = _need(d, key, list)
            if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in raw):
                raise _bad_manifest(f"layer {key} must be a list of [start, stop] pairs")
            return tuple((p[0], p[1]) for p in raw)

        return cls(
            index=_need(d, "index", int),
            tensors=tuple(_need(d, "tensors", list)),
            ranges=pairs("ranges"),
            size=_need(d, "size", int),
            sha256=_need(d, "sha256", str),
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
        hashes = _need(d, "piece_hashes", list)
        if not all(isinstance(h, str) and len(h) == 64 for h in hashes):
            raise _bad_manifest("piece_hashes must be 64-digit hex strings")
        return cls(
            meta_version=_need(d, "meta_version", int),
            piece_length=_need(d, "piece_length", int),
            piece_count=_need(d, "piece_count", int),
            pieces_root=_need(d, "pieces_root", str),
            piece_hashes=tuple(hashes),
            info_hash_v2=_need(d, "info_hash_v2", str),
        )


def torrent_info_dict(file: FileInfo, piece_length: int, pieces_root: bytes) -> dict[str, Any]:
    """The BEP 52 info dictionary of a one-file v2 torrent, as libtorrent writes it."""
    return {
        "file tree": {file.name: {"": {"length": file.size, "pieces root": pieces_root}}},
        "meta version": TORRENT_META_VERSION,
        "name": file.name,
        "piece length": piece_length,
    }


@attrs.frozen
class Manifest:
    """A Model Artifact manifest. Build with build_manifest(), read with Manifest.load()."""

    schema: int
    model: ModelIdentity
    file: FileInfo
    header: HeaderInfo
    tensors: tuple[TensorEntry, ...]  # in file offset order
    layers: tuple[LayerEntry, ...]  # index 0 .. block_count-1
    torrent: TorrentInfo
    id: str = ""

    # -- encoding -------------------------------------------------------------
    def body_json(self) -> dict[str, Any]:
        """Every field but the id: what the id hashes."""
        return {
            "kind": MANIFEST_KIND,
            "schema": self.schema,
            "model": self.model.to_json(),
            "file": self.file.to_json(),
            "header": self.header.to_json(),
            "tensors": [t.to_json() for t in self.tensors],
            "layers": [layer.to_json() for layer in self.layers],
            "torrent": self.torrent.to_json(),
        }

    def compute_id(self) -> str:
        return hashlib.sha256(canonical_json(self.body_json())).hexdigest()

    def with_id(self) -> "Manifest":
        return attrs.evolve(self, id=self.compute_id())

    def to_json(self) -> dict[str, Any]:
        body = self.body_json()
        body["id"] = self.id
        return body

    def dumps(self) -> str:
        """Human-readable JSON (indent 1); the id does not depend on the layout."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename) so a reader never sees half a manifest."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.dumps(), encoding="ascii")
        os.replace(tmp, p)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Manifest":
        """Parse and check a manifest.

        Raises:
            CallerError(ARTIFACT_MISMATCH): unknown kind or schema, missing or
                ill-typed field, or parts that disagree (id, layer digests,
                pieces root, info-hash).
        """
        if not isinstance(data, Mapping):
            raise _bad_manifest("not a JSON object")
        if data.get("kind") != MANIFEST_KIND:
            raise _bad_manifest(f"kind is {data.get('kind')!r}, expected {MANIFEST_KIND!r}")
        schema = _need(data, "schema", int)
        if schema not in set(SchemaVersion):
            raise _bad_manifest(f"schema version {schema} is not supported (known: {[int(v) for v in SchemaVersion]})")
        m = cls(
            schema=schema,
            model=ModelIdentity.from_json(_need(data, "model", dict)),
            file=FileInfo.from_json(_need(data, "file", dict)),
            header=HeaderInfo.from_json(_need(data, "header", dict)),
            tensors=tuple(TensorEntry.from_json(t) for t in _need(data, "tensors", list)),
            layers=tuple(LayerEntry.from_json(x) for x in _need(data, "layers", list)),
            torrent=TorrentInfo.from_json(_need(data, "torrent", dict)),
            id=_need(data, "id", str),
        )
        m.check()
        return m

    @classmethod
    def loads(cls, text: str | bytes) -> "Manifest":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _bad_manifest(f"not JSON: {exc}") from None
        return cls.from_json(data)

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        """Read a manifest file.

        Raises:
            CallerError(NOT_FOUND): no such file.
            CallerError(ARTIFACT_MISMATCH): see from_json.
        """
        try:
            text = Path(path).read_bytes()
        except FileNotFoundError:
            raise CallerError(Reason.NOT_FOUND, f"manifest not found: {path}") from None
        except OSError as exc:
            raise CallerError(Reason.NOT_FOUND, f"cannot read manifest {path}: {exc.strerror}") from None
        return cls.loads(text)

    def check(self) -> None:
        """Recompute every derived field and refuse a manifest whose parts disagree.

        Raises:
            CallerError(ARTIFACT_MISMATCH)
        """
        t = self.torrent
        if t.meta_version != TORRENT_META_VERSION:
            raise _bad_manifest(f"torrent meta_version {t.meta_version} is not {TORRENT_META_VERSION}")
        if t.piece_length < PieceSize.MIN or t.piece_length & (t.piece_length - 1):
            raise _bad_manifest(f"piece length {t.piece_length} is not 16 KiB * 2^k")
        if t.piece_count != merkle.piece_count(self.file.size, t.piece_length) or len(t.piece_hashes) != t.piece_count:
            raise _bad_manifest("piece count does not match the file size and piece length")
        root = merkle.root_from_piece_hashes([bytes.fromhex(h) for h in t.piece_hashes], self.file.size, t.piece_length)
        if root.hex() != t.pieces_root:
            raise _bad_manifest("pieces_root is not the merkle root of piece_hashes")
        if self.info_hash_v2() != t.info_hash_v2:
            raise _bad_manifest("info_hash_v2 is not the hash of the info dict")
        by_name = {x.name: x for x in self.tensors}
        if len(by_name) != len(self.tensors):
            raise _bad_manifest("duplicate tensor names")
        for x in self.tensors:
            if x.offset < self.header.length or x.end > self.file.size or x.size < 0:
                raise _bad_manifest(f"tensor {x.name} lies outside the tensor data section")
        if len(self.layers) != self.model.block_count:
            raise _bad_manifest(f"{len(self.layers)} layer entries for {self.model.block_count} blocks")
        for i, layer in enumerate(self.layers):
            if layer.index != i:
                raise _bad_manifest(f"layer entry {i} has index {layer.index}")
            members = [x for x in self.tensors if x.layer == i]
            if sorted(x.name for x in members) != sorted(layer.tensors):
                raise _bad_manifest(f"layer {i} lists tensors that are not the layer's")
            if layer.sha256 != layer_digest((x.name, x.sha256) for x in members):
                raise _bad_manifest(f"layer {i} digest does not match its tensors")
        if self.id != self.compute_id():
            raise _bad_manifest("id does not match the content (edited or corrupted)")

    # -- torrent ----------------------------------------------------------------
    def info_dict(self) -> dict[str, Any]:
        return torrent_info_dict(self.file, self.torrent.piece_length, bytes.fromhex(self.torrent.pieces_root))

    def info_hash_v2(self) -> str:
        return hashlib.sha256(bencode(self.info_dict())).hexdigest()

    def torrent_bytes(self) -> bytes:
        """A complete v2 .torrent (info + piece layers), built from the manifest alone."""
        torrent: dict[str, Any] = {"info": self.info_dict(), "piece layers": {}}
        if self.file.size > self.torrent.piece_length:
            layer = b"".join(bytes.fromhex(h) for h in self.torrent.piece_hashes)
            torrent["piece layers"] = {bytes.fromhex(self.torrent.pieces_root): layer}
        return bencode(torrent)

    # -- lookups ----------------------------------------------------------------
    def tensor(self, name: str) -> TensorEntry:
        for x in self.tensors:
            if x.name == name:
                return x
        raise CallerError(Reason.NOT_FOUND, f"no tensor {name!r} in manifest {self.id[:12]}")

    def check_layers(self, layers: LayerRange) -> None:
        """Raises CallerError(INVALID_REQUEST) if layers is not within [0, block_count)."""
        if layers.stop > self.model.block_count:
            raise CallerError(
                Reason.INVALID_REQUEST,
                f"layers {layers} are outside the model's {self.model.block_count} layers",
            )

    def needed_tensors(self, layers: LayerRange | None, need: GlobalNeed = GlobalNeed.COMPUTE) -> list[TensorEntry]:
        """Tensors a node serving layers needs (every tensor when layers is None), in offset order."""
        if layers is None:
            return list(self.tensors)
        self.check_layers(layers)
        head = layers.start == 0
        tail = layers.stop == self.model.block_count
        wanted_roles = {Role.SHARED}
        if head:
            wanted_roles |= {Role.HEAD, Role.HEAD_TAIL}
        if tail:
            wanted_roles |= {Role.TAIL, Role.HEAD_TAIL}
        out = []
        for x in self.tensors:
            if x.layer is not None:
                if layers.start <= x.layer < layers.stop:
                    out.append(x)
            elif need is GlobalNeed.LOADER or x.role in wanted_roles:
                out.append(x)
        return out

    def needed_ranges(self, layers: LayerRange | None, need: GlobalNeed = GlobalNeed.COMPUTE) -> list[tuple[int, int]]:
        """Byte ranges [start, end) a node serving layers needs: the header plus needed tensors."""
        spans = [(0, self.header.length)] + [(x.offset, x.end) for x in self.needed_tensors(layers, need)]
        return merge_spans(spans)

    def pieces_for_ranges(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """Sorted piece indices overlapping any of the byte ranges."""
        return pieces_of(ranges, self.torrent.piece_length)

    def needed_pieces(self, layers: LayerRange | None, need: GlobalNeed = GlobalNeed.COMPUTE) -> list[int]:
        """Pieces a node must download to serve layers: header + needed tensors, rounded up to pieces."""
        return self.pieces_for_ranges(self.needed_ranges(layers, need))

    def piece_span(self, piece: int) -> tuple[int, int]:
        p = self.torrent.piece_length
        return piece * p, min((piece + 1) * p, self.file.size)

    def model_info(self, name: str | None = None) -> ModelInfo:
        """The ModelInfo a node advertises for this artifact; digest is the file's sha256."""
        m = self.model
        return ModelInfo(
            name=name or m.name or self.file.name,
            architecture=m.architecture,
            n_layers=m.block_count,
            hidden_size=m.hidden_size,
            seam_width=m.seam_width,
            vocab_size=m.vocab_size,
            context_length=m.context_length,
            digest=self.file.sha256,
            metadata={"manifest_id": self.id, "info_hash_v2": self.torrent.info_hash_v2},
        )


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge touching or overlapping [start, end) ranges; drop empty ones."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def pieces_of(ranges: Iterable[tuple[int, int]], piece_length: int) -> list[int]:
    out: set[int] = set()
    for start, end in ranges:
        if end > start:
            out.update(range(start // piece_length, (end - 1) // piece_length + 1))
    return sorted(out)


def piece_runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
