"""The sha256 of a model file, cached so that a node start does not rehash it.

A model's identity (ModelInfo.digest) is its file's sha256. Hashing a large
model takes minutes, so the digest is cached under `cache_dir()`, keyed by
(path, size, mtime_ns): any write to the file changes the key. A sparse
partial download records the digest its verified pieces prove
(`remember_sha256`), since its holes would hash to something else.

Left out: what the digest is checked against (dgr.artifact).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from dgr.errors import CallerError, Reason

__all__ = ["cache_dir", "file_sha256", "remember_sha256"]

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where dgr caches what it derives from files: model digests, and (beside it) fetched artifacts."""
    env = os.environ.get("DGR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dgr" / "cache"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _memo_path(p: Path, st: os.stat_result) -> Path:
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "digests" / key


def remember_sha256(path: str | Path, digest: str) -> None:
    """Record `digest` as the sha256 of `path` (as it is now), so file_sha256 does not read it.

    For a sparse partial download whose needed tensors were verified against
    a Model Artifact manifest: its own bytes (holes read as zeros) would hash
    to something else, and hashing every hole of a large model costs minutes,
    while the pieces it holds are the manifest file's (digest = manifest
    file.sha256). Any later write changes mtime and drops the record.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file cannot be stat'ed.
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    _atomic_write_text(_memo_path(p, st), digest)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, streamed in 1 MiB chunks; cached by (path, size, mtime_ns).

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file cannot be read.
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    memo = _memo_path(p, st)
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    try:
        with p.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    digest = h.hexdigest()
    try:
        _atomic_write_text(memo, digest)
    except OSError:
        pass  # a read-only cache only costs a rehash next time
    return digest
