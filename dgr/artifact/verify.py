"""Check a GGUF file, or only the part a layer range needs, against its manifest.

A node checks its file before it serves, seeds or shards it; a fetcher
checks what it downloaded before use. The answer is per layer: which layers
are intact, and for a bad one exactly which tensors differ.

Rules:
- Structural problems raise at once, each with its own message: a missing or
  non-GGUF file, a truncated file (MODEL_LOAD_FAILED), a file of another
  model or another GGUF build (ARTIFACT_MISMATCH). "Another model" is told
  apart from "truncated" by parsing the file's own header with gguf-py, only
  on that error path.
- Tensor mismatches do not raise: they are reported, and
  `VerifyReport.raise_for_mismatch()` turns them into one ARTIFACT_MISMATCH
  naming every bad layer and tensor.
- With a layer range, only the header, those layers' tensors and the globals
  they need are read; the rest of the file may be absent (a sparse partial
  download) or shorter.

Left out: BitTorrent piece checks during transfer (libtorrent does those).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import attrs

from dgr.artifact.constants import HASH_CHUNK, GlobalNeed
from dgr.artifact.build import read_gguf_layout
from dgr.artifact.manifest import Manifest
from dgr.artifact.sections import TensorEntry
from dgr.progress import NullProgress, Progress
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = ["TensorMismatch", "LayerResult", "VerifyReport", "verify_file", "hash_range"]


@attrs.frozen
class TensorMismatch:
    name: str
    layer: int | None
    offset: int
    size: int
    expected: str
    actual: str


@attrs.frozen
class LayerResult:
    """One layer's verdict; index None is the global tensors."""

    index: int | None
    tensors: int  # tensors checked
    bytes: int
    bad: tuple[str, ...]  # names of tensors that differ

    @property
    def ok(self) -> bool:
        return not self.bad

    def label(self) -> str:
        return "globals" if self.index is None else f"layer {self.index}"


@attrs.frozen
class VerifyReport:
    manifest_id: str
    path: str
    layers: LayerRange | None  # None: the whole file
    results: tuple[LayerResult, ...]  # globals first (if any were checked), then layers in order
    mismatches: tuple[TensorMismatch, ...]
    bytes_checked: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def bad_layers(self) -> list[int]:
        return sorted({m.layer for m in self.mismatches if m.layer is not None})

    @property
    def bad_tensors(self) -> list[str]:
        return [m.name for m in self.mismatches]

    def lines(self) -> list[str]:
        """One line per layer, for people."""
        out = []
        for r in self.results:
            if r.ok:
                out.append(f"{r.label()}: ok ({r.tensors} tensors, {r.bytes} bytes)")
            else:
                out.append(f"{r.label()}: MISMATCH in {', '.join(r.bad)}")
        return out

    def raise_for_mismatch(self) -> None:
        """Raises CallerError(ARTIFACT_MISMATCH) naming each bad layer and tensor."""
        if self.ok:
            return
        parts = []
        for r in self.results:
            if not r.ok:
                parts.append(f"{r.label()}: {', '.join(r.bad)}")
        raise CallerError(
            Reason.ARTIFACT_MISMATCH,
            f"{self.path} differs from manifest {self.manifest_id[:12]}: " + "; ".join(parts),
            layers=self.bad_layers,
            tensors=self.bad_tensors,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_id": self.manifest_id,
            "path": self.path,
            "layers": None if self.layers is None else str(self.layers),
            "ok": self.ok,
            "bad_layers": self.bad_layers,
            "bad_tensors": self.bad_tensors,
            "bytes_checked": self.bytes_checked,
            "seconds": self.seconds,
        }


def hash_range(f: Any, offset: int, size: int, progress: Progress | None = None) -> str:
    """sha256 hex of bytes [offset, offset+size) of an open binary file.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file ends inside the range.
    """
    h = hashlib.sha256()
    f.seek(offset)
    left = size
    while left:
        chunk = f.read(min(HASH_CHUNK, left))
        if not chunk:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED,
                f"file ends at byte {offset + size - left}, inside [{offset}, {offset + size})",
            )
        h.update(chunk)
        left -= len(chunk)
        if progress is not None:
            progress.advance(len(chunk))
    return h.hexdigest()


