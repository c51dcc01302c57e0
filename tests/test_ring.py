"""The ring through real processes: each node forwards to the next, the tail answers the gateway and
sends each next decode step straight to the head.

The same answers as one stub over every layer, one hidden state per hop on the
decode seam, a lost node named by the neighbour that could not reach it, and
deliveries that only the session's own route can make.
"""

from __future__ import annotations

import contextlib
import json
import uuid

import httpx
import numpy as np
import openai
import pytest
import trio
import trio.testing

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.seam.frame import TokenResult, decode_frame, encode_frame
from dgr.seam.stream import Record, encode_record
from dgr.seam.transport import ConnectionPool, TransportError
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, DELIVER_STREAM_PATH, HEADER_SIZE,
                           ROUTE_SESSION_HEADER, STREAM_PATH, FrameKind)
from dgr.security.auth import Scope
from dgr.security.identity import Identity
from dgr.testing.harness import LOSS_BOUND_S, LocalRoute, first_error, first_text, sse_events
from dgr.testing.reference import expected_greedy

@pytest.fixture(scope="module")
def ring():
    with LocalRoute(backend="stub", nodes=3, extra=("--stub-delay", "0.0005")) as r:
        yield r


def test_ring_answers_equal_the_stub_and_the_seam_carries_one_step(ring) -> None:
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    client = openai.OpenAI(base_url=ring.api, api_key="unused", max_retries=0)
    for prompt in ("The route", "x" * 700):  # 700 positions: two prefill chunks through the ring
        ids = stub.tokenize(prompt, add_special=True, parse_special=True)
        want = expected_greedy([stub], ids, 40)
        got = client.completions.create(model="stub", prompt=prompt, max_tokens=40, temperature=0)
        assert got.choices[0].text == want.text and got.usage.completion_tokens == want.completion_tokens
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="stub", prompt=prompt, max_tokens=40, temperature=0, stream=True) if c.choices)
        assert streamed == want.text
    for name in ("node1", "node2"):  # the previous node sent it one position of 576 float32
        seam = ring.node_status(name)["seam"]
        assert seam["last_decode_frame_bytes"] == HEADER_SIZE + 576 * 4
    with httpx.stream("POST", f"{ring.api}/completions", timeout=30,
                      json={"model": "stub", "prompt": "hops", "max_tokens": 8, "stream": True}) as r:
        sid = r.headers["x-dgr-route-session"]
        r.read()
    snap = ring.wait_session_ended(sid)
    assert snap["phase"] == "done" and set(snap["hop_latency_ms"]) == {"node0", "node1", "node2"}
    ring.wait_sessions_freed(["node0", "node1", "node2"])


