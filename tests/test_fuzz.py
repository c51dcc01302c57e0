"""Fuzzing the three doors remote input comes through: seam frames, node HTTP bodies, OpenAI bodies.

Whatever arrives, the answer is a result or a typed `CallerError` (a 4xx on
the wire) and a refused input changes nothing. Bounded so it fits `make
test`; `DGR_SLOW=1` runs the same properties with many more examples.
"""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.parse
import uuid
import zlib

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr.api.http import parse_json
from dgr.api.openai import GenerationRequest, parse_request
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError
from dgr.node.app import make_node_app
from dgr.node.membership import registration
from dgr.node.service import NodeService
from dgr.sampling import SamplingParams
from dgr.security.auth import CapabilityAuthority, Signer
from dgr.security.identity import Identity
from dgr.testing.inproc import http_scope, receive_once
from dgr.testing.nodes import running, settled
from dgr.testing.onering import OneNodeRing
from dgr.seam.frame import Frame, decode_frame, encode_frame
from dgr.seam.wire import HEADER, HEADER_SIZE, MAGIC, NODE_HEADER, VERSION, DType, Flag, FrameKind
from dgr.tracker.app import make_tracker_app
from dgr.tracker.gateway import Gateway
from dgr.tracker.registry import Registry

# Wild hidden values (inf, 3e38) overflow inside the stub's arithmetic: expected, and not what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
SLOW = os.environ.get("DGR_SLOW") == "1"
SPEC = StubSpec(n_layers=6, hidden_size=16)
W = SPEC.seam_width
SID = uuid.UUID(int=7).hex
FUZZ = settings(max_examples=2000 if SLOW else 150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


# -- seam frames ----------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=HEADER_SIZE + 256))
def test_decode_frame_on_arbitrary_bytes(data: bytes) -> None:
    try:
        frame = decode_frame(data, max_bytes=HEADER_SIZE + 200)
    except CallerError:
        return
    assert isinstance(frame, Frame) and frame.size == len(data)


def _u32():
    return st.one_of(st.integers(0, 8), st.integers(0, 2 ** 32 - 1), st.sampled_from([W - 1, W + 1, 2 ** 31, 2 ** 32 - 1]))


# Plausible header fields; each may be swapped for a wild value, so every check in turn gets reached.
PLAUSIBLE = {
    "magic": st.just(MAGIC),
    "version": st.just(VERSION),
    "kind": st.sampled_from([FrameKind.PREFILL, FrameKind.DECODE]),
    "dtype": st.sampled_from([DType.F32, DType.F16]),
    "flags": st.sampled_from([Flag.TOKENS, Flag.HIDDEN, Flag.TOKENS | Flag.HIDDEN]).flatmap(
        lambda f: st.sampled_from([f, f | Flag.SAMPLE])),
    "session": st.just(SID),
    "seq": st.sampled_from([0, 0, 0, 1, 1, 2]),  # 0 and 1 are next for a fresh and a prefilled session
    "pos0": st.sampled_from([0, 0, 2, 2, 1, 3]),
    "n_tokens": st.integers(1, 3),
    "width": st.just(W),
}
WILD = {
    "magic": st.just(b"DGRX"),
    "version": st.sampled_from([0, 2, 255]),
    "kind": st.integers(0, 7),
    "dtype": st.integers(2, 255),
    "flags": st.integers(0, 255),
    "session": st.just(uuid.UUID(int=8).hex),
    "seq": _u32(),
    "pos0": _u32(),
    "n_tokens": _u32(),
    "width": _u32(),
}


@st.composite
def frames(draw) -> bytes:
    wild = draw(st.sets(st.sampled_from(sorted(WILD)), max_size=2))
    h = {k: int(draw((WILD if k in wild else PLAUSIBLE)[k])) if k not in ("magic", "session")
         else draw((WILD if k in wild else PLAUSIBLE)[k]) for k in PLAUSIBLE}
    style = draw(st.sampled_from(["fits", "fits", "fits", "random", "values"]))
    n, w = min(h["n_tokens"], 6), min(h["width"], 2 * W)
    if style == "fits":  # a payload sized to the header's own claims (clamped), so deeper checks run
        parts = b""
        if h["flags"] & Flag.TOKENS:
            ids = draw(st.lists(st.integers(0, 80) | st.integers(-(2 ** 31), 2 ** 31 - 1), min_size=n, max_size=n))
            parts += np.array(ids, "<i4").tobytes()
        if h["flags"] & Flag.HIDDEN:
            value = draw(st.sampled_from([1.0, 1.0, -0.5, np.nan, np.inf, 6e4, 3e38]))
            with np.errstate(over="ignore"):
                arr = np.full(n * w, value, np.float32).astype("<f2" if h["dtype"] == DType.F16 else "<f4")
            parts += arr.tobytes()
        payload = parts
    elif style == "values":
        payload = np.array(draw(st.lists(st.floats(width=32), max_size=3 * W)), "<f4").tobytes()
    else:
        payload = draw(st.binary(max_size=4 * W))
    crc = zlib.crc32(payload) if style != "random" or draw(st.booleans()) else draw(st.integers(0, 2 ** 32 - 1))
    plen = len(payload) if draw(st.integers(0, 9)) else draw(_u32())
    header = HEADER.pack(h["magic"], h["version"], h["kind"], h["dtype"], h["flags"], uuid.UUID(hex=h["session"]).bytes,
                         h["seq"], h["pos0"], h["n_tokens"], h["width"], plen, crc)
    return header + payload


def _services(authority: CapabilityAuthority | None = None) -> list[NodeService]:
    return [NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(a, b)), node_id=f"n{a}", authority=authority)
            for a, b in ((0, 2), (2, 4), (4, 6))]