def _identity_mismatch(path: Path, manifest: Manifest) -> CallerError:
    """Explain a header that differs: another model, another build, or a broken file."""
    layout = read_gguf_layout(path)  # raises MODEL_LOAD_FAILED for truncated/corrupt headers
    theirs, ours = layout.model, manifest.model
    if theirs != ours:
        return CallerError(
            Reason.ARTIFACT_MISMATCH,
            f"{path} is another model: {theirs.architecture} {theirs.name!r} with {theirs.block_count} layers, "
            f"hidden {theirs.hidden_size}; the manifest {manifest.id[:12]} is for {ours.architecture} "
            f"{ours.name!r} ({manifest.file.name}) with {ours.block_count} layers, hidden {ours.hidden_size}",
        )
    return CallerError(
        Reason.ARTIFACT_MISMATCH,
        f"{path} has the same model identity as manifest {manifest.id[:12]} ({manifest.file.name}) but a "
        "different GGUF header (other metadata, quantization or tensor layout)",
    )


def verify_file(
    path: str | Path,
    manifest: Manifest,
    layers: LayerRange | None = None,
    *,
    need: GlobalNeed = GlobalNeed.COMPUTE,
    progress: Progress | None = None,
) -> VerifyReport:
    """Hash the header and the needed tensors of path and compare them with manifest.

    layers None checks the whole file (every tensor and the exact size).

    Raises:
        CallerError(MODEL_LOAD_FAILED): missing, not GGUF, or truncated.
        CallerError(ARTIFACT_MISMATCH): the file is another model or GGUF build.
        CallerError(INVALID_REQUEST): layers outside the model.
    """
    progress = progress or NullProgress()
    started = time.perf_counter()
    p = check_gguf_file(path)
    size = p.stat().st_size
    needed = manifest.needed_tensors(layers, need)
    header_len = manifest.header.length
    progress.start(f"verifying {p.name}", header_len + sum(t.size for t in needed))

    with p.open("rb") as f:
        head = f.read(header_len)
        if hashlib.sha256(head).hexdigest() != manifest.header.sha256:
            raise _identity_mismatch(p, manifest)
        progress.advance(len(head))
        need_end = max((t.end for t in needed), default=header_len)
        if layers is None and size > manifest.file.size:
            raise CallerError(
                Reason.ARTIFACT_MISMATCH,
                f"{p} has {size} bytes, more than the {manifest.file.size} of manifest {manifest.id[:12]}",
            )
        if size < need_end or (layers is None and size < manifest.file.size):
            cut = [t.name for t in needed if t.end > size]
            cut_layers = sorted({t.layer for t in needed if t.end > size and t.layer is not None})
            raise CallerError(
                Reason.MODEL_LOAD_FAILED,
                f"{p} is truncated: {size} bytes, the manifest says {manifest.file.size}; "
                f"{len(cut)} needed tensors lie past the end (layers {cut_layers})",
                layers=cut_layers,
                tensors=cut,
            )
        mismatches: list[TensorMismatch] = []
        by_group: dict[int | None, list[TensorEntry]] = {}
        for t in needed:
            actual = hash_range(f, t.offset, t.size, progress)
            by_group.setdefault(t.layer, []).append(t)
            if actual != t.sha256:
                mismatches.append(TensorMismatch(t.name, t.layer, t.offset, t.size, t.sha256, actual))

    bad = {m.name for m in mismatches}
    results = []
    for key in sorted(by_group, key=lambda k: -1 if k is None else k):
        group = by_group[key]
        results.append(
            LayerResult(
                index=key,
                tensors=len(group),
                bytes=sum(t.size for t in group),
                bad=tuple(t.name for t in group if t.name in bad),
            )
        )
    return VerifyReport(
        manifest_id=manifest.id,
        path=str(p),
        layers=layers,
        results=tuple(results),
        mismatches=tuple(mismatches),
        bytes_checked=header_len + sum(t.size for t in needed),
        seconds=time.perf_counter() - started,
    )
