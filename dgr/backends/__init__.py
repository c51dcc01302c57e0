"""Shard backends: what a node computes for its layer range."""

from dgr.backends.base import LayerRange, ShardBackend

__all__ = ["LayerRange", "ShardBackend"]
