"""No body before a credential (issue 55, the lows), driven as the attacks were: raw sockets against a real
tracker or node served on loopback.

- The tracker's failure reports were read (up to 1 MiB) and parsed before their capability was checked.
- A node's layer-possession challenges were read and parsed before the tracker's signature on them was.
- `POST /v1/assign` was read, parsed and priced for anyone.
- A refused step was read whole, up to a 64 MiB frame, before it was refused.

Each check now runs on the request's headers (for a step: its frame's header) and the refusal is answered at
once, nothing more read, with `Connection: close`. A test here announces a body and sends none of it (or a
frame's header and none of its payload): the answer must come within a second, which it could not while the
server waited for the bytes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid

import h11
import pytest
import trio

from dgr.api.server import serve_asgi
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.node.app import make_node_app
from dgr.node.assign import ASSIGN_PATH
from dgr.node.service import NodeService
from dgr.security.auth import JOIN_HEADER, Admission, CapabilityAuthority, Scope, Signer, join_proof
from dgr.security.identity import Identity
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, HEADER, HEADER_SIZE, MAGIC, NODE_HEADER,
                           RECORD_PREFIX, ROUTE_SESSION_HEADER, STREAM_PATH, VERSION, DType, Flag, FrameKind)
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway
from dgr.tracker.proofs import CHALLENGE_PATH
from dgr.tracker.registry import Registry

pytestmark = pytest.mark.trio

ANSWER_S = 1.0  # a refusal from the headers comes at once; a server waiting for the body would take its 10 s


@contextlib.asynccontextmanager
async def served(app):
    """`app` on loopback for one test, bounded to 20 s; yields how to open a connection to it."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_asgi, app, "127.0.0.1", 0))
            yield functools.partial(trio.open_tcp_stream, "127.0.0.1", int(url.rpartition(":")[2]))
            nursery.cancel_scope.cancel()


