"""Ed25519 identities for nodes and trackers: made once, kept in a file, named by their public key.

Why a key per party instead of one cluster secret: with a shared secret every
node could sign anything the tracker signs (capabilities, membership for any
node id). With a key pair per party, a signature says *who* signed, so:
- a node's registrations, heartbeats and proof answers are signed with its
  own key, and the tracker binds a node id to the first key that registers
  it (an id derived from a key belongs to that key from the start);
- capabilities are signed with the tracker's key, which nodes pin when they
  join; a node cannot mint one.

Rules:
- A key file holds one PKCS#8 PEM private key, mode 600. It is made on first
  use; a file that group or others can read is refused (chmod 600), like the
  join token and API key files.
- Without `--identity`, a process takes the first key file under the user's
  config folder (`$XDG_CONFIG_HOME/dgr`, else `~/.config/dgr`) named
  `ROLE.key`, `ROLE-1.key`, ... that no other running process holds (an
  exclusive `flock` held for the process's life), so two nodes started on one
  machine get two identities instead of fighting over one id.
- Every signature is over a domain tag and the message, so a signature made
  for one purpose (a request, a capability, a proof) is never valid for
  another.
- A secret the holder needs across restarts (the tracker's prefix-root key,
  dgr.seam.keys) is derived from the private key under a domain tag
  (`derive`): it lives and dies with the key file, and no second secret file
  is kept.

Left out: key rotation and revocation (a tracker operator drops a node by
restarting without it in `--allow-node`, or with a new join token).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import IO, Any

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dgr.errors import CallerError, Reason

__all__ = [
    "Identity",
    "b64e",
    "b64d",
    "config_dir",
    "claim_identity",
    "node_id_for",
    "is_derived_id",
    "key_text",
    "key_from_text",
    "parse_public_key",
    "verify",
]

_ID_PREFIX = "n-"
# A public key's text starts with a letter: bare base64url starts with "-" for
# one key in 64, and a command line then reads `--allow-node -Xyz...` as an option.
_KEY_PREFIX = "ed25519:"
_ID_CHARS = 20  # base32 characters: 100 bits of the key's hash


def b64e(raw: bytes) -> str:
    """URL-safe base64 without padding: keys and signatures in headers and JSON."""
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def b64d(text: str) -> bytes:
    """Raises: ValueError for anything that is not URL-safe base64."""
    if not isinstance(text, str) or len(text) > 4096:
        raise ValueError("not a base64 string")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def node_id_for(public: bytes) -> str:
    """The node id a public key names: `n-` and 20 base32 characters of its hash."""
    digest = hashlib.sha256(b"dgr/v1/node-id\0" + public).digest()
    return _ID_PREFIX + base64.b32encode(digest).decode("ascii")[:_ID_CHARS].lower()


def is_derived_id(node_id: str) -> bool:
    """True for ids shaped like `node_id_for`'s: those belong to their key even before it registers."""
    return node_id.startswith(_ID_PREFIX) and len(node_id) == len(_ID_PREFIX) + _ID_CHARS


def key_text(public: bytes) -> str:
    """A public key as `--allow-node`, `X-Dgr-Key` and ready lines carry it: `ed25519:` and base64url."""
    return _KEY_PREFIX + b64e(public)


def key_from_text(text: str) -> bytes:
    """The raw 32-byte public key `key_text` wrote.

    Raises: ValueError for anything else.
    """
    if not isinstance(text, str) or not text.startswith(_KEY_PREFIX):
        raise ValueError(f"a public key's text starts with {_KEY_PREFIX!r}")
    raw = b64d(text[len(_KEY_PREFIX):])
    Ed25519PublicKey.from_public_bytes(raw)  # ValueError unless 32 bytes
    return raw


def parse_public_key(text: str) -> bytes:
    """A raw public key from text a person gave (`--allow-node`).

    Raises:
        CallerError(INVALID_REQUEST): not `ed25519:` and the base64url of 32 bytes.
    """
    try:
        raw = key_from_text(text.strip())
    except ValueError:
        raise CallerError(Reason.INVALID_REQUEST, f"not an Ed25519 public key: {text[:60]!r}") from None
    return raw


def verify(public: bytes, domain: bytes, message: bytes, signature: bytes) -> bool:
    """True if `signature` is `public`'s over (domain, message); False for any bad input."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, domain + b"\0" + message)
    except (InvalidSignature, ValueError):
        return False
    return True


@attrs.frozen
class Identity:
    """A private key, and the file (and lock) it came from, if any."""

    private: Ed25519PrivateKey
    path: Path | None = None
    _lock: IO[Any] | None = attrs.field(default=None, repr=False)  # held open: the flock lives with it

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def public_text(self) -> str:
        return key_text(self.public)

    @property
    def node_id(self) -> str:
        return node_id_for(self.public)

    def sign(self, domain: bytes, message: bytes) -> bytes:
        return self.private.sign(domain + b"\0" + message)

    def derive(self, domain: bytes) -> bytes:
        """A 32-byte secret for `domain`: HMAC-SHA256 keyed with the private key's raw bytes."""
        raw = self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                         serialization.NoEncryption())
        return hmac.new(raw, b"dgr-derive\0" + domain, hashlib.sha256).digest()

    def save(self, path: str | Path) -> None:
        """Write the key to `path` (mode 600, its folder made 700 if new)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = self.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    @classmethod
    def load(cls, path: str | Path, *, create: bool = True, lock: IO[Any] | None = None) -> Identity:
        """The identity in `path`, made there first if it does not exist and `create`.

        Raises:
            CallerError(INVALID_REQUEST): unreadable, readable by others, or not an Ed25519 key.
        """
        p = Path(path).expanduser()
        if not p.exists() and create:
            cls.generate().save(p)
        try:
            mode = p.stat().st_mode
            raw = p.read_bytes()
        except OSError as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"cannot read the identity file {p}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CallerError(Reason.INVALID_REQUEST, f"the identity file {p} is readable by others: chmod 600 it")
        try:
            key = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError):
            raise CallerError(Reason.INVALID_REQUEST, f"the identity file {p} holds no readable private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise CallerError(Reason.INVALID_REQUEST, f"the identity file {p} is not an Ed25519 key")
        return cls(key, p, lock)


def config_dir() -> Path:
    """`$XDG_CONFIG_HOME/dgr`, else `~/.config/dgr`."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dgr"


def claim_identity(path: str | None, role: str, *, limit: int = 64) -> Identity:
    """`path`'s identity, or the first free `ROLE[-N].key` under `config_dir()`, locked for this process.

    Raises:
        CallerError(INVALID_REQUEST): a bad key file, or `limit` identities all in use.
    """
    if path:
        return Identity.load(path)
    folder = config_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for i in range(limit):
        candidate = folder / (f"{role}.key" if i == 0 else f"{role}-{i}.key")
        lock = open(folder / f".{candidate.name}.lock", "a")  # closed (and unlocked) with the identity
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        return Identity.load(candidate, lock=lock)
    raise CallerError(Reason.INVALID_REQUEST, f"{limit} {role} identities under {folder} are all in use")
