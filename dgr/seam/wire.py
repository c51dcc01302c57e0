"""Every constant that crosses the seam, in one place, with explicit numbers.

spec/seam.md is generated from this module (dgr.specgen.protocol) and a test
fails when the committed document differs.
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "HEADER_SIZE",
    "HEADER_FIELDS",
    "FrameKind",
    "DType",
    "Flag",
    "DTYPE_SIZE",
    "DTYPE_NUMPY",
    "TOKEN_RESULT",
    "SPEC_RESULT",
    "MAX_DRAFTS",
    "MAX_FRAME_BYTES",
    "MAX_CONTROL_BYTES",
    "MAX_TOKENIZE_BYTES",
    "CONTENT_TYPE",
    "CAPABILITY_HEADER",
    "STATUS_SCOPE",
    "ROUTE_SESSION_HEADER",
    "TICKET_HEADER",
    "NODE_HEADER",
    "DELIVER_PATH",
    "STREAM_PATH",
    "DELIVER_STREAM_PATH",
    "RECORD_PREFIX",
    "HOP_COMPUTE",
    "MAX_HOPS",
    "KIND_OFFSET",
    "raw_header",
    "frame_kind",
    "BLOCK_TOKENS",
    "KEY_HEX",
]

# HTTP headers of the seam. A stream carries its Route Session capability (each hop's compute rides in
# its stream records).
CAPABILITY_HEADER = "X-Dgr-Capability"
# The "session" a capability names to see a node's per-kind counters on /v1/node/status. Route Session
# ids are 32 hex digits, so no capability the gateway issues for a session can pass for it.
STATUS_SCOPE = "status"
# The gateway's answer to a completion names its Route Session (clients follow its telemetry by it); a
# node's open and stream name theirs in it too, so it is checked before any body is read.
ROUTE_SESSION_HEADER = "X-Dgr-Route-Session"
# An open carries the tracker's single-use ticket for it (dgr.security.tickets).
TICKET_HEADER = "X-Dgr-Ticket"
# A node's heartbeat names its node id here, so that the tracker checks the signing key owns the id before it
# parses the body (whose "node" must agree).
NODE_HEADER = "X-Dgr-Node"
DELIVER_PATH = "/v1/seam/deliver"  # on the tracker: a ring's failure reports
# A ring session's steps along one link travel as one long-lived request whose chunked body is a
# sequence of records (below): to the next node, or from the tail to the tracker. No answer per step.
STREAM_PATH = "/v1/seam/stream"  # on a node
DELIVER_STREAM_PATH = "/v1/seam/deliver/stream"  # on the tracker


def raw_header(name: str) -> bytes:
    """A header name as an ASGI scope carries it: lowercase latin-1 bytes."""
    return name.lower().encode("latin-1")


# Prefix keys (dgr.node.prefix), which cross the wire in opens and closes: a hash chain over the prompt's
# token ids in blocks of BLOCK_TOKENS, each key the first 128 bits of SHA-256 in hex.
BLOCK_TOKENS = 64  # tokens per hash block: the granularity of reuse
KEY_HEX = 32


MAGIC = b"DGRS"
VERSION = 1
CONTENT_TYPE = "application/x-dgr-seam"
# A 2,048-token prefill chunk of a 7,168-wide model in f32 is 58 MiB; larger
# chunks must be split by the sender.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Every other request body a node reads (a later hop's open, a prefix named, challenges): small JSON.
MAX_CONTROL_BYTES = 1024 * 1024
# A head's open carries the prompt (dgr.seam.opening): as large as the gateway's own body limit. The
# gateway refuses a prompt whose bytes would exceed it.
MAX_TOKENIZE_BYTES = 4 * 1024 * 1024

# (name, struct code, meaning); little-endian, no padding.
HEADER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", "4s", "b'DGRS'"),
    ("version", "B", "format version, 1"),
    ("kind", "B", "FrameKind"),
    ("dtype", "B", "DType of the hidden-state payload"),
    ("flags", "B", "bit set of Flag"),
    ("session", "16s", "Route Session id, 16 raw bytes (a UUID)"),
    ("seq", "I", "step sequence number within the session, from 0"),
    ("pos0", "I", "first position the step covers"),
    ("n_tokens", "I", "positions in this step (1 for decode)"),
    ("width", "I", "seam width: floats per position (hidden_size for most models)"),
    ("payload_len", "I", "bytes after the header"),
    ("crc32", "I", "zlib CRC-32 of the payload bytes"),
)
HEADER = struct.Struct("<" + "".join(code for _, code, _ in HEADER_FIELDS))
HEADER_SIZE = HEADER.size
# Byte offset of `kind` (after magic and version), for counting frames without decoding them.
KIND_OFFSET = struct.calcsize("<4sB")


class FrameKind(enum.IntEnum):
    PREFILL = 1  # gateway -> node: a chunk of prompt positions
    DECODE = 2  # gateway -> node: exactly one position
    HIDDEN = 3  # node -> gateway: hidden states after the node's last layer
    TOKEN = 4  # tail -> gateway: the sampled token (payload: TOKEN_RESULT + piece bytes)
    ACK = 5  # tail -> gateway: a prefill chunk that needed no sample


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1


class Flag(enum.IntFlag):
    TOKENS = 1  # payload starts with n_tokens int32 token ids
    HIDDEN = 2  # payload carries n_tokens x width hidden values of dtype
    SAMPLE = 4  # tail: sample a token after the last position of this step
    EOG = 8  # TOKEN frame: the sampled token ends generation
    # TOKEN frame of a speculative step (issue 42): its payload starts with SPEC_RESULT, and the step's
    # tokens come as that many TOKEN frames of the step's seq
    SPEC = 16


DTYPE_SIZE: dict[DType, int] = {DType.F32: 4, DType.F16: 2}
DTYPE_NUMPY: dict[DType, str] = {DType.F32: "<f4", DType.F16: "<f2"}

# A stream record: how many hops have computed its step so far, each one's compute in microseconds
# (route order, from the hop that took the step first), then one whole frame (its header says how long).
RECORD_PREFIX = struct.Struct("<B")
HOP_COMPUTE = struct.Struct("<I")
MAX_HOPS = 64

# TOKEN payload: token id, its log-probability, then the token's raw bytes.
TOKEN_RESULT = struct.Struct("<if")
# Before it on a speculative step's TOKEN frames: the step's drafts (k), how many the tail accepted, and
# how many more TOKEN frames of the step follow this one (the step emits up to accepted + 1 tokens, fewer
# where one of them ends generation). A DECODE step carries at most MAX_DRAFTS + 1 positions: the last
# accepted token and its drafts.
SPEC_RESULT = struct.Struct("<BBB")
MAX_DRAFTS = 8


def frame_kind(frame: bytes | bytearray | memoryview) -> FrameKind:
    """The kind of an encoded frame, read from its header without checking the rest.

    Raises:
        ValueError: not a frame kind (the caller has already sent or decoded the frame).
    """
    return FrameKind(frame[KIND_OFFSET])