async def _open(services: list[NodeService]) -> None:
    """A ring of the three: each node's output comes to the test (dgr.testing.onering), which hands it on."""
    for s in services:
        await OneNodeRing.of(s).open(SID, 16)


async def _prefill(services: list[NodeService]) -> None:
    """Two positions in, so frames can also land on a session mid-prefill."""
    hidden = None
    for i, s in enumerate(services):
        ids = [5, 6] if i == 0 else None
        raw = encode_frame(FrameKind.PREFILL, SID, 0, 0, 2, W, token_ids=ids, hidden=hidden,
                           flags=Flag.SAMPLE if i == 2 else Flag(0))
        reply = await OneNodeRing.of(s).step(raw)
        hidden = decode_frame(reply).hidden


@FUZZ
@given(st.lists(frames(), min_size=1, max_size=6), st.booleans())
def test_node_step_answers_or_refuses_and_refusals_change_nothing(raws: list[bytes], prefilled: bool) -> None:
    async def run() -> None:
        services = _services()
        async with running(*services):
            await _open(services)
            if prefilled:
                await _prefill(services)
            for raw in raws:
                for s in services:
                    ring = OneNodeRing.of(s)
                    before = (await s.session_json(SID), s.scheduler.kv_bytes, len(s.sessions))
                    try:
                        ring.send(raw, SID)  # on the session's stream
                    except CallerError:
                        assert (await s.session_json(SID), s.scheduler.kv_bytes, len(s.sessions)) == before
                        continue
                    await settled(s)
                    # a frame that passed every check must not break compute (its failure would be reported)
                    assert not ring.reports, f"{s.node_id} accepted a frame its backend then failed on"
                    assert decode_frame(await ring.answer(SID)).session == SID

    trio.run(run)


@FUZZ
@given(frames(), st.one_of(st.none(), st.text(max_size=80), st.sampled_from(["good", "other-session", "other-node"])))
def test_node_step_with_a_tracker_key_refuses_without_the_right_capability(raw: bytes, token) -> None:
    authority = CapabilityAuthority.issuer(TRACKER)
    good = {"good": (SID, "n2"), "other-session": (uuid.UUID(int=8).hex, "n2"), "other-node": (SID, "n0")}
    if token in good:
        sid, node = good[token]
        token = authority.issue(sid, node, 2, 4, now=time.time())
    s = _services(CapabilityAuthority.verifier(TRACKER.public))[1]  # a node holds only the tracker's public key

    async def run() -> bool:
        async with running(s):
            ring = OneNodeRing(s)
            await ring.open(SID, 16)
            before = await s.session_json(SID)
            try:  # what a stream of SID does: its capability checked from the headers, then each frame
                s.trust.authorize(token, SID)
                ring.send(raw, SID)
            except CallerError:
                assert await s.session_json(SID) == before
                return False
            return True

    if not trio.run(run):
        return
    assert token is not None and authority.check(token, session=SID, node="n2", start=2, stop=4, now=0)


