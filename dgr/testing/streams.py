"""A fake of a node's pooled connections, for relays tested in process (dgr.node.relay).

`FakePool` stands where `ConnectionPool` does: its streams hand every record written to them to
`on_send` and answer 200 once ended; its requests (a relay's failure reports) go to `on_request`.
No socket is opened, so a test sees exactly what a relay wrote, and in which order.
"""

from __future__ import annotations

from typing import Callable

import attrs
import trio

from dgr.seam.transport import HttpResponse

__all__ = ["FakeStream", "FakePool"]


def _ignore(*_args) -> None:
    return None


@attrs.define(eq=False)
class FakeStream:
    """An OutStream: what is sent goes to `on_send`; it answers 200 once ended."""

    on_send: Callable[[bytes], None] = _ignore
    ended: trio.Event = attrs.field(factory=trio.Event)

    async def send(self, data: bytes) -> None:
        self.on_send(data)

    async def answer(self) -> HttpResponse:
        await self.ended.wait()
        return HttpResponse(200, {}, b"")

    async def end(self) -> None:
        self.ended.set()

    async def release(self) -> None:
        pass


@attrs.define(eq=False)
class FakePool:
    """A ConnectionPool: streams are FakeStreams on `on_send`; a request goes to `on_request(target, body)`."""

    on_send: Callable[[bytes], None] = _ignore
    on_request: Callable[[str, bytes], None] = _ignore
    opened: list[str] = attrs.field(factory=list)  # the targets of the streams opened, in order

    async def open_stream(self, target: str, headers) -> FakeStream:
        self.opened.append(target)
        return FakeStream(self.on_send)

    async def request(self, method: str, target: str, body: bytes, headers) -> HttpResponse:
        self.on_request(target, body)
        return HttpResponse(200, {}, b"{}")

    async def aclose(self) -> None:
        pass
