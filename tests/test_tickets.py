"""A route member's capabilities, and open tickets, attacked on a real route (issue 40, item 3 and part of 4).

The route is `dgr up` (stub backend, ring topology) with a tracker, a join
token and a key folder, so every node checks capabilities. The attacker is a
route member: it holds what the gateway's relay plans hand a node for its
neighbour, built here by the gateway's own `credentials.relay_plans` with
the route's tracker key. A session id node1 has never seen stands for an old
one after node1 restarted (a restarted node remembers no ended session); the
last test restarts it for real.
"""

from __future__ import annotations

import json
import socket
import time
import types
import uuid

import httpx
import numpy as np
import pytest

from dgr.fsm.route import Hop
from dgr.seam.frame import encode_frame
from dgr.seam.stream import encode_record
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, MAX_CONTROL_BYTES, MAX_TOKENIZE_BYTES,
                           ROUTE_SESSION_HEADER, STREAM_PATH, Flag, FrameKind)
from dgr.security.auth import CapabilityAuthority
from dgr.testing.harness import LocalRoute, stream_steps
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.registry import Registry

W = 576  # the default stub's seam width
NEIGHBOUR = "only lets its holder send session"  # the refusal of a neighbour's capability for a control call


@pytest.fixture(scope="module")
def route():
    with LocalRoute(nodes=2) as r:
        yield r


def _plans(route: LocalRoute, sid: str) -> dict:
    """The relay plans the route's gateway would hand its nodes for `sid` (signed with the route's tracker key)."""
    gateway = Gateway(Registry(), GatewayConfig(),
                      authority=CapabilityAuthority.issuer(route.tracker_identity))
    hops = []
    for n in route.node_table():
        a, b = n["layers"].split(":")
        hops.append(Hop(n["node"], n["url"], int(a), int(b)))
        # the registry's entry as far as the plans read it: the node's boot, which its capabilities name, no TLS
        gateway.registry.nodes[n["node"]] = types.SimpleNamespace(boot=n["boot"], tls_cert=None)
    plans = gateway.credentials.relay_plans(sid, tuple(sorted(hops, key=lambda h: h.start)))
    return {node: order.to_json() for node, order in plans.items()}  # as an open's body carries them


