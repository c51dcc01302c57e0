"""Slow is not dead: a wait on nodes whose deadline their liveness extends.

A step's deadline comes: is its node dead, or only busy (other sessions'
long prompts, another process on its cores)? Shortly before the deadline the
gateway asks the nodes it waits on for `/healthz`, which a node answers on
its event loop, never behind compute (`lead`: how long before). While every
one answers, the deadline moves on by its own length, up to `slow_cap` times
it; a silent one ends the wait at once. A wait that ends without its answer
is `route_node_lost` naming the silent node, or, when every node still
answered at the cap, `session_timeout` naming none (`Wait.failed`).

The gateway holds the waits (Gateway._patient for one call, Gateway._answer
inline on a ring's every-token path); the probe itself is the gateway's.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import attrs
import trio

from dgr.errors import PeerError, Reason

__all__ = ["PROBE_S", "Wait", "keep_waiting", "lead"]

PROBE_S = 2.0  # how long a node has to answer the tracker's own /healthz


def lead(deadline_s: float) -> float:
    """How long before a deadline its nodes are asked whether they live: the probe's own bound."""
    return min(PROBE_S, deadline_s / 2)


@attrs.define(eq=False)
class Wait:
    """A wait on some nodes with a deadline that their liveness extends."""

    scope: trio.CancelScope
    start: float
    cap: float  # the latest the deadline may move to
    silent: str | None = None  # the node that did not answer its probe, once one did not

    def failed(self, what: str, node: str | None, *, route: bool = False, **details) -> PeerError:
        """The error for a wait that ended without its answer: `route_node_lost` naming the silent node,
        or, when every node still answered at the cap, `session_timeout` naming none as lost."""
        waited = trio.current_time() - self.start
        who = "the route" if route else f"node {node}"
        if self.silent is None and self.scope.deadline < self.cap:
            self.silent = node  # the deadline came before its probe's answer (or with no watcher to ask)
        if self.silent is not None:
            return PeerError(Reason.ROUTE_NODE_LOST, f"{who} {what} within {waited:.1f}s, and node {self.silent} "
                                                     "did not answer its liveness probe", node=self.silent, **details)
        return PeerError(Reason.SESSION_TIMEOUT, f"{who} {what} within {waited:.1f}s, though its nodes answer "
                                                 "their liveness probes: too slow, not lost", **details)


async def keep_waiting(wait: Wait, nodes: list[str], deadline_s: float, watcher: trio.CancelScope,
                       silent: Callable[[list[str], float], Awaitable[str | None]],
                       extended: Callable[[], None]) -> None:
    """Watch `wait` (in the gateway's nursery, so its caller's exceptions stay its own) until `watcher` is
    cancelled: probe `nodes` shortly before each deadline (`silent` gives the first that does not answer),
    extend it while they all answer, cut it at once when one does not."""
    with watcher:
        ahead = lead(deadline_s)
        while True:
            await trio.sleep_until(wait.scope.deadline - ahead)
            wait.silent = await silent(nodes, ahead)
            if wait.silent is not None:
                wait.scope.cancel()  # dead: nothing to wait for
                return
            if wait.scope.deadline >= wait.cap:
                return
            wait.scope.deadline = min(wait.cap, wait.scope.deadline + deadline_s)
            extended()
