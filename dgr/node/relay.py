"""A node's relays on a ring: what it computed, sent on in order.

The gateway sends a session's prompt chunks to the head. Every node computes
each step and hands its result to the session's relay, which sends it on: to
the next node as that node's input frame, or, from the tail, to the gateway
as the answer (a TOKEN frame, or an ACK for a prefill chunk). The tail has a
second relay (`Loop`): each next decode step goes from it straight to the
head, so the gateway is off the path between tokens (N one-way messages a
token on N nodes). On a ring of one node the tail is the head, and its loop
(`SelfLoop`) admits each next step here, with no socket.

Rules:
- One relay task per session and link keeps the session's frames in order (a
  node's step FSM refuses a frame out of order, so order is a correctness
  matter).
- The frames go on one outgoing link (dgr.seam.link): records of one streamed
  request, opened with the first frame and ended when the session ends here.
- Each hop appends its compute to the record's hop times (dgr.seam.stream), so
  the gateway learns every hop's compute with the answer.
- A link that ends early is reported to the gateway (`Report`): a next node
  whose connection drops while the session lives is `route_node_lost` naming
  it (a killed process's socket closes at once, so this needs no step in
  flight); a refusal is `node_error` naming the node that refused. The relay
  then stops; the gateway fails the Route Session and closes it everywhere,
  which ends the relay.
- Nothing is retried: a seam step is not idempotent.

Left out: computing (dgr.node.service submits to the scheduler) and how the
gateway correlates answers (dgr.tracker.ring).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Callable

import attrs
import trio

from dgr.errors import DgrError, Failure, Reason, parse_error_body
from dgr.node import steptrace
from dgr.seam.link import Link, LinkBroken, LinkEnd
from dgr.seam.opening import Loop, NextHop  # an open's relay names them (dgr.seam.opening.RelayOrder)
from dgr.seam.stream import Record, encode_record
from dgr.seam.transport import ConnectionPool, OutStream, TransportError
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, DELIVER_STREAM_PATH, ROUTE_SESSION_HEADER,
                           STREAM_PATH)

__all__ = ["NextHop", "Loop", "RelayPlan", "Relay", "SelfLoop", "Outgoing", "Report"]

log = logging.getLogger("dgr.node")

REPORT_TRY_S = 5.0  # one try of a failure report to the gateway
REPORT_S = 30.0  # all the tries of one report: well within a step's capped deadline (80 s at the defaults)



@attrs.frozen
class RelayPlan:
    """Where a ring session's results go: the next node (None on the tail) and the gateway."""

    next: NextHop | None
    deliver_url: str  # the tracker's DELIVER_PATH
    deliver_capability: str | None  # what it answers the tracker with: DELIVER on the tail, REPORT elsewhere
    loop: Loop | None = None  # the tail of a ring only
    # the route's nodes, as the gateway names them, and how many: a node batches the decode steps of
    # one phase group of the route at a time (dgr.node.service), and a ring's tail holds each step for
    # its group (dgr.node.links); "" and 1: no groups
    route: str = ""
    nodes: int = 1


@attrs.frozen(eq=False)
class Outgoing:
    """One computed step, ready to send on: the next hop's input frame, or the tail's answer."""

    frame: bytes
    compute_us: tuple[int, ...]  # each hop's compute for this step so far, this node's last


@attrs.frozen
class Report:
    """A failure to tell the gateway about."""

    failure: Failure


