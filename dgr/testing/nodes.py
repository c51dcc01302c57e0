"""In-process nodes for trio-level tests: a NodeService with its scheduler running.

A `NodeService` only computes while its `StepScheduler` runs (the one owner
of the backend), so in-process tests run it in a nursery, as `dgr node` does.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import trio

from dgr.node.service import NodeService

__all__ = ["running"]


@contextlib.asynccontextmanager
async def running(*services: NodeService) -> AsyncIterator[tuple[NodeService, ...]]:
    """Run each service's scheduler for the body of the `async with`, then stop them."""
    async with trio.open_nursery() as nursery:
        for s in services:
            await nursery.start(s.run)
        yield services
        nursery.cancel_scope.cancel()
