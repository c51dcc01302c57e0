"""The default topology's deadlines on trio's MockClock: an in-process ring (real node apps, real gateway and
tracker app, in-memory links, no sockets).

Each fault is injected where it happens (a node that never answers, a node
that is slow, a node killed mid-decode, a reader that stops reading,
heartbeats that stop, a phase group's member that stalls), and the time it
takes to be caught is read off the mock clock, exactly, instead of slept
through on the wall clock. The node schedulers run inline, so compute takes
no mock time: every second that passes is one the test chose (each link's
latency, a stall).
"""

from __future__ import annotations

import uuid

import pytest
import trio
import trio.testing

from dgr.api.openai import parse_request
from dgr.errors import DgrError, Reason
from dgr.fsm.phases import MAX_HOLD_S
from dgr.sampling import SamplingParams
from dgr.node.relay import Loop, NextHop, RelayPlan
from dgr.seam.frame import encode_frame
from dgr.seam.stream import Record
from dgr.seam.wire import HEADER_SIZE, Flag, FrameKind
from dgr.testing.inproc import TRACKER_URL, InProcRoute, asgi_client, http_scope, receive_once
from dgr.testing.nodes import settled
from dgr.tracker.gateway import GatewayConfig

BEAT_S = 0.25


def _req(**kw):
    return parse_request({"model": "stub", "prompt": "hello", "temperature": 0, **kw}, "completion")


async def _drain(live, within_s: float = 60.0) -> int:
    """Read the session to its end; a session nothing ends fails here after `within_s` of mock time."""
    n = 0
    with trio.fail_after(within_s):
        async for _ in live.recv:
            n += 1
    return n


async def _beat(route: InProcRoute, nodes: list[int]) -> None:
    while True:
        await trio.sleep(BEAT_S)
        for i in nodes:
            route.heartbeat(i)


def _ring(config: GatewayConfig, splits=((0, 15), (15, 30)), latency_s: float = 0.01) -> InProcRoute:
    """A ring (the default topology) whose records each take `latency_s` of mock time to arrive."""
    route = InProcRoute.stub(splits=splits, config=config, inline=True)
    route.latency(latency_s)
    route.register_all()
    return route


ROUTE = 2  # nodes on the default route


async def test_a_tail_that_stops_answering_fails_the_session_at_the_route_deadline(autojump_clock, nursery) -> None:
    """A ring's tail that hangs (its steps and its /healthz unanswered) while heartbeats go on: the session
    fails after the route's deadline (a step's, per node) naming the tail, caught by its silent probe."""
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1)
    route = _ring(cfg)
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])  # heartbeats go on: only the route deadline can catch it
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    await live.recv.receive()  # decoding
    route.stall(1, hang=True)
    hung_at = trio.current_time()
    await _drain(live)
    waited = trio.current_time() - hung_at
    failure = live.rs.failure
    assert (failure.reason, failure.node, failure.phase) == (Reason.ROUTE_NODE_LOST, "n1", "decode"), failure
    assert "gave no answer to step" in failure.message and "liveness probe" in failure.message
    deadline = ROUTE * (cfg.step_deadline_s + cfg.per_token_deadline_s)  # the route's, for one decode step
    assert deadline <= waited <= deadline + 0.1, waited
    assert not route.services[0].sessions  # the survivor was told to drop it
    # once it runs again it registers anew (its next heartbeat is refused), and serves new sessions
    route.resume(1)
    route.register(1)
    again = await route.gateway.open(_req(max_tokens=3, ignore_eos=True))
    await _drain(again)
    assert again.rs.failure is None and again.rs.completion_tokens == 3


async def test_a_head_that_hangs_is_the_node_named(autojump_clock, nursery) -> None:
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1)
    route = _ring(cfg)
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    await live.recv.receive()
    route.stall(0, hang=True)
    hung_at = trio.current_time()
    await _drain(live)
    failure = live.rs.failure
    assert (failure.reason, failure.node) == (Reason.ROUTE_NODE_LOST, "n0"), failure
    deadline = ROUTE * (cfg.step_deadline_s + cfg.per_token_deadline_s)
    assert deadline <= trio.current_time() - hung_at <= deadline + 0.1


