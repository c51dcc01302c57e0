"""Speculative decoding on a ring (issue 42), in process on trio's MockClock: stub nodes, the real gateway.

The tail drafts from the session's own tokens and verifies k of them a trip; the answers must be those of
decoding without speculation, every node must end with no session and no KV, and a node lost mid-step must
end the session in the structured failure.
"""

from __future__ import annotations

import trio

from dgr.api.openai import parse_request
from dgr.testing.inproc import InProcRoute
from dgr.tracker.gateway import GatewayConfig

# a prompt whose continuation the stub repeats: copied text is what n-gram drafts predict
PROMPT = "abcabcabcabcabcabcabcabcabcabc"


def _req(**kw):
    return parse_request({"model": "stub", "prompt": PROMPT, "temperature": 0, "max_tokens": 48,
                          "ignore_eos": True, **kw}, "completion")


def _ring(config: GatewayConfig, splits=((0, 15), (15, 30)), latency_s: float = 0.02) -> InProcRoute:
    route = InProcRoute.stub(splits=splits, config=config, inline=True)
    route.latency(latency_s)
    route.register_all()
    route.registry.dead_after_s = 3600.0  # no heartbeats here
    return route


async def _answer(route: InProcRoute, **kw) -> tuple[str, float, dict]:
    """(text, mock seconds from open to the end, the session's last telemetry)."""
    t0 = trio.current_time()
    live = await route.gateway.open(_req(**kw))
    text = []
    with trio.fail_after(120):
        async for delta in live.recv:
            text.append(delta.text)
    while route.gateway.sessions:  # its closes
        await trio.sleep(0.01)
    return "".join(text), trio.current_time() - t0, live.rs.snapshot(trio.current_time())


def _clean(route: InProcRoute) -> None:
    for s in route.services:
        assert s.scheduler.session_count == 0 and s.scheduler.kv_bytes == 0, s.node_id


async def test_greedy_answers_equal_decoding_without_speculation_in_fewer_trips(autojump_clock, nursery) -> None:
    for splits in (((0, 15), (15, 30)), ((0, 10), (10, 20), (20, 30))):
        plain = _ring(GatewayConfig(), splits)
        await nursery.start(plain.run)
        want, plain_s, snap = await _answer(plain)
        assert snap["speculation"]["steps"] == 0
        for k in (1, 4, 8):
            route = _ring(GatewayConfig(speculation="ngram", spec_k=k, spec_exact=True), splits)
            await nursery.start(route.run)
            got, spec_s, snap = await _answer(route)
            assert got == want, (splits, k)
            spec = snap["speculation"]
            assert 0 < spec["k"] <= k and spec["drafted"] > 0 and spec["accepted"] > 0, spec
            assert spec["rejected"] == spec["drafted"] - spec["accepted"]
            # every link costs 20 ms; a step of k drafts the tail accepts saves their trips
            assert spec_s < plain_s * 0.9, (splits, k, spec_s, plain_s)
            _clean(route)


async def test_refused_drafts_are_dropped_everywhere_and_the_answer_is_unchanged(autojump_clock, nursery) -> None:
    """Free text, where the tail's drafts are often wrong: every refused draft is dropped from every node's KV
    before the next step (the node session refuses a step that does not start there), and the answer is the
    one decoding without speculation gives, with and without one-position kernels."""
    kw = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 80}
    plain = _ring(GatewayConfig())
    await nursery.start(plain.run)
    want, _, _ = await _answer(plain, **kw)
    for exact in (False, True):
        route = _ring(GatewayConfig(speculation="ngram", spec_k=4, spec_exact=exact))
        await nursery.start(route.run)
        got, _, snap = await _answer(route, **kw)
        spec = snap["speculation"]
        assert got == want and spec["rejected"] > 0 and spec["accepted"] > 0, spec
        _clean(route)


async def test_a_seeded_sampled_answer_is_the_one_without_speculation(autojump_clock, nursery) -> None:
    """Sampling: the tail draws each row's token with the session's own seeded sampler, in order, and takes
    drafts while they equal it (the speculative rule for a deterministic draft), so a seeded request gets
    the very tokens it gets without speculation, however many drafts each step carried."""
    kw = {"prompt": "hello there", "temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 64}
    plain = _ring(GatewayConfig())
    await nursery.start(plain.run)
    want, _, _ = await _answer(plain, **kw)
    route = _ring(GatewayConfig(speculation="ngram", spec_k=4, spec_exact=True))
    await nursery.start(route.run)
    got, _, snap = await _answer(route, **kw)
    assert got == want and snap["speculation"]["drafted"] > 0, snap["speculation"]
    other, _, _ = await _answer(plain, **{**kw, "seed": 8})
    assert other != want  # the seed matters: the equality above is not that of a greedy answer


async def test_a_request_asks_for_speculation_or_not(autojump_clock, nursery) -> None:
    route = _ring(GatewayConfig(speculation="ngram", spec_k=4))
    await nursery.start(route.run)
    _, _, off = await _answer(route, speculation="off")
    assert off["speculation"]["steps"] == 0
    route2 = _ring(GatewayConfig(spec_k=4))
    await nursery.start(route2.run)
    _, _, on = await _answer(route2, speculation="ngram")
    assert on["speculation"]["steps"] > 0


async def test_a_node_lost_mid_speculation_fails_the_session_and_frees_the_rest(autojump_clock, nursery) -> None:
    route = _ring(GatewayConfig(speculation="ngram", spec_k=4), ((0, 10), (10, 20), (20, 30)))
    route.registry.dead_after_s = 3600.0
    await nursery.start(route.run)
    live = await route.gateway.open(_req(max_tokens=400))
    got = 0
    with trio.fail_after(120):
        async for _ in live.recv:
            got += 1
            if got == 5:
                route.kill(1)
    while route.gateway.sessions:
        await trio.sleep(0.01)
    failure = live.rs.failure
    assert failure is not None and (failure.reason.value, failure.node) == ("route_node_lost", "n1"), failure
    assert live.rs.spec_steps > 0
    for i in (0, 2):
        s = route.services[i]
        assert s.scheduler.session_count == 0 and s.scheduler.kv_bytes == 0
