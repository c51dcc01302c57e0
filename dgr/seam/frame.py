"""Encode and decode seam frames, refusing anything malformed with a reason.

A frame is `HEADER` (dgr.seam.wire) followed by the payload: optional int32
token ids, then optional hidden states as raw little-endian floats. Decoding
checks magic, version, kind, dtype, flags, sizes and the CRC before anything
reaches a session, and never trusts a length it has not checked against the
bytes actually received. Every refusal is a `CallerError` with a reason, so
the node answers 4xx and its state is unchanged. `decode_head` makes every
check the header alone allows (the payload's length included: the header
says what it holds), so a stream refuses a step from its first bytes,
before its payload (up to a 64 MiB prefill chunk) is waited for.
"""

from __future__ import annotations

import uuid
import zlib

import attrs
import numpy as np

from dgr.errors import CallerError, Reason
from dgr.seam.wire import (
    DTYPE_NUMPY,
    DTYPE_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_FRAME_BYTES,
    SPEC_RESULT,
    TOKEN_RESULT,
    VERSION,
    DType,
    Flag,
    FrameKind,
)

__all__ = ["Frame", "FrameHead", "TokenResult", "encode_frame", "decode_head", "decode_frame", "readdressed"]


@attrs.frozen
class Frame:
    """A decoded frame. Arrays are read-only views of the received bytes."""

    kind: FrameKind
    session: str  # 32 hex digits
    seq: int
    pos0: int
    n_tokens: int
    width: int
    dtype: DType = DType.F32
    flags: Flag = Flag(0)
    token_ids: np.ndarray | None = None  # int32 [n_tokens]
    hidden: np.ndarray | None = None  # dtype [n_tokens, width]
    extra: bytes = b""  # TOKEN frames: TOKEN_RESULT + piece bytes
    crc32: int = 0
    size: int = 0  # bytes on the wire, header included

    def hidden_f32(self) -> np.ndarray | None:
        if self.hidden is None:
            return None
        return self.hidden.astype(np.float32, copy=False)


@attrs.frozen
class TokenResult:
    token: int
    logprob: float
    piece: bytes
    eog: bool
    spec: tuple[int, int, int] | None = None  # a speculative step's (k, accepted, frames left): SPEC_RESULT

    def payload(self) -> bytes:
        head = b"" if self.spec is None else SPEC_RESULT.pack(*self.spec)
        return head + TOKEN_RESULT.pack(self.token, self.logprob) + self.piece

    @property
    def more(self) -> bool:
        """Another TOKEN frame of the same step follows this one (a speculative step's accepted drafts)."""
        return self.spec is not None and self.spec[2] > 0

    @classmethod
    def from_frame(cls, frame: Frame) -> "TokenResult":
        spec = None
        extra = frame.extra
        if frame.kind is FrameKind.TOKEN and frame.flags & Flag.SPEC and len(extra) >= SPEC_RESULT.size:
            spec = SPEC_RESULT.unpack_from(extra)
            extra = extra[SPEC_RESULT.size:]
            if not spec[1] <= spec[0] or not spec[2] <= spec[1]:
                raise CallerError(Reason.BAD_FRAME, f"a speculative step's result {spec} is not (k, accepted <= k, "
                                                    "frames left <= accepted)")
        if frame.kind is not FrameKind.TOKEN or len(extra) < TOKEN_RESULT.size:
            raise CallerError(Reason.BAD_FRAME, f"expected a TOKEN frame, got {frame.kind.name}")
        token, logprob = TOKEN_RESULT.unpack_from(extra)
        return cls(token, logprob, extra[TOKEN_RESULT.size :], bool(frame.flags & Flag.EOG), spec)


# A session id's header bytes, parsed once per session rather than once per frame (a few sessions' worth of
# memory; cleared whole when full, as a cache may be).
_SESSION_BYTES: dict[str, bytes] = {}
_SESSION_BYTES_KEPT = 4096


_GATHER_PAYLOAD = 64 * 1024  # hidden states this big go into the frame from the array itself (see encode_frame)


