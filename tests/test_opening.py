"""A route opens in as few round trips as its prompt allows (issue 41): the head tokenizes inside its open.

An in-process ring on trio's MockClock whose every open (and prefix named) takes LATENCY_S, so the
time `Gateway.open` takes, read off the clock, is its round trips before compute, exactly.
"""

from __future__ import annotations

import pytest
import trio

from dgr.api.openai import parse_request
from dgr.errors import CallerError, Reason
from dgr.fsm.node import NodeSession, StepKind
from dgr.testing.inproc import InProcRoute
from dgr.tracker.gateway import GatewayConfig

LATENCY_S = 0.01
SYSTEM = "You answer in one line. " * 12  # ~290 stub tokens: four whole blocks


class _Calls:
    """A NodeClient stand-in that records each open (with a prompt or without) and prefix named, and forwards
    it after LATENCY_S: a control call's round trip."""

    def __init__(self, inner, log: list, latency_s: float = LATENCY_S) -> None:
        self._inner, self._log, self._latency_s = inner, log, latency_s

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def open(self, req, *a, **kw):
        kind = "prompt" if req.prompt is not None else "waiting" if req.max_new else "prefix"
        self._log.append((self._inner.node_id, kind))
        await trio.sleep(self._latency_s)
        return await self._inner.open(req, *a, **kw)

    async def adopt_prefix(self, *a, **kw):
        self._log.append((self._inner.node_id, "adopt"))
        await trio.sleep(LATENCY_S)
        return await self._inner.adopt_prefix(*a, **kw)


def _route(nodes: int = 2, later_s: float = LATENCY_S, **config) -> tuple[InProcRoute, list]:
    """A ring of `nodes` stub nodes whose head answers its opens in LATENCY_S and the others in `later_s`."""
    splits = {1: ((0, 30),), 2: ((0, 15), (15, 30)), 3: ((0, 10), (10, 20), (20, 30))}[nodes]
    route = InProcRoute.stub(splits=splits, config=GatewayConfig(sweep_s=3600.0, **config), inline=True)
    log: list = []
    route.wrap = lambda client: _Calls(client, log, LATENCY_S if client.node_id == "n0" else later_s)
    route.register_all()
    return route, log


def _req(prompt: str, **kw):
    return parse_request({"model": "stub", "prompt": prompt, "temperature": 0, "max_tokens": 8, **kw}, "completion")


async def _ask(route: InProcRoute, prompt: str, **kw) -> tuple[str, float, object]:
    """(answer, mock seconds the open took, the live session)."""
    start = trio.current_time()
    live = await route.gateway.open(_req(prompt, **kw), scope="k1")
    opened = trio.current_time() - start
    return "".join([d.text async for d in live.recv]), opened, live


@pytest.mark.parametrize("nodes", [1, 2, 3])
async def test_a_route_opens_in_one_round_trip_and_names_a_held_prefix_in_a_second(autojump_clock, nursery,
                                                                                    nodes: int) -> None:
    route, log = _route(nodes)
    await nursery.start(route.run)
    text, opened, live = await _ask(route, SYSTEM)
    ids = [h.node_id for h in live.rs.route]
    # the head tokenized inside its open; the later hops opened with it, their KV waiting, and none held a prefix
    assert opened == pytest.approx(LATENCY_S) and live.rs.prefix_reused == 0
    assert sorted(log) == sorted([(ids[0], "prompt"), *((i, "waiting") for i in ids[1:])])
    log.clear()
    # the next turn: the head may hold the conversation's prefix, so it is named to every hop in one more trip
    # (a head alone on its route too: only the tracker can name a prefix, whose root no node is told)
    _, opened, live = await _ask(route, SYSTEM + text + " next")
    assert live.rs.prefix_reused > 0
    assert opened == pytest.approx(LATENCY_S * 2)
    assert sorted(log) == sorted([(ids[0], "prompt"), *((i, "waiting") for i in ids[1:]),
                                  *((i, "adopt") for i in ids)])


async def test_without_a_prefix_kept_the_later_hops_are_told_none(autojump_clock, nursery) -> None:
    route, log = _route(2, prefix_reuse=False)
    await nursery.start(route.run)
    text, _, _ = await _ask(route, SYSTEM)
    log.clear()
    _, opened, live = await _ask(route, SYSTEM + text + " next")
    assert opened == pytest.approx(LATENCY_S) and live.rs.prefix_reused == 0
    assert [kind for _, kind in log].count("adopt") == 0


async def test_a_speculating_tail_opens_once_the_ids_are_known(autojump_clock, nursery) -> None:
    """The tail drafts from the prompt's ids, so it opens after the head has answered them: two trips."""
    route, log = _route(2)
    await nursery.start(route.run)
    text, opened, live = await _ask(route, SYSTEM, speculation="ngram")
    head, tail = (h.node_id for h in live.rs.route)
    assert opened == pytest.approx(2 * LATENCY_S) and log == [(head, "prompt"), (tail, "prefix")]
    plain, _, _ = await _ask(route, SYSTEM)
    assert text == plain
    log.clear()  # the next turn's prefix is named to the head while the tail opens on it, in the same trip
    text, opened, live = await _ask(route, SYSTEM + text + " next", speculation="ngram")
    assert live.rs.prefix_reused > 0 and opened == pytest.approx(2 * LATENCY_S)
    assert sorted(log) == [(head, "adopt"), (head, "prompt"), (tail, "prefix")]


@pytest.mark.parametrize("later_s", [LATENCY_S, 3 * LATENCY_S])
async def test_a_prompt_the_head_refuses_closes_the_later_hops_waiting(autojump_clock, nursery, later_s) -> None:
    """Also where the refusal comes back before the tail's open has answered: that open is not cut short
    (which would leave its session there until the tail's next heartbeat), it is closed with the rest."""
    route, log = _route(2, later_s, max_prompt_tokens=10)
    await nursery.start(route.run)
    with pytest.raises(CallerError) as err:
        await route.gateway.open(_req("y" * 40))
    assert err.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED and err.value.details["param"] == "prompt"
    assert "the prompt has 40 tokens" in err.value.message
    assert sorted(kind for _, kind in log) == ["prompt", "waiting"]  # the tail had opened with the head
    for s in route.services:  # and, once the refusal is out, holds nothing: no session, no KV, no close owed
        assert s.sessions == {} and s.backend.session_count() == 0
    assert not route.gateway.unclosed


def test_a_session_opened_before_its_prompt_s_length_is_bounded_at_the_prompt_s_last_chunk() -> None:
    s = NodeSession(sid="a" * 32, max_positions=64, last_active=0.0, max_new=5)
    s.accept(StepKind.PREFILL, 0, 0, 8, now=0.0)
    assert s.max_positions == 64  # the prompt may go on
    s.accept(StepKind.PREFILL, 1, 8, 2, now=0.0, last_chunk=True)
    assert s.max_positions == 15 and s.max_new is None
    for seq, pos in enumerate(range(10, 15), start=2):
        s.accept(StepKind.DECODE, seq, pos, 1, now=0.0)
    with pytest.raises(CallerError) as err:
        s.check_step(StepKind.DECODE, 7, 15, 1)
    assert err.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED
