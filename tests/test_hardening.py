"""Limits, cleanup and bad-input paths, trio-level: an in-process route (real node apps, real gateway, no sockets).

Each test here was written against the code before its fix and failed there.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import trio
import trio.testing

from dgr.api.openai import parse_request
from dgr.errors import CallerError, PeerError, Reason
from dgr.node.membership import HEARTBEAT_RANGE_S, HEARTBEAT_S, RETRY_MIN_S, stay_registered
from dgr.sampling import SamplingParams
from dgr.seam.opening import OpenRequest
from dgr.seam.wire import NODE_HEADER
from dgr.security.identity import Identity
from dgr.testing.inproc import InProcRoute, http_scope, receive_once
from dgr.testing.nodes import settled
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import GatewayConfig
from dgr.tracker.registry import Registry
from dgr.tracker.seam_client import NodeClient

QUIET = GatewayConfig(sweep_s=3600.0)  # no background sweeps: each test drives time and reconciliation itself


def _req(prompt: str = "hello", **kw):
    return parse_request({"model": "stub", "prompt": prompt, "temperature": 0, **kw}, "completion")


async def _drain(live) -> str:
    text = []
    async for delta in live.recv:
        text.append(delta.text)
    return "".join(text)


# -- one sampling validator --------------------------------------------------------------------------------


def _node_sampling(sampling: dict) -> SamplingParams:
    """The sampling a node reads from an open that carries `sampling`."""
    body = {"session": "a" * 32, "max_positions": 64, "relay": {"next": None}, "sampling": sampling}
    return OpenRequest.from_json(body, named=None, max_positions=64, vocab_size=98).sampling


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 - 1, True, 1.5, "7"])
def test_gateway_and_nodes_refuse_the_same_seeds(seed) -> None:
    with pytest.raises(CallerError) as api:
        _req(seed=seed)
    with pytest.raises(CallerError) as node:
        _node_sampling({"seed": seed})
    assert api.value.reason is node.value.reason is Reason.INVALID_REQUEST
    assert api.value.details.get("param") == "seed" and api.value.message == node.value.message


def test_gateway_and_nodes_accept_the_same_seeds() -> None:
    for seed in (None, 0, 2**63 - 1):
        assert _req(seed=seed).sampling == _node_sampling({"temperature": 0, "seed": seed})


# -- context clamp ------------------------------------------------------------------------------------------


async def test_context_is_the_smallest_ctx_on_the_route(nursery) -> None:
    route = InProcRoute.stub(n_ctx=(64, 48), config=QUIET)
    route.register_all()
    assert [n.max_positions for n in route.registry.nodes.values()] == [64, 48]  # advertised at registration
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=1000, ignore_eos=True))
    await _drain(live)
    assert live.rs.finish_reason == "length" and live.rs.completion_tokens == 48 - len("hello")
    # and the prompt limit defaults to the same context
    with pytest.raises(CallerError) as err:
        await route.gateway.open(_req("x" * 48))
    assert err.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED and "context is 48" in err.value.message


# -- prompt bytes are capped before tokenizing --------------------------------------------------------------


async def test_prompt_bytes_are_refused_before_the_head_tokenizes(nursery) -> None:
    route = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0, max_prompt_tokens=10))
    route.register_all()
    calls: list = []
    route.wrap = lambda client: _Spy(client, calls)
    await nursery.start(route.run)
    with pytest.raises(CallerError) as err:
        await route.gateway.open(_req("y" * 1000))
    assert err.value.reason is Reason.PROMPT_TOO_LARGE and err.value.details["param"] == "prompt"
    assert calls == []  # the head never saw it
    with pytest.raises(CallerError) as err:  # a short prompt of too many tokens is still counted in tokens
        await route.gateway.open(_req("y" * 40))
    assert err.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED and len(calls) == 1


class _Spy:
    """A NodeClient stand-in that records the opens that carry a prompt (the head tokenizes inside its open)
    and forwards everything."""

    def __init__(self, inner: NodeClient, calls: list) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def open(self, req, *a, **kw):
        if req.prompt is not None:
            self._calls.append(req.prompt)
        return await self._inner.open(req, *a, **kw)


# -- lost nodes and lost replies do not keep KV -------------------------------------------------------------


async def test_a_lost_node_that_comes_back_has_the_sessions_closed(nursery) -> None:
    route = InProcRoute.stub(delay_s=0.001, config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=100_000, ignore_eos=True, stream=True))
    await live.recv.receive()  # decoding
    route.gateway.node_lost("n1", "declared lost while only slow")
    await _drain(live)
    assert live.rs.failure.reason is Reason.ROUTE_NODE_LOST
    slow = route.services[1]
    assert live.rs.sid in slow.sessions  # nobody told it: the gateway skipped the lost node
    with pytest.raises(CallerError):  # its next heartbeat is refused: it registers again
        route.heartbeat(1)
    route.register(1)
    route.heartbeat(1)
    assert route.gateway.reconcile() == [("n1", live.rs.sid)]
    await settled(*route.services)
    assert not slow.sessions and slow.backend.kv_bytes() == 0
    assert not route.services[0].sessions  # the survivor was closed at once, as before
    route.heartbeat(1)
    assert route.gateway.reconcile() == []


async def test_an_open_whose_reply_was_lost_is_closed_on_the_next_heartbeat(nursery) -> None:
    route = InProcRoute.stub(config=QUIET)

    class LostReply(_Spy):
        async def open(self, *a, **kw):
            await self._inner.open(*a, **kw)
            raise PeerError(Reason.ROUTE_NODE_LOST, "the reply was lost", node=self._inner.node_id)

    route.wrap = lambda client: LostReply(client, []) if client.node_id == "n1" else client
    route.register_all()
    await nursery.start(route.run)
    with pytest.raises(PeerError):
        await route.gateway.open(_req())
    held = route.services[1].sessions
    (sid,) = held
    assert not route.gateway.sessions and ("n1", sid) in route.gateway.unclosed
    # n0's open may have been cut off by n1's failure after n0 took it: then n0 is owed a close too
    await settled(*route.services)
    route.heartbeat(0)
    route.heartbeat(1)
    assert ("n1", sid) in route.gateway.reconcile()
    await settled(*route.services)
    assert not route.services[1].sessions and not route.services[0].sessions and not route.gateway.unclosed


async def test_sessions_running_or_opened_by_someone_else_are_left_alone(nursery) -> None:
    from dgr.node.relay import NextHop, RelayPlan
    from dgr.sampling import SamplingParams
    from dgr.testing.inproc import TRACKER_URL

    route = InProcRoute.stub(delay_s=0.001, config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=100_000, ignore_eos=True, stream=True))
    await live.recv.receive()
    plan = RelayPlan(NextHop("n1", route.urls[1], None), TRACKER_URL, None)
    await route.services[0].open_session("f" * 32, 8, SamplingParams(), plan)  # not this gateway's
    route.heartbeat(0)
    route.heartbeat(1)
    assert route.gateway.reconcile() == []
    route.gateway.cancel(live.rs.sid, "done with it")
    await _drain(live)
    assert list(route.services[0].sessions) == ["f" * 32] and not route.gateway.unclosed


# -- a stream whose body never starts -----------------------------------------------------------------------


async def test_a_stream_nobody_starts_reading_is_cancelled(nursery) -> None:
    """The client left after `open` and before the SSE body started: nothing else would ever cancel it."""
    route = InProcRoute.stub(delay_s=0.001, config=GatewayConfig(sweep_s=0.05, unclaimed_stream_s=0.2))
    route.registry.dead_after_s = 3600.0  # nodes stay alive without heartbeats
    route.register_all()
    await nursery.start(route.run)
    tracker = make_tracker_app(route.gateway)
    sent: list[dict] = []
    body = b'{"model": "stub", "prompt": "hi", "max_tokens": 100000, "ignore_eos": true, "stream": true}'
    responded = trio.Event()

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.start":
            # the client is gone: the server tears the connection down before the body starts
            responded.set()
            request_scope.cancel()
            await trio.sleep_forever()

    request_scope = trio.CancelScope()
    nursery.start_soon(_call, tracker, http_scope("POST", "/v1/completions", body), receive_once(body), send,
                       request_scope)
    await responded.wait()
    (live,) = route.gateway.sessions.values()
    with trio.fail_after(30):  # a guard: before the fix it ran on towards max_tokens
        await _drain(live)
    assert live.rs.failure.reason is Reason.CANCELLED and "before its stream started" in live.rs.failure.message
    assert live.rs.completion_tokens < 100_000
    assert not route.services[0].sessions and not route.services[1].sessions


async def _call(app, scope, receive, send, request_scope: trio.CancelScope) -> None:
    with request_scope:
        await app(scope, receive, send)


# -- the death threshold, on trio's clock, and dead entries pruned ------------------------------------------


async def test_death_threshold_survives_slow_heartbeats_on_the_trio_clock(autojump_clock, nursery) -> None:
    route = InProcRoute.stub()
    route.register_all()
    await nursery.start(route.run)
    for _ in range(5):  # heartbeats 2 s apart, as from a node starved of CPU while others load
        await trio.sleep(2.0)
        route.heartbeat(0)
        route.heartbeat(1)
    assert all(n.alive for n in route.registry.nodes.values())
    await trio.sleep(route.registry.dead_after_s + 0.5)
    assert not any(n.alive for n in route.registry.nodes.values())
    assert Registry(dead_after_s=0.5).dead_after_s == 0.5  # configurable (--dead-after)


async def test_dead_nodes_are_forgotten_with_connections_stats_and_metric_labels(autojump_clock, nursery) -> None:
    from dgr.metrics import render

    route = InProcRoute.stub()
    route.register_all()
    gw = route.gateway
    await nursery.start(gw.run)
    gw.clients.get(route.registry.nodes["n1"])
    gw.hop_stats["n1"].overhead_ms.append(1.0)
    gw.metrics.hop_latency_seconds.labels(node="n1").observe(0.001)
    gw.metrics.seam_bytes_total.labels(node="n1", kind="DECODE").inc(10)
    assert b'node="n1"' in render(gw.metrics.registry)

    async def beat() -> None:  # n0 stays; n1 falls silent
        while True:
            await trio.sleep(0.25)
            route.heartbeat(0)

    nursery.start_soon(beat)
    await trio.sleep(route.registry.dead_after_s + route.registry.forget_after_s + 1.0)
    assert list(route.registry.nodes) == ["n0"]
    assert "n1" not in gw.clients.clients and "n1" not in gw.hop_stats
    assert b'node="n1"' not in render(gw.metrics.registry)


def test_default_node_ids_are_derived_from_keys_and_unique_per_process(tmp_path, monkeypatch) -> None:
    """A pid is not unique (in containers it is often 1); a key is, and two nodes on one machine without
    --identity take two key files (the first is locked by its holder)."""
    from dgr.security.identity import claim_identity, is_derived_id, node_id_for

    ids = {Identity.generate().node_id for _ in range(100)}
    assert len(ids) == 100 and all(is_derived_id(i) for i in ids)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    first, second = claim_identity(None, "node"), claim_identity(None, "node")
    assert (first.path.name, second.path.name) == ("node.key", "node-1.key")
    assert first.node_id != second.node_id == node_id_for(second.public)
    assert oct(first.path.stat().st_mode & 0o777) == "0o600"
    again = claim_identity(str(first.path), "node")  # a restart with the same file is the same node
    assert again.node_id == first.node_id


# -- a 401 is retried ---------------------------------------------------------------------------------------


async def test_a_refused_node_retries_with_backoff_and_says_why(autojump_clock, nursery, caplog) -> None:
    route = InProcRoute.stub()
    registers: list[float] = []

    def tracker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/nodes/register":
            registers.append(trio.current_time())
            if len(registers) <= 3:  # e.g. the tracker restarts with a rotated secret
                return httpx.Response(401, json={"error": {"code": "unauthenticated", "message": "bad signature"}})
            return httpx.Response(200, json={"node": "n0", "registered": True, "proof": {"state": "none"},
                                             "tracker_key": Identity.generate().public_text})
        return httpx.Response(200, json={"ok": True, "proof": {"state": "none"}})

    with caplog.at_level(logging.WARNING, logger="dgr.node"):
        await nursery.start(lambda task_status: stay_registered(
            route.services[0], "http://tracker.test", route.urls[0], transport=httpx.MockTransport(tracker),
            task_status=task_status))
    assert len(registers) == 4
    gaps = [b - a for a, b in zip(registers, registers[1:])]
    assert gaps[0] >= RETRY_MIN_S and gaps[0] < gaps[1] < gaps[2]
    said = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(said) == 3 and "refused this node (unauthenticated): bad signature" in said[0]


# -- the tracker sets the heartbeat period -------------------------------------------------------------------


async def test_the_tracker_tells_its_nodes_how_often_to_beat() -> None:
    """A tracker that declares nodes dead after 3 s asks for a beat every 0.5 s; after 1 s, every 1/6 s."""
    from dgr.node.membership import registration
    from dgr.testing.inproc import asgi_client

    for dead_after, period in ((3.0, 0.5), (1.0, 1 / 6)):
        route = InProcRoute.stub()
        route.registry.dead_after_s = dead_after
        app = make_tracker_app(route.gateway)
        body, headers = route.signed(0, "/v1/nodes/register", registration(route.services[0], route.urls[0]))
        async with asgi_client(app, "http://127.0.0.1:8000") as http:
            r = await http.post("/v1/nodes/register", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["heartbeat_s"] == pytest.approx(period)


@pytest.mark.parametrize("said, period", [(0.5, 0.5), (2, 2.0), (1e-9, HEARTBEAT_RANGE_S[0]), (1e9, HEARTBEAT_RANGE_S[1]),
                                          (float("nan"), HEARTBEAT_S), ("0.5", HEARTBEAT_S), (True, HEARTBEAT_S),
                                          (None, HEARTBEAT_S)])
async def test_a_node_beats_at_the_period_its_tracker_asks_for_within_bounds(autojump_clock, nursery, said,
                                                                              period) -> None:
    route = InProcRoute.stub()
    beats: list[float] = []
    reply = {"node": "n0", "registered": True, "proof": {"state": "none"},
             "tracker_key": Identity.generate().public_text}
    if said is not None:
        reply["heartbeat_s"] = said

    def tracker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/nodes/register":  # json.dumps writes NaN, as a tracker's JSON might
            return httpx.Response(200, content=json.dumps(reply), headers={"Content-Type": "application/json"})
        beats.append(trio.current_time())
        return httpx.Response(200, json={"ok": True, "proof": {"state": "none"}})

    with trio.fail_after(120):  # trio's clock (autojump): a node that never registers fails, it does not spin
        await nursery.start(lambda task_status: stay_registered(
            route.services[0], "http://tracker.test", route.urls[0], transport=httpx.MockTransport(tracker),
            task_status=task_status))
        while len(beats) < 4:
            await trio.sleep(0.01)
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert gaps == pytest.approx([period] * 3)
    nursery.cancel_scope.cancel()


# -- membership input never makes a 5xx ---------------------------------------------------------------------


async def test_bad_heartbeats_and_registrations_are_refused_with_4xx() -> None:
    from dgr.node.membership import registration
    from dgr.testing.inproc import asgi_client

    route = InProcRoute.stub()
    app = make_tracker_app(route.gateway)
    good = registration(route.services[0], route.urls[0])

    async def post(http, path: str, data):
        body, headers = route.signed(0, path, data)  # signed by n0's own key: past the signature check
        return await http.post(path, content=body, headers={**headers, NODE_HEADER: "n0"})

    async with asgi_client(app, "http://127.0.0.1:8000") as http:
        assert (await post(http, "/v1/nodes/register", good)).status_code == 200
        for beat in ({"node": "n0", "sessions": "many"}, {"node": "n0", "kv_bytes": [1]},
                     {"node": "n0", "sessions": -1}, {"node": "n0", "session_ids": "all"},
                     {"node": "n0", "session_ids": [5]}, {"node": ["n0"]}, {"node": "n0", "sessions": True}):
            r = await post(http, "/v1/nodes/heartbeat", beat)
            assert r.status_code in (400, 404), (beat, r.status_code, r.text)
        for change in ({"capacity": 1e300}, {"layers": [0, "x"]}, {"layers": 5}, {"url": "::nonsense"},
                       {"model": {**good["model"], "n_layers": "30"}}, {"model": []}, {"pid": "1"},
                       {"artifact": ["x"]}, {"max_positions": 0}, {"describe": 3}, {"tls_cert": "not a cert"}):
            r = await post(http, "/v1/nodes/register", {**good, **change})
            assert r.status_code == 400, (change, r.status_code, r.text)


# -- node bodies are limited to what they need --------------------------------------------------------------


async def test_node_routes_other_than_the_seam_take_small_bodies(nursery) -> None:
    from dgr.testing.inproc import asgi_client

    route = InProcRoute.stub()
    await nursery.start(route.run)
    big = b'{"pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    async with asgi_client(route.apps[route.urls[0]], route.urls[0]) as http:
        for method, path in (("POST", "/v1/artifact/challenge"), ("POST", "/nowhere"),
                             ("DELETE", "/v1/seam/sessions/" + "a" * 32), ("GET", "/v1/node/status")):
            r = await http.request(method, path, content=big, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", (method, path, r.text)
        # a prompt may be larger, up to the gateway's own body limit: the head tokenizes it inside its open
        r = await http.post("/v1/seam/sessions", json={"session": "b" * 32, "max_positions": 64, "sampling": {},
                                                       "prompt": {"prompt": "y" * (2 * 1024 * 1024)}, "max_new": 1,
                                                       "relay": {"next": {"node": "n1", "url": route.urls[1]}}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"the prompt has {2 * 1024 * 1024} tokens" in r.json()["error"]["message"]
        big = b'{"pad": "' + b"x" * (5 * 1024 * 1024) + b'"}'  # past that limit, even an open is refused unread
        r = await http.post("/v1/seam/sessions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text


def test_dgr_up_passes_the_death_threshold_to_its_tracker() -> None:
    from dgr.cli import build_parser
    from dgr.up import tracker_args

    args = build_parser().parse_args(["up", "--dead-after", "1.5"])
    cmd = tracker_args(args)
    assert cmd[cmd.index("--dead-after") + 1] == "1.5"
    assert build_parser().parse_args(["tracker"]).dead_after == 3.0


async def test_a_beat_that_does_not_reach_the_tracker_is_sent_again_soon(autojump_clock, nursery) -> None:
    """Driven as the inside soak's flood was: the tracker at its connection cap turns the node's new
    connection away (a transport error) twice. The node beats again within a fraction of its period, as a
    heartbeat (no registration again), so the tracker never goes its death threshold without hearing it."""
    route = InProcRoute.stub()
    beats: list[float] = []
    registers: list[float] = []

    def tracker(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/nodes/register":
            registers.append(trio.current_time())
            return httpx.Response(200, json={"node": "n0", "registered": True, "proof": {"state": "none"},
                                             "heartbeat_s": 0.5, "tracker_key": Identity.generate().public_text})
        beats.append(trio.current_time())
        if len(beats) in (3, 4):
            raise httpx.ConnectError("connection reset by peer", request=request)  # closed at the door, unread
        return httpx.Response(200, json={"ok": True, "proof": {"state": "none"}})

    with trio.fail_after(120):
        await nursery.start(lambda task_status: stay_registered(
            route.services[0], "http://tracker.test", route.urls[0], transport=httpx.MockTransport(tracker),
            task_status=task_status))
        while len(beats) < 6:
            await trio.sleep(0.01)
    gaps = [round(b - a, 3) for a, b in zip(beats, beats[1:])]
    assert len(registers) == 1, registers  # still registered: a beat not delivered is no refusal
    assert gaps == [0.5, 0.5, 0.05, 0.1, 0.5], gaps  # the 3rd and 4th turned away: again in 0.05, then 0.1 s
    nursery.cancel_scope.cancel()
