"""Claims are proven before they are believed, and routes spread fairly (issue 55, items 2 and 3).

Each attack as it was run: an in-process route of stub nodes (real node apps, the real gateway and its
registry), one member gone bad by patching its own methods at run time: it names in its heartbeats every
block key of the prompts it wants (the worst case: it knows them all, as a member that saw their chains at
a close would), and it sorts first by name. Before: the prefix keys a node named were believed without a
check and chose the route ahead of the spread; routes through a shared stage tied on it and the lowest node
id won every session; the prefix root was public (SHA-256 of the model digest and the scope) and handed to
every head, so any node computed the keys of any prompt offline.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys

import trio

from dgr.api.openai import parse_request
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.node import membership
from dgr.procs import WatchedChild, dgr_command
from dgr.seam.keys import BLOCK_TOKENS, block_chain, prefix_root, prompt_offer
from dgr.security.identity import Identity
from dgr.testing.harness import LocalRoute
from dgr.testing.inproc import InProcRoute
from dgr.tracker.affinity import BAR_S
from dgr.tracker.gateway import GatewayConfig

QUIET = GatewayConfig(sweep_s=3600.0)
SYSTEM = "You answer in one line, and you keep it short. " * 6  # ~280 stub tokens: four whole blocks
SCOPE = "k1"


def _req(prompt: str, max_tokens: int = 8, stream: bool = False):
    return parse_request({"model": "stub", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                          "stream": stream, "ignore_eos": stream}, "completion")


async def _ask(route: InProcRoute, prompt: str, scope: str = SCOPE):
    """(answer, the Route Session's node ids, positions it reused), every node having heartbeat first (as
    its membership loop does every half second)."""
    for i in range(len(route.services)):
        route.heartbeat(i)
    live = await route.gateway.open(_req(prompt), scope=scope)
    text = "".join([d.text async for d in live.recv])
    return text, [h.node_id for h in live.rs.route], live.rs.prefix_reused


def _claim_every_key(monkeypatch, route: InProcRoute, i: int, prompts: list[str], scope: str = SCOPE) -> None:
    """Node `i` names, in every registration and heartbeat from now on, every block key of `prompts` (it keeps
    none of them): its membership's list of what it kept, patched."""
    liar = route.services[i]
    head = route.services[0].backend
    root = prefix_root(head.info.digest, scope, route.gateway.admission.prefix_secret)
    keys = [k for p in prompts for k in prompt_offer(head.tokenize(p, add_special=True, parse_special=True), root)[1]]
    honest = membership._advertised
    monkeypatch.setattr(membership, "_advertised",
                        lambda service: list(dict.fromkeys(keys)) if service is liar else honest(service))


