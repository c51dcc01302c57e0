"""Seam protocol v1: binary frames that carry activations between shards."""

from dgr.seam.frame import Frame, TokenResult, decode_frame, encode_frame
from dgr.seam.wire import HEADER, HEADER_SIZE, DType, FrameKind, Flag

__all__ = ["Frame", "TokenResult", "decode_frame", "encode_frame", "HEADER", "HEADER_SIZE", "DType", "FrameKind", "Flag"]
