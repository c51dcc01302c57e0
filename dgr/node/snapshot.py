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

Theory: `check` is pure over (manifest, bytes, the node's identity); the
node's service calls `write` and `load` in its scheduler's thread (the
backend's bytes come from there).

Left out: a disk budget (the directory grows with distinct conversations),
and signing: the digest catches a changed or truncated file, not an
attacker who rewrites both files (whoever can write DIR can do as much to
the node's model file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.node.prefix import BLOCK_TOKENS, KEY_HEX, valid_chain

__all__ = ["SNAPSHOT_SCHEMA", "Snapshot", "SnapshotDir", "check"]

SNAPSHOT_SCHEMA = 1  # the manifest's "schema": a change to the format gets a new number


@attrs.frozen
class Snapshot:
    """A checked snapshot: what to load, and where it came from."""

    chain: tuple[str, ...]
    data: bytes

    @property
    def positions(self) -> int:
        return len(self.chain) * BLOCK_TOKENS


def _identity(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("model_digest", "manifest_id", "backend", "layers")}


def check(manifest: Any, data: bytes, own: dict[str, Any]) -> Snapshot:
    """The snapshot, if `manifest` and `data` match this node (`own`: model_digest, manifest_id, backend, layers).

    Raises:
        CallerError(SNAPSHOT_MISMATCH): a malformed manifest, another model, manifest, backend or layer
        range, or bytes that are not the ones the manifest's digest names.
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
    if manifest.get("bytes") != len(data) or manifest.get("sha256") != hashlib.sha256(data).hexdigest():
        raise CallerError(Reason.SNAPSHOT_MISMATCH, "the KV bytes do not match the manifest's size and sha256 "
                                                    "(changed or truncated)", field="sha256")
    return Snapshot(tuple(chain), data)


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

    def write(self, chain: tuple[str, ...], data: bytes) -> None:
        """Write a kept prefix (its manifest last, so a manifest always names whole bytes) and delete the
        snapshots it supersedes."""
        self.root.mkdir(parents=True, exist_ok=True)
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
        """Every snapshot in the folder that matches this node, longest first; refusals go to `refused`."""
        found = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            name = path.stem
            try:
                if len(name) != KEY_HEX:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, "not named by a block key")
                try:
                    manifest = json.loads(path.read_text())
                    data = (self.root / f"{name}.kv").read_bytes()
                except (OSError, ValueError) as exc:
                    raise CallerError(Reason.SNAPSHOT_MISMATCH, f"unreadable: {exc}") from None
                snap = check(manifest, data, self.own)
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
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
