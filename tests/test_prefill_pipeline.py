"""A prompt on a multi-node route is cut into a pipeline's chunks (dgr.tracker.live.pipeline_chunk).

Why: a route of N nodes computes a prompt as a pipeline, and ends (N - 1) times its largest chunk's time
after one stage's sum; 512-position chunks left a core idle for a whole chunk at each end of a cold
2,316-token turn on SmolLM2 (7.78 s against 6.07 to 6.24 s in 73-position chunks, 1 thread a node).
"""

from __future__ import annotations

import trio

from dgr import cli
from dgr.fsm.route import RouteSession
from dgr.tracker import live as live_mod
from dgr.tracker.live import MIN_PIPELINE_CHUNK, PIPELINE_CUTS, GatewayConfig, LiveSession, pipeline_chunk
from dgr.tracker.telemetry import Broadcast
from dgr.api.textstream import TextAssembler


def test_a_pipelines_chunks_are_a_32nd_of_the_prompt_per_extra_node_within_bounds() -> None:
    assert pipeline_chunk(2316, 512, 1) == 512  # one node: no pipeline, one ubatch a chunk
    assert pipeline_chunk(2316, 512, 2, cuts=0) == 512  # --pipeline-cuts 0
    assert pipeline_chunk(2316, 512, 2) == 73  # 32 chunks
    assert pipeline_chunk(4632, 512, 3) == 73  # 64 chunks: 32 a node after the head
    assert pipeline_chunk(600, 512, 3) == MIN_PIPELINE_CHUNK  # never below a chunk worth its round trips
    assert pipeline_chunk(100_000, 512, 2) == 512  # never above the ubatch
    assert pipeline_chunk(2316, 32, 2) == 32  # a ubatch smaller than the least chunk is the chunk
    assert pipeline_chunk(1, 512, 2) == MIN_PIPELINE_CHUNK
    # the CLI's defaults, kept beside the parser so that parsing imports no trio
    assert (cli.PIPELINE_CUTS, cli.MIN_PIPELINE_CHUNK) == (PIPELINE_CUTS, MIN_PIPELINE_CHUNK) == (
        live_mod.PIPELINE_CUTS, live_mod.MIN_PIPELINE_CHUNK)


def test_a_sessions_chunk_is_chosen_once_from_the_prompt_its_route_computes() -> None:
    rs = RouteSession(sid="r" * 32, model="stub", created_at=0.0)
    live = LiveSession(rs=rs, request=None, prompt=list(range(3000)), max_tokens=8, nodes=(), model_width=8,
                       needs_token_ids=False, telemetry=Broadcast(), send=None, recv=None, text=TextAssembler())
    rs.route = ("a", "b")
    rs.prefix_reused = 0  # the route computes 3,000 positions
    config = GatewayConfig()
    assert live.chunk_size(config) == 94
    steps = live.steps(live.chunk_size(config))
    assert [len(ids) for _, _, ids, _ in steps] == [94] * 31 + [86] and steps[0][1] == 0
    rs.route = ("a", "b", "c")  # a repair's steps are cut as the lost route's were, whatever it changes
    live.steps_from = 1500
    assert live.chunk_size(config) == 94 and live.steps(94)[0][1:3] == (1500, list(range(1500, 1594)))
    reused = LiveSession(rs=RouteSession(sid="s" * 32, model="stub", created_at=0.0), request=None,
                         prompt=list(range(3000)), max_tokens=8, nodes=(), model_width=8, needs_token_ids=False,
                         telemetry=Broadcast(), send=None, recv=None, text=TextAssembler())
    reused.rs.route, reused.rs.prefix_reused = ("a", "b"), 2360  # a kept prefix: 640 positions left to compute
    assert reused.chunk_size(config) == 64


async def test_a_ubatchs_positions_go_in_flight_a_hop_however_finely_a_prompt_is_cut(autojump_clock, nursery) -> None:
    """The gateway keeps up to a ubatch's positions in flight a hop: with the tail stalled, the head of a 2-node
    ring takes 16 chunks of 64 positions (2 x 512 positions), not 2 (the window counted chunks before the
    pipeline's finer cut, and on a slow link each chunk then paid a round trip); then the prompt completes."""
    from dgr.api.openai import parse_request
    from dgr.testing.inproc import InProcRoute

    route = InProcRoute.stub(config=GatewayConfig(sweep_s=0.1), inline=True)
    route.latency(0.001)
    route.register_all()
    await nursery.start(route.run)
    route.stall(1)
    req = parse_request({"model": "stub", "prompt": "x" * 2000, "temperature": 0, "max_tokens": 2}, "completion")
    live = await route.gateway.open(req)
    assert live.chunk_size(route.gateway.config) == MIN_PIPELINE_CHUNK and len(live.prompt) > 16 * MIN_PIPELINE_CHUNK
    await trio.sleep(1.0)  # well within a step's deadline: the head has every chunk the window lets through
    head = route.services[0]
    assert head.stats.frames_in["PREFILL"] == 2 * (512 // MIN_PIPELINE_CHUNK)
    route.resume(1)
    with trio.fail_after(30):
        text = "".join([d.text async for d in live.recv])
    assert live.rs.failure is None and live.rs.completion_tokens == 2 and text
    assert head.stats.frames_in["PREFILL"] == -(-len(live.prompt) // MIN_PIPELINE_CHUNK)
