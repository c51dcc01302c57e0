"""Issue 40, item 7 (transport): --require-tls, --tracker-key, the persisted tracker pin.

Each is driven against the real tracker or node app (in process, over ASGI) the way the attack runs:
a registration or an open carrying a plain http URL, a tracker that answers with another key.
"""

from __future__ import annotations

import functools
import json
import logging
import stat

import httpx
import pytest
import trio

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Reason
from dgr.node.membership import registration, stay_registered
from dgr.node.run import check_transport
from dgr.node.service import NodeService
from dgr.node.app import make_node_app
from dgr.security.identity import Identity
from dgr.security.pins import TrackerPin, pin_path
from dgr.security.tls import TlsTrust
from dgr.testing.inproc import InProcRoute, asgi_client
from dgr.tracker.app import make_tracker_app

TRACKER = "http://127.0.0.1:8000"


async def _join(service: NodeService, tracker_key: Identity, pin: TrackerPin, caplog, seconds: float = 5.0) -> list[str]:
    """Run `service`'s membership against a real tracker app holding `tracker_key` for `seconds`; what it warned."""
    route = InProcRoute.stub()
    app = make_tracker_app(route.gateway, identity=tracker_key)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dgr.node"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(stay_registered, service, TRACKER, "http://n0.test:9000", pin=pin,
                                                 transport=httpx.ASGITransport(app=app)))
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()
    return [r.getMessage() for r in caplog.records]


def _node(identity: Identity | None = None) -> NodeService:
    return NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                       identity=identity or Identity.generate(), joining=True)


async def test_a_node_given_tracker_key_refuses_a_tracker_with_another_key(autojump_clock, caplog) -> None:
    """Before, a node trusted whatever key the first registration reply carried: a rogue tracker at the
    address (or anyone on the path, over http) became the node's authority. With --tracker-key X, a tracker
    answering with Y is refused, both keys named; the node never joins it, so it honours none of its
    capabilities."""
    x, y = Identity.generate(), Identity.generate()
    service = _node()
    said = await _join(service, y, TrackerPin(None, TRACKER, x.public, given=True), caplog)
    assert service.tracker_key is None and not service.joined.is_set()
    refusals = [m for m in said if "answered with key" in m]
    assert refusals and y.public_text in refusals[0] and x.public_text in refusals[0]
    assert "--tracker-key" in refusals[0] and "retrying" in refusals[0]
    # the key it was given: joined
    said = await _join(service, x, TrackerPin(None, TRACKER, x.public, given=True), caplog)
    assert service.tracker_key == x.public and not [m for m in said if "answered with key" in m]


async def test_a_restarted_node_refuses_a_tracker_whose_key_differs_from_its_pin(autojump_clock, caplog,
                                                                                tmp_path) -> None:
    """Before, the pin lived in memory: a restarted node trusted on first use again, so an attacker needed
    only to catch a restart. Now the first key is written beside the node's identity (0600, atomically) and
    a restart refuses another key, saying how to reset the pin; --tracker-key overrides and rewrites it."""
    key_file = tmp_path / "node.key"
    me = Identity.generate()
    me.save(key_file)
    y, z = Identity.generate(), Identity.generate()
    first = _node(me)
    await _join(first, y, TrackerPin.beside(key_file, TRACKER), caplog)
    assert first.tracker_key == y.public
    pinned = pin_path(key_file)
    assert pinned == tmp_path / "node.tracker" and stat.S_IMODE(pinned.stat().st_mode) == 0o600
    assert json.loads(pinned.read_text()) == {"trackers": {TRACKER: y.public_text}}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    restarted = _node(me)  # a new process: nothing in memory, the same identity file
    said = await _join(restarted, z, TrackerPin.beside(key_file, TRACKER), caplog)
    assert restarted.tracker_key is None
    refusal = next(m for m in said if "answered with key" in m)
    assert z.public_text in refusal and y.public_text in refusal and str(pinned) in refusal
    assert f"delete {pinned}" in refusal and f"--tracker-key {z.public_text}" in refusal
    # the same tracker again: joined; another tracker URL is its own pin (trust on first use there)
    await _join(restarted, y, TrackerPin.beside(key_file, TRACKER), caplog)
    assert restarted.tracker_key == y.public
    # the operator says the key changed: joined, and the pin follows
    moved = _node(me)
    await _join(moved, z, TrackerPin.beside(key_file, TRACKER, z.public), caplog)
    assert moved.tracker_key == z.public
    assert json.loads(pinned.read_text()) == {"trackers": {TRACKER: z.public_text}}
    # a pin file others can write is refused at start: whoever changes it picks whom the node obeys
    pinned.chmod(0o666)
    with pytest.raises(CallerError, match="can be changed by others"):
        TrackerPin.beside(key_file, TRACKER)


