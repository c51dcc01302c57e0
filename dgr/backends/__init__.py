"""Shard backends: what a node computes for its layer range."""

from dgr.backends.base import LayerRange, ModelInfo, ShardBackend

__all__ = ["LayerRange", "ModelInfo", "ShardBackend"]
