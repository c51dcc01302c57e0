"""Prefix Snapshots: a kept prefix's KV on disk, verifiable, reloaded after a restart.

Contract:
- `dgr node --snapshot-dir DIR` writes every prefix the node keeps
  (dgr.node.prefix) as two files named by the prefix's last block key:
  `KEY.kv`, the backend's bytes of that KV (llama.cpp: one sequence's state,
  `llama_state_seq_get_data`), and `KEY.json`, its manifest: schema version,
  model name and weight digest (sha256 of the GGUF), the Model Artifact
  manifest id where the node serves one, backend, layer range, the block
  hash chain, positions, and the size and sha256 of `KEY.kv`.
- At start the node checks every manifest against itself and reloads those
  that match into free sequence slots, as kept prefixes. A snapshot of
  another model file, manifest, backend or layer range, or whose bytes do not
  hash to its digest, is refused (`snapshot_mismatch`, with what differs) and
  never loaded; refusals are listed in the node's status.
- A snapshot whose chain is a prefix of a newly written one is deleted (the
  same conversation, a turn later), as the cache supersedes entries. Evicted
  prefixes keep their files: cold reuse after a restart.

On disk, only the node's user can read or write them: the folder is made
0700 and a folder that others can write is refused (nothing is loaded from
it, nothing written to it); files are written 0600 through a temporary file
opened O_EXCL|O_NOFOLLOW, so a planted symlink cannot redirect a write. At
start only the manifests are read; a snapshot's KV bytes are read when it
is loaded into a free slot.

Theory: `check_manifest` and `check` are pure over (manifest, bytes, the
node's identity); the node's service calls `write` and `scan`/`read` in its
scheduler's thread (the backend's bytes come from there).

Left out: a disk budget (the directory grows with distinct conversations),
and signing: the digest catches a changed or truncated file, not an
attacker who rewrites both files (whoever can write DIR can do as much to
the node's model file).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.node.prefix import BLOCK_TOKENS, KEY_HEX, valid_chain

__all__ = ["SNAPSHOT_SCHEMA", "Snapshot", "SnapshotDir", "check", "check_manifest"]

SNAPSHOT_SCHEMA = 1  # the manifest's "schema": a change to the format gets a new number


@attrs.frozen
class Snapshot:
    """A snapshot whose manifest matches this node: its chain, and where its KV bytes are."""

    chain: tuple[str, ...]
    manifest: dict[str, Any] = attrs.field(eq=False, repr=False)
    path: Path | None = None  # the KEY.kv file; None once `data` is given
    data: bytes | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def positions(self) -> int:
        return len(self.chain) * BLOCK_TOKENS

    def read(self) -> bytes:
        """The KV bytes, checked against the manifest's size and digest.

        Raises:
            CallerError(SNAPSHOT_MISMATCH): unreadable, or not the bytes the manifest names.
        """
        if self.data is not None:
            return self.data
        try:
            data = _read_private(self.path)
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
    chain = manifest.get("chain")
    if not valid_chain(chain, 1 << 16) or not chain or manifest.get("positions") != len(chain) * BLOCK_TOKENS:
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
    """One node's snapshot folder."""

    root: Path = attrs.field(converter=Path)
    own: dict[str, Any]  # model_digest, manifest_id, backend, layers: what a snapshot must match
    model: str = ""
    chains: dict[str, tuple[str, ...]] = attrs.field(factory=dict)  # name -> chain, of the snapshots written or loaded
    written: int = 0
    loaded: int = 0
    refused: list[dict[str, str]] = attrs.field(factory=list)  # {file, code, message}

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

    def write(self, chain: tuple[str, ...], data: bytes) -> None:
        """Write a kept prefix (its manifest last, so a manifest always names whole bytes) and delete the
        snapshots it supersedes.

        Raises:
            OSError: the folder is not private (see `_private_root`), or the disk refused.
        """
        self._private_root()
        name = chain[-1]
        meta = {"schema": SNAPSHOT_SCHEMA, "model": self.model, **self.own, "block_tokens": BLOCK_TOKENS,
                "chain": list(chain), "positions": len(chain) * BLOCK_TOKENS, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(self.root / f"{name}.kv", data)
        _atomic_write(self.root / f"{name}.json", json.dumps(meta, indent=1).encode())
        for old, old_chain in list(self.chains.items()):
            n = len(old_chain)
            if old != name and n <= len(chain) and chain[n - 1] == old_chain[-1]:
                self._delete(old)
        self.chains[name] = chain
        self.written += 1

    def _delete(self, name: str) -> None:
        self.chains.pop(name, None)
        for suffix in (".json", ".kv"):
            (self.root / f"{name}{suffix}").unlink(missing_ok=True)

    def scan(self) -> list[Snapshot]:
        """Every snapshot in the folder whose manifest matches this node, longest first (their KV bytes are read
        by `Snapshot.read`, for the slots they are loaded into); refusals go to `refused`."""
        if not self.root.is_dir():
            return []
        try:
            self._private_root()
        except OSError as exc:
            self.refused.append({"file": str(self.root), "code": Reason.SNAPSHOT_MISMATCH.value, "message": str(exc)})
            return []
        found = []
        for path in sorted(self.root.glob("*.json")):
            name = path.stem
            try:
                if len(name) != KEY_HEX:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, "not named by a block key")
                try:
                    manifest = json.loads(_read_private(path))
                except (OSError, ValueError) as exc:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, f"unreadable: {exc}") from None
                snap = Snapshot(check_manifest(manifest, self.own), manifest, self.root / f"{name}.kv")
                if snap.chain[-1] != name:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, "named by another key than its chain's last")
            except CallerError as exc:
                self.refused.append({"file": path.name, "code": exc.reason.value, "message": exc.message})
                continue
            found.append(snap)
            self.chains[name] = snap.chain
        return sorted(found, key=lambda s: -len(s.chain))

    def to_json(self) -> dict[str, Any]:
        return {"dir": str(self.root), "written": self.written, "loaded": self.loaded, "on_disk": len(self.chains),
                "refused": list(self.refused)}


def _atomic_write(path: Path, data: bytes) -> None:
    """`data` into `path` (0600) through a temporary file that is created, never followed or reused."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)  # a stale one from a crash, or a planted link: removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read_private(path: Path | None) -> bytes:
    """A file's bytes, not through a symlink."""
    if path is None:
        raise FileNotFoundError("no KV file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()