def test_a_failure_report_needs_the_sessions_capability_and_answers_come_only_on_streams(ring) -> None:
    sid = uuid.uuid4().hex
    report = json.dumps({"session": sid, "reporter": "node1", "code": "route_node_lost", "message": "forged",
                         "node": "node2"}).encode()
    for headers in ({}, {CAPABILITY_HEADER: "forged.token"},
                    ring.capability(sid, "node1", scope=Scope.REPORT, identity=Identity.generate()),  # not the tracker's
                    ring.capability(sid, "node1", scope=Scope.STEP),  # a node capability is not one for the tracker
                    ring.capability(sid, "node1", scope=Scope.CONTROL),
                    ring.capability(sid, "gateway", layers=(0, 1), scope=Scope.STEP)):  # what delivered before v3
        r = httpx.post(f"{ring.url}{DELIVER_PATH}", content=report, timeout=5,
                       headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    # the right capability for a session that is not live: refused as unknown, nothing changes
    r = httpx.post(f"{ring.url}{DELIVER_PATH}", content=report, timeout=5,
                   headers={"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid,
                             **ring.capability(sid, "node1", scope=Scope.REPORT)})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session", r.text
    # an answer posted alone is refused, even with the capability: a route's answers come on the delivery stream
    frame = encode_frame(FrameKind.TOKEN, sid, 0, 0, 1, 576, extra=TokenResult(5, -0.1, b"x", False).payload())
    r = httpx.post(f"{ring.url}{DELIVER_PATH}", content=frame, timeout=5,
                   headers={"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid,
                             **ring.capability(sid, "node2", scope=Scope.DELIVER)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_frame", r.text


def test_a_members_report_fails_only_its_session_in_the_trackers_words(ring) -> None:
    """A route member's failure report (issue 40): it must come from and name nodes of that session's route;
    it fails that session only, with the tracker's own text, not the reporter's; and no node is marked dead on
    a member's word, so other sessions through the named node go on. Its reporter is the holder of its
    capability, whatever the body says."""
    body = {"model": "stub", "prompt": "a long one", "max_tokens": 400, "temperature": 0, "stream": True}
    lure = "SECURITY NOTICE: re-enter your API key at http://attacker.example/login"
    with httpx.stream("POST", f"{ring.api}/completions", json=body, timeout=30) as victim:
        sid = victim.headers["x-dgr-route-session"]
        cap = {"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid,
                             **ring.capability(sid, "node1", scope=Scope.REPORT)}

        def report(reporter: str, node: str) -> httpx.Response:
            data = {"session": sid, "reporter": reporter, "code": "route_node_lost", "message": lure, "node": node}
            return httpx.post(f"{ring.url}{DELIVER_PATH}", content=json.dumps(data).encode(), timeout=5, headers=cap)

        # not of this route, or not the capability's holder: refused
        for reporter, node in (("node1", "nodeX"), ("stranger", "node2"), ("node0", "node2")):
            r = report(reporter, node)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        assert report("node1", "node2").status_code == 204
        text = victim.read().decode()
    assert "attacker.example" not in text and "node node1 reported route_node_lost for node node2" in text
    assert ring.wait_session_ended(sid)["phase"] == "failed"
    # node2 is not marked dead: a new session through it answers
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    want = expected_greedy([stub], stub.tokenize("after", add_special=True, parse_special=True), 8).text
    got = httpx.post(f"{ring.api}/completions", json={"model": "stub", "prompt": "after", "max_tokens": 8,
                                                        "temperature": 0}, timeout=30).json()
    assert got["choices"][0]["text"] == want
    assert all(n["alive"] for n in ring.node_table()), ring.node_table()


def test_a_ring_sessions_step_sent_out_of_its_order_is_refused_and_the_session_goes_on(ring) -> None:
    """A step of a live ring session on a second stream (with node1's capability) that is not the session's
    next is refused before it touches the session, which answers as if nothing had come. (Before issue 57 a
    node also had a single-step path, which refused a ring session's steps: it is gone.)"""
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    want = expected_greedy([stub], stub.tokenize("a long one", add_special=True, parse_special=True), 300).text
    node1 = ring.node("node1")["url"]
    body = {"model": "stub", "prompt": "a long one", "max_tokens": 300, "temperature": 0, "stream": True}
    text, refused = "", None
    with httpx.stream("POST", f"{ring.api}/completions", json=body, timeout=30) as r:
        sid = r.headers["x-dgr-route-session"]
        for kind, data in sse_events(r):
            if kind == "data" and isinstance(data, dict):
                text += "".join(c.get("text") or "" for c in data.get("choices", []))
            if text and refused is None:  # the session is decoding: a step of it, alone, with node1's capability
                frame = encode_frame(FrameKind.DECODE, sid, 10_000, 0, 1, 576, hidden=np.zeros((1, 576), np.float32))
                refused = httpx.post(f"{node1}{STREAM_PATH}", content=encode_record((), frame), timeout=5,
                                     headers={"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid,
                                              **ring.capability(sid, "node1")})
                assert httpx.post(f"{node1}/v1/seam/step", content=frame, timeout=5).status_code == 404
    assert refused is not None
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "step_out_of_order", refused.text
    assert text == want


@pytest.mark.parametrize("victim, reporter", [("node1", "node0"), ("node2", "node1"),
                                              ("node0", "node2")])  # the ring's tail feeds the head
def test_a_lost_node_is_named_by_its_neighbour(victim: str, reporter: str) -> None:
    # Heartbeats would name the node too, after --dead-after; here the neighbour's report must do it.
    # Its request stays open while the victim computes, and a node killed between steps refuses the
    # next one, so whenever the kill lands the neighbour sees it.
    with LocalRoute(backend="stub", nodes=3, extra=("--stub-delay", "0.004", "--dead-after", "60")) as route:
        body = {"model": "stub", "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{route.api}/completions", json=body, timeout=30) as r:
            events = sse_events(r)
            first_text(events)
            killed_at = route.kill(victim)
            error, seen_at = first_error(events)
        assert seen_at - killed_at < LOSS_BOUND_S
        assert (error["code"], error["node"], error["phase"]) == ("route_node_lost", victim, "decode")
        assert reporter in error["message"]
        route.wait_sessions_freed([n for n in ("node0", "node1", "node2") if n != victim])


def test_a_stream_is_authorized_from_its_headers_before_its_body_is_read(ring) -> None:
    """A ring link's stream names its session and capability in its headers: a bad one is answered
    at once, while its body is still open, and a frame of another session on a good one is refused."""
    sid, other = uuid.uuid4().hex, uuid.uuid4().hex
    node1 = ring.node("node1")["url"]
    frame = encode_frame(FrameKind.DECODE, other, 0, 0, 1, 576, hidden=np.zeros((1, 576), np.float32))

    async def answer(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str]:
        pool = ConnectionPool(url)
        stream = await pool.open_stream(path, [("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, sid),
                                               *headers.items()])
        try:
            await stream.send(body)  # and never end the body: an answer must come anyway
            with trio.fail_after(10):
                r = await stream.answer()
            with contextlib.suppress(TransportError):  # the server may have hung up already
                await stream.end()  # which makes both sides done: the connection must still not be pooled
            await stream.release()
            assert pool.idle_connections == 0  # the server closes a connection whose body it cut short
            return r.status, json.loads(r.body)["error"]["code"]
        finally:
            await stream.release()
            await pool.aclose()

    async def main() -> None:
        half = encode_record((), frame)[:30]
        for headers in ({}, {CAPABILITY_HEADER: "forged.token"},
                        ring.capability(sid, "node1", identity=Identity.generate()),  # not the tracker's
                        ring.capability(sid, "node2")):  # another node's
            assert await answer(node1, STREAM_PATH, headers, half) == (403, "forbidden")
        for headers in ({}, ring.capability(sid, "node2", layers=(0, 1)),  # a node's is not a delivery one
                        ring.capability(sid, "node1", scope=Scope.REPORT)):  # nor is one that only reports
            assert await answer(ring.url, DELIVER_STREAM_PATH, headers, half) == (403, "forbidden")
        # the session's own capability, and a frame of another session in the body
        assert await answer(node1, STREAM_PATH, ring.capability(sid, "node1"), encode_record((), frame)) == (
            403, "forbidden")
        assert await answer(ring.url, DELIVER_STREAM_PATH, ring.capability(sid, "node2", scope=Scope.DELIVER),
                            encode_record((), frame)) == (400, "bad_frame")  # a node's input is no answer
        # a stream that ends cleanly is answered 200 and its connection is kept for the next one
        pool = ConnectionPool(ring.url)
        stream = await pool.open_stream(DELIVER_STREAM_PATH, [
            ("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, sid),
            *ring.capability(sid, "node2", scope=Scope.DELIVER).items()])
        await stream.end()
        with trio.fail_after(10):
            r = await stream.answer()
        await stream.release()
        assert (r.status, json.loads(r.body)["frames"], pool.idle_connections) == (200, 0, 1)
        await pool.aclose()

    trio.run(main)


def _assert_at_once_as_alone(route: LocalRoute, prompts: list[str]) -> None:
    """Every prompt at once on `route`, 48 greedy tokens each: each answer is the one it gets alone."""
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    want = [expected_greedy([stub], stub.tokenize(p, add_special=True, parse_special=True), 48).text for p in prompts]
    got: list[str | None] = [None] * len(prompts)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        r = await client.post(f"{route.api}/completions", json={
            "model": "stub", "prompt": prompts[i], "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        got[i] = r.json()["choices"][0]["text"]

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, client, i)

    trio.run(main)
    assert got == want


# -- the ring: the tail sends each next decode step to the head; the gateway only listens ----------
def test_ring_answers_equal_the_stub_wherever_generation_stops(ring) -> None:
    """The tail decides, as the gateway would, when no next step is due (the last token, end of
    generation); a stop string ends the session at the gateway while the tail's next steps are on
    their way, and those are discarded with the session everywhere."""
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    client = openai.OpenAI(base_url=ring.api, api_key="unused", max_retries=0)
    for prompt in ("The route", "x" * 700):  # 700 positions: two prefill chunks through the ring
        ids = stub.tokenize(prompt, add_special=True, parse_special=True)
        for n in (1, 2, 40):
            want = expected_greedy([stub], ids, n)
            got = client.completions.create(model="stub", prompt=prompt, max_tokens=n, temperature=0)
            assert (got.choices[0].text, got.usage.completion_tokens) == (want.text, want.completion_tokens)
            assert got.choices[0].finish_reason == want.finish_reason
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="stub", prompt=prompt, max_tokens=40, temperature=0, stream=True) if c.choices)
        assert streamed == expected_greedy([stub], ids, 40).text
    # the head's decode steps came from the tail: one token id, no hidden state; the others get one position
    assert ring.node_status("node0")["seam"]["last_decode_frame_bytes"] == len(
        encode_frame(FrameKind.DECODE, uuid.uuid4().hex, 0, 0, 1, 576, token_ids=[1]))
    for name in ("node1", "node2"):
        assert ring.node_status(name)["seam"]["last_decode_frame_bytes"] == HEADER_SIZE + 576 * 4

    ids = stub.tokenize("stop here", add_special=True, parse_special=True)
    whole = expected_greedy([stub], ids, 300).text
    stop = whole[len(whole) // 2:][:6]
    want = expected_greedy([stub], ids, 300, stop=(stop,))
    assert want.finish_reason == "stop" and 0 < want.completion_tokens < 300
    with httpx.stream("POST", f"{ring.api}/completions", timeout=30, json={
            "model": "stub", "prompt": "stop here", "max_tokens": 300, "temperature": 0, "stop": [stop]}) as r:
        sid = r.headers["x-dgr-route-session"]
        got = json.loads(r.read())
    assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (want.text, "stop")
    snap = ring.wait_session_ended(sid)
    assert snap["phase"] == "done" and set(snap["hop_latency_ms"]) == {"node0", "node1", "node2"}
    ring.wait_sessions_freed(["node0", "node1", "node2"])
    again = client.completions.create(model="stub", prompt="stop here", max_tokens=300, temperature=0, stop=[stop])
    assert again.choices[0].text == want.text


def test_ring_sessions_at_once_travel_in_phase_groups_and_answer_as_alone(ring) -> None:
    """On a ring the tail holds each next step for its phase group (dgr.node.links), as the
    gateway did on a chain; it counts the steps it sent with their group."""
    before = ring.node_status("node2")["ring_phases"]["released"]
    _assert_at_once_as_alone(ring, [f"ring member {i}" for i in range(6)])
    assert ring.node_status("node2")["ring_phases"]["released"] > before
    ring.wait_sessions_freed(["node0", "node1", "node2"])


def test_a_ring_tail_sends_the_next_step_exactly_when_the_gateway_would() -> None:
    """The gateway sends the step of token k while k < max_tokens, on a session opened on
    len(prompt) + max_tokens positions, and none after an end of generation unless ignore_eos."""
    from dgr.node.relay import Loop, NextHop
    from dgr.node.replies import next_step_frame
    from dgr.seam.frame import decode_frame
    from dgr.seam.wire import Flag

    sid, head = uuid.uuid4().hex, NextHop("node0", "http://127.0.0.1:1", None)
    word, eog = TokenResult(7, -0.1, b"x", False), TokenResult(2, -0.1, b"", True)
    prompt, max_tokens = 16, 3
    last_chunk = decode_frame(encode_frame(FrameKind.PREFILL, sid, 3, 10, 6, 576, flags=Flag.SAMPLE,
                                           hidden=np.zeros((6, 576), np.float32)))  # positions 10 to 15

    def nxt(frame, result, loop=Loop(head)):
        step = next_step_frame(frame, result, loop, prompt + max_tokens)
        return None if step is None else decode_frame(step)

    first = nxt(last_chunk, word)  # token 1's step
    assert (first.kind, first.session, first.seq, first.pos0, first.n_tokens) == (FrameKind.DECODE, sid, 4, 16, 1)
    assert first.token_ids.tolist() == [7] and first.flags & Flag.SAMPLE and first.hidden is None
    second = nxt(first, word)  # token 2's step
    assert (second.seq, second.pos0) == (5, 17)
    assert nxt(second, word) is None  # token 3 is the last: no step for it
    assert nxt(last_chunk, eog) is None
    assert nxt(last_chunk, eog, Loop(head, ignore_eos=True)).token_ids.tolist() == [2]


async def test_a_ring_tails_next_step_goes_out_before_its_answer() -> None:
    """A tail's next step and its answer to the gateway are put together; whichever relay trio runs first,
    the step is written first (the head waits on it; only the gateway waits on the answer)."""
    from dgr.node.relay import NextHop, Outgoing, Relay, RelayPlan
    from dgr.testing.streams import FakePool

    events: list[str] = []
    pools = {name: FakePool(on_send=lambda data, name=name: events.append(name)) for name in ("answer", "step")}

    step = encode_frame(FrameKind.DECODE, uuid.uuid4().hex, 5, 17, 1, 576, token_ids=[7])
    answer = encode_frame(FrameKind.TOKEN, uuid.uuid4().hex, 4, 16, 1, 576,
                          extra=TokenResult(7, -0.5, b"x", False).payload())
    head = NextHop("node0", "http://head", None)
    for answer_first in (True, False):
        events.clear()
        answers = Relay("s", "node1", RelayPlan(None, "http://tracker", None), lambda *a: pools["answer"], defer=True)
        loop = Relay("s", "node1", RelayPlan(head, "http://tracker", None), lambda *a: pools["step"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answers.run)
            nursery.start_soon(loop.run)
            for _ in range(20):  # trio runs the woken relays in either order, at random
                await trio.testing.wait_all_tasks_blocked()
                if answer_first:
                    answers.put(Outgoing(answer, (1,)))
                    loop.put(Outgoing(step, ()))
                else:
                    loop.put(Outgoing(step, ()))
                    answers.put(Outgoing(answer, (1,)))
            await trio.testing.wait_all_tasks_blocked()
            answers.close()
            loop.close()
        assert events == ["step", "answer"] * 20


async def test_a_one_node_rings_loop_admits_its_next_step_in_process_and_reports_a_refusal() -> None:
    """On a ring of one node the tail is the head: each next step is admitted on the node itself (no
    socket, no relay task), the answers are those of the model, and a step it refuses is reported to
    the gateway as a refused step naming the node, as a head's refusal on a network loop would be."""
    from dgr.node.relay import Loop, NextHop, Outgoing, RelayPlan, SelfLoop
    from dgr.node.service import NodeService
    from dgr.pipeline import Pipeline
    from dgr.sampling import SamplingParams
    from dgr.seam.stream import RecordReader
    from dgr.seam.wire import Flag
    from dgr.testing.nodes import running
    from dgr.testing.streams import FakePool

    answers: list[bytes] = []
    reports: list[tuple[str, dict]] = []
    reader = RecordReader(1 << 20)
    gateway = FakePool(on_send=lambda data: answers.extend(r.frame for r in reader.feed(data)),
                       on_request=lambda target, body: reports.append((target, json.loads(body))))

    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    node = NodeService(backend=stub, node_id="solo")
    node.pools["http://gateway"] = gateway  # the node's pooled connections to the gateway
    prompt, max_tokens = [3, 14, 15, 92], 12
    sid = uuid.uuid4().hex
    plan = RelayPlan(None, "http://gateway", None, Loop(NextHop("solo", "http://solo", None), ignore_eos=True))
    async with running(node):
        await node.open_session(sid, len(prompt) + max_tokens, SamplingParams(temperature=0.0), relay=plan)
        assert isinstance(node.sessions[sid].loop, SelfLoop)
        node.replies.accept_streamed(sid, Record(encode_frame(FrameKind.PREFILL, sid, 0, 0, len(prompt), 576,
                                                      token_ids=prompt, flags=Flag.SAMPLE)))
        want = Pipeline([StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))]).generate_greedy(
            prompt, max_tokens, sid="0" * 32).tokens
        with trio.fail_after(10):
            while len(answers) < max_tokens:
                await trio.sleep(0.001)
        assert [TokenResult.from_frame(decode_frame(a)).token for a in answers] == want
        assert set(node.pools) == {"http://gateway"}, "the node opened no connection to itself"

        other = uuid.uuid4().hex
        await node.open_session(other, 64, SamplingParams(temperature=0.0), relay=plan)
        node.sessions[other].loop.put(Outgoing(encode_frame(FrameKind.DECODE, other, 3, 9, 1, 576, token_ids=[7],
                                                    flags=Flag.SAMPLE), ()))  # out of order: refused
        node.sessions[other].loop.put(Outgoing(b"never admitted", ()))
        with trio.fail_after(10):
            while not reports:
                await trio.sleep(0.001)
    assert gateway.opened == [DELIVER_STREAM_PATH]  # the first session's answers; the second had none to send
    assert len(reports) == 1
    target, report = reports[0]
    assert target == DELIVER_PATH
    assert report["session"] == other and report["code"] == "node_error" and report["node"] == "solo"
    assert "solo refused its own next step" in report["message"]


def test_a_relay_plan_names_its_route_and_node_count_or_is_refused() -> None:
    from dgr.errors import CallerError, Reason
    from dgr.node.app import _relay_plan
    from dgr.node.service import NodeService
    from dgr.seam.opening import RelayOrder

    node = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 15)), node_id="n0",
                       tracker_url="http://gateway")
    nxt = {"node": "n1", "url": "http://n1"}

    def read(body: dict):  # as an open reads its relay: its shape, then what this node can follow
        return _relay_plan(node, RelayOrder.from_json(body))

    plan = read({"next": nxt, "route": "n0,n1", "nodes": 2})
    assert (plan.route, plan.nodes, plan.next.node) == ("n0,n1", 2, "n1")
    assert (read({"next": nxt}).route, read({"next": nxt}).nodes) == ("", 1)
    for bad in ({"nodes": 0}, {"nodes": True}, {"nodes": "2"}, {"route": 5}, {"route": "x" * 10_000}):
        with pytest.raises(CallerError) as refused:
            read({"next": nxt, **bad})
        assert refused.value.reason is Reason.INVALID_REQUEST and refused.value.details["param"] == "relay.route"
    with pytest.raises(CallerError) as refused:  # a next hop where this node is the tail: the node's own check
        _relay_plan(NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(15, 30)), node_id="n1",
                                tracker_url="http://gateway"), RelayOrder.from_json({"next": nxt}))
    assert refused.value.reason is Reason.INVALID_REQUEST and "tail delivers" in refused.value.message
