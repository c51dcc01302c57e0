"""Writing a file only its owner may read, where a planted link cannot redirect the write.

`write_private` writes through a temporary file beside the target, created
0600 with O_EXCL|O_NOFOLLOW (a stale one from a crash, or a symlink someone
planted, is removed first, never followed), then renamed over the target.
Used for the tracker pin (dgr.security.pins) and Prefix Snapshots
(dgr.node.snapshot).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_private"]


def write_private(path: Path, data: bytes, *, durable: bool = False) -> None:
    """`data` into `path` (0600), atomically; `durable`: on disk (fsync) before the rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