async def test_a_member_claiming_every_key_on_a_shared_stage_gets_its_fair_share_plus_one_at_most(nursery, monkeypatch) -> None:
    """A shared head n0 and three tails; n1, first by name, names every key of 20 prompts that share a system
    prompt. Before: the routes tied on the shared head's turn and n1 won all 20 (then held the prefix, which
    pinned the rest to it). Now the tails take turns, and each session reuses the system prompt where its
    route kept it."""
    route = InProcRoute.stub(splits=((0, 15), (15, 30), (15, 30), (15, 30)), config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    prompts = [SYSTEM + f" Question {i}: what is {i} and {i}?" for i in range(20)]
    _claim_every_key(monkeypatch, route, 1, prompts)
    tails, reused = [], []
    for p in prompts:
        _, hops, positions = await _ask(route, p)
        tails.append(hops[1])
        reused.append(positions)
    fair = len(prompts) / 3
    assert tails.count("n1") <= fair + 1, tails
    assert all(tails.count(t) >= fair - 1 for t in ("n2", "n3")), tails
    # once every tail has served (and kept) one, every session reuses the system prompt: spreading costs no reuse
    warm = max(tails.index(t) for t in ("n1", "n2", "n3")) + 1
    assert warm <= 5 and all(r >= 4 * BLOCK_TOKENS for r in reused[warm:]), (tails, reused)


# A real `dgr node` whose membership names the keys in $DGR_TEST_CLAIMS, as kept, in every registration and
# heartbeat: the member gone bad, patched at run time in its own process.
_LIAR = """
import json, os, sys
from dgr.node import membership
keys = json.loads(os.environ["DGR_TEST_CLAIMS"])
membership._advertised = lambda service: keys
from dgr.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_capture_over_real_processes_gets_a_claimer_that_sorts_first_its_fair_share_plus_one() -> None:
    """The attack as it was run: `dgr up` (a tracker, node0 on layers 0:15 and node1 on 15:30) and two more
    tails over loopback, one of them a member named to sort first that names every key of 20 prompts sharing a
    system prompt (computed here with the tracker's own secret: the worst case). Before: it got 19 of 20."""
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))
    prompts = [SYSTEM + f" Question {i}: what is {i} and {i}?" for i in range(20)]
    with LocalRoute(nodes=2) as route:
        root = prefix_root(route.node("node0")["digest"], "", route.tracker_identity.derive(b"prefix-root"))
        keys = list(dict.fromkeys(k for p in prompts for k in prompt_offer(stub.tokenize(
            p, add_special=True, parse_special=True), root)[1]))
        extra = ["--backend", "stub", "--layers", "15:30", "--tracker", route.url, "--busy-poll-ms", "0"]
        members = [WatchedChild.spawn("a-thief", [sys.executable, "-c", _LIAR, "node", "--name", "a-thief", *extra],
                                      env={**route.env(), "DGR_TEST_CLAIMS": json.dumps(keys)}),
                   WatchedChild.spawn("node2", dgr_command("node", "--name", "node2", *extra), env=route.env())]
        try:
            route.wait_nodes_alive(["a-thief", "node2"], timeout_s=60)
            assert route.node("a-thief")["prefixes"] == len(keys)
            tails = []
            for p in prompts:
                r = route.http.post(f"{route.api}/completions", json={"model": "stub", "prompt": p, "max_tokens": 4,
                                                                      "temperature": 0}, headers=route.headers,
                                    timeout=30)
                assert r.status_code == 200, r.text
                tails.append(r.json()["dgr"]["telemetry"]["route"][1]["node"])
        finally:
            for p in members:
                p.stop()
    assert tails.count("a-thief") <= len(prompts) / 3 + 1, tails
    assert all(tails.count(t) >= len(prompts) / 3 - 1 for t in ("node1", "node2")), tails


async def test_a_claim_shown_not_held_drops_the_claimers_claims_and_bars_it(nursery, monkeypatch) -> None:
    """Three nodes of every layer; n0 names every key of six new conversations it never kept. Before: each
    claim was believed, and all six went to n0. Now the first session routed for its claim shows it held
    nothing: its named keys are dropped, its claims ignored (though it names them again), its trust halved."""
    route = InProcRoute.stub(splits=((0, 30), (0, 30), (0, 30)), config=QUIET)
    route.register_all()
    await nursery.start(route.run)
    prompts = [f"{i}: a conversation begins here. " * 10 for i in range(6)]
    _claim_every_key(monkeypatch, route, 0, prompts)
    attacker = route.registry.nodes["n0"]
    attacker.proven = 64  # it had been trusted with more at once: a miss halves it
    heads = []
    for i, p in enumerate(prompts):
        text, hops, reused = await _ask(route, p)
        heads.append(hops[0])
        assert text and reused == 0  # the session itself goes on; nothing of it was kept anywhere
        if i == 0:  # its claim drew the first: shown not held, its named keys are dropped and its trust halved
            assert hops == ["n0"] and attacker.prefixes == frozenset() and attacker.proven == 32
    assert heads.count("n0") <= 2, heads  # its one claimed session, and its turn
    assert route.gateway.admission.affinity.barred("n0", trio.current_time())
    assert not route.gateway.admission.affinity.barred("n0", trio.current_time() + BAR_S + 1)


async def test_routes_through_a_shared_stage_take_turns_and_no_name_sorts_first(nursery) -> None:
    """A shared head n0, tails n1 and n2. Before: both routes' most recent node was the shared head, so they
    tied, and the lowest id, n1, won 4 of 4. Now routes are compared on what differs: the tails take turns;
    and where they tie, a seeded draw decides, not a name."""
    route = InProcRoute.stub(splits=((0, 15), (15, 30), (15, 30)), config=GatewayConfig(sweep_s=3600.0,
                                                                                         prefix_reuse=False))
    route.register_all()
    await nursery.start(route.run)
    tails = [(await _ask(route, f"prompt number {i}"))[1][1] for i in range(4)]
    assert sorted(tails) == ["n1", "n1", "n2", "n2"], tails
    first = set()
    for seed in range(8):
        for n in route.registry.nodes.values():
            n.turns, n.routed_at = 0, 0.0  # every turn alike: only the last tie-break is left
        route.gateway.admission.rng = random.Random(seed)
        first.add((await _ask(route, f"seed {seed}"))[1][1])
    assert first == {"n1", "n2"}


