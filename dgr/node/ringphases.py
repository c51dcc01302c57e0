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

__all__ = ["RingPhases"]


@attrs.define(eq=False)
class RingPhases:
    send: Callable[[str, bytes], None]  # (sid, step): to the session's loop relay
    boards: dict[str, RoutePhases] = attrs.field(factory=dict)  # route -> its board
    route_of: dict[str, str] = attrs.field(factory=dict)  # sid -> route
    held: dict[str, bytes] = attrs.field(factory=dict)  # sid -> its step, waiting for its group
    _wake: dict[str, trio.Event] = attrs.field(factory=dict)  # sid -> what ends its hold early
    _last: dict[str, float] = attrs.field(factory=dict)  # sid -> when its last step went out (trio clock)
    released: int = 0  # steps sent with their group
    alone: int = 0  # steps sent alone, after their hold

    def join(self, sid: str, route: str, nodes: int, lane: int | None) -> None:
        board = self.boards.get(route)
        if board is None:
            board = self.boards[route] = RoutePhases(max(1, nodes))
        if lane is None or lane in board.lanes.values():
            board.join(sid)
        else:
            board.lanes[sid] = lane
        self.route_of[sid] = route

    def go(self, sid: str, step: bytes, nursery: trio.Nursery) -> None:
        """`sid`'s next step is ready: sent now with its group, or held (a bounded wait in `nursery`)."""
        board = self.boards.get(self.route_of.get(sid, ""))
        if board is None:
            self.send(sid, step)
            return
        now = trio.current_time()
        last = self._last.get(sid)
        self.held[sid] = step
        out = board.arrive(sid)
        if sid in out:
            self._release(out)
            return
        self._wake[sid] = trio.Event()
        nursery.start_soon(self._hold, sid, hold_for(now, last))

    def stop(self, sid: str) -> None:
        """`sid` sends no more steps (its last token): its group may go without it."""
        board = self.boards.get(self.route_of.get(sid, ""))
        if board is not None:
            self._release(board.stop(sid))

    def leave(self, sid: str) -> None:
        """`sid` ended here: its lane is free, a step it held is dropped."""
        route = self.route_of.pop(sid, None)
        self.held.pop(sid, None)
        self._last.pop(sid, None)
        wake = self._wake.pop(sid, None)
        if wake is not None:
            wake.set()
        board = self.boards.get(route) if route is not None else None
        if board is None:
            return
        self._release(board.leave(sid))
        if not board.lanes:
            del self.boards[route]

    def _release(self, sids: list[str]) -> None:
        for s in sids:
            step = self.held.pop(s, None)
            wake = self._wake.pop(s, None)
            if wake is not None:
                wake.set()
            if step is not None:
                self.released += 1
                self._out(s, step)

    async def _hold(self, sid: str, hold_s: float) -> None:
        wake = self._wake.get(sid)
        if wake is None:
            return
        with trio.move_on_after(hold_s):
            await wake.wait()
        if self._wake.get(sid) is not wake:
            return  # released with its group, or ended
        del self._wake[sid]
        board = self.boards.get(self.route_of.get(sid, ""))
        if board is not None:
            board.withdraw(sid)
        step = self.held.pop(sid, None)
        if step is not None:
            self.alone += 1
            self._out(sid, step)

    def _out(self, sid: str, step: bytes) -> None:
        """Send a held step, noting when it went: its session's next hold counts from here."""
        if sid in self.route_of:
            self._last[sid] = trio.current_time()
        self.send(sid, step)