async def test_a_ring_slower_than_its_deadline_that_answers_its_probe_is_waited_for(autojump_clock, nursery) -> None:
    """A tail that computes nothing for 1.25 times the route's deadline (other sessions' long prompts, a
    CPU hog) but answers /healthz at once: the deadline extends, the session finishes, no node is lost."""
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1)
    route = _ring(cfg)
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])
    live = await route.gateway.open(_req(max_tokens=3, ignore_eos=True, stream=True))
    await live.recv.receive()  # decoding
    route.stall(1)
    slow_at = trio.current_time()
    await trio.sleep(25.0)
    route.resume(1)
    await _drain(live)
    assert live.rs.failure is None and live.rs.completion_tokens == 3
    assert trio.current_time() - slow_at >= 25.0, "a step did wait past its deadline"
    stats = route.gateway.stats()  # as /v1/stats shows it
    assert stats["slow_waits"] > 0 and not stats["failures"], stats
    assert all(n.alive for n in route.registry.nodes.values())


async def test_a_ring_that_answers_its_probes_but_never_its_step_times_out_at_the_cap(autojump_clock, nursery) -> None:
    """A tail whose loop answers but whose compute never ends is too slow, not lost: `session_timeout` at
    `slow_cap` times the route's deadline (the session's one budget of extensions), naming the tail that held
    the step, which takes a strike for it and stays alive in the registry."""
    cfg = GatewayConfig(step_deadline_s=10.0, per_token_deadline_s=0.05, sweep_s=0.1, slow_cap=3.0)
    route = _ring(cfg)
    await nursery.start(route.run)
    nursery.start_soon(_beat, route, [0, 1])
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    await live.recv.receive()
    route.stall(1)
    busy_at = trio.current_time()
    await _drain(live, within_s=120.0)
    waited = trio.current_time() - busy_at
    failure = live.rs.failure
    assert failure.reason is Reason.SESSION_TIMEOUT and "not lost" in failure.message, failure
    assert failure.node == "n1", failure
    cap = cfg.slow_cap * ROUTE * (cfg.step_deadline_s + cfg.per_token_deadline_s)
    assert cap <= waited <= cap + 0.1, waited
    assert all(n.alive for n in route.registry.nodes.values())
    assert len(route.registry.nodes["n1"].standing.strikes) == 1


@pytest.mark.parametrize("killed", [0, 1, 2])
async def test_a_node_killed_mid_decode_fails_the_session_naming_it_and_frees_every_survivor(
        autojump_clock, nursery, killed: int) -> None:
    """A ring of 3 loses its head, middle or tail mid-decode: the node before it (the tail, for the head)
    finds its link broken and reports it; the session fails at once naming it, and each surviving node
    ends with no session and no KV."""
    cfg = GatewayConfig(step_deadline_s=10.0, sweep_s=0.1)
    route = _ring(cfg, splits=((0, 10), (10, 20), (20, 30)))
    route.registry.dead_after_s = 3600.0  # heartbeats cannot catch it: the links must
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=10_000, ignore_eos=True, stream=True))
    for _ in range(3):
        await live.recv.receive()
    route.kill(killed)
    killed_at = trio.current_time()
    await _drain(live)
    failure = live.rs.failure
    assert (failure.reason, failure.node) == (Reason.ROUTE_NODE_LOST, f"n{killed}"), failure
    assert trio.current_time() - killed_at <= 0.6  # a link's refusal grace, not a deadline
    await trio.sleep(1.0)
    for i, service in enumerate(route.services):
        if i != killed:
            await settled(service)
            assert not service.sessions and service.scheduler.session_count == 0, f"n{i}"
            assert service.scheduler.kv_bytes == 0, f"n{i}"
    # no repair and no route without it: a clear no_route naming the layers it held
    with pytest.raises(DgrError) as refused:
        await route.gateway.open(_req(max_tokens=3))
    lost = ("0:10", "10:20", "20:30")[killed]
    assert refused.value.reason is Reason.NO_ROUTE and f"missing layers: {lost}" in refused.value.message