def encode_frame(
    kind: FrameKind,
    session: str,
    seq: int,
    pos0: int,
    n_tokens: int,
    width: int,
    *,
    dtype: DType = DType.F32,
    flags: Flag | int = Flag(0),
    token_ids: np.ndarray | None = None,  # int [n_tokens]
    hidden: np.ndarray | bytes | None = None,  # [n_tokens, width] or its raw bytes
    extra: bytes = b"",
) -> bytes:
    """Build a frame's bytes. Sets the TOKENS/HIDDEN flags from what is given.

    Raises:
        CallerError(WRONG_SIZE): the ids or hidden states do not fit `n_tokens` x `width`.
        CallerError(BAD_FRAME): `session` is not a UUID's hex digits.
    """
    parts: list[bytes] = []
    flags = int(flags)  # a plain int from here: enum.Flag's operators cost a microsecond each
    if token_ids is not None:
        ids = np.ascontiguousarray(token_ids, dtype="<i4").reshape(-1)
        if ids.shape[0] != n_tokens:
            raise CallerError(Reason.WRONG_SIZE, f"{ids.shape[0]} token ids for {n_tokens} positions")
        parts.append(ids.tobytes())
        flags |= _TOKENS
    if hidden is not None:
        if isinstance(hidden, bytes) and len(hidden) < _GATHER_PAYLOAD:
            raw = hidden
        elif isinstance(hidden, (bytes, bytearray, memoryview)):
            raw = memoryview(hidden).cast("B")
        else:
            arr = np.ascontiguousarray(hidden, dtype=DTYPE_NUMPY[dtype])
            if arr.shape != (n_tokens, width):
                raise CallerError(Reason.WRONG_SIZE, f"hidden shape {arr.shape} != ({n_tokens}, {width})")
            raw = memoryview(arr).cast("B") if arr.nbytes >= _GATHER_PAYLOAD else arr.tobytes()
        if (raw.nbytes if isinstance(raw, memoryview) else len(raw)) != n_tokens * width * DTYPE_SIZE[dtype]:
            raise CallerError(Reason.WRONG_SIZE, "hidden bytes do not match n_tokens x width x dtype")
        parts.append(raw)
        flags |= _HIDDEN
    parts.append(extra)
    payload = None
    if isinstance(parts[-2 if len(parts) > 1 else -1], memoryview):
        # a prefill chunk's: the payload is never joined on its own, its length and CRC are summed over the
        # parts, and the frame is one allocation of its exact size (it was three copies of its hidden states)
        payload_len, crc = 0, 0
        for part in parts:
            payload_len += part.nbytes if isinstance(part, memoryview) else len(part)
            crc = zlib.crc32(part, crc)
    else:  # a decode step's: one join of small parts, the cheapest in time
        payload = b"".join(parts)
        payload_len, crc = len(payload), zlib.crc32(payload)
    sid = _SESSION_BYTES.get(session)  # the header's 16 bytes; decode_frame gives them back as hex
    if sid is None:
        try:
            sid = uuid.UUID(hex=session).bytes
        except ValueError:
            raise CallerError(Reason.BAD_FRAME, f"session id {session!r} is not a 32-hex-digit UUID") from None
        if len(_SESSION_BYTES) >= _SESSION_BYTES_KEPT:
            _SESSION_BYTES.clear()
        _SESSION_BYTES[session] = sid
    header = HEADER.pack(
        MAGIC, VERSION, int(kind), int(dtype), flags, sid,
        seq, pos0, n_tokens, width, payload_len, crc,
    )
    return header + payload if payload is not None else b"".join((header, *parts))


_KINDS = {int(k): k for k in FrameKind}
_DTYPES = {int(d): d for d in DType}
_KNOWN_FLAGS = int(Flag.TOKENS | Flag.HIDDEN | Flag.SAMPLE | Flag.EOG | Flag.SPEC)
_TOKENS, _HIDDEN = int(Flag.TOKENS), int(Flag.HIDDEN)


@attrs.frozen
class FrameHead:
    """A frame's header, checked: everything but the payload's bytes and their CRC."""

    kind: FrameKind
    session: str  # 32 hex digits
    seq: int
    pos0: int
    n_tokens: int
    width: int
    dtype: DType
    flags: Flag
    payload_len: int
    crc32: int
    ids_bytes: int  # of the payload: the token ids (TOKENS), then the hidden states (HIDDEN), then the rest
    hidden_bytes: int


