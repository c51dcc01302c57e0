"""Bencoding (BEP 3), encode only, canonical.

The manifest computes the BitTorrent v2 info-hash itself, so that the tracker
can check it without libtorrent; that needs the exact bytes of the info
dictionary. Bencoding is canonical when dictionary keys are sorted by their raw
bytes, which `bencode` always does. Decoding is left out: nothing in dgr reads
a .torrent it did not write (tests use libtorrent's own `bdecode` to compare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from dgr.errors import CallerError, Reason

__all__ = ["Bencodable", "bencode"]

# Documentation of what encodes; the functions take Any because dict and list
# are invariant, so dict[str, Any] would not type-check against it.
Bencodable = Union[int, bytes, str, Sequence["Bencodable"], Mapping[Union[bytes, str], "Bencodable"]]


def bencode(value: Any) -> bytes:
    """The canonical bencoding of value: str is UTF-8, dict keys sorted as bytes.

    Raises:
        CallerError(INVALID_REQUEST): a type bencoding has no form for (float, None, bool).
    """
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def _key(k: bytes | str) -> bytes:
    return k.encode("utf-8") if isinstance(k, str) else k


def _encode(value: Any, out: list[bytes]) -> None:
    # bool is an int subclass; bencoding has no booleans, so refuse it rather
    # than silently writing i1e.
    if isinstance(value, bool) or value is None:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot bencode {value!r}")
    if isinstance(value, int):
        out.append(b"i%de" % value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out.append(b"%d:" % len(raw))
        out.append(raw)
    elif isinstance(value, str):
        _encode(value.encode("utf-8"), out)
    elif isinstance(value, list):
        out.append(b"l")
        for item in value:
            _encode(item, out)
        out.append(b"e")
    elif isinstance(value, dict):
        out.append(b"d")
        items = sorted(((_key(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        for i in range(1, len(items)):
            if items[i][0] == items[i - 1][0]:
                raise CallerError(Reason.INVALID_REQUEST, f"duplicate bencode key {items[i][0]!r}")
        for k, v in items:
            _encode(k, out)
            _encode(v, out)
        out.append(b"e")
    else:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot bencode a {type(value).__name__}")
