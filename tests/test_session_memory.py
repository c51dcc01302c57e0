"""What a Route Session leaves behind once it has ended: nothing per session, on its nodes or the tracker.

`dgr soak` saw every node's RSS grow by about 6 KB a session. Part of it was the
capabilities the nodes (and the tracker) had verified: each authority remembers a
token whose signature verified, so that a session's steps skip the Ed25519 check,
and it dropped them only when 4,096 later tokens had pushed them out (about 2,000
sessions, 2 tokens each on a node). A session's end now drops its tokens
(`CapabilityAuthority.forget`).

The route is the real one, on loopback in this process: a tracker and two stub
nodes (`run_tracker`, `run_node`), their services caught as they are made. The
sessions end every usual way: read to the end (streamed or not), and a stream the
client leaves after its first text (`cancelled`).

Left out: the rest of a node's RSS growth in the soak, which is not held memory.
Its Python objects and glibc's bytes in use (mallinfo2 uordblks) stay flat; what
grows is the free space inside glibc's main heap (fragmentation: large transient
buffers, 64 to 300 KB socket reads and seam frames, come from the heap once glibc
has raised its mmap threshold), which malloc_trim(0) hands back at once.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from typing import AsyncIterator

import attrs
import httpx
import trio

import dgr.node.run
import dgr.security.auth
import dgr.tracker.run
from dgr.api.server import listening_socket
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.node.run import run_node
from dgr.node.service import NodeService
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.identity import Identity
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.run import run_tracker

SPLITS = {"n0": (0, 15), "n1": (15, 30)}
SESSIONS = 12  # each kind of end at least 4 times


@attrs.define
class Route:
    http: httpx.AsyncClient  # the tracker's
    services: dict[str, NodeService]
    gateway: Gateway


@contextlib.asynccontextmanager
async def route(monkeypatch) -> AsyncIterator[Route]:
    """A tracker and two stub nodes on loopback, with the node services and the gateway they run."""
    services: dict[str, NodeService] = {}
    gateways: list[Gateway] = []

    def node_app(service: NodeService, **kw):
        services[service.node_id] = service
        return make_node_app(service, **kw)

    def tracker_app(gateway: Gateway, **kw):
        gateways.append(gateway)
        return make_tracker_app(gateway, **kw)

    make_node_app, make_tracker_app = dgr.node.run.make_node_app, dgr.tracker.run.make_tracker_app
    monkeypatch.setattr(dgr.node.run, "make_node_app", node_app)
    monkeypatch.setattr(dgr.tracker.run, "make_tracker_app", tracker_app)
    listening = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listening.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(run_tracker, host="127.0.0.1", port=0, config=GatewayConfig(),
                                             identity=Identity.generate(), listening=listening))
        for name, layers in SPLITS.items():
            nursery.start_soon(functools.partial(run_node, StubBackend(spec=StubSpec(), layers=LayerRange(*layers)),
                                                 node_id=name, host="127.0.0.1", port=0, tracker=url,
                                                 identity=Identity.generate()))
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            with trio.fail_after(30):
                while len(services) < len(SPLITS) or not await _all_alive(http):
                    await trio.sleep(0.05)
            yield Route(http, services, gateways[0])
        nursery.cancel_scope.cancel()


async def _all_alive(http: httpx.AsyncClient) -> bool:
    try:
        listed = (await http.get("/v1/nodes")).json()["nodes"]
    except httpx.TransportError:
        return False
    return sum(n["alive"] for n in listed) == len(SPLITS)


async def _session(http: httpx.AsyncClient, i: int) -> None:
    """Session `i`: completed (i % 3 == 0), streamed to its end (1), or a stream left after its first text (2)."""
    body = {"model": "stub", "prompt": f"session {i} of the memory test", "max_tokens": 6, "temperature": 0.8,
            "seed": i}
    if i % 3 == 0:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                            "max_tokens": 6 if i % 3 == 1 else 10_000}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if i % 3 == 2 and line.startswith("data: {") and '"text": ""' not in line:
                return  # the client leaves mid-stream: the session is cancelled
            if line == "data: [DONE]":
                return
    raise AssertionError(f"session {i}'s stream ended without [DONE]")


async def test_an_ended_session_leaves_no_verified_capability_on_its_nodes_or_the_tracker(monkeypatch) -> None:
    """After sessions that ended every usual way, no authority remembers a capability: before, each node kept the
    2 tokens every session had shown it (24 here), and the tracker the ones its tail's answers carried."""
    async with route(monkeypatch) as run:
        for i in range(SESSIONS):
            await _session(run.http, i)
        with trio.fail_after(10):  # a cancelled session's closes run on after the client has gone
            while run.gateway.sessions or any(len(s.table) for s in run.services.values()):
                await trio.sleep(0.02)
        kept = {name: s.trust.authority.kept() for name, s in run.services.items()}
        kept["tracker"] = run.gateway.authority.kept()
        ended = {name: len(s.table.ended) for name, s in run.services.items()}
    assert ended == {name: SESSIONS for name in SPLITS}, ended  # every session reached both nodes and ended there
    assert kept == {"n0": 0, "n1": 0, "tracker": 0}, kept


def test_forget_drops_a_sessions_tokens_and_the_count_cap_keeps_the_index_in_step(monkeypatch) -> None:
    """`forget` drops every token of its session and nothing else; a token the cap pushed out is gone from the
    session's index too, so forgetting that session later drops only what is left."""
    monkeypatch.setattr(dgr.security.auth, "_VERIFIED_KEPT", 3)
    tracker = Identity.generate()
    issuer, node = CapabilityAuthority.issuer(tracker), CapabilityAuthority.verifier(tracker.public)
    now = time.time()

    def check(sid: str, scope: Scope) -> None:
        token = issuer.issue(sid, "n0", 0, 15, now, scope=scope)
        node.check(token, session=sid, node="n0", start=0, stop=15, now=now)

    a, b, c = (uuid.uuid4().hex for _ in range(3))
    check(a, Scope.CONTROL)
    check(a, Scope.STEP)
    check(b, Scope.STEP)
    assert node.kept() == 3
    check(c, Scope.STEP)  # over the cap: a's oldest goes
    assert node.kept() == 3
    node.forget(a)  # its one token left
    assert node.kept() == 2
    node.forget(c)
    node.forget("never seen")
    assert node.kept() == 1
