"""Prefix Snapshots: a kept prefix's KV on disk, verifiable, reloaded after a restart.

Contract:
- `dgr node --snapshot-dir DIR` writes every prefix the node keeps
  (dgr.node.prefix) as two files named by the prefix's last block key:
  `KEY.kv`, the backend's bytes of that KV (llama.cpp: one sequence's state,
  `llama_state_seq_get_data`), and `KEY.json`, its manifest: schema version,
  model name and weight digest (sha256 of the GGUF), the Model Artifact
  manifest id where the node serves one, backend, layer range, the block
  hash chain, the marks of the positions after its last whole block (`tail`,
  absent when none), positions, and the size and sha256 of `KEY.kv`.
- At start the node checks every manifest against itself and reloads those
  that match into free sequence slots, as kept prefixes. A snapshot of
  another model file, manifest, backend or layer range, or whose bytes do not
  hash to its digest, is refused (`snapshot_mismatch`, with what differs) and
  never loaded; refusals are listed in the node's status.
- A snapshot whose chain is a prefix of a newly written one is deleted (the
  same conversation, a turn later), as the cache supersedes entries. Evicted
  prefixes keep their files: cold reuse after a restart.
- The folder has a budget (`--snapshot-max-mb`, default 1024 MiB): before a
  snapshot is written, the least recently used ones (written, loaded or
  reused last longest ago; a manifest's mtime across restarts) are deleted
  until it fits, so the snapshot files together never exceed it. A snapshot
  larger than the whole budget is not written. Every snapshot pair in the
  folder counts, another model's or layer range's too; at start, a folder
  over budget (the budget was lowered) is trimmed the same way.
- Positions are checked against the data: the KV file must be the size its
  manifest names (checked with `stat` at start, before any byte is read) and
  hash to its digest, and the backend refuses bytes that hold another number
  of positions than the manifest claims (`import_prefix`). A snapshot so
  refused is deleted, never loaded into a slot: its bytes are not what its
  manifest says. One that is merely another node's (model, manifest,
  backend, layers) is refused and kept, for that node.

On disk, only the node's user can read or write them: the folder is made
0700 and a folder that others can write is refused (nothing is loaded from
it, nothing written to it); files are written 0600 through a temporary file
opened O_EXCL|O_NOFOLLOW, so a planted symlink cannot redirect a write. At
start only the manifests are read; a snapshot's KV bytes are read when it
is loaded into a free slot.

Theory: `check_manifest` and `check` are pure over (manifest, bytes, the
node's identity); the node's service calls `write` and `scan`/`read` in its
scheduler's thread (the backend's bytes come from there).

Left out: signing: the digest catches a changed or truncated file, not an
attacker who rewrites both files (whoever can write DIR can do as much to
the node's model file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.security.private_files import write_private
from dgr.seam.keys import BLOCK_TOKENS, KEY_HEX, MARK_BYTES, decode_marks, encode_marks, valid_chain

__all__ = ["SNAPSHOT_SCHEMA", "SNAPSHOT_MAX_MB", "Snapshot", "SnapshotDir", "check", "check_manifest"]

log = logging.getLogger("dgr.node")
SNAPSHOT_SCHEMA = 1  # the manifest's "schema": a change to the format gets a new number
# A node's default disk budget for its snapshots: a SmolLM2-135M prefix of 4,096 positions is about 90 MiB,
# a 7B model's about 500 MiB at f16, so a few of the longest, or hundreds of short system prompts
SNAPSHOT_MAX_MB = 1024


@attrs.frozen
class Snapshot:
    """A snapshot whose manifest matches this node: its chain, and where its KV bytes are."""

    chain: tuple[str, ...]
    manifest: dict[str, Any] = attrs.field(eq=False, repr=False)
    path: Path | None = None  # the KEY.kv file; None once `data` is given
    data: bytes | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def tail(self) -> bytes:
        """The marks of its positions after the last whole block (checked by `check_manifest`)."""
        return decode_marks(self.manifest.get("tail", ""), BLOCK_TOKENS - 1) or b""

    @property
    def positions(self) -> int:
        return len(self.chain) * BLOCK_TOKENS + len(self.tail) // MARK_BYTES

    def read(self) -> bytes:
        """The KV bytes, checked against the manifest's size and digest.

        Raises:
            CallerError(SNAPSHOT_MISMATCH): unreadable, or not the bytes the manifest names.
        """
        if self.data is not None:
            return self.data
        try:
            data = _read_private(self.path, exactly=self.manifest.get("bytes"))
        except OSError as exc:
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"unreadable: {exc}") from None
        _check_data(self.manifest, data)
        return data


def _identity(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("model_digest", "manifest_id", "backend", "layers")}


def check(manifest: Any, data: bytes, own: dict[str, Any]) -> Snapshot:
    """The snapshot, if `manifest` and `data` match this node (`own`: model_digest, manifest_id, backend, layers).

    Raises:
        CallerError(SNAPSHOT_MISMATCH): a malformed manifest, another model, manifest, backend or layer
        range, or bytes that are not the ones the manifest's digest names.
    """
    chain = check_manifest(manifest, own)
    _check_data(manifest, data)
    return Snapshot(chain, manifest, data=data)


def _check_data(manifest: dict[str, Any], data: bytes) -> None:
    if manifest.get("bytes") != len(data) or manifest.get("sha256") != hashlib.sha256(data).hexdigest():
        raise CallerError(Reason.SNAPSHOT_MISMATCH, "the KV bytes do not match the manifest's size and sha256 "
                                                    "(changed or truncated)", field="sha256")


def check_manifest(manifest: Any, own: dict[str, Any]) -> tuple[str, ...]:
    """The block chain of `manifest`, if it is a snapshot of this node's model, manifest, backend and layers.

    Raises:
        CallerError(SNAPSHOT_MISMATCH): a malformed manifest, or another model, manifest, backend or layer range.
    """
    if not isinstance(manifest, dict) or manifest.get("schema") != SNAPSHOT_SCHEMA:
        raise CallerError(Reason.SNAPSHOT_MISMATCH, f"not a schema {SNAPSHOT_SCHEMA} prefix snapshot manifest")
    chain, tail = manifest.get("chain"), decode_marks(manifest.get("tail", ""), BLOCK_TOKENS - 1)
    if (not valid_chain(chain, 1 << 16) or not chain or tail is None
            or manifest.get("positions") != len(chain) * BLOCK_TOKENS + len(tail) // MARK_BYTES):
        raise CallerError(Reason.SNAPSHOT_MISMATCH, "the manifest's block chain or positions are malformed")
    for field, want in own.items():
        if manifest.get(field) != want:
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"the snapshot's {field} is {str(manifest.get(field))[:80]!r}, "
                                                        f"this node's is {str(want)[:80]!r}", field=field)
    if not isinstance(manifest.get("bytes"), int) or not isinstance(manifest.get("sha256"), str):
        raise CallerError(Reason.SNAPSHOT_MISMATCH, "the manifest names no size and sha256 of its KV bytes")
    return tuple(chain)


@attrs.define
class SnapshotDir:
    """One node's snapshot folder, kept within `max_bytes`."""

    root: Path = attrs.field(converter=Path)
    own: dict[str, Any]  # model_digest, manifest_id, backend, layers: what a snapshot must match
    model: str = ""
    max_bytes: int | None = SNAPSHOT_MAX_MB * 2**20  # None: no budget
    chains: dict[str, tuple[str, ...]] = attrs.field(factory=dict)  # name -> chain, of the snapshots written or loaded
    # name -> bytes on disk (manifest and KV) of every snapshot pair in the folder, least recently used first
    sizes: dict[str, int] = attrs.field(factory=dict)
    written: int = 0
    loaded: int = 0
    evicted: int = 0
    too_large: int = 0  # snapshots not written: larger than the whole budget
    deleted: int = 0  # snapshots refused for their bytes, and deleted
    refused: list[dict[str, str]] = attrs.field(factory=list)  # {file, code, message}
    scanned: bool = False  # `sizes` counts what was in the folder before this process wrote to it

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes.values())

    def _private_root(self) -> None:
        """Make the folder (0700) if it is missing.

        Raises:
            OSError: the folder is not a folder of this user's that only this user can write.
        """
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022 or st.st_uid != os.geteuid():
            raise PermissionError(f"snapshot folder {self.root} must be a folder of this user's that no one else "
                                  f"can write (mode {stat.S_IMODE(st.st_mode):o})")

    def write(self, chain: tuple[str, ...], data: bytes, tail: bytes = b"") -> bool:
        """Write a kept prefix (its manifest last, so a manifest always names whole bytes), after deleting the
        snapshots it supersedes and, least recently used first, those that leave it no room in the budget.

        Returns False, writing nothing, for a snapshot larger than the whole budget.

        Raises:
            OSError: the folder is not private (see `_private_root`), or the disk refused.
        """
        if not self.scanned:  # what an earlier process left counts against the budget too
            self.scan()
        self._private_root()
        name = chain[-1]
        meta = {"schema": SNAPSHOT_SCHEMA, "model": self.model, **self.own, "block_tokens": BLOCK_TOKENS,
                "chain": list(chain), "positions": len(chain) * BLOCK_TOKENS + len(tail) // MARK_BYTES,
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if tail:
            meta["tail"] = encode_marks(tail)
        manifest = json.dumps(meta, indent=1).encode()
        size = len(data) + len(manifest)
        if self.max_bytes is not None and size > self.max_bytes:
            self.too_large += 1
            return False
        for old, old_chain in list(self.chains.items()):
            n = len(old_chain)
            if old != name and n <= len(chain) and chain[n - 1] == old_chain[-1]:
                self._delete(old)
        self._delete(name)  # rewritten: its old size no longer counts
        self._fit(size)
        write_private(self.root / f"{name}.kv", data)
        write_private(self.root / f"{name}.json", manifest)
        self.chains[name] = chain
        self.sizes[name] = size  # the most recently used
        self.written += 1
        return True

    def touch(self, name: str) -> None:
        """`name` was used (loaded, or reused from memory): the last to be evicted, after a restart too."""
        if name in self.sizes:
            self.sizes[name] = self.sizes.pop(name)
            try:
                os.utime(self.root / f"{name}.json", follow_symlinks=False)
            except OSError:
                pass  # only the order after a restart suffers

    def discard(self, name: str) -> None:
        """Delete a snapshot whose bytes are not what its manifest says: it is never worth loading again."""
        self._delete(name)
        self.deleted += 1

    def _fit(self, size: int) -> None:
        """Delete least recently used snapshots until `size` more bytes fit in the budget."""
        if self.max_bytes is None:
            return
        while self.sizes and self.disk_bytes + size > self.max_bytes:
            self._delete(next(iter(self.sizes)))
            self.evicted += 1

    def _delete(self, name: str) -> None:
        self.chains.pop(name, None)
        self.sizes.pop(name, None)
        for suffix in (".json", ".kv"):
            try:
                (self.root / f"{name}{suffix}").unlink(missing_ok=True)
            except OSError as exc:  # a folder in its place: nothing dgr wrote, and nothing it will read
                log.warning("could not delete prefix snapshot file %s%s: %s", name, suffix, exc)

    def scan(self) -> list[Snapshot]:
        """Every snapshot in the folder whose manifest matches this node, longest first (their KV bytes are read
        by `Snapshot.read`, for the slots they are loaded into); refusals go to `refused`.

        Only manifests are read, and the KV files' sizes: a snapshot whose KV file is not the size its
        manifest names, or whose manifest is unreadable or malformed, is deleted. Then the folder is
        trimmed to the budget, least recently used (oldest manifest) first.
        """
        self.scanned = True
        if not self.root.is_dir():
            return []
        try:
            self._private_root()
        except OSError as exc:
            self.refused.append({"file": str(self.root), "code": Reason.SNAPSHOT_MISMATCH.value, "message": str(exc)})
            return []
        for stale in self.root.glob("*.tmp"):  # a write a crash cut short
            stale.unlink(missing_ok=True)
        for kv in self.root.glob("*.kv"):  # no manifest (a crash between the two writes): never loadable
            if not kv.with_suffix(".json").exists():
                kv.unlink(missing_ok=True)
        found, ages = {}, {}
        for path in self.root.glob("*.json"):
            name = path.stem
            kv = self.root / f"{name}.kv"
            try:
                st = os.lstat(path)
            except OSError:
                continue
            kv_size = _size(kv)
            ages[name] = st.st_mtime
            self.sizes[name] = st.st_size + (kv_size or 0)
            foreign = False
            try:
                if len(name) != KEY_HEX:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, "not named by a block key")
                try:
                    manifest = json.loads(_read_private(path, at_most=_MAX_MANIFEST))
                except (OSError, ValueError) as exc:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, f"unreadable: {exc}") from None
                try:
                    chain = check_manifest(manifest, self.own)
                except CallerError as exc:
                    foreign = exc.details.get("field") in self.own  # intact, another node's: kept for it
                    raise
                if chain[-1] != name:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, "named by another key than its chain's last")
                if kv_size != manifest["bytes"]:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH,
                                      f"the KV file holds {kv_size} bytes, its manifest names {manifest['bytes']}",
                                      field="bytes")
            except CallerError as exc:
                self.refused.append({"file": path.name, "code": exc.reason.value, "message": exc.message})
                if not foreign:
                    self.discard(name)
                continue
            found[name] = Snapshot(chain, manifest, kv)
            self.chains[name] = chain
        self.sizes = {n: self.sizes[n] for n in sorted(self.sizes, key=lambda n: ages.get(n, 0.0))}
        self._fit(0)
        return sorted((s for n, s in found.items() if n in self.sizes), key=lambda s: -len(s.chain))

    def to_json(self) -> dict[str, Any]:
        return {"dir": str(self.root), "written": self.written, "loaded": self.loaded, "on_disk": len(self.sizes),
                "disk_bytes": self.disk_bytes, "max_bytes": self.max_bytes, "evicted": self.evicted,
                "too_large": self.too_large, "deleted": self.deleted, "refused": list(self.refused)}


_MAX_MANIFEST = 1 << 22  # a manifest of the longest chain (65,536 blocks) is about 4.3 MB


def _size(path: Path) -> int | None:
    """A regular file's size, not through a symlink; None for anything else, or nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _read_private(path: Path | None, *, exactly: Any = None, at_most: int | None = None) -> bytes:
    """A regular file's bytes, not through a symlink, when it holds `exactly` (an int) or `at_most` bytes.

    Raises:
        OSError: missing, a link or not a regular file, or another size (then nothing is read).
    """
    if path is None:
        raise FileNotFoundError("no KV file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if exactly is not None and st.st_size != exactly:
            raise OSError(f"{path.name} holds {st.st_size} bytes, its manifest names {exactly}")
        if at_most is not None and st.st_size > at_most:
            raise OSError(f"{path.name} holds {st.st_size} bytes, more than {at_most}")
        return f.read()
