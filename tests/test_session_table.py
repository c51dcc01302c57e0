"""dgr.sessions.SessionTable: the one exists/capacity/context/unknown/ended check, and the node and the
stub backend answering through it alike."""

from __future__ import annotations

import pytest

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Failure, Reason
from dgr.sessions import SessionTable


def _reason(fn) -> Reason | None:
    try:
        fn()
    except CallerError as exc:
        return exc.reason
    return None


def test_an_open_is_refused_in_order_and_a_refusal_changes_nothing() -> None:
    t: SessionTable[str] = SessionTable("n0", capacity=2, max_positions=64, remember=4)
    t.open("a", 64, "A")
    # every combination of (exists, too long, full): the first that applies in the rule's order answers
    t.open("b", 1, "B")
    assert _reason(lambda: t.open("a", 65, "x")) is Reason.SESSION_EXISTS
    assert _reason(lambda: t.open("c", 65, "x")) is Reason.CONTEXT_LENGTH_EXCEEDED
    assert _reason(lambda: t.open("c", 0, "x")) is Reason.CONTEXT_LENGTH_EXCEEDED
    assert _reason(lambda: t.open("c", 64, "x")) is Reason.NODE_AT_CAPACITY
    assert t.live == {"a": "A", "b": "B"}
    with pytest.raises(CallerError) as err:
        t.check_room()
    assert err.value.details["retry_after"] == 1


def test_in_use_counts_slots_the_owner_holds_beyond_its_sessions() -> None:
    t: SessionTable[int] = SessionTable("this shard", capacity=3, max_positions=8)
    t.open("a", 8, 0)
    assert _reason(lambda: t.check_open("b", 8, in_use=3)) is Reason.NODE_AT_CAPACITY  # two kept prefixes
    t.check_open("b", 8, in_use=2)
    assert t.get("a") == 0  # a falsy value is still a session


def test_an_ended_id_is_refused_as_ended_until_forgotten_then_unknown() -> None:
    t: SessionTable[str] = SessionTable("n0", capacity=8, max_positions=8, remember=2)
    for sid in "abc":
        t.open(sid, 8, sid)
    t.end("a", Failure(Reason.SESSION_TIMEOUT, "idle"))
    assert t.is_live("b") and not t.is_live("a") and "a" in t  # held until popped: it counts against capacity
    with pytest.raises(CallerError, match=r"ended on n0 \(session_timeout\)") as err:
        t.get("a")
    assert err.value.reason is Reason.SESSION_ENDED
    assert _reason(lambda: t.open("a", 8, "again")) is Reason.SESSION_EXISTS  # an id opens once
    t.pop("a")
    t.end("b", None)
    t.end("c", None)  # remembers two: "a" is forgotten
    assert _reason(lambda: t.get("a")) is Reason.UNKNOWN_SESSION
    assert _reason(lambda: t.get("b")) is Reason.SESSION_ENDED


def test_a_backend_table_remembers_nothing() -> None:
    t: SessionTable[str] = SessionTable("this shard", capacity=1, max_positions=8)
    t.open("a", 8, "A")
    t.end("a", None)
    t.pop("a")
    assert _reason(lambda: t.get("a")) is Reason.UNKNOWN_SESSION
    t.open("a", 8, "A")  # a backend's slot is free for the id again once closed


def test_the_stub_backend_refuses_as_the_table_does() -> None:
    stub = StubBackend(spec=StubSpec(), layers=LayerRange(0, 2), capacity=2, n_ctx=32)
    stub.open_session("a", 32)
    assert _reason(lambda: stub.open_session("a", 8)) is Reason.SESSION_EXISTS
    assert _reason(lambda: stub.open_session("b", 33)) is Reason.CONTEXT_LENGTH_EXCEEDED
    stub.open_session("b", 8)
    assert _reason(lambda: stub.open_session("c", 8)) is Reason.NODE_AT_CAPACITY
    assert _reason(lambda: stub.forward("zz", 0, None, None, False)) is Reason.UNKNOWN_SESSION


def test_a_step_fits_the_positions_its_open_asked_for() -> None:
    t: SessionTable[int] = SessionTable("this shard", capacity=2, max_positions=64)
    t.open("a", 16, 0)
    t.check_fits("a", 16)
    with pytest.raises(CallerError, match="17 positions exceed 16") as err:
        t.check_fits("a", 17)
    assert err.value.reason is Reason.CONTEXT_LENGTH_EXCEEDED
    t.pop("a")
    t.check_open("b", 64)
    t.add("b", 64, 1)  # a slot known only once the open is allowed
    t.check_fits("b", 64)
    assert t.limits == {"b": 64}