def decode_head(data: bytes | bytearray | memoryview) -> FrameHead:
    """Parse and check a frame's header (its first HEADER_SIZE bytes): every check but the payload's CRC.

    Raises:
        CallerError(BAD_FRAME | WRONG_DTYPE | WRONG_SIZE)
    """
    if len(data) < HEADER_SIZE:
        raise CallerError(Reason.BAD_FRAME, f"frame of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, kind, dtype, flags, session, seq, pos0, n_tokens, width, payload_len, crc) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CallerError(Reason.BAD_FRAME, f"bad magic {magic!r}")
    if version != VERSION:
        raise CallerError(Reason.BAD_FRAME, f"unsupported seam version {version}")
    # table lookups and int masks: a header is checked twice per step per hop (stream, then frame)
    known_kind, known_dtype = _KINDS.get(kind), _DTYPES.get(dtype)
    if known_kind is None:
        raise CallerError(Reason.BAD_FRAME, f"unknown frame kind {kind}")
    if known_dtype is None:
        raise CallerError(Reason.WRONG_DTYPE, f"unknown dtype {dtype}")
    kind, dtype = known_kind, known_dtype
    if flags & ~_KNOWN_FLAGS:
        raise CallerError(Reason.BAD_FRAME, f"unknown flag bits {flags:#x}")
    ids = 4 * n_tokens if flags & _TOKENS else 0
    if ids > payload_len:
        raise CallerError(Reason.WRONG_SIZE, f"{n_tokens} token ids need {ids} bytes")
    hidden = n_tokens * width * DTYPE_SIZE[dtype] if flags & _HIDDEN else 0
    if ids + hidden > payload_len:
        raise CallerError(Reason.WRONG_SIZE,
                          f"{n_tokens} x {width} {dtype.name} values need {hidden} bytes, {payload_len - ids} left")
    if ids + hidden < payload_len and kind is not FrameKind.TOKEN:
        raise CallerError(Reason.WRONG_SIZE, f"{payload_len - ids - hidden} unexpected trailing payload bytes")
    return FrameHead(kind, session.hex(), seq, pos0, n_tokens, width, dtype, Flag(flags), payload_len, crc, ids,
                     hidden)


def decode_frame(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Parse and check a frame.

    Raises:
        CallerError(FRAME_TOO_LARGE | BAD_FRAME | WRONG_DTYPE | WRONG_SIZE | BAD_CHECKSUM)
    """
    size = len(data)
    if size > max_bytes:
        raise CallerError(Reason.FRAME_TOO_LARGE, f"frame of {size} bytes exceeds the limit of {max_bytes}")
    head = decode_head(data)
    if head.payload_len != size - HEADER_SIZE:
        raise CallerError(
            Reason.WRONG_SIZE,
            f"header says {head.payload_len} payload bytes, {size - HEADER_SIZE} arrived",
        )
    payload = memoryview(data)[HEADER_SIZE:]
    if zlib.crc32(payload) != head.crc32:
        raise CallerError(Reason.BAD_CHECKSUM, "payload CRC-32 does not match the header")
    token_ids = hidden = None
    end, flags = head.ids_bytes, int(head.flags)
    if flags & _TOKENS:
        token_ids = np.frombuffer(payload[:end], dtype="<i4")
    if flags & _HIDDEN:
        hidden = np.frombuffer(payload[end:end + head.hidden_bytes], dtype=DTYPE_NUMPY[head.dtype]).reshape(
            head.n_tokens, head.width)
    return Frame(
        kind=head.kind, session=head.session, seq=head.seq, pos0=head.pos0, n_tokens=head.n_tokens,
        width=head.width, dtype=head.dtype, flags=head.flags, token_ids=token_ids, hidden=hidden,
        extra=bytes(payload[end + head.hidden_bytes:]), crc32=head.crc32, size=size,
    )


def readdressed(frame: bytes, session: str) -> bytes:
    """An encoded frame (one this side encoded: it is not checked again) as session `session`'s: the header's
    session field rewritten, the payload and its CRC as they were. A repaired route's hop sends its journal's
    frames on under the session id the repair opened (dgr.node.journal)."""
    fields = list(HEADER.unpack_from(frame))
    fields[5] = uuid.UUID(hex=session).bytes
    return HEADER.pack(*fields) + frame[HEADER_SIZE:]
