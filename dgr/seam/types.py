"""Value types that cross process boundaries outside the seam frames themselves.

`ModelInfo` is what a node tells the tracker about its model when it
registers (and what the tracker keeps per node to decide which nodes may share
a route). Backends produce it, but it is a wire type: the tracker, the
manifest and the registry read it without importing any backend.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ModelInfo"]


@attrs.frozen
class ModelInfo:
    """What a node and the tracker need to know of a model, whatever the backend."""

    name: str  # id served by /v1/models
    architecture: str
    n_layers: int
    hidden_size: int
    seam_width: int  # floats per token on the seam; hidden_size for most models
    vocab_size: int
    context_length: int
    digest: str  # identity of the weights (sha256 of the file); nodes of different digests never share a route
    needs_token_ids: bool = False  # the seam also carries token ids (DeepSeek-V4 hash-routed layers)
    # its memory can drop a session's latest positions: what speculation needs, to forget refused drafts
    # (not a recurrent state, nor DeepSeek-V4's compressor, which keep no earlier copy)
    drops_positions: bool = True
    metadata: dict[str, Any] = attrs.field(factory=dict, eq=False, hash=False)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelInfo:
        return cls(**data)
