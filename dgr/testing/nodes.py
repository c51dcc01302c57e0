"""In-process nodes for trio-level tests: a NodeService with its scheduler running.

A `NodeService` only computes while its `StepScheduler` runs (the one owner
of the backend), so in-process tests run it in a nursery, as `dgr node` does.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import trio
import trio.testing

from dgr.node.service import NodeService

__all__ = ["running", "settled"]


@contextlib.asynccontextmanager
async def running(*services: NodeService) -> AsyncIterator[tuple[NodeService, ...]]:
    """Run each service's scheduler for the body of the `async with`, then stop them."""
    async with trio.open_nursery() as nursery:
        for s in services:
            await nursery.start(s.run)
        yield services
        nursery.cancel_scope.cancel()


async def settled(*services: NodeService) -> None:
    """Return once every backend job queued so far on these nodes has run, and what awaited them has
    gone on as far as it can.

    `trio.testing.wait_all_tasks_blocked` is not enough: a scheduler waiting on
    its worker thread counts as blocked while the job still runs. A no-op job
    queued now runs after every job already queued (an iteration runs its
    control jobs in queue order), so waiting for it waits for them. The tasks
    those jobs wake (a gateway noting a close was answered, say) may not have
    run yet when the no-op returns: the last wait lets them.
    """
    await trio.testing.wait_all_tasks_blocked()
    for s in services:
        await s.scheduler.call(lambda: None)
    await trio.testing.wait_all_tasks_blocked()