def _refused(r: httpx.Response, status: int, code: str, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err


def _open(url: str, sid: str, cap: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/seam/sessions", content=json.dumps({"session": sid, **body}).encode(),
                      headers={"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: cap,
                               **headers})


def test_a_neighbours_capability_cannot_open_read_or_have_a_prompt_tokenized(route) -> None:
    sid = uuid.uuid4().hex
    plans = _plans(route, sid)
    tail = route.node("node1")["url"]
    held_by_head = plans["node0"]["next"]["capability"]  # node0's, to send node1 this session's steps
    held_by_tail = plans["node1"]["loop"]["head"]["capability"]  # node1's, to send the head each next step
    # a re-open of the session (an old one, after node1 restarted) for free compute
    _refused(_open(tail, sid, held_by_head, {"max_positions": 64}), 403, "forbidden", NEIGHBOUR)
    _refused(httpx.get(f"{tail}/v1/seam/sessions/{sid}", headers={CAPABILITY_HEADER: held_by_head}),
             403, "forbidden", NEIGHBOUR)
    head = route.node("node0")["url"]
    _refused(_open(head, sid, held_by_tail, {"max_positions": 64, "prompt": {"prompt": "free work"}, "max_new": 1}),
             403, "forbidden", NEIGHBOUR)
    assert route.node_status("node1")["sessions"] == 0


def test_a_ring_tail_is_not_reopened_toward_an_address_of_the_holders_choosing(route) -> None:
    sid = uuid.uuid4().hex
    plans = _plans(route, sid)
    tail = route.node("node1")["url"]
    held_by_head = plans["node0"]["next"]["capability"]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        forged = json.loads(json.dumps(plans["node1"]))
        forged["loop"]["head"]["url"] = f"http://127.0.0.1:{trap.getsockname()[1]}"
        body = {"max_positions": 64, "sampling": {"temperature": 0.0}, "relay": forged}
        # with the neighbour's capability, and with the gateway's own and a genuine ticket for the genuine plan
        _refused(_open(tail, sid, held_by_head, body), 403, "forbidden", NEIGHBOUR)
        raw, headers = route.opening(sid, "node1", {**body, "relay": plans["node1"]})
        forged_raw = json.dumps({"session": sid, **body}).encode()
        _refused(httpx.post(f"{tail}/v1/seam/sessions", content=forged_raw, headers=headers), 403, "forbidden",
                 "not the one its ticket was signed for")
        # a step the neighbour's capability does allow: there is no session for it to drive toward the trap
        frame = encode_frame(FrameKind.PREFILL, sid, 0, 0, 4, W, hidden=np.full((4, W), 0.25, np.float32),
                             flags=Flag.SAMPLE)
        r = httpx.post(f"{tail}{STREAM_PATH}", content=encode_record((), frame),
                       headers={"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: held_by_head})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session", r.text
        trap.settimeout(1.5)
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing ever connected to the holder's address
    assert route.node_status("node1")["sessions"] == 0


def test_a_neighbours_capability_cannot_close_a_session_or_plant_kept_kv(route) -> None:
    sid = uuid.uuid4().hex
    tail = route.node("node1")["url"]
    raw, headers = route.opening(sid, "node1", {"max_positions": 128, "relay": route.relay(sid, "node1")})
    assert httpx.post(f"{tail}/v1/seam/sessions", content=raw, headers=headers).status_code == 201
    own = route.capability(sid, "node1")
    frame = encode_frame(FrameKind.PREFILL, sid, 0, 0, 64, W, hidden=np.full((64, W), 0.25, np.float32))
    assert stream_steps(tail, sid, [frame], own).status_code == 200
    kept = route.node_status("node1")["prefix"]["entries"]
    held_by_head = _plans(route, sid)["node0"]["next"]["capability"]
    victims_key = "ab" * 16  # a key of the victim's scope: its next turn would reuse what is kept under it
    for params in ({"keep": victims_key}, {}, {"reason": "cancelled"}):
        _refused(httpx.delete(f"{tail}/v1/seam/sessions/{sid}", params=params,
                              headers={CAPABILITY_HEADER: held_by_head}), 403, "forbidden", NEIGHBOUR)
    assert route.node_status("node1")["prefix"]["entries"] == kept
    assert httpx.get(f"{tail}/v1/seam/sessions/{sid}", headers=own).json()["positions"] == 64  # still the victim's
    assert httpx.delete(f"{tail}/v1/seam/sessions/{sid}", headers=own).status_code == 200


def _refused_unread(url: str, path: str, length: int, headers: dict[str, str]) -> bytes:
    """Announce a `length`-byte body, send only the head, and return the answer (which must not wait for it)."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)  # times out (3 s) if the node waits for the body
            if not chunk:
                break
            answer += chunk
    return answer


def test_a_body_from_a_caller_without_a_capability_is_never_read(route) -> None:
    sid = uuid.uuid4().hex
    plans = _plans(route, sid)
    head, tail = route.node("node0")["url"], route.node("node1")["url"]
    step_only = {CAPABILITY_HEADER: plans["node1"]["loop"]["head"]["capability"]}
    for headers in ({}, step_only):
        t0 = time.monotonic()
        answer = _refused_unread(head, "/v1/seam/sessions", MAX_TOKENIZE_BYTES, {ROUTE_SESSION_HEADER: sid, **headers})
        assert answer.startswith(b"HTTP/1.1 403") and time.monotonic() - t0 < 2.0, answer
        assert b"connection: close" in answer.lower()  # what it did not read cannot start another request
    answer = _refused_unread(tail, "/v1/seam/sessions", MAX_CONTROL_BYTES,
                             {ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: plans["node0"]["next"]["capability"]})
    assert answer.startswith(b"HTTP/1.1 403"), answer
    answer = _refused_unread(tail, "/v1/seam/sessions", MAX_CONTROL_BYTES,  # the gateway's capability, no ticket
                             {ROUTE_SESSION_HEADER: sid, **route.capability(sid, "node1")})
    assert answer.startswith(b"HTTP/1.1 403"), answer
    assert httpx.get(f"{head}/healthz", timeout=2).status_code == 200


def test_a_genuine_open_ticket_is_used_once_and_expires(route) -> None:
    tail = route.node("node1")["url"]
    sid = uuid.uuid4().hex
    raw, headers = route.opening(sid, "node1", {"max_positions": 64, "relay": route.relay(sid, "node1")})
    assert httpx.post(f"{tail}/v1/seam/sessions", content=raw, headers=headers).status_code == 201
    assert httpx.delete(f"{tail}/v1/seam/sessions/{sid}", headers=route.capability(sid, "node1")).status_code == 200
    _refused(httpx.post(f"{tail}/v1/seam/sessions", content=raw, headers=headers), 403, "forbidden", "used once")
    # one never used is good until its expiry, and refused as expired after
    late = uuid.uuid4().hex
    raw, headers = route.opening(late, "node1", {"max_positions": 64, "relay": route.relay(late, "node1")}, ttl_s=1.0)
    time.sleep(1.2)
    _refused(httpx.post(f"{tail}/v1/seam/sessions", content=raw, headers=headers), 403, "forbidden", "expired")
    assert route.node_status("node1")["sessions"] == 0


def test_a_captured_open_is_refused_by_its_node_once_it_restarted(route) -> None:
    """Last in this module: it restarts node1. Issue 55: an open captured on the wire (capability, ticket and
    body) re-opened its session on the node's next process, within the ticket's 120 s, since a restarted node
    forgets the ids it opened; both are now bound to the boot nonce the node registered, and a new process
    refuses them. The tracker learns the new boot from the new registration, so the route serves on."""
    tail = route.node("node1")["url"]
    sid = uuid.uuid4().hex
    captured = route.opening(sid, "node1", {"max_positions": 64, "relay": route.relay(sid, "node1")})
    assert httpx.post(f"{tail}/v1/seam/sessions", content=captured[0], headers=captured[1]).status_code == 201
    assert httpx.delete(f"{tail}/v1/seam/sessions/{sid}", headers=route.capability(sid, "node1")).status_code == 200
    before, layers = route.boot("node1"), route.node("node1")["layers"]
    route.kill("node1")
    route.restart_node("node1", layers)
    assert route.boot("node1") not in ("", before)
    tail = route.node("node1")["url"]
    r = httpx.post(f"{tail}/v1/seam/sessions", content=captured[0], headers=captured[1])
    _refused(r, 403, "forbidden", "another boot of this node")
    # the capability alone, or the ticket alone with a capability for the new boot, does not pass either
    _refused(httpx.get(f"{tail}/v1/seam/sessions/{sid}", headers={CAPABILITY_HEADER: captured[1][CAPABILITY_HEADER]}),
             403, "forbidden", "another boot of this node")
    _refused(httpx.post(f"{tail}/v1/seam/sessions", content=captured[0],
                        headers={**captured[1], **route.capability(sid, "node1")}),
             403, "forbidden", "open ticket was issued for another boot")
    assert route.node_status("node1")["sessions"] == 0
    # what the tracker issues now is bound to the new boot: the route answers
    r = route.http.post(f"{route.api}/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 2},
                        timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_forged_or_misplaced_ticket_is_refused_from_the_headers_alone() -> None:
    """In process: every way a ticket can be wrong is refused before the body is looked at."""
    from dgr.errors import CallerError
    from dgr.security.identity import Identity, b64e
    from dgr.security.tickets import TicketBook, issue_ticket

    tracker, member = Identity.generate(), Identity.generate()
    sid, body, now = uuid.uuid4().hex, b'{"session": "x"}', time.time()
    book = TicketBook(tracker.public)
    good = issue_ticket(tracker, sid, "n1", 15, 30, body, now)
    claims, _, sig = good.partition(".")
    nan = b64e(json.dumps({"s": sid, "n": "n1", "l": [15, 30], "e": float("nan"), "b": "0" * 64}).encode())
    for token, words in [(None, "needs the tracker's ticket"),
                         (issue_ticket(member, sid, "n1", 15, 30, body, now), "does not verify"),  # a member's own
                         (issue_ticket(tracker, sid, "n0", 15, 30, body, now), "another node"),
                         (issue_ticket(tracker, sid, "n1", 0, 30, body, now), "another node or layer range"),
                         (issue_ticket(tracker, uuid.uuid4().hex, "n1", 15, 30, body, now), "another Route Session"),
                         (issue_ticket(tracker, sid, "n1", 15, 30, body, now, ttl_s=-1), "expired"),
                         (nan + "." + sig, "does not verify"), ("!!." + sig, "malformed")]:
        with pytest.raises(CallerError, match=words):
            book.check(token, session=sid, node="n1", start=15, stop=30, now=now)
    ticket = book.check(good, session=sid, node="n1", start=15, stop=30, now=now)
    with pytest.raises(CallerError, match="not the one its ticket was signed for"):
        book.redeem(ticket, body + b" ", now)
    book.redeem(ticket, body, now)
    with pytest.raises(CallerError, match="used once"):
        book.check(good, session=sid, node="n1", start=15, stop=30, now=now)
    # remembered until the ticket expires, and refused as expired after
    with pytest.raises(CallerError, match="expired"):
        book.check(good, session=sid, node="n1", start=15, stop=30, now=now + 121)
    assert sid not in book.used
