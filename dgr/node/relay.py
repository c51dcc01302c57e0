"""A node's relay on a chain route: what it computed, sent on in order.

On a chain (`Topology.CHAIN`) the gateway sends each step to the head only.
Every node computes and hands its result to the session's relay, which sends
it on: to the next node as that node's input frame, or, from the tail, to the
gateway as the answer (a TOKEN frame, or an ACK for a prefill chunk). A token
then costs N + 1 one-way messages instead of the star's 2N round-trip halves.

Rules:
- One relay task per session keeps the session's frames in order (a node's
  step FSM refuses a frame out of order, so order is a correctness matter).
- Each hop adds "node=compute microseconds" to the hops header it passes on,
  so the gateway learns every hop's compute with the answer.
- A send that fails is reported to the gateway (`Report`): a node that cannot
  be reached is `route_node_lost` naming it; a refusal is `node_error` naming
  the node that refused. The relay then stops; the gateway fails the Route
  Session and closes it everywhere, which ends the relay.
- Nothing is retried: a seam step is not idempotent.

Left out: computing (dgr.node.service submits to the scheduler) and how the
gateway correlates answers (dgr.tracker.gateway).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Callable

import attrs
import trio

from dgr.errors import Failure, Reason, parse_error_body
from dgr.seam.transport import ConnectionPool, TransportError
from dgr.seam.wire import CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, HOPS_HEADER, STEP_PATH

__all__ = ["NextHop", "RelayPlan", "Relay", "Outgoing", "Report"]

log = logging.getLogger("dgr.node")



@attrs.frozen
class NextHop:
    """The node after this one on a chain, and this session's capability there."""

    node: str
    url: str
    capability: str | None
    tls_cert: str | None = None  # its registered certificate, pinned when `url` is https


@attrs.frozen
class RelayPlan:
    """Where a chain session's results go: the next node (None on the tail) and the gateway."""

    next: NextHop | None
    deliver_url: str  # the tracker's DELIVER_PATH
    deliver_capability: str | None


@attrs.frozen(eq=False)
class Outgoing:
    """One computed step, ready to send on: the next hop's input frame, or the tail's answer."""

    frame: bytes
    hops: str  # the hops header so far, this node included
    # set once the frame is written to the next hop (or will never be): until then the node holds
    # the step, so it keeps its sender's request open
    sent: trio.Event = attrs.field(factory=trio.Event)


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
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _recv: trio.MemoryReceiveChannel = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # Unbounded: each item is a step the session's FSM already accepted and computed; dropping
        # one would break the chain's order. A session has at most its prompt's chunks in flight.
        self._send, self._recv = trio.open_memory_channel(math.inf)

    def put(self, item: Outgoing | Report) -> None:
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if isinstance(item, Outgoing):  # the session has ended: nothing more goes out for it
                item.sent.set()

    def close(self) -> None:
        self._send.close()

    async def run(self) -> None:
        """Send every item in order until the session closes the relay or a send fails."""
        try:
            async for item in self._recv:
                if isinstance(item, Report):
                    await self._report(item.failure)
                    return
                try:
                    failure = await self._send_on(item)
                finally:
                    item.sent.set()
                if failure is not None:
                    await self._report(failure)
                    return
        finally:
            self._release()
            self._recv.close()

    def _release(self) -> None:
        """Nothing more will be sent: let every step still waiting to be sent answer its sender."""
        while True:
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if isinstance(item, Outgoing):
                item.sent.set()

    async def _send_on(self, item: Outgoing) -> Failure | None:
        nxt = self.plan.next
        if nxt is None:
            url, cap, who = self.plan.deliver_url, self.plan.deliver_capability, "the gateway"
        else:
            url, cap, who = nxt.url, nxt.capability, nxt.node
        headers = [("Content-Type", CONTENT_TYPE), (HOPS_HEADER, item.hops)]
        if cap is not None:
            headers.append((CAPABILITY_HEADER, cap))
        target = STEP_PATH if nxt is not None else DELIVER_PATH
        try:
            pool = self.pool(url) if nxt is None else self.pool(url, nxt.tls_cert)
            r = await pool.request("POST", target, item.frame, headers, sent=item.sent)
        except TransportError as exc:
            if nxt is None:
                log.warning("%s: cannot deliver session %s to the gateway: %s", self.node_id, self.sid, exc)
                return None  # nobody to tell: the gateway's step deadline fails the session
            return Failure(Reason.ROUTE_NODE_LOST, f"lost node {who}: {self.node_id} could not reach it: {exc}",
                           node=who)
        if r.status in (200, 202, 204):
            return None
        if nxt is None:
            log.warning("%s: the gateway refused session %s's answer (%d)", self.node_id, self.sid, r.status)
            return None
        code, text = parse_error_body(r.body)
        message = text if code is None else f"{code}: {text}"
        return Failure(Reason.NODE_ERROR, f"{who} refused a step from {self.node_id} ({r.status} {message})"[:300],
                       node=who)

    async def _report(self, failure: Failure) -> None:
        body = json.dumps({"session": self.sid, "reporter": self.node_id, **failure.to_json()}).encode()
        headers = [("Content-Type", "application/json")]
        if self.plan.deliver_capability is not None:
            headers.append((CAPABILITY_HEADER, self.plan.deliver_capability))
        try:
            with trio.move_on_after(5.0):
                await self.pool(self.plan.deliver_url).request("POST", DELIVER_PATH, body, headers)
        except TransportError as exc:
            log.warning("%s: cannot report %s for session %s: %s", self.node_id, failure.reason.value, self.sid, exc)