async def test_a_require_tls_tracker_refuses_an_http_registration() -> None:
    """Before, a tracker took any http:// registration and handed it out as a next hop, so activations and
    capabilities crossed the network in clear. With --require-tls it refuses one (403, nothing recorded);
    an https:// one registers."""
    route = InProcRoute.stub()
    route.registry.require_tls = True
    app = make_tracker_app(route.gateway, identity=Identity.generate())
    async with asgi_client(app, TRACKER) as http:
        body, headers = route.signed(0, "/v1/nodes/register", registration(route.services[0], "http://n0.test:9000"))
        r = await http.post("/v1/nodes/register", content=body, headers=headers)
        assert r.status_code == 403 and "--require-tls" in r.json()["error"]["message"]
        assert route.registry.nodes == {}
        body, headers = route.signed(0, "/v1/nodes/register", registration(route.services[0], "https://n0.test:9000"))
        r = await http.post("/v1/nodes/register", content=body, headers=headers)
        assert r.status_code == 200 and route.registry.nodes["n0"].url == "https://n0.test:9000"


async def test_a_require_tls_node_refuses_an_http_next_hop_or_loop_head(nursery) -> None:
    """A node under --require-tls opens no session whose relay plan sends its activations (or a ring tail's
    tokens) to an http:// address; it refuses to register with an http:// tracker, and to start with an
    http:// URL of its own to register."""
    sid = "ab" * 16

    def open_body(**relay) -> dict:
        return {"session": sid, "max_positions": 64, "relay": {"route": "n0,n1", "nodes": 2, **relay}}

    for layers, relay, what in [
        ((0, 15), {"next": {"node": "n1", "url": "http://n1.test:9001"}}, "relay.next"),
        ((15, 30), {"loop": {"head": {"node": "n0", "url": "http://n0.test:9000"}}}, "relay.loop.head"),
    ]:
        for required in (False, True):
            service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(*layers)), node_id="n0",
                                  tracker_url="https://tracker.test", tls=TlsTrust(required=required))
            await nursery.start(service.run)
            async with asgi_client(make_node_app(service), "https://n0.test:9000") as http:
                r = await http.post("/v1/seam/sessions", json=open_body(**relay))
            if required:
                assert r.status_code == 403, r.text
                assert what in r.json()["error"]["message"] and "--require-tls" in r.json()["error"]["message"]
                assert service.sessions == {} and service.backend.session_count() == 0
            else:
                assert r.status_code == 201, r.text  # the same plan, TLS not required: opened
                await service.lifecycle.close(sid, [])

    tls = TlsTrust(required=True)
    with pytest.raises(CallerError, match="the tracker 'http://") as err:
        await stay_registered(_node(), TRACKER, "https://n0.test:9000", tls=tls)
    assert err.value.reason is Reason.FORBIDDEN
    with pytest.raises(CallerError, match="plain http:// URL"):
        check_transport(tls, "https://tracker.test", None, None)
    with pytest.raises(CallerError, match="--advertise"):
        check_transport(tls, "https://tracker.test", None, "http://n0.test:9000")
    check_transport(tls, "https://tracker.test", ("cert.pem", "key.pem"), None)
    check_transport(TlsTrust(), TRACKER, None, None)  # not required: plain http as before


async def test_a_pooled_connection_its_server_closed_is_not_reused(nursery) -> None:
    """A restarted server (a tracker) leaves the pool's idle connections half closed: the next request or
    stream goes on a new connection, not on one whose peer is gone (a ring tail lost its first answers to a
    restarted tracker that way)."""
    from dgr.seam.transport import ConnectionPool

    served: list[int] = []

    async def one_answer_then_close(stream: trio.SocketStream) -> None:
        served.append(len(served))
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await stream.aclose()  # keep-alive as far as the client knows, closed here: what a restart does

    listeners = await nursery.start(functools.partial(trio.serve_tcp, one_answer_then_close, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    pool = ConnectionPool(f"http://127.0.0.1:{port}")
    first = await pool.request("GET", "/")
    assert first.status == 200 and pool.idle_connections == 1
    await trio.sleep(0.2)  # the server's FIN arrives
    second = await pool.request("GET", "/")
    assert second.status == 200 and served == [0, 1]
    await pool.aclose()
