"""How a prompt's prefix is named on both sides of the wire: block keys and position marks.

A prefix is named by a hash chain over its token ids in blocks of
`BLOCK_TOKENS`: block i's key is H(key of block i-1 || the block's token ids
as little-endian int32), and block 0 chains from a root keyed with a secret
only the tracker holds, mixing in the model's digest and an isolation scope
(`prefix_root`). No node is told a root: a node could otherwise compute the
keys of any prompt offline (a shared system prompt) and name them as kept to
draw its sessions (spec/security.md, "Prefix claims"). Each position also has
a mark: the first `MARK_BYTES` bytes of H(key of its block's predecessor ||
its block's token ids up to and including it) (`token_marks`), so a mark names
every token before it, and a block's last mark begins its key.

The head computes its own from the prompt it tokenized, and the tracker the
same from the ids the head answers with (`prompt_offer`, dgr.tracker.admission); a
node, which on a non-head shard never sees token ids, compares them
(dgr.node.prefix) and checks what the wire brings (`valid_chain`,
`decode_marks`). Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from typing import Sequence

from dgr.seam.wire import BLOCK_TOKENS, KEY_HEX

__all__ = ["BLOCK_TOKENS", "KEY_HEX", "MARK_BYTES", "MAX_ADVERTISED", "MAX_MARKS", "block_chain", "decode_marks",
           "encode_marks", "prefix_root", "prompt_offer", "token_marks", "valid_chain"]

_DOMAIN = b"dgr-prefix-v2"  # v1 roots were unkeyed


def prefix_root(model_digest: str, scope: str, secret: bytes) -> str:
    """The key block 0 chains from: one per model file and isolation scope ('' when shared), keyed with the
    tracker's `secret` (HMAC-SHA256), so that whoever lacks it cannot name a prompt's blocks.

    Raises: ValueError for an empty secret (the root would be public again).
    """
    if not secret:
        raise ValueError("a prefix root needs the tracker's secret")
    mac = hmac.new(secret, _DOMAIN + b"\0" + model_digest.encode() + b"\0" + scope.encode(), hashlib.sha256)
    return mac.hexdigest()[:KEY_HEX]


def block_chain(tokens: Sequence[int], root: str, block: int = BLOCK_TOKENS) -> list[str]:
    """The keys of every whole block of `tokens`, in order; a partial last block has none."""
    keys, prev = [], bytes.fromhex(root)
    for i in range(0, len(tokens) - block + 1, block):
        part = tokens[i : i + block]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(part)}i", *part)).digest()[: KEY_HEX // 2]
        keys.append(prev.hex())
    return keys


# A position's mark: 48 bits. Two different tokens at the first position where two sequences differ
# (their earlier blocks' keys agreeing) give one mark by chance once in 2**48 matches.
MARK_BYTES = 6
# An offer marks at most this many positions (base64: 8 characters each, 512 KiB of an open's 1 MiB);
# past them a match is whole blocks only.
MAX_MARKS = 65536
# A node's heartbeat names at most this many kept prefixes (each by its last block key, 32 hex digits:
# about 9 KB), the most recently used first, so routing by prefix survives a tracker's restart.
MAX_ADVERTISED = 256


def token_marks(tokens: Sequence[int], root: str, block: int = BLOCK_TOKENS) -> bytes:
    """Every position's mark (MARK_BYTES each), chained like `block_chain`: a block's last mark begins its key."""
    out, prev = bytearray(), bytes.fromhex(root)
    for i in range(0, len(tokens), block):
        h = hashlib.sha256(prev)
        for t in tokens[i : i + block]:
            h.update(struct.pack("<i", t))
            out += h.digest()[:MARK_BYTES]
        prev = h.digest()[: KEY_HEX // 2]
    return bytes(out)


def encode_marks(marks: bytes) -> str:
    """Marks as they cross the wire: unpadded URL-safe base64, 8 characters a position."""
    return base64.urlsafe_b64encode(marks).decode()


def decode_marks(text: object, limit: int) -> bytes | None:
    """The marks `text` encodes, at most `limit` positions of them; None when malformed (checks wire input)."""
    if not isinstance(text, str) or len(text) % 8 or len(text) // 8 > limit:
        return None
    try:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


def prompt_offer(prompt: Sequence[int], root: str) -> tuple[int, list[str], bytes]:
    """What a prompt offers to reuse: (its positions, their block keys, their marks).

    Never the last token: its logits give the first answer token. Nor the one before: a lone position
    would run on other kernels than a chunk (dgr.tracker.live), and giving it back later would need a
    node to drop a position, which some memories cannot (recurrent, SWA).
    """
    offered = prompt[: max(len(prompt) - 2, 0)]
    return len(offered), block_chain(offered, root), token_marks(offered[:MAX_MARKS], root)


def valid_chain(chain: object, limit: int) -> bool:
    """True for a list of at most `limit` keys of KEY_HEX lowercase hex digits (checks wire input)."""
    return (isinstance(chain, list) and len(chain) <= limit
            and all(isinstance(k, str) and len(k) == KEY_HEX and all(c in "0123456789abcdef" for c in k)
                    for k in chain))