# -- node HTTP bodies, through the real ASGI app ----------------------------------------------------


async def _asgi(app, method: str, path: str, body: bytes, headers=(), query_string: bytes = b"") -> int:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = http_scope(method, path, body, headers=headers, query_string=query_string)
    with trio.fail_after(10):
        await app(scope, receive_once(body), send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@FUZZ
@given(st.one_of(json_values, st.fixed_dictionaries(
    {"session": st.sampled_from([uuid.UUID(int=9).hex, "x" * 32, 5]), "max_positions": json_values | st.integers(-5, 10 ** 6),
     "sampling": json_values | st.fixed_dictionaries({}, optional={"temperature": json_values, "top_p": json_values,
                                                                   "seed": json_values, "bogus": json_values})})))
def test_node_open_session_body_is_answered_below_500(body) -> None:
    service = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(4, 6)), node_id="tail")
    app = make_node_app(service)
    raw = json.dumps(body).encode()

    async def run() -> int:
        async with running(service):
            return await _asgi(app, "POST", "/v1/seam/sessions", raw)

    status = trio.run(run)
    assert status in (201, 400, 404, 409, 413, 429), (status, body)
    if status != 201:
        assert not service.sessions


@FUZZ
@given(st.sampled_from(["close", "status", "challenge", "open", "prefix"]), st.one_of(
    json_values, st.fixed_dictionaries({}, optional={"messages": json_values | st.lists(st.fixed_dictionaries(
        {}, optional={"role": st.sampled_from(["user", "system", "x"]) | json_values, "content": json_values}),
        max_size=3), "prompt": json_values | st.fixed_dictionaries({}, optional={
            "prompt": json_values | st.text(max_size=40), "ids": json_values | st.lists(st.integers(-2, 400)),
            "messages": json_values}),
        "session": json_values | st.sampled_from([SID, uuid.UUID(int=7).hex]), "max_positions": json_values,
        "max_new": json_values, "max_prompt": json_values, "root": json_values | st.sampled_from(["0" * 32]),
        "prefix": json_values, "marks": json_values})),
    st.one_of(st.sampled_from([SID, "x" * 32, "..", "%00"]), st.text(max_size=40)),
    st.dictionaries(st.sampled_from(["reason", "message"]), st.text(max_size=30) | st.sampled_from(["cancelled", "x"]),
                    max_size=2))
def test_node_control_routes_answer_below_500(route, body, sid, query) -> None:
    """Every node route but the seam step (fuzzed above), with any body, path and query."""
    service = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 2)), node_id="head")
    app = make_node_app(service)
    method, path = {"close": ("DELETE", f"/v1/seam/sessions/{sid}"),
                    "status": ("GET", f"/v1/seam/sessions/{sid}"), "challenge": ("POST", "/v1/artifact/challenge"),
                    "open": ("POST", "/v1/seam/sessions"), "prefix": ("POST", f"/v1/seam/sessions/{sid}/prefix")}[route]
    query_string = urllib.parse.urlencode(query).encode()

    async def run() -> int:
        async with running(service):
            await OneNodeRing(service).open(SID, 16, SamplingParams())
            return await _asgi(app, method, path, json.dumps(body).encode(), (), query_string)

    status = trio.run(run)
    assert status < 500, (status, route, body, sid, query)


TRACKER = Identity.generate()
NODE = Identity.generate()


@functools.cache
def _good_registration() -> dict:
    service = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 2)), node_id="n0")
    return registration(service, "http://127.0.0.1:9")


registrations = st.one_of(json_values, st.builds(
    lambda changes: {**_good_registration(), **changes},
    st.dictionaries(st.sampled_from(["node", "url", "pid", "layers", "backend", "model", "capacity", "describe",
                                     "artifact", "max_positions"]), json_values, max_size=3)))
