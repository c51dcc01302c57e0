"""Seam frames against a node: any sequence gives the right state or a typed refusal."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Reason
from dgr.node.service import NodeService
from dgr.testing.nodes import running, settled
from dgr.testing.onering import OneNodeRing
from dgr.sampling import SamplingParams
from dgr.seam.frame import decode_frame, encode_frame
from dgr.seam.stream import Record, RecordReader, encode_record
from dgr.seam.wire import (HEADER_FIELDS, HEADER_SIZE, HOP_COMPUTE, KIND_OFFSET, MAX_HOPS, RECORD_PREFIX, DType, Flag,
                           ROUTE_SESSION_HEADER, STREAM_PATH, FrameKind, frame_kind, raw_header)

SPEC = StubSpec(n_layers=6, hidden_size=32)
W = SPEC.seam_width


def _service(start: int, stop: int) -> NodeService:
    return NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(start, stop)), node_id=f"n{start}")


def test_frame_roundtrip_and_sizes() -> None:
    sid = uuid.uuid4().hex
    hidden = np.arange(3 * W, dtype=np.float32).reshape(3, W)
    raw = encode_frame(FrameKind.PREFILL, sid, 2, 10, 3, W, token_ids=[5, 6, 7], hidden=hidden)
    f = decode_frame(raw)
    assert (f.kind, f.session, f.seq, f.pos0, f.n_tokens, f.width) == (FrameKind.PREFILL, sid, 2, 10, 3, W)
    assert f.flags == Flag.TOKENS | Flag.HIDDEN
    assert np.array_equal(f.hidden, hidden) and list(f.token_ids) == [5, 6, 7]
    assert len(raw) == HEADER_SIZE + 3 * 4 + 3 * W * 4
    half = encode_frame(FrameKind.DECODE, sid, 0, 0, 1, W, dtype=DType.F16, hidden=hidden[:1])
    assert len(half) == HEADER_SIZE + W * 2
    assert frame_kind(raw) is FrameKind.PREFILL and frame_kind(half) is FrameKind.DECODE


def test_kind_offset_is_the_header_fields() -> None:
    names = [name for name, _, _ in HEADER_FIELDS]
    sizes = {"4s": 4, "B": 1, "16s": 16, "I": 4}
    assert KIND_OFFSET == sum(sizes[code] for _, code, _ in HEADER_FIELDS[: names.index("kind")])


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:10], Reason.BAD_FRAME),
        (lambda b: b"XXXX" + b[4:], Reason.BAD_FRAME),
        (lambda b: b[:4] + b"\x07" + b[5:], Reason.BAD_FRAME),  # version
        (lambda b: b[:5] + b"\x09" + b[6:], Reason.BAD_FRAME),  # kind
        (lambda b: b[:6] + b"\x09" + b[7:], Reason.WRONG_DTYPE),
        (lambda b: b[:7] + b"\x80" + b[8:], Reason.BAD_FRAME),  # unknown flag
        (lambda b: b + b"\x00", Reason.WRONG_SIZE),
        (lambda b: b[:-1], Reason.WRONG_SIZE),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), Reason.BAD_CHECKSUM),
    ],
)
def test_malformed_frames_are_refused_with_reasons(mutate, reason) -> None:
    raw = encode_frame(FrameKind.DECODE, uuid.uuid4().hex, 0, 0, 1, W, hidden=np.ones((1, W), np.float32))
    with pytest.raises(CallerError) as info:
        decode_frame(mutate(raw))
    assert info.value.reason is reason


def test_oversized_frame_refused() -> None:
    raw = encode_frame(FrameKind.PREFILL, uuid.uuid4().hex, 0, 0, 64, W, hidden=np.ones((64, W), np.float32))
    with pytest.raises(CallerError) as info:
        decode_frame(raw, max_bytes=1024)
    assert info.value.reason is Reason.FRAME_TOO_LARGE


def _reference(tokens: list[int]) -> list[np.ndarray]:
    """Hidden output of a [0, 3) shard for each token, fed one chunk at a time."""
    b = StubBackend(spec=SPEC, layers=LayerRange(0, 3))
    b.open_session("r", 64)
    return [b.forward("r", i, np.array([t], np.int32), None, False)[0] for i, t in enumerate(tokens)]


# Each action: (kind, dseq, dpos, n, corruption)
actions = st.lists(
    st.tuples(
        st.sampled_from([FrameKind.PREFILL, FrameKind.DECODE, FrameKind.HIDDEN]),
        st.sampled_from([0, 0, 0, -1, 1]),
        st.sampled_from([0, 0, 0, -1, 2]),
        st.integers(0, 4),
        st.sampled_from(["none"] * 6 + ["crc", "width", "truncate", "session", "nan"]),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions)
def test_any_frame_sequence_is_correct_or_refused(seq_actions) -> None:
    async def run() -> None:
        head, mid = _service(0, 3), _service(3, 6)
        async with running(head, mid):
            await _any_sequence(head, mid, seq_actions)

    trio.run(run)


async def _any_sequence(head: NodeService, mid: NodeService, seq_actions) -> None:
    """A ring of two: the head's output goes on to the harness, which hands it to the tail (`mid`)."""
    sid = uuid.uuid4().hex
    rings = OneNodeRing.of(head), OneNodeRing.of(mid)
    for ring in rings:
        await ring.open(sid, 64)
    tokens_fed: list[int] = []
    positions, next_seq, state = 0, 0, "created"
    rng = np.random.default_rng(0)
    for kind, dseq, dpos, n, corruption in seq_actions:
        seq, pos0 = max(next_seq + dseq, 0), max(positions + dpos, 0)
        ids = [int(x) for x in rng.integers(1, 90, size=n)]
        raw = bytearray(encode_frame(kind, sid, seq, pos0, n, W, token_ids=ids))
        if corruption == "crc" and n:
            raw[-1] ^= 0xFF
        elif corruption == "width":
            raw = bytearray(encode_frame(kind, sid, seq, pos0, n, W + 1, token_ids=ids))
        elif corruption == "truncate":
            raw = raw[: HEADER_SIZE - 3]
        elif corruption == "session":
            raw = bytearray(encode_frame(kind, uuid.uuid4().hex, seq, pos0, n, W, token_ids=ids))
        legal_kind = kind in (FrameKind.PREFILL, FrameKind.DECODE)
        legal_state = (kind is FrameKind.PREFILL and state in ("created", "prefill")) or (
            kind is FrameKind.DECODE and state in ("prefill", "decode"))
        ok = (corruption in ("none", "nan") and legal_kind and legal_state and seq == next_seq and pos0 == positions
              and n >= 1 and not (kind is FrameKind.DECODE and n != 1) and pos0 + n <= 64)
        before = await head.session_json(sid)
        try:
            reply = await rings[0].step(bytes(raw), sid)  # on the session's stream
        except CallerError:
            assert not ok
            assert await head.session_json(sid) == before  # a refusal changes nothing
            continue
        assert ok
        out = decode_frame(reply)
        assert out.kind is kind and out.hidden.shape == (n, W)  # the next hop's input
        tokens_fed += ids
        positions += n
        next_seq += 1
        state = "prefill" if kind is FrameKind.PREFILL else "decode"
        # the next shard accepts exactly what the head produced
        f = encode_frame(kind, sid, next_seq - 1, positions - n, n, W, hidden=out.hidden)
        rings[1].send(f)
    await settled(mid)
    assert (await head.session_json(sid))["positions_computed"] == positions
    assert (await mid.session_json(sid))["positions_computed"] == positions
    if tokens_fed:
        # a fresh one-token-at-a-time run gives the same last hidden state as the accepted chunks
        assert np.array_equal(_reference(tokens_fed)[-1], out.hidden[-1])


