"""Records of a seam stream: one chain link's steps, back to back in one request body.

On a chain, each link (gateway to head, node to node, tail to tracker) carries
a session's steps as one long-lived HTTP/1.1 request with a chunked body,
instead of one request and one answer per step: a token then costs one write
and one read per hop, no HTTP head to build or parse, and no answer to wake the
sender for. A record is `RECORD_PREFIX` (the length of the hops text), the
hops text, then one whole frame, whose own header says how long it is.

`RecordReader` cuts records out of the body as it arrives, however the bytes
were split, and refuses a malformed or oversized one from its first bytes,
before the rest of it is buffered. It checks the frame's size only; the frame
itself is decoded (CRC and all) by whoever applies it.
"""

from __future__ import annotations

import attrs

from dgr.errors import CallerError, Reason
from dgr.seam.wire import HEADER, HEADER_FIELDS, HEADER_SIZE, MAGIC, MAX_FRAME_BYTES, MAX_HOPS_BYTES, RECORD_PREFIX

__all__ = ["encode_record", "RecordReader"]

_MAGIC_AT = [name for name, _, _ in HEADER_FIELDS].index("magic")
_PAYLOAD_LEN_AT = [name for name, _, _ in HEADER_FIELDS].index("payload_len")


def encode_record(hops: str, frame: bytes) -> bytes:
    """One record: the hops text so far and an encoded frame."""
    text = hops.encode("ascii")
    if len(text) > MAX_HOPS_BYTES:
        raise ValueError(f"hops text of {len(text)} bytes exceeds {MAX_HOPS_BYTES}")
    return RECORD_PREFIX.pack(len(text)) + text + frame


@attrs.define
class RecordReader:
    """Incremental parser of a stream body: feed it bytes, take whole records (hops, frame bytes)."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    _buf: bytearray = attrs.field(factory=bytearray)
    _need: int = 0  # bytes the record at the front needs in all, once its header is known; 0: not yet

    @property
    def pending(self) -> int:
        """Bytes of a record not yet complete (0 between records: a clean place for the body to end)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        """The records `data` completes, in order.

        Raises:
            CallerError(BAD_FRAME): a hops text too long or not ASCII, or no frame magic where a frame starts.
            CallerError(FRAME_TOO_LARGE): a frame whose header announces more than `max_frame_bytes`.
        """
        self._buf += data
        out = []
        while True:
            need = self._need or self._measure()
            if need == 0 or len(self._buf) < need:
                self._need = need
                return out
            n_hops = RECORD_PREFIX.unpack_from(self._buf)[0]
            start = RECORD_PREFIX.size + n_hops
            try:
                hops = self._buf[RECORD_PREFIX.size:start].decode("ascii")
            except UnicodeDecodeError:
                raise CallerError(Reason.BAD_FRAME, "a stream record's hops text is not ASCII") from None
            out.append((hops, bytes(self._buf[start:need])))
            del self._buf[:need]
            self._need = 0

    def _measure(self) -> int:
        """The length of the record at the front, once enough of it has come to know; 0 before."""
        buf = self._buf
        if len(buf) < RECORD_PREFIX.size:
            return 0
        n_hops = RECORD_PREFIX.unpack_from(buf)[0]
        if n_hops > MAX_HOPS_BYTES:
            raise CallerError(Reason.BAD_FRAME, f"a stream record's hops text of {n_hops} bytes exceeds {MAX_HOPS_BYTES}")
        start = RECORD_PREFIX.size + n_hops
        if len(buf) < start + HEADER_SIZE:
            return 0
        header = HEADER.unpack_from(buf, start)
        if header[_MAGIC_AT] != MAGIC:
            raise CallerError(Reason.BAD_FRAME, "a stream record does not hold a seam frame (bad magic)")
        payload = header[_PAYLOAD_LEN_AT]
        if HEADER_SIZE + payload > self.max_frame_bytes:
            raise CallerError(Reason.FRAME_TOO_LARGE,
                              f"frame of {HEADER_SIZE + payload} bytes exceeds {self.max_frame_bytes}")
        return start + HEADER_SIZE + payload