async def test_a_node_killed_in_prefill_is_named_in_prefill(autojump_clock, nursery) -> None:
    cfg = GatewayConfig(step_deadline_s=10.0, sweep_s=0.1, prefill_chunk=16)
    route = _ring(cfg, splits=((0, 10), (10, 20), (20, 30)), latency_s=0.05)
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
    live = await route.gateway.open(_req(prompt="p" * 300, max_tokens=20))  # 19 chunks, pipelined
    await trio.sleep(0.3)
    assert live.rs.state.value == "prefill", live.rs.state
    route.kill(1)
    killed_at = trio.current_time()
    await _drain(live)
    failure = live.rs.failure
    assert (failure.reason, failure.node, failure.phase) == (Reason.ROUTE_NODE_LOST, "n1", "prefill"), failure
    assert trio.current_time() - killed_at <= 0.6
    await trio.sleep(1.0)
    for i in (0, 2):
        await settled(route.services[i])
        assert not route.services[i].sessions and route.services[i].scheduler.kv_bytes == 0, f"n{i}"


async def test_a_node_that_stalls_again_and_again_still_answers_the_same(autojump_clock, nursery) -> None:
    """A node stopped for half of every second (a CPU hog, a SIGSTOP duty cycle) slows its session but
    changes none of its tokens."""
    route = _ring(GatewayConfig(sweep_s=0.1))
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)

    async def text() -> str:
        live = await route.gateway.open(_req(prompt="slow", max_tokens=30, ignore_eos=True))
        out = "".join([d.text async for d in live.recv])
        assert live.rs.failure is None and live.rs.completion_tokens == 30
        return out

    want = await text()
    stalls = 0

    async def duty_cycle() -> None:
        nonlocal stalls
        while True:
            route.stall(1)
            stalls += 1
            await trio.sleep(0.5)
            route.resume(1)
            await trio.sleep(0.5)

    async with trio.open_nursery() as inner:
        inner.start_soon(duty_cycle)
        started = trio.current_time()
        got = await text()
        took = trio.current_time() - started
        inner.cancel_scope.cancel()
    assert stalls > 1 and took > 1.0, (stalls, took)
    assert got == want


async def test_a_full_node_answers_429_after_the_admission_wait_and_its_idle_session_is_freed(autojump_clock,
                                                                                            nursery) -> None:
    """A node whose one slot a session the tracker does not know of holds: the request waits --admission-wait-s
    for room, then is refused 429 node_at_capacity with Retry-After (over HTTP, as a client sees it); the node
    frees the idle session itself, and once the tracker hears of it a request goes through."""
    route = _full_node(GatewayConfig(sweep_s=0.1, admission_wait_s=0.5))
    await nursery.start(route.run)
    await _foreign_session(route)
    body = {"model": "stub", "prompt": "hi", "max_tokens": 2}
    async with asgi_client(route.tracker, TRACKER_URL) as http:
        asked = trio.current_time()
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "node_at_capacity" and r.headers["retry-after"] == "1"
        assert trio.current_time() - asked == pytest.approx(0.5)  # it waited for room first
        await trio.sleep(2.1)  # idle past --idle-timeout; the node looks every second
        await settled(route.services[0])
        assert not route.services[0].sessions and route.services[0].scheduler.kv_bytes == 0
        route.heartbeat(0)  # the tracker hears of the free slot
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text


async def test_an_open_that_a_node_refuses_for_room_the_gateway_counted_free_waits_for_it(autojump_clock,
                                                                                          nursery) -> None:
    """The gateway's count of a node's slots is not the node's: a session the gateway is done with holds its slot
    there until its running step is done (or its owed close lands), and the node frees it with no word to the
    gateway. An open that such a node refuses for room waits (a slot given back, or the node's Retry-After) and
    is tried again within --admission-wait-s: it goes through once the node has freed the slot, where it was
    answered 429 at once (issue 54: one of the storm with kills' requests failed so)."""
    route = _full_node(GatewayConfig(sweep_s=0.1))
    await nursery.start(route.run)
    await _foreign_session(route)
    asked = trio.current_time()
    live = await route.gateway.open(_req())
    assert trio.current_time() - asked > 1.0  # the node freed its idle session (1 s, looked at every second)
    await _drain(live)
    assert live.rs.failure is None
    assert set(route.gateway.stats()["failures"]) == {"node_at_capacity"}  # the refused tries, each its own id


