"""Where secrets come from: a file or an environment variable, never argv.

A secret on the command line is visible to every user through `ps` and
/proc, so dgr reads the join token and API keys only from a file
(`--join-token-file`, `--api-key-file`) or from the environment
(`DGR_JOIN_TOKEN`, `DGR_API_KEYS`). `dgr up` generates a fresh join token
per local route and hands it to its children in the environment.

The join token only admits a node's key to a tracker (dgr.security.auth):
it signs nothing, so a node that holds it can join but cannot mint
capabilities or speak for another node.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from dgr.errors import CallerError, Reason

__all__ = ["JOIN_ENV", "API_KEYS_ENV", "load_join_token", "load_api_keys", "new_secret", "MIN_SECRET_BYTES"]

JOIN_ENV = "DGR_JOIN_TOKEN"
API_KEYS_ENV = "DGR_API_KEYS"
MIN_SECRET_BYTES = 32  # new_secret() gives 64 hex digits: 32 random bytes
_MIN_DISTINCT = 8  # a token of fewer distinct characters (aaaa..., 1212...) is guessable whatever its length


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


def load_join_token(path: str | None) -> bytes | None:
    """The join token from `path` or $DGR_JOIN_TOKEN; None when neither is set.

    Raises:
        CallerError(INVALID_REQUEST): unreadable, world-readable or too short.
    """
    text = _read(path, "join token") if path else os.environ.get(JOIN_ENV, "").strip()
    if not text:
        return None
    raw = text.encode()
    if len(raw) < MIN_SECRET_BYTES or len(set(raw)) < _MIN_DISTINCT:
        raise CallerError(Reason.INVALID_REQUEST,
                          f"the join token must be at least {MIN_SECRET_BYTES} random characters "
                          "(python -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def load_api_keys(path: str | None) -> frozenset[str]:
    """API keys, one per line in `path`, or comma-separated in $DGR_API_KEYS."""
    if path:
        keys = [line.strip() for line in _read(path, "API key").splitlines()]
    else:
        keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",")]
    return frozenset(k for k in keys if k and not k.startswith("#"))