async def test_affinity_never_sends_a_conversation_to_a_busier_route(nursery) -> None:
    """Two nodes of every layer. n0 kept turn 1 of a conversation, then holds a session that n1 does not.
    Before: turn 2 went to n0 however busy. Now affinity applies only among routes that tie on the spread."""
    route = InProcRoute.stub(splits=((0, 30), (0, 30)), config=QUIET, delay_s=0.002)
    route.register_all()
    await nursery.start(route.run)
    first = "A short conversation, its first turn. " * 3 + " Q1: why?"  # ~120 stub tokens
    text, hops, _ = await _ask(route, first)
    holder = hops[0]
    # two long streams, one a node; then the other node's ends: only the holder is busy
    held = [await route.gateway.open(_req(f"long {i}", max_tokens=4000, stream=True), scope="other")
            for i in range(2)]
    nodes = {live.rs.route[0].node_id: live for live in held}
    assert set(nodes) == {"n0", "n1"}
    other = nodes["n1" if holder == "n0" else "n0"]
    route.gateway.cancel(other.rs.sid, "done")
    async for _ in other.recv:
        pass
    await _wait_released(route, other)
    _, hops, reused = await _ask(route, first + text + " Q2: and then?")
    assert hops[0] != holder and reused == 0
    live = nodes[holder]
    route.gateway.cancel(live.rs.sid, "test over")
    async for _ in live.recv:
        pass
    await _wait_released(route, live)
    # idle again, the holder ties on the spread: a turn that continues what it kept goes back to it
    _, hops, reused = await _ask(route, first + text + " Q2b: or else?")
    assert hops[0] == holder and reused > 0


async def _wait_released(route: InProcRoute, live) -> None:
    with trio.fail_after(10):
        while any(n.reserved for n in route.registry.nodes.values() if n.node_id == live.rs.route[0].node_id):
            await trio.sleep(0.01)


class _Recorder:
    """A NodeClient stand-in that keeps every open's body and every prefix named, then forwards the call."""

    def __init__(self, inner, opens: list, named: list) -> None:
        self._inner, self._opens, self._named = inner, opens, named

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def open(self, req, *a, **kw):
        self._opens.append(req.to_json())
        return await self._inner.open(req, *a, **kw)

    async def adopt_prefix(self, sid, offer, *a, **kw):
        self._named.append(list(offer.prefix))
        return await self._inner.adopt_prefix(sid, offer, *a, **kw)


async def test_no_node_is_told_a_root_and_keys_cannot_be_computed_from_public_facts(nursery, tmp_path) -> None:
    """Before: every head's open carried the root, SHA-256 of the public model digest and the scope, so a
    member computed the keys of any prompt offline and named them. Now the root is keyed with the tracker's
    secret and no open carries it; the keys named to nodes are not those the public facts give."""
    route = InProcRoute.stub(config=QUIET)
    opens, named = [], []
    route.wrap = lambda client: _Recorder(client, opens, named)
    route.register_all()
    await nursery.start(route.run)
    prompt = SYSTEM + " Q1: why?"
    text, _, _ = await _ask(route, prompt)
    _, _, reused = await _ask(route, prompt + text + " Q2: and?")
    assert reused > 0 and named  # the second turn's prefix was named to its nodes
    assert opens and all("root" not in body and "root" not in str(body.get("prompt")) for body in opens)
    head = route.services[0].backend
    ids = head.tokenize(prompt + text + " Q2: and?", add_special=True, parse_special=True)
    public = hashlib.sha256(b"dgr-prefix-v1\0" + head.info.digest.encode() + b"\0" + SCOPE.encode()).hexdigest()[:32]
    guessed = block_chain(ids[:-2], public)
    assert guessed and all(set(guessed).isdisjoint(chain) for chain in named)
    # the secret lives with the tracker's identity: a restart with the same key file keys the same roots
    path = tmp_path / "tracker.key"
    first, again = Identity.load(path), Identity.load(path)
    assert first.derive(b"prefix-root") == again.derive(b"prefix-root") != Identity.generate().derive(b"prefix-root")
