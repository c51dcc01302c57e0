"""Where secrets come from: a file or an environment variable, never argv.

A secret on the command line is visible to every user through `ps` and
/proc, so dgr reads the cluster secret and API keys only from a file
(`--cluster-secret-file`, `--api-key-file`) or from the environment
(`DGR_CLUSTER_SECRET`, `DGR_API_KEYS`). `dgr up` generates a fresh cluster
secret per local route and hands it to its children in the environment.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dgr.errors import CallerError, Reason

__all__ = ["CLUSTER_ENV", "API_KEYS_ENV", "load_cluster_secret", "load_api_keys", "new_secret", "MIN_SECRET_BYTES"]

CLUSTER_ENV = "DGR_CLUSTER_SECRET"
API_KEYS_ENV = "DGR_API_KEYS"
MIN_SECRET_BYTES = 16


def new_secret() -> str:
    return secrets.token_hex(32)


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text().strip()
    except OSError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot read the {what} file {p}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # warn-level strictness would be ignored; refusing teaches chmod 600 once
        raise CallerError(Reason.INVALID_REQUEST, f"the {what} file {p} is readable by others: chmod 600 it")
    return text


def load_cluster_secret(path: str | None) -> bytes | None:
    """The cluster secret from `path` or $DGR_CLUSTER_SECRET; None when neither is set.

    Raises:
        CallerError(INVALID_REQUEST): unreadable, world-readable or too short.
    """
    text = _read(path, "cluster secret") if path else os.environ.get(CLUSTER_ENV, "").strip()
    if not text:
        return None
    raw = text.encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise CallerError(Reason.INVALID_REQUEST, f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def load_api_keys(path: str | None) -> frozenset[str]:
    """API keys, one per line in `path`, or comma-separated in $DGR_API_KEYS."""
    if path:
        keys = [line.strip() for line in _read(path, "API key").splitlines()]
    else:
        keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",")]
    return frozenset(k for k in keys if k and not k.startswith("#"))
