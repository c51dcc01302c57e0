"""The ring as the gateway drives it: the prompt's chunks out to the head, the tail's answers in.

A Route Session's steps travel its ring. The gateway sends each prompt chunk
to the head on one outgoing link (dgr.seam.link); every node computes and
forwards (dgr.node.relay); the tail delivers each answer to the tracker
(dgr.tracker.deliveries puts it in the session's inbox) and, once it has
sampled a token that does not end the session (dgr.fsm.stop), sends the next
decode step straight to the head itself. So the gateway's part is the two
calls of `Driver`:

- `prefill(live, links)`: every chunk to the head (after a repair, the steps
  the replacement's head lacks, and the answers from the step the gateway
  waited on: `LiveSession.steps`, `rebuild`, dgr.tracker.resume), in order,
  with at most one chunk a node in flight (enough for every node to compute at once, and no
  more, so a node never queues a whole prompt); each chunk's answer taken in
  order, prefill progress published; the last chunk's answer, the first
  token, returned. The link to the head then ends in the background: from
  here a lost head is the tail's to report.
- `answer(live, seq)`: the tail's answer to step `seq`, whose number the
  caller takes from the answer before it, within the route's deadline
  (dgr.tracker.patience: extended while every node answers its probe, from
  the session's one budget, `LiveSession.allowance`, made at prefill; a step
  past its deadline is blamed on the hop holding it). Its
  round trip since the answer before, less every hop's compute, is shared
  out among the N links a token crosses: each hop's seam overhead.

While the link to the head is open, a refusal or a lost head fails the
session through its inbox, whatever step the driver waits on.
"""

from __future__ import annotations

import functools
from typing import Protocol

import attrs
import trio

from dgr.errors import Failure, PeerError, Reason
from dgr.seam.frame import encode_frame
from dgr.seam.link import Link, LinkBroken, LinkEnd
from dgr.seam.stream import encode_record
from dgr.seam.wire import Flag, FrameKind
from dgr.tracker.accounting import Accounting
from dgr.tracker.clients import NodeClients
from dgr.tracker.live import Answer, GatewayConfig, LiveSession
from dgr.tracker.patience import Patience

__all__ = ["Driver", "Ring"]


class Driver(Protocol):
    """How a Route Session's steps travel its route, as the gateway's one loop sees it."""

    async def prefill(self, live: LiveSession, links: trio.Nursery) -> Answer: ...

    async def answer(self, live: LiveSession, seq: int) -> Answer: ...


