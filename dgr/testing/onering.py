"""One node on a ring, in memory: for trio-level tests that drive a single `NodeService` step by step.

Every session on a node is on a ring (dgr.node.app): its open names a relay, and a tail's relay loops back
to the head. `OneNodeRing` opens sessions as the gateway opens them (`plan`): a node that is the whole
model is a ring of itself (no next hop, its loop back to itself: `SelfLoop`, dgr.node.relay), and a node
that is not has a next hop that is this harness. It hands the node steps as the previous hop's stream
would (`send`: `NodeReplies.accept_streamed`) and reads what the node's relays send out (`answer`): a
tail's answers to the tracker (ACK and TOKEN frames) or a head's output to its next hop, one frame a
record, in order, by session; failure reports land in `reports`.

On a ring of itself the tail makes each next decode step from the token it sampled and takes it back at
once, so after the prompt's last chunk a test only reads answers: the node decodes until the session's
last position or end of generation, as it does for the gateway.

No sockets: the node's pools (`NodeService.connect_pool`) are this harness's. The caller runs the service
(dgr.testing.nodes.running).
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import trio

from dgr.node.relay import Loop, NextHop, RelayPlan
from dgr.node.service import NodeService, Opened
from dgr.sampling import SamplingParams
from dgr.seam.frame import decode_frame
from dgr.seam.stream import Record, RecordReader
from dgr.seam.transport import HttpResponse

__all__ = ["OneNodeRing", "TRACKER_URL", "NEXT_URL"]

TRACKER_URL = "http://tracker.test:7000"  # where the node's answers and reports go: this harness
NEXT_URL = "http://next.test:8001"  # a head's (or middle node's) next hop: this harness too


@attrs.define(eq=False)
class _Sink:
    """One streamed request the node sent: each record's frame goes to its session's channel."""

    ring: "OneNodeRing"
    url: str
    sid: str
    reader: RecordReader = attrs.field(factory=RecordReader)
    over: trio.Event = attrs.field(factory=trio.Event)

    async def send(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        for record in self.reader.feed(data):
            self.ring._channel(self.url, self.sid)[0].send_nowait(record)

    async def end(self) -> None:
        self.over.set()

    async def answer(self) -> HttpResponse:
        await self.over.wait()  # a stream is answered when its body ends, as the tracker and a node answer it
        return HttpResponse(200, {}, b"")

    async def release(self) -> None:
        self.over.set()


@attrs.define(eq=False)
class _Pool:
    """ConnectionPool's calls, to this harness."""

    ring: "OneNodeRing"
    url: str
    ssl_context: Any = None

    @property
    def idle_connections(self) -> int:
        return 0

    async def open_stream(self, target: str, headers: list[tuple[str, str]]) -> _Sink:
        sid = dict(headers)["X-Dgr-Route-Session"]
        return _Sink(self.ring, self.url, sid)

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: list[tuple[str, str]] | None = None) -> HttpResponse:
        self.ring.reports.append(json.loads(body))  # a failure report: the only request a relay makes
        return HttpResponse(200, {}, b"{}")

    async def aclose(self) -> None:
        pass


@attrs.define(eq=False)
class OneNodeRing:
    """`service`, whose relays send to this harness; see the module docstring."""

    service: NodeService
    reports: list[dict[str, Any]] = attrs.field(factory=list)  # failure reports the node posted
    # (url, sid) -> what the node sent there for the session: the tracker, or the next hop (a tail's: the head)
    _channels: dict[tuple[str, str], tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]] = attrs.field(
        factory=dict)

    def __attrs_post_init__(self) -> None:
        # the node keeps the pools it made (NodeService.pools): a second harness on it would read nothing
        if self.service.pools:
            raise ValueError(f"{self.service.node_id} has its pools already: use OneNodeRing.of")
        self.service.connect_pool = self._pool
        if self.service.tracker_url is None:
            self.service.tracker_url = TRACKER_URL

    @classmethod
    def of(cls, service: NodeService) -> "OneNodeRing":
        """The harness of `service`, made on first use."""
        ring = getattr(service.connect_pool, "__self__", None)
        return ring if isinstance(ring, cls) else cls(service)

    def _pool(self, url: str, ssl_context: Any = None) -> _Pool:
        return _Pool(self, url, ssl_context)

    def plan(self, *, route: str = "", nodes: int = 1, ignore_eos: bool = False) -> RelayPlan:
        """The relay plan the gateway gives this node: a tail's loops back to the head, which is this node
        where it is the whole model (a ring of itself), else this harness."""
        backend, me = self.service.backend, self.service.node_id
        if not backend.is_tail:
            return RelayPlan(NextHop("next", NEXT_URL, None), TRACKER_URL, None, None, route, nodes)
        head = NextHop(me, "http://self.test", None) if backend.is_head else NextHop("head", NEXT_URL, None)
        return RelayPlan(None, TRACKER_URL, None, Loop(head, ignore_eos), route, nodes)

    async def open(self, sid: str, max_positions: int, sampling: SamplingParams = SamplingParams(temperature=0.0),
                   *, route: str = "", nodes: int = 1, ignore_eos: bool = False, **kw: Any) -> Opened:
        """Open `sid` on this ring (NodeService.open_session's other arguments in `kw`)."""
        return await self.service.open_session(sid, max_positions, sampling,
                                               self.plan(route=route, nodes=nodes, ignore_eos=ignore_eos), **kw)

    def send(self, frame: bytes, sid: str | None = None, compute_us: tuple[int, ...] = ()) -> None:
        """A step, as the stream of session `sid` (by default the frame's own) brings it from the previous hop;
        refusals raise CallerError, as there."""
        sid = decode_frame(frame).session if sid is None else sid
        self.service.replies.accept_streamed(sid, Record(frame, compute_us))

    async def answer(self, sid: str) -> bytes:
        """The next frame the node sent out for `sid`: a tail's answer to the tracker, or a head's (or middle
        node's) output to its next hop."""
        return (await self.record(sid)).frame

    async def record(self, sid: str) -> Record:
        return await self._channel(self._out, sid)[1].receive()

    async def looped(self, sid: str) -> bytes:
        """The next decode step a tail that is not its route's head sent back to the head."""
        return (await self._channel(NEXT_URL, sid)[1].receive()).frame

    @property
    def _out(self) -> str:
        return TRACKER_URL if self.service.backend.is_tail else NEXT_URL

    async def step(self, frame: bytes, sid: str | None = None) -> bytes:
        """`send`, then the `answer` it gets: for a step whose answer is the next one out."""
        sid = decode_frame(frame).session if sid is None else sid
        self.send(frame, sid)
        return await self.answer(sid)

    def pending(self, sid: str) -> int:
        """Frames sent out for `sid` (as `answer` reads them) and not read yet."""
        return self._channel(self._out, sid)[1].statistics().current_buffer_used

    def _channel(self, url: str, sid: str) -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
        key = (url.rstrip("/"), sid)
        if key not in self._channels:
            self._channels[key] = trio.open_memory_channel(math.inf)
        return self._channels[key]