# devices: well formed, with any printable name and description (what reaches metric labels and the listing),
# or broken in one field or more
printable = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cn", "Co", "Cs", "Zl", "Zp", "Zs")), min_size=1,
                    max_size=12)  # str.isprintable: no "Other" nor "Separator" character
good_device = st.fixed_dictionaries({
    "name": st.sampled_from(["CUDA0", 'a"b\\{}=', "RPC[10.0.0.1:50052]"]) | printable,
    "description": printable, "memory_free": st.integers(0, 2 ** 40), "memory_total": st.just(2 ** 40)})
bad_device = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["CUDA0", "x\n", ""]) | json_values, "description": json_values,
    "memory_free": st.sampled_from([-1, 1.5, 2 ** 63]) | json_values, "memory_total": json_values})
devices = st.lists(good_device, max_size=3) | st.lists(good_device | bad_device | json_values, max_size=3)
heartbeats = st.one_of(json_values, st.fixed_dictionaries(
    {"node": st.sampled_from(["n0", "n0", "n0", "x"]) | json_values},
    optional={"sessions": json_values, "kv_bytes": json_values,
              "session_ids": json_values | st.lists(st.sampled_from([SID, "x", "A" * 32]), max_size=3),
              "devices": json_values | devices}))


@FUZZ
@given(registrations, heartbeats, devices)
def test_membership_routes_answer_below_500(reg, beat, devs) -> None:
    """Registration and heartbeats, signed with a node key (an open loopback tracker admits any key), so
    bodies get past the signature and the admission check; then a beat whose devices alone vary, so that
    many are well formed and reach the listing and /metrics."""
    app = make_tracker_app(Gateway(registry=Registry()), identity=TRACKER)

    async def signed(path: str, data) -> int:
        body = json.dumps(data).encode()
        headers = Signer(NODE).headers("POST", path, body, time.time())
        if path == "/v1/nodes/heartbeat":
            headers[NODE_HEADER] = "n0"  # the registered id: the body's parser is what is fuzzed
        return await _asgi(app, "POST", path, body, [(k.lower().encode(), v.encode()) for k, v in headers.items()])

    async def run() -> list[int]:
        await signed("/v1/nodes/register", _good_registration())
        return [await signed("/v1/nodes/register", reg),
                await signed("/v1/nodes/heartbeat", beat),
                await signed("/v1/nodes/heartbeat", {"node": "n0", "devices": devs}),
                await _asgi(app, "GET", "/v1/nodes", b""),  # whatever was accepted must render
                await _asgi(app, "GET", "/v1/models", b""),
                await _asgi(app, "GET", "/metrics", b"")]

    statuses = trio.run(run)
    assert all(s < 500 for s in statuses), (statuses, reg, beat, devs)


# -- OpenAI bodies ------------------------------------------------------------------------------------

FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "seed",
          "stop", "stream", "stream_options", "dgr_telemetry", "ignore_eos")
bodies = st.one_of(
    st.dictionaries(st.text(max_size=12), json_values, max_size=6),
    st.fixed_dictionaries({}, optional={k: json_values for k in FIELDS}),
    st.fixed_dictionaries({"model": st.just("stub"), "messages": st.lists(
        st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "tool", "x"]) | json_values,
                                            "content": json_values}), max_size=3)},
        optional={k: json_values for k in FIELDS[3:]}),
)


@FUZZ
@given(bodies, st.sampled_from(["chat", "completion"]))
def test_parse_request_returns_a_request_or_a_typed_refusal(body, kind) -> None:
    try:
        req = parse_request(body, kind)
    except CallerError as exc:
        assert exc.details.get("param") is None or isinstance(exc.details["param"], str)
        return
    assert isinstance(req, GenerationRequest) and req.max_tokens >= 1 and req.model


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps(v).encode(), json_values),
                 st.integers(1, 200_000).map(lambda n: b"[" * n)))
def test_body_bytes_become_an_object_or_a_typed_refusal(raw: bytes) -> None:
    try:
        data = parse_json(raw)
    except CallerError:
        return
    assert isinstance(data, dict)
