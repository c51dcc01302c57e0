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
  its canonical encoding, and the checks a loaded manifest must pass. Each
  section's record and its JSON form are dgr.artifact.sections.
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
from pathlib import Path
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
from dgr.artifact.sections import (
    FileInfo,
    HeaderInfo,
    LayerEntry,
    ModelIdentity,
    TensorEntry,
    TorrentInfo,
    bad_manifest,
    need_field,
    torrent_info_dict,
)
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role
from dgr.seam.types import ModelInfo

__all__ = [
    "Manifest",
    "choose_piece_length",
    "canonical_json",
    "layer_digest",
    "merge_spans",
    "piece_runs",
    "pieces_of",
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
            raise bad_manifest("not a JSON object")
        if data.get("kind") != MANIFEST_KIND:
            raise bad_manifest(f"kind is {data.get('kind')!r}, expected {MANIFEST_KIND!r}")
        schema = need_field(data, "schema", int)
        if schema not in set(SchemaVersion):
            raise bad_manifest(f"schema version {schema} is not supported (known: {[int(v) for v in SchemaVersion]})")
        m = cls(
            schema=schema,
            model=ModelIdentity.from_json(need_field(data, "model", dict)),
            file=FileInfo.from_json(need_field(data, "file", dict)),
            header=HeaderInfo.from_json(need_field(data, "header", dict)),
            tensors=tuple(TensorEntry.from_json(t) for t in need_field(data, "tensors", list)),
            layers=tuple(LayerEntry.from_json(x) for x in need_field(data, "layers", list)),
            torrent=TorrentInfo.from_json(need_field(data, "torrent", dict)),
            id=need_field(data, "id", str),
        )
        m.check()
        return m

    @classmethod
    def loads(cls, text: str | bytes) -> "Manifest":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise bad_manifest(f"not JSON: {exc}") from None
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
            raise bad_manifest(f"torrent meta_version {t.meta_version} is not {TORRENT_META_VERSION}")
        if t.piece_length < PieceSize.MIN or t.piece_length & (t.piece_length - 1):
            raise bad_manifest(f"piece length {t.piece_length} is not 16 KiB * 2^k")
        if t.piece_count != merkle.piece_count(self.file.size, t.piece_length) or len(t.piece_hashes) != t.piece_count:
            raise bad_manifest("piece count does not match the file size and piece length")
        root = merkle.root_from_piece_hashes([bytes.fromhex(h) for h in t.piece_hashes], self.file.size, t.piece_length)
        if root.hex() != t.pieces_root:
            raise bad_manifest("pieces_root is not the merkle root of piece_hashes")
        if self.info_hash_v2() != t.info_hash_v2:
            raise bad_manifest("info_hash_v2 is not the hash of the info dict")
        by_name = {x.name: x for x in self.tensors}
        if len(by_name) != len(self.tensors):
            raise bad_manifest("duplicate tensor names")
        for x in self.tensors:
            if x.offset < self.header.length or x.end > self.file.size or x.size < 0:
                raise bad_manifest(f"tensor {x.name} lies outside the tensor data section")
        if len(self.layers) != self.model.block_count:
            raise bad_manifest(f"{len(self.layers)} layer entries for {self.model.block_count} blocks")
        for i, layer in enumerate(self.layers):
            if layer.index != i:
                raise bad_manifest(f"layer entry {i} has index {layer.index}")
            members = [x for x in self.tensors if x.layer == i]
            if sorted(x.name for x in members) != sorted(layer.tensors):
                raise bad_manifest(f"layer {i} lists tensors that are not the layer's")
            if layer.sha256 != layer_digest((x.name, x.sha256) for x in members):
                raise bad_manifest(f"layer {i} digest does not match its tensors")
        if self.id != self.compute_id():
            raise bad_manifest("id does not match the content (edited or corrupted)")

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
