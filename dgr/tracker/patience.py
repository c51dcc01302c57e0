"""Slow is not dead, and slow is blamed: waits on nodes whose deadline their liveness extends, within one budget.

A step's deadline comes: is its node dead, or only busy (other sessions'
long prompts, another process on its cores)? Shortly before the deadline the
gateway asks the nodes it waits on for `/healthz`, which a node answers on
its event loop, never behind compute (`lead`: how long before). A silent one
ends the wait at once: `route_node_lost` naming it. While every one answers,
the deadline moves on by its own length, drawn from a budget:

- A Route Session has one budget of extensions (`Allowance`), not one per
  step: (slow_cap - 1) times one decode step's deadline on its route, in
  all. Before, every step could wait `slow_cap` times its deadline, so a
  member could take 80 s a token on 2 nodes at the defaults, for as long as
  `--max-session-s`. A wait that is not a session's (an open) still has its
  own cap, `slow_cap` times its deadline.
- The probe proves progress: on a ring's answer the gateway asks each node
  about the session (dgr.tracker.clients `probe`), and each answers, naming
  itself, the last step it took and computed and its scheduler's iteration.
  A step still missing at its deadline counts against the hop holding it
  (dgr.tracker.blame `locate`): a strike to the node (dgr.tracker.registry),
  once per session, that costs it sessions, routing weight and, repeated, a
  ban. A node that answers /healthz but makes no progress on the session is
  the one blamed.
- A wait that runs out of budget fails `session_timeout` naming the hop
  holding the step (`Wait.failed`): too slow, not lost.

`Patience` holds the waits: `patient` for one call (a watcher task probes
and moves the deadline), `until_answer` inline on a ring's every-token path
(no task: the wait is cut and taken up again). The probes themselves are the
caller's (dgr.tracker.clients `NodeClients.probe`).
"""

from __future__ import annotations

import contextlib
from typing import Awaitable, Callable, Iterator, TypeVar

import attrs
import trio

from dgr.errors import PeerError, Reason
from dgr.tracker.blame import Progress, locate

__all__ = ["PROBE_S", "Allowance", "Wait", "Patience", "Probe", "lead"]

T = TypeVar("T")

PROBE_S = 2.0  # how long a node has to answer the tracker's own /healthz

# (nodes, within seconds, session or None, node id -> the session's capability there) -> the nodes that
# answered, each with its progress on the session (dgr.tracker.clients `NodeClients.probe`)
Probe = Callable[[list[str], float, "str | None", dict[str, str]], Awaitable[dict[str, Progress]]]


def lead(deadline_s: float) -> float:
    """How long before a deadline its nodes are asked whether they live: the probe's own bound."""
    return min(PROBE_S, deadline_s / 2)


@attrs.define(eq=False)
class Allowance:
    """One Route Session's patience: its one budget of deadline extensions, and the nodes it has blamed."""

    left_s: float  # extension seconds left, for the whole session
    sid: str | None = None  # what the probes ask each node's progress on
    caps: dict[str, str] = attrs.field(factory=dict)  # node id -> the session's capability there
    blamed: list[str] = attrs.field(factory=list)  # nodes struck for this session, in order (once each)


