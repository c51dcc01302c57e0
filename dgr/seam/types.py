"""Value types that cross process boundaries outside the seam frames themselves.

`ModelInfo` is what a node tells the tracker about its model when it
registers (and what the tracker keeps per node to decide which nodes may share
a route). Backends produce it, but it is a wire type: the tracker, the
manifest and the registry read it without importing any backend.

`DeviceMemory` is an accelerator a node's layers are on, with its memory as
last read: what the node's status, heartbeats and /metrics report. Its
bounds (`MAX_DEVICES` and the lengths) are the wire's: a node keeps to them,
and the tracker (dgr.tracker.registration) drops a heartbeat's devices that
break them.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["DeviceMemory", "MAX_DEVICES", "MAX_DEVICE_DESCRIPTION", "MAX_DEVICE_NAME", "ModelInfo"]

# A node sees a handful of accelerators; a heartbeat names at most this many (a machine with more is rare, and
# the tracker would rather drop the list than store what any node says).
MAX_DEVICES = 16
MAX_DEVICE_NAME = 64  # a ggml device name (CUDA0, Vulkan1, SYCL0): a metric label on the tracker
MAX_DEVICE_DESCRIPTION = 256  # the driver's name for the card ("NVIDIA H100 80GB HBM3")


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


@attrs.frozen
class DeviceMemory:
    """An accelerator that holds a node's layers, and its memory as last read, in bytes.

    `memory_free` is what the driver says is free on the whole device, so `memory_used` counts every
    process's buffers, not this node's alone: it is what another node on the same card would find taken.
    """

    name: str  # the ggml device name, unique on its node: the metrics' `device` label
    description: str
    memory_free: int
    memory_total: int

    @property
    def memory_used(self) -> int:
        return self.memory_total - self.memory_free

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_ggml(cls, device: dict[str, Any]) -> DeviceMemory:
        """One of dgr.backends.placement.devices(), its description clipped to the wire's bound."""
        return cls(name=device["name"], description=device["description"][:MAX_DEVICE_DESCRIPTION],
                   memory_free=device["memory_free"], memory_total=device["memory_total"])