def _full_node(config: GatewayConfig) -> InProcRoute:
    """A ring whose nodes hold one session each, idle ones for a second."""
    route = _ring(config, latency_s=0.0)
    route.registry.dead_after_s = 3600.0
    for service in route.services:
        service.capacity = 1
        service.idle_timeout_s = 1.0
    return route


async def _foreign_session(route: InProcRoute) -> None:
    """Fill the head's one slot with a session the tracker does not know of."""
    await route.services[0].open_session(uuid.UUID(int=7).hex, 8, SamplingParams(temperature=0.0),
                                         RelayPlan(NextHop("n1", route.urls[1], None), TRACKER_URL, None))


async def test_heartbeats_that_stop_fail_the_session_after_the_death_threshold(autojump_clock, nursery) -> None:
    route = _ring(GatewayConfig(sweep_s=0.1))
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
    route = _ring(GatewayConfig(sweep_s=0.1, max_session_s=5.0), latency_s=0.02)
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
    started = trio.current_time()
    live = await route.gateway.open(_req(max_tokens=100_000, ignore_eos=True))
    tokens = await _drain(live)
    assert live.rs.failure.reason is Reason.SESSION_TIMEOUT and "limit of 5s" in live.rs.failure.message
    assert 5.0 <= trio.current_time() - started <= 5.2
    assert 0 < tokens < 100_000
    await trio.sleep(1.0)
    assert not route.services[0].sessions and not route.services[1].sessions
    async with asgi_client(route.tracker, TRACKER_URL) as http:  # not streamed: a 504 in the OpenAI shape
        r = await http.post("/v1/completions", json={"model": "stub", "prompt": "go on", "max_tokens": 100_000,
                                                     "ignore_eos": True, "temperature": 0})
    assert r.status_code == 504 and r.json()["error"]["code"] == "session_timeout", r.text