@attrs.define(eq=False)
class Wait:
    """A wait on some nodes with a deadline that their liveness extends."""

    scope: trio.CancelScope
    start: float
    cap: float  # the latest the deadline may move to without an allowance
    silent: str | None = None  # the node that did not answer its probe, once one did not
    allowance: Allowance | None = None  # the session's budget the extensions draw on, where it has one
    granted: tuple[float, float] | None = None  # (the deadline it moved from, seconds drawn) until that passes

    def grant(self, deadline_s: float) -> float:
        """Seconds the deadline may move on by now: one more length, within the allowance or the cap."""
        if self.allowance is None:
            return max(0.0, min(deadline_s, self.cap - self.scope.deadline))
        g = max(0.0, min(deadline_s, self.allowance.left_s))
        self.allowance.left_s -= g
        self.granted = (self.scope.deadline, g)
        return g

    def refund(self) -> None:
        """Give back an extension whose deadline the wait never reached: it ended in time."""
        if self.granted is not None and self.allowance is not None and trio.current_time() < self.granted[0]:
            self.allowance.left_s += self.granted[1]
        self.granted = None

    def failed(self, what: str, node: str | None, *, route: bool = False, seen: Progress | None = None,
               **details) -> PeerError:
        """The error for a wait that ended without its answer: `route_node_lost` naming the silent node, or,
        when every node still answered at the cap, `session_timeout` naming `node`, the one holding it (`seen`:
        its last probe's answer)."""
        waited = trio.current_time() - self.start
        who = "the route" if route else f"node {node}"
        out_of_time = self.scope.deadline >= self.cap or (self.allowance is not None and self.allowance.left_s <= 0)
        if self.silent is None and not out_of_time:
            self.silent = node  # the deadline came before its probe's answer (or with no watcher to ask)
        if self.silent is not None:
            return PeerError(Reason.ROUTE_NODE_LOST, f"{who} {what} within {waited:.1f}s, and node {self.silent} "
                                                     "did not answer its liveness probe", node=self.silent, **details)
        held = f": node {node} held it" if node is not None else ""
        if seen is not None and seen.iteration is not None:
            held += (f" (it took step {seen.taken}, computed step {seen.done}, its scheduler at iteration "
                     f"{seen.iteration})")
        return PeerError(Reason.SESSION_TIMEOUT, f"{who} {what} within {waited:.1f}s, though its nodes answer "
                                                 f"their liveness probes{held}: too slow, not lost", node=node,
                         **details)


