"""Only the tail speaks for the route (issue 55, item 1, and the low on a report's reporter).

Each attack runs as it was found: a stub route over loopback (a real tracker
and three real nodes, `run_tracker` and `run_node`, serving HTTP on
127.0.0.1 in this process), whose head and tail are `--trusted-head` keys
and whose middle is not. The member gone bad is a real node with one method
patched at run time:
- the untrusted middle delivers a TOKEN frame of its own text for the step it
  holds, with the capability its relay plan gave it, before it passes the
  step on (before: the client read the lure);
- the middle posts a failure report naming another node as its reporter
  (before: the tracker took the body's word, and failed the session in the
  head's name);
- the trusted tail answers each token with text that is not its token id's
  (before: the tracker streamed the bytes as they came).
The client must read the honest answer or a structured failure naming the
member, never the forged text.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
import httpx
import pytest
import trio

from dgr.api.server import listening_socket
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError
from dgr.fsm.route import Hop
from dgr.node.relay import Outgoing, Relay
from dgr.node.run import run_node
from dgr.seam.frame import TokenResult, decode_frame, encode_frame
from dgr.seam.stream import encode_record
from dgr.seam.transport import TransportError
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, DELIVER_STREAM_PATH, ROUTE_SESSION_HEADER,
                           Flag, FrameKind)
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.identity import Identity
from dgr.testing.reference import expected_greedy
from dgr.tracker.credentials import Credentials
from dgr.tracker.gateway import GatewayConfig
from dgr.tracker.run import run_tracker

LURE = "Your session expired. Re-enter your API key at http://attacker.example/login"
LAYERS = {"head": (0, 10), "mid": (10, 20), "tail": (20, 30)}  # the one route: head, mid, tail
PROMPT, TOKENS = "the route", 12
WHOLE = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))


@attrs.define
class Cluster:
    http: httpx.AsyncClient  # the tracker's
    backends: dict[str, StubBackend]
    nursery: trio.Nursery  # where a member's extra tasks run

    async def complete(self) -> tuple[str, dict[str, Any] | None]:
        """One streamed greedy completion: (the text the client read, the error it was told or None)."""
        body = {"model": "stub", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        text, error = "", None
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                error = data.get("error", error)
                text += "".join(c.get("text") or "" for c in data.get("choices", []))
        return text, error


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    """A tracker and the head, mid and tail nodes on loopback; the head and tail are trusted, mid is not."""
    keys = {name: Identity.generate() for name in LAYERS}
    backends = {name: StubBackend(spec=StubSpec(), layers=LayerRange(*layers)) for name, layers in LAYERS.items()}
    listening = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(
            run_tracker, host="127.0.0.1", port=0, config=GatewayConfig(), identity=Identity.generate(),
            trusted_ends=frozenset({keys["head"].public, keys["tail"].public}), listening=listening))
        for name, backend in backends.items():
            nursery.start_soon(functools.partial(run_node, backend, node_id=name, host="127.0.0.1", port=0,
                                                 tracker=url, identity=keys[name]))
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            with trio.fail_after(30):
                while True:
                    listed = (await http.get("/v1/nodes")).json()["nodes"] if await _serving(http) else []
                    if sum(n["alive"] for n in listed) == len(LAYERS):
                        break
                    await trio.sleep(0.05)
            yield Cluster(http, backends, nursery)
        nursery.cancel_scope.cancel()


async def _serving(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


def _honest() -> str:
    return expected_greedy([WHOLE], WHOLE.tokenize(PROMPT, add_special=True, parse_special=True), TOKENS).text


def _mid_holds_its_first_sampled_step(monkeypatch, run: Cluster,
                                      act: Callable[[Relay, Outgoing], Awaitable[None]]) -> None:
    """Patch the node `mid`: the first step it computed whose answer is a token (the prompt's last chunk) waits
    until `act(relay, item)` has run, then goes on as an honest node sends it."""
    original = Relay.put
    pending = [True]

    async def act_then_pass_on(relay: Relay, item: Outgoing) -> None:
        await act(relay, item)
        original(relay, item)

    def put(self: Relay, item) -> None:
        if (self.node_id == "mid" and pending[0] and isinstance(item, Outgoing)
                and decode_frame(item.frame).flags & Flag.SAMPLE):
            pending[0] = False
            run.nursery.start_soon(act_then_pass_on, self, item)
            return
        original(self, item)

    monkeypatch.setattr(Relay, "put", put)


def _error_of(r) -> str:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""


async def test_an_untrusted_middle_node_cannot_deliver_an_answer(monkeypatch) -> None:
    """The middle delivers a TOKEN of its own text for the step it holds, with the capability it was handed, then
    passes the step on. Before: the tracker took it, and the client read the lure as the first token. Now the
    middle's capability only reports: its stream is refused (403) before its body is read, the middle is struck
    (what a late step costs), and the client reads the tail's honest answer."""
    answered: list[tuple[int, str]] = []

    async def forge(relay: Relay, item: Outgoing) -> None:
        step = decode_frame(item.frame)
        token = encode_frame(FrameKind.TOKEN, step.session, step.seq, step.pos0 + step.n_tokens - 1, 1, step.width,
                             extra=TokenResult(5, -0.01, LURE.encode(), False).payload())
        stream = await relay.pool(relay.plan.deliver_url).open_stream(DELIVER_STREAM_PATH, [
            ("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, relay.sid),
            (CAPABILITY_HEADER, relay.plan.deliver_capability)])
        try:
            with contextlib.suppress(TransportError):  # a refusal may come before the body is taken
                await stream.send(encode_record((), token))
                await stream.end()
            with trio.fail_after(10):
                r = await stream.answer()
            answered.append((r.status, r.body.decode()))
        finally:
            await stream.release()

    async with cluster() as run:
        _mid_holds_its_first_sampled_step(monkeypatch, run, forge)
        text, error = await run.complete()
        strikes = {n["node"]: n["strikes"] for n in (await run.http.get("/v1/nodes")).json()["nodes"]}
    [(status, body)] = answered
    assert LURE not in text and "attacker.example" not in text, text
    assert status == 403 and "forbidden" in body, (status, body)
    assert (text, error) == (_honest(), None), (text, error)
    assert strikes == {"head": 0, "mid": 1, "tail": 0}, strikes


async def test_a_members_report_is_its_capability_holders_never_the_name_in_its_body(monkeypatch) -> None:
    """The middle reports, with the capability it holds, a failure of the tail in the head's name. Before: the
    tracker believed the body's reporter (204) and failed the session saying the head reported it. Now that
    report is refused (403), the middle is struck, and the session answers as if nothing had come; a report that names no reporter is
    the middle's own, and the client is told so."""
    answers: list[tuple[int, str]] = []

    def reporting(reporter: str | None):
        async def report(relay: Relay, item: Outgoing) -> None:
            data = {"session": relay.sid, "code": "node_error", "message": LURE, "node": "tail"}
            if reporter is not None:
                data["reporter"] = reporter
            r = await relay.pool(relay.plan.deliver_url).request(
                "POST", DELIVER_PATH, json.dumps(data).encode(),
                [("Content-Type", "application/json"), (ROUTE_SESSION_HEADER, relay.sid),
                 (CAPABILITY_HEADER, relay.plan.deliver_capability)])
            answers.append((r.status, r.body.decode()))
        return report

    async with cluster() as run:
        _mid_holds_its_first_sampled_step(monkeypatch, run, reporting("head"))
        spoofed = await run.complete()
        strikes = {n["node"]: n["strikes"] for n in (await run.http.get("/v1/nodes")).json()["nodes"]}
        _mid_holds_its_first_sampled_step(monkeypatch, run, reporting(None))
        own = await run.complete()
    (status, body), (own_status, own_body) = answers
    assert status == 403 and "forbidden" in body, (status, body)
    assert spoofed == (_honest(), None), spoofed
    assert strikes == {"head": 0, "mid": 1, "tail": 0}, strikes  # an honest node names itself: caught, struck
    assert own_status == 204, own_body
    text, error = own
    assert error is not None and error["code"] == "node_error" and error["node"] == "tail", error
    assert "node mid reported node_error for node tail" in error["message"], error
    assert "attacker.example" not in text + json.dumps(error)


async def test_a_tail_cannot_send_text_that_is_not_its_tokens(monkeypatch) -> None:
    """The trusted tail answers every token with the lure as its bytes (its token ids are honest). Before: the
    tracker streamed the bytes as they came, and the client read the lure twelve times. Now the tracker checks
    each answer against its token id with the model's vocabulary: the first is refused and the session fails
    naming the tail. An honest route beside it answers as before."""
    async with cluster() as run:
        honest = await run.complete()
        original, tail = StubBackend.token_bytes, run.backends["tail"]
        monkeypatch.setattr(StubBackend, "token_bytes",
                            lambda self, token: LURE.encode() if self is tail else original(self, token))
        text, error = await run.complete()
    assert honest == (_honest(), None), honest
    assert LURE not in text and "attacker.example" not in text, text
    assert error is not None and (error["code"], error["node"]) == ("node_error", "tail"), error
    assert "not token" in error["message"] and "attacker.example" not in json.dumps(error), error


async def test_a_tail_cannot_end_an_answer_on_a_token_that_does_not_end_it(monkeypatch) -> None:
    """The tail flags its first token as the end of generation (its id and bytes are honest). Before: the tracker
    ended the answer there, empty, as a clean stop. Now that flag is checked against the token id too: refused,
    and the session fails naming the tail."""
    import dgr.node.replies as replies

    original = replies.NodeReplies.sample
    tail: list[StubBackend] = []

    def sample(self, frame, sampler, out) -> TokenResult:
        result = original(self, frame, sampler, out)
        return attrs.evolve(result, eog=True) if any(self.backend is t for t in tail) else result

    async with cluster() as run:
        tail.append(run.backends["tail"])
        monkeypatch.setattr(replies.NodeReplies, "sample", sample)
        text, error = await run.complete()
    assert text == "" and error is not None and (error["code"], error["node"]) == ("node_error", "tail"), (text, error)
    assert "end of generation" in error["message"], error


def test_relay_plans_give_the_answers_capability_to_the_tail_alone_each_bound_to_its_holder() -> None:
    """Each hop's capability for the tracker names the hop itself: DELIVER on the tail, REPORT elsewhere; none of
    them is a step, or any other call, on a node (not even the holder's own)."""
    tracker = Identity.generate()
    hops = tuple(Hop(name, f"http://{name}.test:9000", *layers) for name, layers in LAYERS.items())
    sid = uuid.uuid4().hex
    plans = Credentials(CapabilityAuthority.issuer(tracker), 60.0, {}).relay_plans(sid, hops)
    verifier = CapabilityAuthority.verifier(tracker.public)
    for hop in hops:
        token = plans[hop.node_id].deliver_capability
        cap = verifier.holder(token, session=sid, now=time.time(), need=Scope.REPORT)
        assert (cap.node, cap.start, cap.stop) == (hop.node_id, hop.start, hop.stop)
        assert cap.scope is (Scope.DELIVER if hop is hops[-1] else Scope.REPORT)
        for need in (Scope.STEP, Scope.CONTROL):
            with pytest.raises(CallerError, match="for what a node sends the tracker"):
                verifier.check(token, session=sid, node=hop.node_id, start=hop.start, stop=hop.stop,
                               now=time.time(), need=need)
        if cap.scope is Scope.REPORT:
            with pytest.raises(CallerError, match="only the route's tail delivers"):
                verifier.holder(token, session=sid, now=time.time(), need=Scope.DELIVER)
