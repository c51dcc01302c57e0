"""The gateway's deadlines on trio's MockClock: an in-process route (real node apps, real gateway, no sockets).

Each fault is injected where it happens (a node that never answers, a node
that is slow, a reader that stops reading, heartbeats that stop), and the
time it takes to be caught is read off the mock clock, exactly, instead of
slept through on the wall clock. The node schedulers run inline, so compute
takes no mock time and every second that passes is one the test chose.
"""

from __future__ import annotations

import uuid

import trio
import trio.testing

from dgr.api.openai import parse_request
from dgr.errors import Reason
from dgr.sampling import SamplingParams
from dgr.seam.frame import encode_frame
from dgr.seam.wire import Flag, FrameKind
from dgr.testing.inproc import InProcRoute, http_scope, receive_once
from dgr.testing.nodes import settled
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import GatewayConfig

BEAT_S = 0.25


def _req(**kw):
    return parse_request({"model": "stub", "prompt": "hello", "temperature": 0, **kw}, "completion")


async def _drain(live) -> int:
    """Read the session to its end; a session nothing ends fails here after a minute of mock time."""
    n = 0
    with trio.fail_after(60):
        async for _ in live.recv:
            n += 1
    return n


class _Slow:
    """A NodeClient whose steps each take `step_s` of (mock) time; `hang` makes the node answer nothing
    (a hung process), `busy` makes its steps never answer while its /healthz still does (a node whose
    loop runs while its compute does not finish)."""

    def __init__(self, inner, step_s: float, hang: trio.Event | None = None, busy: trio.Event | None = None,
                 slow_s: float = 0.0) -> None:
        self._inner, self._step_s, self._hang, self._busy, self._slow_s = inner, step_s, hang, busy, slow_s

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def step(self, *a, **kw):
        for event in (self._hang, self._busy):
            if event is not None and event.is_set():
                if self._slow_s:
                    await trio.sleep(self._slow_s)
                    break
                await trio.sleep_forever()
        await trio.sleep(self._step_s)
        return await self._inner.step(*a, **kw)

    async def alive(self):
        if self._hang is not None and self._hang.is_set():
            await trio.sleep_forever()
        return await self._inner.alive()


async def _beat(route: InProcRoute, nodes: list[int]) -> None:
    while True:
        await trio.sleep(BEAT_S)
        for i in nodes:
            route.heartbeat(i)


async def test_a_node_that_stops_answering_fails_the_session_at_its_step_deadline(autojump_clock, nursery) -> None:
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1)
    route = InProcRoute.stub(config=cfg, inline=True)
    hang = trio.Event()
    route.wrap = lambda client: _Slow(client, 0.01, hang) if client.node_id == "n1" else client
    route.register_all()
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])  # heartbeats go on: only the step deadline can catch it
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    await live.recv.receive()  # decoding
    hang.set()
    hung_at = trio.current_time()
    await _drain(live)
    waited = trio.current_time() - hung_at
    failure = live.rs.failure
    assert (failure.reason, failure.node, failure.phase) == (Reason.ROUTE_NODE_LOST, "n1", "decode"), failure
    assert "did not answer step" in failure.message and "liveness probe" in failure.message
    # caught by the deadline of one decode step (10 s + 1 token x 50 ms), give or take a step in flight
    assert cfg.step_deadline_s + cfg.per_token_deadline_s <= waited <= cfg.step_deadline_s + 0.2, waited


async def test_a_node_slower_than_its_deadline_that_answers_its_probe_is_waited_for(autojump_clock, nursery) -> None:
    """A step that takes 2.5 times the deadline (other sessions' prompts, a CPU hog) on a node that
    answers /healthz at once: the deadline extends, the session finishes, and no node is lost."""
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1)
    route = InProcRoute.stub(config=cfg, inline=True)
    busy = trio.Event()
    route.wrap = lambda client: _Slow(client, 0.01, busy=busy, slow_s=25.0) if client.node_id == "n1" else client
    route.register_all()
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])
    live = await route.gateway.open(_req(max_tokens=3, ignore_eos=True, stream=True))
    await live.recv.receive()  # decoding
    busy.set()
    slow_at = trio.current_time()
    await _drain(live)
    assert live.rs.failure is None and live.rs.completion_tokens == 3
    assert trio.current_time() - slow_at >= 25.0, "a step did wait past its deadline"
    assert route.gateway.slow_waits > 0
    assert all(n.alive for n in route.registry.nodes.values())


async def test_a_node_that_answers_its_probe_but_never_its_step_times_out_at_the_cap(autojump_clock, nursery) -> None:
    """A node whose loop answers but whose step never ends is too slow, not lost: `session_timeout` at
    `slow_cap` times the deadline, and the node stays alive in the registry."""
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1, slow_cap=3.0)
    route = InProcRoute.stub(config=cfg, inline=True)
    busy = trio.Event()
    route.wrap = lambda client: _Slow(client, 0.01, busy=busy) if client.node_id == "n1" else client
    route.register_all()
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    await live.recv.receive()
    busy.set()
    busy_at = trio.current_time()
    await _drain(live)
    waited = trio.current_time() - busy_at
    failure = live.rs.failure
    assert failure.reason is Reason.SESSION_TIMEOUT and "not lost" in failure.message, failure
    assert 3 * (cfg.step_deadline_s + cfg.per_token_deadline_s) <= waited <= 3 * (cfg.step_deadline_s + 0.05) + 0.2
    assert all(n.alive for n in route.registry.nodes.values())


