"""A ring tail's phase groups: its decode steps go back to the head in groups of consecutive lanes.

Why: on a chain the gateway holds each session's next decode step until every
decoding session of its phase group has its token (dgr.fsm.phases), so a
group reaches every node as one pass over consecutive sequence ids. On a ring
the steps never pass the gateway: the tail sends them to the head. Without a
hold, 8 sessions on a 2-node SmolLM2 ring decoded at 0.924x the chain's rate
(paired rounds, 0.79x to 1.01x); with it, at 0.977x (0.91x to 1.14x). So the
tail holds them instead, by the same rules and the same pure board
(`RoutePhases`, from the tracker's module: it is pure and shared), keyed by
the route the gateway names in the session's relay plan; lanes are the ones the
gateway gave at open.

Rules:
- A session's step waits until its group is complete, or at most `hold_for`
  its round trip since its last step went out, after which it goes alone (it
  only costs speed); a later step waits again.
- A session that sends no next step (its last token, end of generation), or
  that ends here, stops counting for its group, which may then go.
- Steps go out through `send`, in the order they are released.

Left out: what a step is (dgr.node.replies builds it), sending (dgr.node.relay).
"""

from __future__ import annotations

from typing import Callable

import attrs
import trio

from dgr.fsm.phases import RoutePhases, hold_for

__all__ = ["Hold", "RingPhases"]


@attrs.define(eq=False)
class Hold:
    """One session's place in its phase groups: on its node session record (dgr.node.sessions), not in a
    table of the ring's keyed by session, so it goes when the session does."""

    route: str | None = None  # its route's board; None: it holds nothing back (not a ring's tail)
    step: bytes | None = None  # its next step, waiting for its group
    wake: trio.Event | None = None  # what ends its hold early
    last: float | None = None  # when its last step went out (trio clock)


@attrs.define(eq=False)
class RingPhases:
    send: Callable[[str, bytes], None]  # (sid, step): to the session's loop relay
    boards: dict[str, RoutePhases] = attrs.field(factory=dict)  # route -> its board
    # route -> its board's sessions' holds (each on its session's record): a released group's steps
    members: dict[str, dict[str, Hold]] = attrs.field(factory=dict)
    released: int = 0  # steps sent with their group
    alone: int = 0  # steps sent alone, after their hold

    def join(self, sid: str, hold: Hold, route: str, nodes: int, lane: int | None) -> None:
        board = self.boards.get(route)
        if board is None:
            board = self.boards[route] = RoutePhases(max(1, nodes))
            self.members[route] = {}
        if lane is None or lane in board.lanes.values():
            board.join(sid)
        else:
            board.lanes[sid] = lane
        self.members[route][sid] = hold
        hold.route = route

    def go(self, sid: str, hold: Hold, step: bytes, nursery: trio.Nursery) -> None:
        """`sid`'s next step is ready: sent now with its group, or held (a bounded wait in `nursery`)."""
        board = self.boards.get(hold.route) if hold.route is not None else None
        if board is None:
            self.send(sid, step)
            return
        now = trio.current_time()
        last = hold.last
        hold.step = step
        out = board.arrive(sid)
        if sid in out:
            self._release(hold.route, out)
            return
        wake = hold.wake = trio.Event()
        nursery.start_soon(self._hold, sid, hold, wake, hold_for(now, last))

    def stop(self, sid: str, hold: Hold) -> None:
        """`sid` sends no more steps (its last token): its group may go without it."""
        board = self.boards.get(hold.route) if hold.route is not None else None
        if board is not None:
            self._release(hold.route, board.stop(sid))

    def leave(self, sid: str, hold: Hold) -> None:
        """`sid` ended here: its lane is free, a step it held is dropped."""
        route, hold.route, hold.step, hold.last = hold.route, None, None, None
        wake, hold.wake = hold.wake, None
        if wake is not None:
            wake.set()
        board = self.boards.get(route) if route is not None else None
        if board is None:
            return
        self.members[route].pop(sid, None)
        self._release(route, board.leave(sid))
        if not board.lanes:
            del self.boards[route], self.members[route]

    def _release(self, route: str, sids: list[str]) -> None:
        members = self.members[route]
        for s in sids:
            hold = members.get(s)
            if hold is None:
                continue
            step, hold.step = hold.step, None
            wake, hold.wake = hold.wake, None
            if wake is not None:
                wake.set()
            if step is not None:
                self.released += 1
                self._out(s, hold, step)

    async def _hold(self, sid: str, hold: Hold, wake: trio.Event, hold_s: float) -> None:
        with trio.move_on_after(hold_s):
            await wake.wait()
        if hold.wake is not wake:
            return  # released with its group, or ended
        hold.wake = None
        board = self.boards.get(hold.route) if hold.route is not None else None
        if board is not None:
            board.withdraw(sid)
        step, hold.step = hold.step, None
        if step is not None:
            self.alone += 1
            self._out(sid, hold, step)

    def _out(self, sid: str, hold: Hold, step: bytes) -> None:
        """Send a held step, noting when it went: its session's next hold counts from here."""
        if hold.route is not None:
            hold.last = trio.current_time()
        self.send(sid, step)