@attrs.define
class Patience:
    """The gateway's waits on nodes: their deadlines, extended while the nodes answer their probes."""

    probe: Probe
    slow_cap: float = 4.0  # a wait's extensions add up to at most (slow_cap - 1) times its deadline
    nursery: trio.Nursery | None = None  # where `patient`'s watchers run; None: no probes, the bare deadline
    strike: Callable[[str], object] = lambda node: None  # a late step blamed on a node (the registry's)
    extended: int = 0  # deadlines extended because every node waited on answered its probe
    blamed: int = 0  # strikes given

    def allowance(self, sid: str, deadline_s: float, caps: dict[str, str]) -> Allowance:
        """A session's one budget: (slow_cap - 1) times `deadline_s`, one decode step's deadline on its route."""
        return Allowance(deadline_s * max(0.0, self.slow_cap - 1), sid, caps)

    async def silent(self, nodes: list[str], within_s: float) -> str | None:
        """The first of `nodes` that does not answer its probe within `within_s`; None if all do."""
        answered = await self.probe(nodes, within_s, None, {})
        return next((n for n in nodes if n not in answered), None)

    def blame(self, allowance: Allowance | None, suspects: tuple[str, ...] | list[str]) -> None:
        """Strike each suspect of a late step, once per session (without an allowance: every time)."""
        for node in suspects:
            if allowance is not None:
                if node in allowance.blamed:
                    continue
                allowance.blamed.append(node)
            self.blamed += 1
            self.strike(node)

    async def _keep_waiting(self, wait: Wait, nodes: list[str], deadline_s: float, watcher: trio.CancelScope) -> None:
        """Watch `wait` (in the gateway's nursery, so its caller's exceptions stay its own) until `watcher` is
        cancelled: probe `nodes` shortly before each deadline, extend it while they all answer (and the budget
        lasts), cut it at once when one does not."""
        with watcher:
            ahead = lead(deadline_s)
            while True:
                await trio.sleep_until(wait.scope.deadline - ahead)
                wait.silent = await self.silent(nodes, ahead)
                if wait.silent is not None:
                    wait.scope.cancel()  # dead: nothing to wait for
                    return
                due, grant = wait.scope.deadline, wait.grant(deadline_s)
                if grant <= 0:
                    return
                wait.scope.deadline += grant
                self.extended += 1
                await trio.sleep_until(due)  # still waiting past it (else this watcher is cancelled)
                wait.granted = None  # spent

    @contextlib.contextmanager
    def patient(self, nodes: list[str], deadline_s: float, allowance: Allowance | None = None) -> Iterator[Wait]:
        """A cancel scope for a wait on `nodes` that ends at `deadline_s` unless they all answer /healthz.

        A watcher (in the gateway's nursery, so the caller's exceptions stay its own) probes the nodes
        shortly before the deadline. With `allowance` the extensions draw on that session's budget (given
        back when the wait ends before the deadline they moved), and a wait past its deadline blames `nodes`.
        The caller checks `wait.scope.cancelled_caught` and raises `wait.failed(...)`.
        """
        now = trio.current_time()
        wait = Wait(trio.CancelScope(deadline=now + deadline_s), now, now + deadline_s * max(1.0, self.slow_cap),
                    allowance=allowance)
        watcher = trio.CancelScope()
        # a session's wait is watched even with its budget spent: a silent node is still told from a slow one
        if self.nursery is not None and (allowance is not None or wait.cap > wait.scope.deadline):
            self.nursery.start_soon(self._keep_waiting, wait, list(nodes), deadline_s, watcher)
        try:
            with wait.scope:
                yield wait
        finally:
            watcher.cancel()
            wait.refund()
            if allowance is not None and wait.silent is None and trio.current_time() >= now + deadline_s:
                self.blame(allowance, nodes)  # it ran past its deadline: the nodes it waited on took it

    async def until_answer(self, take: Callable[[], Awaitable[T]], nodes: list[str], last: str, deadline_s: float,
                           what: str, *, allowance: Allowance | None = None, seq: int = 0, from_gateway: bool = False,
                           **details) -> T:
        """`await take()`, the answer to step `seq` of a session on the route `nodes`, within `deadline_s`,
        extended while every node answers its probe, from `allowance` (else up to slow_cap times it).

        Shortly before each deadline every node is asked for its progress on the session; if the deadline
        then passes, the hop holding the step is blamed (`Patience.blame`, dgr.tracker.blame `locate`;
        `from_gateway`: the head takes this step from the gateway, not from the ring's tail).

        Raises:
            PeerError(ROUTE_NODE_LOST): a node was silent (or, with no probe asked, `last`, the node the
                answer comes from); PeerError(SESSION_TIMEOUT): still no answer once the budget is spent,
                naming the hop that held the step.
        """
        start = trio.current_time()
        until, granted = start + deadline_s, 0.0  # until: from start and the sum granted, not summed onto itself
        left = [deadline_s * max(0.0, self.slow_cap - 1)] if allowance is None else None
        sid, caps = (allowance.sid, allowance.caps) if allowance is not None else (None, {})
        ahead = lead(deadline_s)
        while True:
            with trio.move_on_at(until - ahead):
                return await take()
            answers = await self.probe(nodes, ahead, sid, caps)
            wait = Wait(trio.CancelScope(), start, until, allowance=allowance)
            wait.silent = next((n for n in nodes if n not in answers), None)
            if wait.silent is not None:
                raise wait.failed(what, last, route=True, **details)
            suspects = locate(nodes, answers, seq, from_gateway=from_gateway) if sid is not None else (last,)
            with trio.move_on_at(until):
                return await take()
            # past its deadline: the step counts against the hop that holds it
            self.blame(allowance, suspects)
            if allowance is not None:
                grant = max(0.0, min(deadline_s, allowance.left_s))
                allowance.left_s -= grant
            else:
                grant = max(0.0, min(deadline_s, left[0]))
                left[0] -= grant
            if grant <= 0:
                raise wait.failed(what, suspects[0], route=True, seen=answers.get(suspects[0]), **details)
            granted += grant
            until = start + (deadline_s + granted)
            self.extended += 1
