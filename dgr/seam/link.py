"""One outgoing link: a session's records to its next hop, in order, on one streamed request.

Every sender on a route uses it: a node's relay (to the next node, from a
ring's tail to its head, from the tail to the tracker) and the gateway (the
prompt's chunks to the head).

Rules:
- The stream opens with the first record (dgr.seam.stream), and each record
  is one write. The other end answers only once the stream has ended, or to
  refuse a record (then it hangs up).
- A watcher reads that answer while the sender writes. Before the sender ends
  the stream on purpose, an answer is a refusal (or an early end) and a broken
  connection is a loss: either is the link's `early` end, told once to
  `on_early`.
- A refusal beats a loss: a write that breaks waits up to `REFUSAL_GRACE_S`
  for an answer the other end may have sent just before it hung up, so the
  sender reports what the other end said rather than that it vanished.
- Ending writes the body's end and waits up to `END_GRACE_S` for the answer
  (the other end answers once it has read every record), then gives the
  connection back to its pool.
- Nothing is retried: a record is a step the other end may have applied.

Left out: what a record holds (dgr.seam.stream) and what an early end means to
the session (the relay reports it, the gateway fails the Route Session).
"""

from __future__ import annotations

from typing import Awaitable, Callable

import attrs
import trio

from dgr.seam.transport import HttpResponse, OutStream, TransportError

__all__ = ["Link", "LinkEnd", "LinkBroken", "END_GRACE_S", "REFUSAL_GRACE_S"]

END_GRACE_S = 2.0  # how long an ending stream waits for the other end's answer
REFUSAL_GRACE_S = 0.5  # how long a broken write waits for a refusal that may have come just before


@attrs.frozen
class LinkEnd:
    """How a link ended before its sender ended it: the other end answered, or the connection broke."""

    answer: HttpResponse | None = None
    lost: TransportError | None = None


class LinkBroken(Exception):
    """A write failed; `end` says why (a refusal when one came in time, else the loss)."""

    def __init__(self, end: LinkEnd) -> None:
        super().__init__(end)
        self.end = end


@attrs.define(eq=False)
class Link:
    opener: Callable[[], Awaitable[OutStream]]  # opens the stream (its target and headers are the caller's)
    nursery: trio.Nursery  # where the watcher runs; it outlives no send
    on_early: Callable[[LinkEnd], None] | None = None
    early: LinkEnd | None = None  # set once, when the link ended before `end`
    _stream: OutStream | None = None
    _ending: bool = False
    _answered: trio.Event = attrs.field(factory=trio.Event)

    @property
    def opened(self) -> bool:
        return self._stream is not None

    async def send(self, record: bytes) -> None:
        """One record, opening the stream first if needed.

        Raises:
            LinkBroken: the link is already over, or this write broke it.
        """
        if self.early is not None:
            raise LinkBroken(self.early)
        try:
            if self._stream is None:
                self._stream = await self.opener()
                self.nursery.start_soon(self._watch, self._stream)
            await self._stream.send(record)
        except TransportError as exc:
            with trio.move_on_after(REFUSAL_GRACE_S):
                await self._answered.wait()
            if self.early is not None and self.early.answer is not None:
                raise LinkBroken(self.early) from None
            raise LinkBroken(LinkEnd(lost=exc)) from None

    async def _watch(self, stream: OutStream) -> None:
        try:
            end = LinkEnd(answer=await stream.answer())
        except TransportError as exc:
            end = LinkEnd(lost=exc)
        self._answered.set()
        if self._ending and (end.answer is None or end.answer.status == 200):
            return  # the answer to our end (or a drop after it): only a refusal still counts
        self.early = end
        if self.on_early is not None:
            self.on_early(end)

    async def end(self) -> None:
        """End the stream, wait for its answer (at most END_GRACE_S), and give its connection back."""
        stream, self._stream = self._stream, None
        self._ending = True
        if stream is None:
            return
        try:
            if self.early is None:
                with trio.move_on_after(END_GRACE_S):
                    try:
                        await stream.end()
                        await self._answered.wait()
                    except TransportError:
                        pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.release()

    async def drop(self) -> None:
        """Give the connection up without ending the stream (the other end sees it cut): for a sender that
        stops on a failure, or is cancelled."""
        stream, self._stream = self._stream, None
        self._ending = True
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.release()