@attrs.define
class Ring:
    config: GatewayConfig
    clients: NodeClients
    patience: Patience
    accounting: Accounting

    def deadline(self, n_tokens: int) -> float:
        """One step's deadline on one node."""
        return self.config.step_deadline_s + self.config.per_token_deadline_s * n_tokens

    async def prefill(self, live: LiveSession, links: trio.Nursery) -> Answer:
        size = live.chunk_size(self.config)
        rs, steps = live.rs, live.steps(size)
        rebuild = live.rebuild
        feed_from, answer_from = (0, 0) if rebuild is None else (rebuild.feed_from, rebuild.answer_from)
        last = len(steps) - 1
        prompt_last = max((k for k, _, _, decode in steps if not decode), default=-1)
        head = rs.route[0]
        live.allowance = self.patience.allowance(live.node_sid, self.deadline(1) * len(rs.route), live.caps)
        client = self.clients.get(head)

        def early(end: LinkEnd) -> None:  # the head refused a step, or was lost, while the link was open
            live.inbox[0].send_nowait(self._head_failure(live, end))

        live.head = Link(functools.partial(client.open_stream, live.node_sid, live.caps.get(head.node_id)), links,
                         on_early=early)
        # a ubatch's positions in flight a hop, however finely the prompt is cut: chunks smaller than the ubatch
        # (a pipeline's, live.pipeline_chunk) must not add round trips on a slow link
        window = trio.Semaphore(len(rs.route) * max(1, self.config.prefill_chunk // size))

        async def feed() -> None:  # every step the head lacks, in order: the ring pipelines them
            for k, pos0, ids, decode in steps[feed_from:]:
                if k >= answer_from:  # a step before it is answered by no one: it only rebuilds KV
                    await window.acquire()
                # a prompt chunk without its ids (the head has them, it tokenized the prompt at open); a token fed,
                # as the tail's loop sent it: a decode step that samples
                frame = encode_frame(FrameKind.DECODE if decode else FrameKind.PREFILL, live.node_sid, k, pos0,
                                     len(ids), live.model_width, dtype=self.config.seam_dtype,
                                     flags=Flag.SAMPLE if decode or k == prompt_last else Flag(0),
                                     token_ids=ids if decode else None)
                await self._send_head(live, frame, len(ids), k)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            for k, pos0, ids, _ in steps[answer_from:]:
                answer = await self.answer(live, k, len(ids), from_gateway=k >= feed_from)
                window.release()
                if k < last:
                    live.publish_progress(pos0 + len(ids))
        links.start_soon(live.head.end)
        if answer.frame.kind is not FrameKind.TOKEN:
            raise PeerError(Reason.NODE_ERROR, "the tail gave no token after prefill", node=rs.route[-1].node_id)
        return answer

    async def _send_head(self, live: LiveSession, frame: bytes, n_tokens: int, step: int) -> None:
        head = live.rs.route[0]
        with self.patience.patient([head.node_id], self.deadline(n_tokens), live.allowance) as wait:
            try:
                await live.head.send(encode_record((), frame))
            except LinkBroken as broken:
                f = self._head_failure(live, broken.end)
                raise PeerError(f.reason, f.message, node=f.node, step=step, phase=live.rs.state.value) from None
        if wait.scope.cancelled_caught:
            raise wait.failed(f"did not take step {step}", head.node_id, step=step, phase=live.rs.state.value)
        self.accounting.sent(head.node_id, FrameKind.PREFILL.name, len(frame))

    def _head_failure(self, live: LiveSession, end: LinkEnd) -> Failure:
        client = self.clients.get(live.rs.route[0])
        return client.stream_failure(end.answer if end.answer is not None else end.lost, phase=live.rs.state.value)

    async def answer(self, live: LiveSession, seq: int, n_tokens: int = 1, *, from_gateway: bool = False) -> Answer:
        """The tail's answer to step `seq` (`from_gateway`: a prompt chunk the gateway sent the head).

        Raises:
            PeerError: a node reported a failure, another step's answer came, or none came in time
                (SESSION_TIMEOUT naming the hop that held it, once the session's budget is spent).
        """
        route = live.rs.route
        got = await self.patience.until_answer(
            functools.partial(self._take, live, seq), [h.node_id for h in route], route[-1].node_id,
            self.deadline(n_tokens) * len(route), f"gave no answer to step {seq}", allowance=live.allowance,
            seq=seq, from_gateway=from_gateway, step=seq, phase=live.rs.state.value)
        now = trio.current_time()
        if got.frame.seq == live.answered_seq:
            return got  # a speculative step's next token: the same trip as the answer before
        since, live.answered_at, live.answered_seq = live.answered_at, now, got.frame.seq
        if since is None or got.frame.kind is not FrameKind.TOKEN or live.rs.generated == 0:
            return got  # prefill's answers overlap one another: no round trip of their own
        share = max(0.0, now - since - sum(got.compute_us) / 1e6) / len(route)
        return attrs.evolve(got, hop_ms={h.node_id: round(share * 1e3, 4) for h in route})

    @staticmethod
    async def _take(live: LiveSession, seq: int) -> Answer:
        """The next item of `live`'s inbox, which must be the answer to step `seq`.

        Raises:
            PeerError: a member's report (it fails this session, and marks no node dead), or another step's answer.
        """
        item = await live.inbox[1].receive()
        if isinstance(item, Failure):
            raise PeerError(item.reason, item.message, node=item.node, step=seq, phase=live.rs.state.value,
                            reported=True)
        if item.frame.seq != seq:
            raise PeerError(Reason.NODE_ERROR, f"the route answered step {item.frame.seq}, not {seq}",
                            node=live.rs.route[-1].node_id, step=seq, phase=live.rs.state.value)
        return item