async def test_nan_hidden_and_missing_parts_refused() -> None:
    mid = _service(3, 6)
    async with running(mid):
        await _nan_and_missing(mid)
    assert mid.backend.session_count() == 0


async def _nan_and_missing(mid: NodeService) -> None:
    sid = uuid.uuid4().hex
    ring = OneNodeRing.of(mid)
    await ring.open(sid, 64, SamplingParams())
    bad = np.full((1, W), np.nan, np.float32)
    for raw, reason in [
        (encode_frame(FrameKind.PREFILL, sid, 0, 0, 1, W, hidden=bad), Reason.BAD_FRAME),
        (encode_frame(FrameKind.PREFILL, sid, 0, 0, 1, W, token_ids=[3]), Reason.BAD_FRAME),
        (encode_frame(FrameKind.DECODE, sid, 0, 0, 1, W, hidden=np.ones((1, W), np.float32)), Reason.ILLEGAL_TRANSITION),
        (encode_frame(FrameKind.PREFILL, uuid.uuid4().hex, 0, 0, 1, W, hidden=np.ones((1, W))), Reason.UNKNOWN_SESSION),
    ]:
        with pytest.raises(CallerError) as info:
            ring.send(raw)  # on the stream of the session the frame names
        assert info.value.reason is reason
    assert (await mid.session_json(sid))["positions"] == 0
    await mid.lifecycle.close(sid)
    with pytest.raises(CallerError) as info:
        ring.send(encode_frame(FrameKind.PREFILL, sid, 0, 0, 1, W, hidden=np.ones((1, W))))
    assert info.value.reason is Reason.SESSION_ENDED


