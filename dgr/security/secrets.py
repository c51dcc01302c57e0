"""Where secrets come from: a file or an environment variable, never argv.

A secret on the command line is visible to every user through `ps` and
/proc, so dgr reads the join token and API keys only from a file
(`--join-token-file`, `--api-key-file`) or from the environment
(`DGR_JOIN_TOKEN`, `DGR_API_KEYS`). `dgr up` generates a fresh join token
per local route and hands it to its children in the environment.

The join token only admits a node's key to a tracker (dgr.security.auth):
it signs nothing, so a node that holds it can join but cannot mint
capabilities or speak for another node.

A join token must carry at least 32 random bytes (256 bits), judged from its
text: its alphabet sets the bits a character carries (hex digits 4,
base64 or base64url 6, any other printable text log2(94), about 6.55), so
at least 64 hex digits (`secrets.token_hex(32)`, what `dgr up` makes) or 43
base64url characters (`secrets.token_urlsafe(32)`). A token of few distinct
characters, or one string repeated, is refused whatever its length: those
estimates hold only for text drawn at random.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import stat
from pathlib import Path

from dgr.errors import CallerError, Reason

__all__ = ["JOIN_ENV", "API_KEYS_ENV", "load_join_token", "load_api_keys", "new_secret", "token_weakness",
           "MIN_SECRET_BYTES"]

JOIN_ENV = "DGR_JOIN_TOKEN"
API_KEYS_ENV = "DGR_API_KEYS"
MIN_SECRET_BYTES = 32  # new_secret() gives 64 hex digits: 32 random bytes
# Bits a character carries, by the smallest alphabet the token is written in
_ALPHABETS = ((re.compile(r"[0-9a-fA-F]+"), 4.0), (re.compile(r"[A-Za-z0-9_+/-]+=*"), 6.0),
              (re.compile(r"[!-~]+"), math.log2(94)))
# Fewer distinct characters than this in a token long enough (hex: 16 expected in 64 digits; base64: about 31
# in 43) is text a person chose, not a draw: a random token falls below it about once in 10^12
_MIN_DISTINCT = {4.0: 10}
_MIN_DISTINCT_OTHER = 16


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
    weak = token_weakness(text)
    if weak:
        raise CallerError(Reason.INVALID_REQUEST,
                          f"the join token must hold at least {MIN_SECRET_BYTES} random bytes (64 hex digits, or 43 "
                          f"base64url characters): {weak}. Make one with "
                          "python -c 'import secrets; print(secrets.token_hex(32))'")
    return text.encode()


def token_weakness(text: str) -> str:
    """Why `text` does not look like at least MIN_SECRET_BYTES random bytes; "" when it does."""
    bits = next((b for pattern, b in _ALPHABETS if pattern.fullmatch(text)), None)
    if bits is None:
        return "it holds spaces or characters outside printable ASCII"
    digits = len(text.rstrip("=")) if bits == 6.0 else len(text)
    if digits * bits < MIN_SECRET_BYTES * 8:
        return f"{len(text)} characters of that alphabet carry about {int(digits * bits)} bits, not 256"
    if len(set(text)) < _MIN_DISTINCT.get(bits, _MIN_DISTINCT_OTHER) or text in (text + text)[1:-1]:
        return "it repeats too few characters, or one string, to be random"
    return ""


def load_api_keys(path: str | None) -> frozenset[str]:
    """API keys, one per line in `path`, or comma-separated in $DGR_API_KEYS."""
    if path:
        keys = [line.strip() for line in _read(path, "API key").splitlines()]
    else:
        keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",")]
    return frozenset(k for k in keys if k and not k.startswith("#"))