@attrs.define(eq=False)
class Relay:
    sid: str
    node_id: str
    plan: RelayPlan
    pool: Callable[..., ConnectionPool]  # (url[, pinned cert]) -> the node's pooled connections to it
    # Let every task woken with an item run before the item is sent. A ring tail's next step and its
    # answer to the gateway are woken together, in either order (trio's), and the answer's send wakes a
    # tracker that sleeps: sent first, it held up the step the head waits on.
    defer: bool = False
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _recv: trio.MemoryReceiveChannel = attrs.field(init=False)
    _failure: Failure | None = None  # what to report to the gateway once the relay stops

    def __attrs_post_init__(self) -> None:
        # Unbounded: each item is a step the session's FSM already accepted and computed; dropping
        # one would break the session's order. A session has at most its prompt's chunks in flight.
        self._send, self._recv = trio.open_memory_channel(math.inf)

    def put(self, item: Outgoing | Report) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the session has ended here: nothing more goes out for it

    def close(self) -> None:
        self._send.close()

    async def run(self) -> None:
        """Send every item in order, on one link, until the session closes the relay or the link ends."""
        role = "answer" if self.plan.next is None else "on"  # its name in step traces
        link: Link | None = None
        try:
            async with trio.open_nursery() as nursery:
                link = Link(self._open, nursery, on_early=lambda end: self._ended(end, nursery.cancel_scope))
                async for item in self._recv:
                    if isinstance(item, Report):
                        self._failure = self._failure or item.failure
                        break
                    if steptrace.ON:
                        steptrace.mark_frame(f"woken:{role}", self.sid, item.frame)
                    if self.defer:
                        await trio.lowlevel.checkpoint()
                    record = encode_record(item.compute_us, item.frame)
                    if steptrace.ON:
                        steptrace.mark_frame(f"send:{role}", self.sid, item.frame)
                    try:
                        await link.send(record)
                    except LinkBroken as broken:
                        self._ended(broken.end, None)
                        break
                else:  # the session ended here: end the stream, and let the next hop answer it
                    await link.end()
                nursery.cancel_scope.cancel()
        finally:
            self._recv.close()
            if link is not None:
                await link.drop()  # after a failure or a cancel: cut (after a clean end: nothing left)
        if self._failure is not None:
            await self._report(self._failure)

    async def _open(self) -> OutStream:
        nxt = self.plan.next
        if nxt is None:
            url, cap, target = self.plan.deliver_url, self.plan.deliver_capability, DELIVER_STREAM_PATH
            pool = self.pool(url)
        else:
            url, cap, target = nxt.url, nxt.capability, STREAM_PATH
            pool = self.pool(url, nxt.tls_cert)
        headers = [("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, self.sid)]
        if cap is not None:
            headers.append((CAPABILITY_HEADER, cap))
        return await pool.open_stream(target, headers)

    def _ended(self, end: LinkEnd, scope: trio.CancelScope | None) -> None:
        """The link ended early: the next node refused a step (NODE_ERROR naming it) or was lost
        (ROUTE_NODE_LOST naming it). The gateway refusing answers of a session it has ended is only logged;
        any other end of the answers' link is reported (NODE_ERROR naming this node), so the session fails
        at once, naming where its answers stopped, instead of waiting for its deadline's cap and ending
        `session_timeout` naming nobody."""
        nxt = self.plan.next
        if nxt is None:
            code, text = parse_error_body(end.answer.body) if end.answer is not None else (None, "")
            why = (f"it refused session {self.sid}'s answers ({end.answer.status} {code}: {text})"
                   if end.answer is not None else f"cannot deliver session {self.sid}: {end.lost}")
            log.warning("%s: the gateway: %s", self.node_id, why)
            if code not in (Reason.UNKNOWN_SESSION.value, Reason.SESSION_ENDED.value):
                self._failure = self._failure or Failure(
                    Reason.NODE_ERROR, f"{self.node_id}: the gateway: {why}"[:300], node=self.node_id)
        elif end.answer is not None:
            code, text = parse_error_body(end.answer.body)
            message = text if code is None else f"{code}: {text}"
            self._failure = self._failure or Failure(
                Reason.NODE_ERROR, f"{nxt.node} refused a step from {self.node_id} ({end.answer.status} {message})"[:300],
                node=nxt.node)
        else:
            self._failure = self._failure or Failure(
                Reason.ROUTE_NODE_LOST, f"lost node {nxt.node}: {self.node_id} could not reach it: {end.lost}",
                node=nxt.node)
        if scope is not None:
            scope.cancel()

    async def _report(self, failure: Failure) -> None:
        """Tell the gateway, which otherwise waits for the step's deadline and its cap: sent again until it is
        answered (a report is idempotent, unlike a step: the gateway fails a session once), for at most
        REPORT_S; an answer other than 2xx is logged (the gateway refused it, or has ended the session). The
        gateway takes the reporter from the capability; the body's `reporter` is only for its log."""
        body = json.dumps({"session": self.sid, "reporter": self.node_id, **failure.to_json()}).encode()
        headers = [("Content-Type", "application/json"), (ROUTE_SESSION_HEADER, self.sid)]  # checked before the body
        if self.plan.deliver_capability is not None:
            headers.append((CAPABILITY_HEADER, self.plan.deliver_capability))
        why, pause = "no answer", 0.05
        with trio.move_on_after(REPORT_S):
            while True:
                with trio.move_on_after(REPORT_TRY_S):
                    try:
                        answer = await self.pool(self.plan.deliver_url).request("POST", DELIVER_PATH, body, headers)
                    except TransportError as exc:
                        why = str(exc)
                    else:
                        if answer.status >= 300:
                            code, text = parse_error_body(answer.body)
                            log.warning("%s: the gateway refused the report of %s for session %s (%d %s: %s)",
                                        self.node_id, failure.reason.value, self.sid, answer.status, code, text)
                        return
                await trio.sleep(pause)
                pause = min(1.0, 2 * pause)
        log.warning("%s: cannot report %s for session %s within %gs: %s", self.node_id, failure.reason.value,
                    self.sid, REPORT_S, why)


@attrs.define(eq=False)
class SelfLoop:
    """A one-node ring's loop: its tail is its head, so each next step is admitted here, on the loop.

    The step skips what a link costs: the relay task's wake, the record's send and read (about 0.5 ms
    of a 14 ms token, one `llama` node with 2 threads). A refusal is what the head would have
    answered a network loop: reported to the gateway, through the session's answer relay, which
    fails the Route Session naming this node.
    """

    sid: str
    node_id: str
    accept: Callable[[str, Record], None]  # the node's own reader of stream records
    answers: Relay  # the session's relay to the gateway
    _closed: bool = False

    def put(self, item: Outgoing | Report) -> None:
        if self._closed:
            return  # the session has ended here, or a step was refused: nothing more goes in
        if isinstance(item, Report):
            self.answers.put(item)
            return
        try:
            self.accept(self.sid, Record(item.frame, item.compute_us))
        except (DgrError, ValueError) as exc:
            self._closed = True
            why = f"{exc.reason.value}: {exc.message}" if isinstance(exc, DgrError) else f"bad frame: {exc}"
            self.answers.put(Report(Failure(Reason.NODE_ERROR, f"{self.node_id} refused its own next step ({why})"[:300],
                                            node=self.node_id)))

    def close(self) -> None:
        self._closed = True
