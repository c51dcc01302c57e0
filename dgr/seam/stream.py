"""Records of a seam stream: one link's steps, back to back in one request body.

Each link of a route (gateway to head, node to node, a ring's tail to its
head, tail to tracker) carries a session's steps as one long-lived HTTP/1.1
request with a chunked body, instead of one request and one answer per step:
a token then costs one write and one read per hop, no HTTP head to build or
parse, and no answer to wake the sender for.

A record is `RECORD_PREFIX` (how many hops computed the step so far), that
many `HOP_COMPUTE` (each hop's compute in microseconds, in route order from the
hop that took the step first), then one whole frame, whose own header says how
long it is. Each node appends its own compute as it passes a step on, so the
gateway learns every hop's compute with the answer, as numbers.

`RecordReader` cuts records out of the body as it arrives, however the bytes
were split, and refuses a malformed or oversized one from its first bytes,
before the rest of it is buffered. It checks the frame's size only, and hands
the frame's header to its `check_head` (where given) as soon as it has come,
so that a receiver refuses a step it would refuse whole (another session's, an
ended one's, a wrong kind or width) before its payload is waited for; the
frame itself is decoded (CRC and all) by whoever applies it.
"""

from __future__ import annotations

from typing import Callable

import attrs

from dgr.errors import CallerError, Reason
from dgr.seam.wire import HEADER, HEADER_FIELDS, HEADER_SIZE, HOP_COMPUTE, MAGIC, MAX_FRAME_BYTES, MAX_HOPS, RECORD_PREFIX

__all__ = ["Record", "encode_record", "RecordReader"]

_MAGIC_AT = [name for name, _, _ in HEADER_FIELDS].index("magic")
_PAYLOAD_LEN_AT = [name for name, _, _ in HEADER_FIELDS].index("payload_len")
_MAX_US = 2**32 - 1
_GATHER = 64 * 1024  # a frame this big is gathered in pieces, not grown in the buffer


@attrs.frozen
class Record:
    """One step on a link: its frame, and the compute of every hop that has run it so far."""

    frame: bytes
    compute_us: tuple[int, ...] = ()


def encode_record(compute_us: tuple[int, ...], frame: bytes) -> bytes:
    """One record: the hops' compute so far (microseconds, clamped to 32 bits) and an encoded frame."""
    if len(compute_us) > MAX_HOPS:
        raise ValueError(f"{len(compute_us)} hops exceed {MAX_HOPS}")
    times = b"".join(HOP_COMPUTE.pack(min(max(int(us), 0), _MAX_US)) for us in compute_us)
    return RECORD_PREFIX.pack(len(compute_us)) + times + frame


@attrs.define
class RecordReader:
    """Incremental parser of a stream body: feed it bytes, take whole `Record`s.

    A big record's frame (a prefill chunk's hidden states: hundreds of KB) is gathered as the pieces that
    came and joined once, at its exact size, instead of grown in the buffer piece by piece: a bytearray
    grown to 0.5 MB reallocates at every size on the way, and a node's heap kept the holes (its RSS grew
    10 to 17% over a 5-minute soak, every Python object flat meanwhile).
    """

    max_frame_bytes: int = MAX_FRAME_BYTES
    # the front record's frame header (HEADER_SIZE bytes), as soon as it has come; raises to refuse the record
    check_head: Callable[[bytes], None] | None = None
    _buf: bytearray = attrs.field(factory=bytearray)
    _checked: bool = False  # the front record's header has been through check_head
    _parts: list = attrs.field(factory=list)  # a big record's frame, as it came (from its header on)
    _have: int = 0  # bytes in _parts
    _want: int = 0  # its frame's size; 0: not gathering
    _times: tuple[int, ...] = ()  # its hops' compute

    @property
    def pending(self) -> int:
        """Bytes of a record not yet complete (0 between records: a clean place for the body to end)."""
        return len(self._buf) + self._have

    def feed(self, data: bytes) -> list[Record]:
        """The records `data` completes, in order.

        Each part of the record at the front (its hop count, its frame's header) is checked as soon as it
        has come, before the rest of the record is waited for.

        Raises:
            CallerError(BAD_FRAME): more hops than MAX_HOPS, or no frame magic where a frame starts.
            CallerError(FRAME_TOO_LARGE): a frame whose header announces more than `max_frame_bytes`.
            CallerError: as `check_head` raises it.
        """
        out = []
        if self._want:
            need = self._want - self._have
            if len(data) < need:
                self._parts.append(data)
                self._have += len(data)
                return out
            with memoryview(data) as view:
                self._parts.append(view[:need])
                out.append(Record(b"".join(self._parts), self._times))
            self._parts, self._have, self._want, self._times, self._checked = [], 0, 0, (), False
            data = data[need:]
        buf = self._buf
        buf += data
        while len(buf) >= RECORD_PREFIX.size:
            n_hops = RECORD_PREFIX.unpack_from(buf)[0]
            if n_hops > MAX_HOPS:
                raise CallerError(Reason.BAD_FRAME, f"a stream record names {n_hops} hops; at most {MAX_HOPS}")
            start = RECORD_PREFIX.size + n_hops * HOP_COMPUTE.size
            if len(buf) < start + HEADER_SIZE:
                break
            header = HEADER.unpack_from(buf, start)
            if header[_MAGIC_AT] != MAGIC:
                raise CallerError(Reason.BAD_FRAME, "a stream record does not hold a seam frame (bad magic)")
            size = HEADER_SIZE + header[_PAYLOAD_LEN_AT]
            if size > self.max_frame_bytes:
                raise CallerError(Reason.FRAME_TOO_LARGE, f"frame of {size} bytes exceeds {self.max_frame_bytes}")
            if self.check_head is not None and not self._checked:
                self.check_head(bytes(buf[start:start + HEADER_SIZE]))
                self._checked = True
            times = tuple(HOP_COMPUTE.unpack_from(buf, RECORD_PREFIX.size + i * HOP_COMPUTE.size)[0]
                          for i in range(n_hops))
            end = start + size
            if len(buf) < end:
                if size >= _GATHER:  # the rest is gathered as it comes (see the class)
                    self._parts, self._have, self._want, self._times = [bytes(buf[start:])], len(buf) - start, size, times
                    buf.clear()
                break
            with memoryview(buf) as view:
                frame = bytes(view[start:end])
            out.append(Record(frame, times))
            del buf[:end]
            self._checked = False
        return out
