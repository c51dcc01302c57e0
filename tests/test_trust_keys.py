"""Issue 55's lows about what a credential is good for: boots, speculation grants, and whose sessions a key sees.

- Boots: a node's capabilities and open tickets are bound to the nonce its process made at start (the live
  replay of a captured open across a restart is tests/test_tickets.py's last test); here, in process, what the
  tracker issues follows the boot a registration names, and a heartbeat of another boot must register again.
- Speculation: a client asked for `*-exact` or `draft` per request, on every node's CPU, and a speculating tail
  was sent the prompt's ids. Now the operator grants modes (`--spec-allow`), and the tail reads the prompt only
  where its mode needs it or the operator granted `prompt`. Driven over HTTP on a real route, and in process
  with the tail spied on as a member gone bad would look.
- Listings: with API keys, any key listed (and read) every session of every key. Driven with two keys on a
  real route.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import trio

from dgr.api.openai import parse_request
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Reason
from dgr.fsm.route import Hop
from dgr.node.membership import heartbeat_body, registration
from dgr.node.service import NodeService
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.security.identity import Identity
from dgr.testing.harness import LocalRoute
from dgr.testing.inproc import InProcRoute
from dgr.tracker.credentials import Credentials
from dgr.tracker.gateway import GatewayConfig
from dgr.tracker.registry import Registry

KEY, OTHER = ("sk-dgr-" + uuid.uuid4().hex for _ in range(2))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\n{OTHER}\n")
    keys.chmod(0o600)
    with LocalRoute(nodes=2, extra=("--api-key-file", str(keys))) as r:
        r.api_key = KEY
        yield r


def _complete(route: LocalRoute, key: str, **extra) -> httpx.Response:
    return route.http.post(f"{route.api}/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                           json={"model": "stub", "prompt": "abcabcabcabc", "max_tokens": 8, **extra})


# -- listings ---------------------------------------------------------------------------------------------------

def test_a_key_lists_and_reads_only_the_sessions_it_made(keyed) -> None:
    mine, theirs = _complete(keyed, KEY), _complete(keyed, OTHER)
    assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
    sid, other_sid = mine.headers["x-dgr-route-session"], theirs.headers["x-dgr-route-session"]

    def listed(key: str) -> set[str]:
        body = keyed.http.get(f"{keyed.api}/route-sessions", headers={"Authorization": f"Bearer {key}"}).json()
        return {s["id"] for s in body["active"] + body["recent"]}

    assert sid in listed(KEY) and other_sid not in listed(KEY)
    assert other_sid in listed(OTHER) and sid not in listed(OTHER)
    unknown = keyed.http.get(f"{keyed.api}/route-sessions/{uuid.uuid4().hex}", headers=keyed.headers)
    for path in (f"/route-sessions/{other_sid}", f"/route-sessions/{other_sid}/events"):
        r = keyed.http.get(f"{keyed.api}{path}", headers=keyed.headers)
        # as for an id that does not exist: the answer tells no other key's session from none
        assert r.status_code == unknown.status_code == 404, r.text
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"] == "not_found"
    assert keyed.http.get(f"{keyed.api}/route-sessions/{sid}", headers=keyed.headers).json()["id"] == sid
    r = keyed.http.get(f"{keyed.api}/route-sessions/{other_sid}", headers={"Authorization": f"Bearer {OTHER}"})
    assert r.status_code == 200 and r.json()["id"] == other_sid


# -- speculation grants -----------------------------------------------------------------------------------------

def test_a_request_cannot_pick_a_costly_speculation_mode_the_operator_did_not_grant(keyed) -> None:
    for mode in ("ngram-exact", "draft", "draft-exact"):
        r = _complete(keyed, KEY, speculation=mode)
        assert r.status_code == 403, (mode, r.text)
        err = r.json()["error"]
        assert err["code"] == "forbidden" and err["param"] == "speculation" and "--spec-allow" in err["message"], err
    for mode in ("ngram", "off"):  # granted by default
        r = _complete(keyed, KEY, speculation=mode)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, (mode, r.text)
    keyed.wait_sessions_freed(["node0", "node1"])


def _req(**kw):
    return parse_request({"model": "stub", "prompt": "abcabcabcabcabcabcabc", "temperature": 0, "max_tokens": 24,
                          "ignore_eos": True, **kw}, "completion")


async def _spied(nursery, monkeypatch, config: GatewayConfig) -> tuple[InProcRoute, list]:
    """A 2-node ring whose tail records the speculation plan each open hands it (patched on the class: a
    NodeService has slots; every other node's opens pass through untouched)."""
    route = InProcRoute.stub(config=config, inline=True)
    route.register_all()
    route.registry.dead_after_s = 3600.0  # no heartbeats here
    tail, plans = route.services[-1], []
    real = NodeService.open_session

    async def spying(self, sid, max_positions, sampling, relay, prefix=None, lane=None, marks=b"", spec=None, **kw):
        if self is tail:
            plans.append(spec)
        return await real(self, sid, max_positions, sampling, relay, prefix, lane, marks, spec, **kw)

    monkeypatch.setattr(NodeService, "open_session", spying)
    await nursery.start(route.run)
    return route, plans


async def _answer(route: InProcRoute, **kw) -> tuple[str, dict]:
    live = await route.gateway.open(_req(**kw))
    text = []
    with trio.fail_after(120):
        async for delta in live.recv:
            text.append(delta.text)
    return "".join(text), live.rs.snapshot(trio.current_time())


async def test_a_speculating_tail_is_sent_the_prompt_only_where_the_operator_grants_it(autojump_clock, nursery,
                                                                                      monkeypatch) -> None:
    plain, plans = await _spied(nursery, monkeypatch, GatewayConfig(speculation="ngram", spec_k=4))
    text, snap = await _answer(plain)
    [plan] = plans
    assert plan is not None and plan.history == () and snap["speculation"]["steps"] > 0, (plan, snap)
    granted, plans = await _spied(nursery, monkeypatch, GatewayConfig(speculation="ngram", spec_k=4,
                                                         spec_allow=frozenset({"ngram", "prompt"})))
    same, _ = await _answer(granted)
    [plan] = plans
    assert len(plan.history) > 0 and same == text  # the prompt helps the drafts, never changes the answer


async def test_the_operators_grant_or_own_mode_lets_a_request_pick_it(autojump_clock, nursery) -> None:
    refusing = InProcRoute.stub(config=GatewayConfig(), inline=True)
    refusing.register_all()
    await nursery.start(refusing.run)
    with pytest.raises(CallerError) as err:
        await refusing.gateway.open(_req(speculation="ngram-exact"))
    assert err.value.reason is Reason.FORBIDDEN and not refusing.gateway.sessions
    assert all(s.scheduler.session_count == 0 for s in refusing.services)  # refused before any open
    for config in (GatewayConfig(spec_allow=frozenset({"ngram-exact"})), GatewayConfig(speculation="ngram-exact")):
        route = InProcRoute.stub(config=config, inline=True)
        route.register_all()
        route.registry.dead_after_s = 3600.0
        await nursery.start(route.run)
        _, snap = await _answer(route, speculation="ngram-exact")
        assert snap["phase"] == "done" and snap["speculation"]["steps"] > 0, snap
    with pytest.raises(CallerError):
        GatewayConfig(spec_allow=frozenset({"everything"}))


# -- boots, in process ------------------------------------------------------------------------------------------

def test_credentials_follow_the_boot_the_node_registered_and_a_stale_heartbeat_registers_again() -> None:
    tracker, key = Identity.generate(), Identity.generate()

    def process() -> NodeService:  # one start of node n0, with the same key each time
        service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                              identity=key, joining=True)
        service.join(tracker.public)
        return service

    registry, first = Registry(), process()
    registry.register(registration(first, "http://127.0.0.1:9"), 0.0, key=key.public)
    credentials = Credentials(CapabilityAuthority.issuer(tracker), 60.0, registry.nodes)
    sid, hops = uuid.uuid4().hex, (Hop("n0", "http://127.0.0.1:9", 0, 30),)
    old = credentials.capabilities(sid, hops)["n0"]
    first.trust.authorize(old, sid, Scope.CONTROL)
    second = process()
    assert second.trust.boot != first.trust.boot
    with pytest.raises(CallerError, match="another boot"):  # what was issued to the first process
        second.trust.authorize(old, sid, Scope.CONTROL)
    registry.register(registration(second, "http://127.0.0.1:9"), 1.0, key=key.public)
    second.trust.authorize(credentials.capabilities(sid, hops)["n0"], sid, Scope.CONTROL)
    ticket = credentials.open_ticket(sid, hops[0], b"{}")
    second.trust.redeem_open(second.trust.admit_open(credentials.capabilities(sid, hops)["n0"], ticket, sid), b"{}")
    with pytest.raises(CallerError) as err:  # the first process, still beating, is told to register again
        registry.heartbeat(heartbeat_body(first), 2.0, key=key.public)
    assert err.value.reason is Reason.NOT_FOUND and "another boot" in err.value.message
    assert registry.heartbeat(heartbeat_body(second), 2.0, key=key.public).boot == second.trust.boot
    with pytest.raises(CallerError) as err:
        registry.heartbeat({**heartbeat_body(second), "boot": "not hex"}, 3.0, key=key.public)
    assert err.value.reason is Reason.INVALID_REQUEST