async def test_heartbeats_that_stop_fail_the_session_after_the_death_threshold(autojump_clock, nursery) -> None:
    route = InProcRoute.stub(config=GatewayConfig(sweep_s=0.1), inline=True)
    route.wrap = lambda client: _Slow(client, 0.01)
    route.register_all()
    await nursery.start(route.run)
    n1_beats = trio.CancelScope()

    async def beat_n1() -> None:
        with n1_beats:
            await _beat(route, [1])

    nursery.start_soon(_beat, route, [0])
    nursery.start_soon(beat_n1)
    live = await route.gateway.open(_req(max_tokens=100_000, ignore_eos=True, stream=True))
    await live.recv.receive()
    n1_beats.cancel()  # n1 hangs: its heartbeats stop, but it does not refuse connections
    silent_at = trio.current_time()
    await _drain(live)
    waited = trio.current_time() - silent_at
    failure = live.rs.failure
    assert (failure.reason, failure.node) == (Reason.ROUTE_NODE_LOST, "n1") and "heartbeats" in failure.message
    dead_after = route.registry.dead_after_s
    assert dead_after - BEAT_S <= waited <= dead_after + 0.2, waited
    assert not route.services[0].sessions  # the survivor was told to drop it


async def test_a_session_past_its_time_limit_fails_with_session_timeout(autojump_clock, nursery) -> None:
    route = InProcRoute.stub(config=GatewayConfig(sweep_s=0.1, max_session_s=5.0), inline=True)
    route.registry.dead_after_s = 3600.0
    route.wrap = lambda client: _Slow(client, 0.02)
    route.register_all()
    await nursery.start(route.run)
    started = trio.current_time()
    live = await route.gateway.open(_req(max_tokens=100_000, ignore_eos=True))
    tokens = await _drain(live)
    assert live.rs.failure.reason is Reason.SESSION_TIMEOUT and "limit of 5s" in live.rs.failure.message
    assert 5.0 <= trio.current_time() - started <= 5.2
    assert 0 < tokens < 100_000
    assert not route.services[0].sessions and not route.services[1].sessions


async def test_a_reader_that_stops_reading_is_cancelled_as_a_slow_client(autojump_clock, nursery) -> None:
    route = InProcRoute.stub(config=GatewayConfig(sweep_s=0.1, slow_client_s=2.0), inline=True)
    route.registry.dead_after_s = 3600.0
    route.wrap = lambda client: _Slow(client, 0.01)
    route.register_all()
    await nursery.start(route.run)
    tracker = make_tracker_app(route.gateway)
    body = b'{"model": "stub", "prompt": "hi", "max_tokens": 100000, "ignore_eos": true, "stream": true}'
    chunks_taken = 0
    stalled = trio.Event()

    async def send(message):
        nonlocal chunks_taken
        if message["type"] == "http.response.body" and message.get("body"):
            chunks_taken += 1
            if chunks_taken >= 3:  # the reader takes three chunks, then its socket stays full
                stalled.set()
                await trio.sleep_forever()

    with trio.CancelScope() as request_scope:
        nursery.start_soon(tracker, http_scope("POST", "/v1/completions", body), receive_once(body), send)
        await stalled.wait()
        stalled_at = trio.current_time()
        (live,) = route.gateway.sessions.values()
        await _drain(live)
        request_scope.cancel()
    failure = live.rs.failure
    assert failure.reason is Reason.SLOW_CLIENT and "for over 2s" in failure.message
    assert 2.0 <= trio.current_time() - stalled_at <= 2.2
    assert not route.services[0].sessions and not route.services[1].sessions


async def test_a_node_session_left_idle_is_failed_and_its_kv_freed_on_the_trio_clock(autojump_clock, nursery) -> None:
    """A node frees a session nobody steps for `idle_timeout_s` (its gateway gone, say) on its own, within a
    second of the timeout: sessions are stamped and checked on trio's clock."""
    route = InProcRoute.stub(splits=((0, 30),), inline=True)
    node = route.services[0]
    node.idle_timeout_s = 30.0
    idle, busy = uuid.UUID(int=1).hex, uuid.UUID(int=2).hex
    await nursery.start(route.run)
    for sid in (idle, busy):
        await node.open_session(sid, 64, SamplingParams(temperature=0.0))
    await settled(node)
    opened = trio.current_time()
    await trio.sleep(29.0)
    assert set(node.sessions) == {idle, busy}
    width = node.backend.info.seam_width
    await node.step(encode_frame(FrameKind.PREFILL, busy, 0, 0, 3, width, token_ids=[3, 14, 15], flags=Flag.SAMPLE))
    await trio.sleep(2.1)
    await settled(node)
    assert idle not in node.sessions and node.ended[idle].reason is Reason.SESSION_TIMEOUT
    assert busy in node.sessions, "a session stepped within the timeout stays"
    assert 30.0 < trio.current_time() - opened <= 31.1
    assert node.scheduler.kv_bytes > 0
    await node.close_session(busy)
    await settled(node)
    assert node.scheduler.session_count == 0 and node.scheduler.kv_bytes == 0
