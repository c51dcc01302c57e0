"""Fan-out of Generation Telemetry snapshots to any number of watchers.

Each watcher gets a memory channel that starts with the latest snapshot. A
watcher that falls behind by a whole buffer loses intermediate snapshots
rather than slowing the route; the channel closes when the session ends.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

__all__ = ["Broadcast"]

_BUFFER = 256


@attrs.define
class Broadcast:
    latest: dict[str, Any] | None = None
    closed: bool = False
    _subs: list[trio.MemorySendChannel] = attrs.field(factory=list)

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.latest = snapshot
        for ch in list(self._subs):
            try:
                ch.send_nowait(snapshot)
            except trio.WouldBlock:
                pass  # a slow watcher skips a snapshot; the next carries the current state
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subs.remove(ch)

    def close(self) -> None:
        self.closed = True
        for ch in self._subs:
            ch.close()
        self._subs.clear()

    def subscribe(self) -> trio.MemoryReceiveChannel:
        send, recv = trio.open_memory_channel(_BUFFER)
        if self.latest is not None:
            send.send_nowait(self.latest)
        if self.closed:
            send.close()
        else:
            self._subs.append(send)
        return recv