def head(path: str, length: int, headers: dict[str, str], content_type: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}", f"Content-Length: {length}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def answer(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """The response on `stream`: (status, headers, body); within ANSWER_S, or the test fails."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    status, headers, body = 0, {}, b""
    with trio.fail_after(ANSWER_S):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, headers, body


def code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


async def test_a_failure_report_is_refused_from_its_headers_before_its_body_is_read() -> None:
    """A report announcing 1 MiB and sending none of it, with no capability, a forged one, one for another
    session or none naming its session: 403 at once. Before, the tracker waited for the body and parsed it
    first: a junk body with a forged capability got 400 invalid_json."""
    tracker = Identity.generate()
    authority = CapabilityAuthority.issuer(tracker)
    app = make_tracker_app(Gateway(registry=Registry(), authority=authority))
    sid, other = uuid.uuid4().hex, uuid.uuid4().hex

    def cap(session: str, by: CapabilityAuthority = authority) -> str:
        return by.issue(session, "n0", 0, 1, time.time(), scope=Scope.REPORT)  # a route member's (trust v3)

    refused = [{}, {CAPABILITY_HEADER: cap(sid)},  # no session named: nothing to check the capability for
               {ROUTE_SESSION_HEADER: sid}, {ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: "forged.token"},
               {ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: cap(other)},
               {ROUTE_SESSION_HEADER: sid, CAPABILITY_HEADER: cap(sid, CapabilityAuthority.issuer(Identity.generate()))}]
    async with served(app) as connect:
        for headers in refused:
            attacker = await connect()
            await attacker.send_all(head(DELIVER_PATH, 1024 * 1024, headers))  # and never a byte of the body
            status, got, body = await answer(attacker)
            assert (status, code(body), got.get("connection")) == (403, "forbidden", "close"), (headers, body)
        junk = b"{not json"
        attacker = await connect()
        await attacker.send_all(head(DELIVER_PATH, len(junk), {ROUTE_SESSION_HEADER: sid,
                                                               CAPABILITY_HEADER: "forged.token"}) + junk)
        status, _, body = await answer(attacker)
        assert (status, code(body)) == (403, "forbidden"), body  # not parsed: invalid_json before
        # the session's own capability: past the headers, the body must name the session its header named
        member = await connect()
        for named, status_code, reason in ((other, 403, "forbidden"), (sid, 404, "unknown_session")):
            report = json.dumps({"session": named, "reporter": "n0", "code": "route_node_lost", "message": "x",
                                 "node": "n1"}).encode()
            await member.send_all(head(DELIVER_PATH, len(report), {ROUTE_SESSION_HEADER: sid,
                                                                   CAPABILITY_HEADER: cap(sid)}) + report)
            status, _, body = await answer(member)
            assert (status, code(body)) == (status_code, reason), body


async def test_a_challenge_is_refused_from_its_headers_before_its_body_is_read() -> None:
    """A layer-possession challenge announcing 1 MiB and sending none of it, unsigned or signed by another key
    than the tracker's the node pinned: 403 at once. Before, the node read and parsed the body to find the
    signature in it: a junk body got 400 invalid_json. The tracker's own challenge passes (this node holds no
    artifact: 404), and is not answered twice (its nonce is spent)."""
    tracker, stranger = Identity.generate(), Identity.generate()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                          identity=Identity.generate(), joining=True)
    service.join(tracker.public)
    body = json.dumps({"node": "n0", "nonce": "0" * 32}).encode()
    async with served(make_node_app(service)) as connect:
        for headers in ({}, Signer(stranger).headers("POST", CHALLENGE_PATH, body, time.time()),
                        Signer(tracker).headers("POST", CHALLENGE_PATH, body, time.time() - 3600)):
            attacker = await connect()
            await attacker.send_all(head(CHALLENGE_PATH, 1024 * 1024, headers))  # and never a byte of the body
            status, got, reply = await answer(attacker)
            assert (status, code(reply), got.get("connection")) == (403, "forbidden", "close"), (headers, reply)
        junk = b"{not json"
        attacker = await connect()
        await attacker.send_all(head(CHALLENGE_PATH, len(junk), {}) + junk)
        status, _, reply = await answer(attacker)
        assert (status, code(reply)) == (403, "forbidden"), reply  # not parsed: invalid_json before
        signed = Signer(tracker).headers("POST", CHALLENGE_PATH, body, time.time())
        for want in ((404, "not_found"), (403, "forbidden")):  # the tracker's; then the same again, replayed
            node = await connect()
            await node.send_all(head(CHALLENGE_PATH, len(body), signed) + body)
            status, _, reply = await answer(node)
            assert (status, code(reply)) == want, reply


async def test_assign_and_membership_are_refused_from_their_headers_before_their_body_is_read() -> None:
    """`POST /v1/assign` was read, parsed and priced for anyone; a registration or heartbeat was read before
    its signature was checked. On a tracker with a join token, each is refused 401 from its headers (unsigned,
    or a key without the token's proof) before a byte of its body is read; a node with the token is answered
    (here: the manifest is unknown, 404)."""
    token = b"t" * 32
    app = make_tracker_app(Gateway(registry=Registry()), admission=Admission(token=token))
    stranger, node = Identity.generate(), Identity.generate()
    async with served(app) as connect:
        for path in (ASSIGN_PATH, "/v1/nodes/register", "/v1/nodes/heartbeat"):
            for headers in ({}, Signer(stranger).headers("POST", path, b"{}", time.time())):
                if path == "/v1/nodes/heartbeat":
                    headers = {**headers, NODE_HEADER: "n0"}
                attacker = await connect()
                await attacker.send_all(head(path, 1024 * 1024, headers))  # and never a byte of the body
                status, got, reply = await answer(attacker)
                want = (401, "unauthenticated") if path != "/v1/nodes/heartbeat" or not headers.get("X-Dgr-Key") \
                    else (404, "not_found")  # a signed heartbeat for an id its key does not own
                assert (status, code(reply), got.get("connection")) == (*want, "close"), (path, headers, reply)
        body = json.dumps({"manifest_id": "m" * 64, "memory_bytes": 2**30}).encode()
        signed = Signer(node).headers("POST", ASSIGN_PATH, body, time.time())
        signed[JOIN_HEADER] = join_proof(token, node.public, signed["X-Dgr-Signature"])
        member = await connect()
        await member.send_all(head(ASSIGN_PATH, len(body), signed) + body)
        status, _, reply = await answer(member)
        assert (status, code(reply)) == (404, "not_found"), reply


def _step_header(session: str, *, kind: FrameKind = FrameKind.PREFILL, width: int, payload: int) -> bytes:
    """A record's prefix (no hops yet) and a PREFILL frame's header announcing `payload` bytes of hidden states
    (f32), which never follow."""
    n_tokens = payload // (width * 4)
    return RECORD_PREFIX.pack(0) + HEADER.pack(MAGIC, VERSION, kind, DType.F32, Flag.HIDDEN, bytes.fromhex(session),
                                               0, 0, n_tokens, width, n_tokens * width * 4, 0)


async def test_a_refused_step_is_answered_from_its_frame_header_without_its_payload() -> None:
    """A step whose frame header already says it is refused (a session this node does not hold, another
    session's frame on this session's stream, a kind or width this shard does not take) and that announces
    60 MiB of hidden states: the node answers from the header, the payload never sent, and closes the stream.
    Before, it waited for the whole frame (up to 64 MiB, buffered) and refused it then."""
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(15, 30)), node_id="n1")
    width = service.backend.info.seam_width
    sid, other = uuid.uuid4().hex, uuid.uuid4().hex
    cases = [(sid, _step_header(sid, width=width, payload=60 * 2**20), 404, "unknown_session"),
             (sid, _step_header(other, width=width, payload=60 * 2**20), 403, "forbidden"),
             (sid, _step_header(sid, width=width + 1, payload=60 * 2**20), 422, "wrong_width"),
             (sid, _step_header(sid, kind=FrameKind.HIDDEN, width=width, payload=60 * 2**20), 400, "bad_frame")]
    async with served(make_node_app(service)) as connect:
        for stream_sid, record, status_code, reason in cases:
            sender = await connect()
            size = len(record) - RECORD_PREFIX.size - HEADER_SIZE + 60 * 2**20
            await sender.send_all(head(STREAM_PATH, size, {ROUTE_SESSION_HEADER: stream_sid}, CONTENT_TYPE) + record)
            status, got, body = await answer(sender)
            assert (status, code(body), got.get("connection")) == (status_code, reason, "close"), body