def test_stub_chunking_and_sharding_do_not_change_results() -> None:
    spec = StubSpec(n_layers=6, hidden_size=32)
    tokens = np.array([3, 14, 15, 92, 65, 35, 89, 79], np.int32)
    whole = StubBackend(spec=spec, layers=LayerRange(0, 6))
    whole.open_session("a", 64)
    ref = whole.forward("a", 0, tokens, None, True)
    a, b = StubBackend(spec=spec, layers=LayerRange(0, 2)), StubBackend(spec=spec, layers=LayerRange(2, 6))
    a.open_session("a", 64)
    b.open_session("a", 64)
    out = None
    for lo, hi in [(0, 3), (3, 4), (4, 8)]:
        h = a.forward("a", lo, tokens[lo:hi], None, False)
        out = b.forward("a", lo, None, h, True)
    assert np.array_equal(out, ref)
    # a repeated position changes the answer: the cache semantics are real
    c = StubBackend(spec=spec, layers=LayerRange(0, 6))
    c.open_session("a", 64)
    c.forward("a", 0, tokens[:4], None, False)
    c.forward("a", 4, tokens[3:8], None, False)
    assert not np.array_equal(c.forward("a", 9, tokens[7:8], None, True), ref)


async def test_a_stream_without_a_capability_is_refused_from_its_headers_and_never_read() -> None:
    """An unauthorized sender of a 60 MiB stream costs the node its headers: the 403 comes before any
    of the body is read, and nothing of it is kept or checksummed."""
    import tracemalloc

    from dgr.node.app import seam_fast_path
    from dgr.security.auth import CapabilityAuthority
    from dgr.security.identity import Identity

    service = NodeService(backend=StubBackend(spec=SPEC, layers=LayerRange(0, 6)), node_id="n0",
                          authority=CapabilityAuthority.verifier(Identity.generate().public))
    raw = encode_frame(FrameKind.PREFILL, uuid.uuid4().hex, 0, 0, 1, W, token_ids=[1])
    mib, n = 1024 * 1024, 60
    reads = 0

    async def receive():  # the header, then n fresh 1 MiB chunks
        nonlocal reads
        reads += 1
        body = raw[:HEADER_SIZE] if reads == 1 else bytes(mib)
        return {"type": "http.request", "body": body, "more_body": reads <= n}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def unreachable(scope, receive, send):
        raise AssertionError("the seam stream went to the framework")

    scope = {"type": "http", "method": "POST", "path": STREAM_PATH,
             "headers": [(raw_header(ROUTE_SESSION_HEADER), decode_frame(raw).session.encode())]}
    tracemalloc.start()
    try:
        await seam_fast_path(service, unreachable)(scope, receive, send)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent[0]["status"] == 403 and reads == 0  # answered from the headers
    assert dict(service.stats.refused) == {Reason.FORBIDDEN.value: 1}  # once: the service never saw it
    assert peak < 8 * mib, f"{peak / mib:.1f} MiB held for a refused frame"


# -- stream records: a chain link's steps in one body --------------------------------------------

_frames = st.builds(
    lambda n, seq, kind: encode_frame(kind, uuid.UUID(int=seq + 1).hex, seq, 0, n, W,
                                      hidden=np.full((n, W), seq, np.float32)),
    st.integers(1, 3), st.integers(0, 50), st.sampled_from([FrameKind.PREFILL, FrameKind.DECODE]))


@given(st.lists(st.tuples(st.lists(st.integers(0, 2**32 - 1), max_size=MAX_HOPS).map(tuple), _frames),
                min_size=1, max_size=5),
       st.lists(st.integers(1, 10_000), max_size=8))
@settings(max_examples=150, deadline=None)
def test_stream_records_come_out_whole_and_in_order_however_the_body_is_cut(records, cuts) -> None:
    body = b"".join(encode_record(times, frame) for times, frame in records)
    bounds = sorted({c % len(body) for c in cuts} | {0, len(body)})
    reader, out = RecordReader(), []
    for a, b in zip(bounds, bounds[1:]):
        out += reader.feed(body[a:b])
    assert out == [Record(frame, times) for times, frame in records] and reader.pending == 0


def test_a_bad_stream_record_is_refused_from_its_first_bytes() -> None:
    frame = encode_frame(FrameKind.DECODE, uuid.uuid4().hex, 0, 0, 1, W, hidden=np.zeros((1, W), np.float32))
    record = encode_record((5,), frame)
    start = RECORD_PREFIX.size + HOP_COMPUTE.size  # where its frame starts
    # an oversized frame is refused from its header: the rest of it is never waited for or buffered
    with pytest.raises(CallerError) as err:
        RecordReader(max_frame_bytes=HEADER_SIZE + 8).feed(record[:start + HEADER_SIZE])
    assert err.value.reason is Reason.FRAME_TOO_LARGE
    for bad in (record[:start] + b"XXXX" + record[start + 4:],  # no frame magic
                RECORD_PREFIX.pack(MAX_HOPS + 1)):  # more hops than a route has
        with pytest.raises(CallerError) as err:
            RecordReader().feed(bad)
        assert err.value.reason is Reason.BAD_FRAME
    reader = RecordReader()
    assert reader.feed(record[:10]) == [] and reader.pending == 10  # half a record: nothing yet, and it shows
