"""The session table: the one place that says whether a session may open, and which session an id names.

Rules:
- An open is refused, in this order, when its id is held or was held and is remembered
  (`SESSION_EXISTS`), when it asks for no positions or more than a session may hold here
  (`CONTEXT_LENGTH_EXCEEDED`), or when the table is full (`NODE_AT_CAPACITY`, with a retry hint):
  an open that can never be served is told so before one that may be served later is told to retry.
  The check is complete before anything is added, so a refused open changes nothing.
- "Full" counts what holds a slot: the live sessions, or the `in_use` the owner names where something
  else holds slots too (a backend's kept prefixes).
- A step is refused when it would leave a session holding more positions than its open asked for
  (`check_fits`: `CONTEXT_LENGTH_EXCEEDED`).
- A lookup of an id that is not live is refused as `SESSION_ENDED` when the id is remembered as ended
  (with the reason it failed, if it did), else `UNKNOWN_SESSION`.
- Ending a session remembers its id (up to `remember` ids, oldest forgotten first) but leaves it
  live until its owner pops it: a node frees a session's slot only once its queued work has run, and
  until then it still counts against capacity.

Used by the node (dgr.node.sessions: Node Sessions, ended ids remembered) and by each backend (its
per-session KV, nothing remembered). It sits below both, so neither imports the other. It holds no
I/O and no clock.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

import attrs

from dgr.errors import CallerError, Failure, Reason

__all__ = ["SessionTable"]

T = TypeVar("T")


@attrs.define
class SessionTable(Generic[T]):
    """Live sessions by id (`live`), ids ended (`ended`, id -> its failure or None), and the limits an open meets."""

    owner: str  # named in refusals: "n0", "this shard"
    capacity: int  # slots: sessions (and whatever else `in_use` counts) this table may hold
    max_positions: int  # KV positions one session may hold
    remember: int = 0  # ended ids remembered; 0: none (an id is unknown once popped)
    live: dict[str, T] = attrs.field(factory=dict)
    limits: dict[str, int] = attrs.field(factory=dict)  # sid -> the positions its open asked for
    ended: collections.OrderedDict[str, Failure | None] = attrs.field(factory=collections.OrderedDict)
    opened: int = 0  # sessions ever held: what a node has served, whichever routes went elsewhere

    def check_open(self, sid: str, positions: int, *, in_use: int | None = None) -> None:
        """Refuse an open of `sid` for `positions` positions, or return; changes nothing.

        Raises:
            CallerError(SESSION_EXISTS | CONTEXT_LENGTH_EXCEEDED | NODE_AT_CAPACITY).
        """
        if sid in self.live or sid in self.ended:
            raise CallerError(Reason.SESSION_EXISTS, f"session {sid} exists or existed on {self.owner}")
        if not 1 <= positions <= self.max_positions:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED,
                              f"{positions} positions requested, {self.owner} holds {self.max_positions} per session")
        self.check_room(in_use)

    def check_room(self, in_use: int | None = None) -> None:
        """Refuse when every slot is held: by the live sessions, or `in_use` where the owner counts more.

        Raises:
            CallerError(NODE_AT_CAPACITY): with a retry hint; a slot frees when a session ends.
        """
        held = len(self.live) if in_use is None else in_use
        if held >= self.capacity:
            raise CallerError(Reason.NODE_AT_CAPACITY, f"{self.owner} holds {held} of {self.capacity} sessions",
                              retry_after=1)

    def open(self, sid: str, positions: int, value: T, *, in_use: int | None = None) -> T:
        """Check an open (`check_open`), then hold `value` for `sid` (`add`).

        Raises:
            CallerError(SESSION_EXISTS | CONTEXT_LENGTH_EXCEEDED | NODE_AT_CAPACITY): nothing added.
        """
        self.check_open(sid, positions, in_use=in_use)
        return self.add(sid, positions, value)

    def add(self, sid: str, positions: int, value: T) -> T:
        """Hold `value` for `sid`, allowed `positions` positions: after `check_open`, where the value
        (a slot) can only be had once the open is known to be allowed."""
        self.live[sid] = value
        self.limits[sid] = positions
        self.opened += 1
        return value

    def check_fits(self, sid: str, positions: int) -> None:
        """Refuse a step that would leave `sid` holding more than the positions its open asked for.

        Raises:
            CallerError(CONTEXT_LENGTH_EXCEEDED).
        """
        limit = self.limits.get(sid, self.max_positions)
        if positions > limit:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"session {sid}: {positions} positions exceed {limit}")

    def get(self, sid: str) -> T:
        """The live session `sid`.

        Raises:
            CallerError(SESSION_ENDED): it ended here (and is remembered). CallerError(UNKNOWN_SESSION): no such session.
        """
        if sid in self.ended:
            failure = self.ended[sid]
            why = f" ({failure.reason.value})" if failure else ""
            raise CallerError(Reason.SESSION_ENDED, f"session {sid} has ended on {self.owner}{why}")
        value = self.live.get(sid)
        if value is None:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no session {sid} on {self.owner}")
        return value

    def is_live(self, sid: str) -> bool:
        """Held and not ended."""
        return sid in self.live and sid not in self.ended

    def end(self, sid: str, failure: Failure | None) -> None:
        """Remember `sid` as ended (with its failure, if it failed); it stays held until `pop`."""
        if self.remember <= 0:
            return
        self.ended[sid] = failure
        while len(self.ended) > self.remember:
            self.ended.popitem(last=False)

    def pop(self, sid: str) -> T | None:
        """Free `sid`'s slot; its value, or None where it held none."""
        self.limits.pop(sid, None)
        return self.live.pop(sid, None)

    def rename(self, sid: str, new: str) -> None:
        """`sid`'s value and limit held under `new` from now on (a repair moves a session onto a fresh id).

        Raises:
            CallerError(SESSION_EXISTS): `new` is held or remembered. As `get`: `sid` is not live.
        """
        value = self.get(sid)
        if new in self.live or new in self.ended:
            raise CallerError(Reason.SESSION_EXISTS, f"session {new} exists or existed on {self.owner}")
        self.live[new], self.limits[new] = value, self.limits.pop(sid, self.max_positions)
        del self.live[sid]

    def clear(self) -> None:
        """Hold nothing (the owner is closing); ended ids stay remembered."""
        self.live.clear()
        self.limits.clear()

    def __contains__(self, sid: object) -> bool:
        return sid in self.live

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self) -> Iterator[str]:
        return iter(self.live)
