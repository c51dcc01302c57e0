"""Slow is not dead: a wait on nodes whose deadline their liveness extends.

A step's deadline comes: is its node dead, or only busy (other sessions'
long prompts, another process on its cores)? Shortly before the deadline the
gateway asks the nodes it waits on for `/healthz`, which a node answers on
its event loop, never behind compute (`lead`: how long before). While every
one answers, the deadline moves on by its own length, up to `slow_cap` times
it; a silent one ends the wait at once. A wait that ends without its answer
is `route_node_lost` naming the silent node, or, when every node still
answered at the cap, `session_timeout` naming none (`Wait.failed`).

`Patience` holds the waits: `patient` for one call (a watcher task probes and
moves the deadline), `until_answer` inline on a ring's every-token path (no
task: the wait is cut and taken up again). The probe itself is the caller's
(dgr.tracker.clients `NodeClients.silent`).
"""

from __future__ import annotations

import contextlib
from typing import Awaitable, Callable, Iterator, TypeVar

import attrs
import trio

from dgr.errors import PeerError, Reason

__all__ = ["PROBE_S", "Wait", "Patience", "keep_waiting", "lead"]

T = TypeVar("T")

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


@attrs.define
class Patience:
    """The gateway's waits on nodes: their deadlines, extended while the nodes answer their probes."""

    silent: Callable[[list[str], float], Awaitable[str | None]]  # the first of some nodes not answering /healthz
    slow_cap: float = 4.0  # a deadline moves on at most to this many times its length
    nursery: trio.Nursery | None = None  # where `patient`'s watchers run; None: no probes, the bare deadline
    extended: int = 0  # deadlines extended because every node waited on answered its probe

    def _extended(self) -> None:
        self.extended += 1

    @contextlib.contextmanager
    def patient(self, nodes: list[str], deadline_s: float) -> Iterator[Wait]:
        """A cancel scope for a wait on `nodes` that ends at `deadline_s` unless they all answer /healthz.

        A watcher (in the gateway's nursery, so the caller's exceptions stay its own) probes the nodes
        shortly before the deadline. The caller checks `wait.scope.cancelled_caught` and raises
        `wait.failed(...)`.
        """
        now = trio.current_time()
        wait = Wait(trio.CancelScope(deadline=now + deadline_s), now, now + deadline_s * max(1.0, self.slow_cap))
        watcher = trio.CancelScope()
        if self.nursery is not None and wait.cap > wait.scope.deadline:
            self.nursery.start_soon(keep_waiting, wait, list(nodes), deadline_s, watcher, self.silent,
                                    self._extended)
        try:
            with wait.scope:
                yield wait
        finally:
            watcher.cancel()

    async def until_answer(self, take: Callable[[], Awaitable[T]], nodes: list[str], last: str, deadline_s: float,
                           what: str, **details) -> T:
        """`await take()` within `deadline_s`, extended while every one of `nodes` answers its probe.

        Raises:
            PeerError(ROUTE_NODE_LOST): a node was silent (or, with no probe asked, `last`, the node the
                answer comes from); PeerError(SESSION_TIMEOUT): still no answer at the cap.
        """
        start = trio.current_time()
        until, cap = start + deadline_s, start + deadline_s * max(1.0, self.slow_cap)
        probed = False
        while True:
            final = until >= cap
            with trio.move_on_at(until if final else until - lead(deadline_s)):
                return await take()
            wait = Wait(trio.CancelScope(), start, cap)
            if final:  # still alive when last asked (or never asked: no patience configured)
                wait.silent = None if probed else last
            else:
                wait.silent = await self.silent(nodes, lead(deadline_s))
                probed = True
                if wait.silent is None:
                    until = min(cap, until + deadline_s)
                    self._extended()
                    continue
            raise wait.failed(what, last, route=True, **details)
