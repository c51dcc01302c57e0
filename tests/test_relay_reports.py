"""A node's failure reports reach the gateway: a broken answers' link is named at once, and a report is sent
again until it is answered.

Without a report the gateway learns of a step's loss only from its deadline and the deadline's cap (92 s for
a short prompt on a 2-node ring), and then ends the session `session_timeout`, naming nobody.
"""

from __future__ import annotations

import json
import uuid

import pytest
import trio

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Failure, Reason, openai_error_body
from dgr.node.service import NodeService
from dgr.seam.frame import encode_frame
from dgr.seam.transport import HttpResponse, TransportError
from dgr.seam.wire import Flag, FrameKind
from dgr.testing import onering
from dgr.testing.nodes import running
from dgr.testing.onering import TRACKER_URL, OneNodeRing

SPEC = StubSpec(n_layers=6, hidden_size=32)


def _prompt(sid: str) -> bytes:
    return encode_frame(FrameKind.PREFILL, sid, 0, 0, 4, SPEC.seam_width, token_ids=[1, 2, 3, 4], flags=Flag.SAMPLE)


async def _one_prompt(monkeypatch, *, answers_end: HttpResponse | None, failed_tries: int, wait_s: float = 10
                      ) -> list[dict]:
    """A whole-model node (a ring of itself) computes a prompt whose answer cannot reach the gateway: its
    link's send breaks, or (`answers_end`) the gateway answers the stream at once. The first
    `failed_tries` report requests break. Returns the reports the gateway got."""
    tries = {"n": 0}

    async def send(self, data: bytes) -> None:
        if self.url == TRACKER_URL:
            if answers_end is not None:
                await trio.sleep_forever()  # the watcher reads the gateway's answer first
            raise TransportError("connection reset by peer")
        await original_send(self, data)

    async def answer(self) -> HttpResponse:
        if self.url == TRACKER_URL and answers_end is not None:
            return answers_end
        return await original_answer(self)

    async def request(self, method, target, body=b"", headers=None) -> HttpResponse:
        tries["n"] += 1
        if tries["n"] <= failed_tries:
            raise TransportError("connection refused")
        return await original_request(self, method, target, body, headers)

    original_send, original_answer = onering._Sink.send, onering._Sink.answer
    original_request = onering._Pool.request
    monkeypatch.setattr(onering._Sink, "send", send)
    monkeypatch.setattr(onering._Sink, "answer", answer)
    monkeypatch.setattr(onering._Pool, "request", request)
    node = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 6)), node_id="n")
    ring = OneNodeRing(node)
    sid = uuid.uuid4().hex
    async with running(node):
        await ring.open(sid, 16)
        ring.send(_prompt(sid))
        with trio.move_on_after(wait_s):
            while len(ring.reports) < 1:
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # no second report follows
    return ring.reports


async def test_a_lost_answers_link_is_reported_naming_the_node_and_the_report_is_sent_again(monkeypatch) -> None:
    reports = await _one_prompt(monkeypatch, answers_end=None, failed_tries=2)
    assert len(reports) == 1, reports
    failure = Failure.from_json(reports[0])
    assert failure.reason is Reason.NODE_ERROR and failure.node == "n" and reports[0]["reporter"] == "n"
    assert "connection reset by peer" in failure.message


@pytest.mark.parametrize("reason, reported", [(Reason.UNKNOWN_SESSION, False), (Reason.FORBIDDEN, True)])
async def test_a_refusal_of_the_answers_is_reported_unless_the_gateway_ended_the_session(
        monkeypatch, reason: Reason, reported: bool) -> None:
    body = json.dumps(openai_error_body(CallerError(reason, "no").failure())).encode()
    reports = await _one_prompt(monkeypatch, answers_end=HttpResponse(404, {}, body), failed_tries=0,
                                wait_s=10 if reported else 1)
    assert len(reports) == int(reported), reports
    if reported:
        assert Failure.from_json(reports[0]).node == "n" and reason.value in reports[0]["message"]