async def test_a_reader_that_stops_reading_is_cancelled_as_a_slow_client(autojump_clock, nursery) -> None:
    route = _ring(GatewayConfig(sweep_s=0.1, slow_client_s=2.0))
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
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
        nursery.start_soon(route.tracker, http_scope("POST", "/v1/completions", body), receive_once(body), send)
        await stalled.wait()
        stalled_at = trio.current_time()
        (live,) = route.gateway.sessions.values()
        async with asgi_client(route.tracker, TRACKER_URL) as http:  # the tracker serves everyone else
            other = await http.post("/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 3})
        assert other.status_code == 200, other.text
        await _drain(live)
        request_scope.cancel()
    failure = live.rs.failure
    assert failure.reason is Reason.SLOW_CLIENT and "for over 2s" in failure.message
    assert 2.0 <= trio.current_time() - stalled_at <= 2.2
    await trio.sleep(1.0)
    assert not route.services[0].sessions and not route.services[1].sessions


async def _times(live) -> list[float]:
    """When each of `live`'s deltas came (mock time), to its end."""
    out = []
    async for _ in live.recv:
        out.append(trio.current_time())
    return out


async def test_sessions_on_one_route_decode_in_phase_groups_and_a_stalled_member_is_held_at_most_max_hold(
        autojump_clock, nursery) -> None:
    """Four sessions on a 2-node ring form two phase groups (lanes 0-1, 2-3) whose members get each token at
    the same moment (the tail sends their steps to the head as one group). While one member is stalled,
    the other's steps wait for it, at most MAX_HOLD_S each, and go on; the other group is not held."""
    link_s = 0.3  # each hop's record takes this: a token's round trip is 2 x link_s, so a hold is capped
    route = _ring(GatewayConfig(sweep_s=0.1), latency_s=link_s)
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
    lives = [await route.gateway.open(_req(max_tokens=12 if i == 0 else 40, ignore_eos=True, stream=True))
             for i in range(4)]
    times: list[list[float]] = [[] for _ in lives]

    async def read(live, out: list[float]) -> None:
        out.extend(await _times(live))

    async with trio.open_nursery() as readers:
        for live, out in zip(lives, times):
            readers.start_soon(read, live, out)
        await trio.sleep(4.0)
        route.stall(0, session=lives[0].rs.sid)  # its steps stop at the head; its group's others do not
        stalled_at = trio.current_time()
        await trio.sleep(8.0)
        route.resume(0)
        resumed_at = trio.current_time()
    assert all(live.rs.failure is None for live in lives)
    # once its first steps have waited for it (FIRST_HOLD_S each), each group moves as one
    before = [[t for t in ts if t < stalled_at][-3:] for ts in times]
    assert before[0] == before[1] and before[2] == before[3], before

    def gaps(ts: list[float]) -> list[float]:
        during = [t for t in ts if stalled_at + 2 * link_s < t <= resumed_at]
        return [t1 - t0 for t0, t1 in zip(during, during[1:])]

    held = gaps(times[1])
    assert len(held) >= 2, times[1]
    # held for its stalled partner, but never past MAX_HOLD_S (twice its round trip would be 1.2 s here)
    assert all(abs(g - (2 * link_s + MAX_HOLD_S)) < 1e-6 for g in held), held
    assert all(abs(g - 2 * link_s) < 1e-6 for g in gaps(times[2]) + gaps(times[3])), "the other group goes on"
    assert route.services[1].ring.alone >= len(held)


async def test_a_node_session_left_idle_is_failed_and_its_kv_freed_on_the_trio_clock(autojump_clock, nursery) -> None:
    """A node frees a session nobody steps for `idle_timeout_s` (its gateway gone, say) on its own, within a
    second of the timeout: sessions are stamped and checked on trio's clock."""
    route = InProcRoute.stub(splits=((0, 30),), inline=True)
    node = route.services[0]
    node.idle_timeout_s = 30.0
    idle, busy = uuid.UUID(int=1).hex, uuid.UUID(int=2).hex
    await nursery.start(route.run)
    alone = RelayPlan(None, TRACKER_URL, None, Loop(NextHop("n0", route.urls[0], None)))  # a ring of itself
    for sid in (idle, busy):
        await node.open_session(sid, 64, SamplingParams(temperature=0.0), alone)
    await settled(node)
    opened = trio.current_time()
    await trio.sleep(29.0)
    assert set(node.sessions) == {idle, busy}
    width = node.backend.info.seam_width
    node.replies.accept_streamed(busy, Record(encode_frame(FrameKind.PREFILL, busy, 0, 0, 3, width, token_ids=[3, 14, 15])))
    await trio.sleep(2.1)
    await settled(node)
    assert idle not in node.sessions and node.ended[idle].reason is Reason.SESSION_TIMEOUT
    assert busy in node.sessions, "a session stepped within the timeout stays"
    assert 30.0 < trio.current_time() - opened <= 31.1
    assert node.scheduler.kv_bytes > 0
    await node.lifecycle.close(busy)
    await settled(node)
    assert node.scheduler.session_count == 0 and node.scheduler.kv_bytes == 0


async def test_a_ring_sessions_figures_reach_its_telemetry_stats_and_metrics(autojump_clock, nursery) -> None:
    """The ring's answers carry each hop's compute to the gateway, which shares a token's round trip out
    per hop: every node of the route has its samples in /v1/stats and the session's hop latencies, and the
    token metrics count each token once."""
    route = _ring(GatewayConfig(sweep_s=0.1))
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=6, ignore_eos=True))
    await _drain(live)
    assert live.rs.failure is None and live.rs.completion_tokens == 6
    assert set(live.rs.hop_latency_ms) == {"n0", "n1"}
    hops = route.gateway.stats()["hops"]
    # one sample a decode token after the first, for each node; the head counts the tail's decode steps itself
    assert [hops[n]["samples"] for n in ("n0", "n1")] == [5, 5], hops
    assert route.services[0].stats.last_decode_frame_bytes == HEADER_SIZE + 4  # one token id
    assert route.gateway.metrics.registry.get_sample_value("dgr_generated_tokens_total") == 6
