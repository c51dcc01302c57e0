"""The opening planner (dgr.fsm.opening): every row of its table, and every path through it.

Exhaustive over (what is known, speculates, head alone): each row is checked against the rules in
the module's header, and every path an opening can take (the ids given; the head's answer saying
nothing reusable, reusable, or held elsewhere, then the holders' route with any speculation and
length) is walked to check its trips and that every hop opens once, on the same prefix or none.
"""

from __future__ import annotations

import itertools

import pytest

from dgr.fsm.opening import PLAN, Call, Known, Then, Trip, plan

_OPENS = {Call.PROMPT, Call.ON_PREFIX, Call.WAITING, Call.IDS}
_NAMES = {Call.ON_PREFIX, Call.ADOPT}  # the prefix is named to the hop
_KEYS = list(itertools.product(Known, (False, True), (False, True)))


def test_the_table_has_one_row_for_every_input() -> None:
    assert sorted(PLAN, key=str) == sorted(_KEYS, key=str)


@pytest.mark.parametrize("known, speculates, alone", _KEYS)
def test_each_row_keeps_the_rules(known: Known, speculates: bool, alone: bool) -> None:
    trip = plan(known, speculates, alone)
    assert trip is PLAN[(known, speculates, alone)] and trip.why
    if alone:
        assert trip.later is Call.NONE  # no later hops
    # only the head is given the prompt, and only before the ids are known; only later hops wait or get bare ids
    assert (trip.head is Call.PROMPT) == (known is Known.TEXT) and trip.later is not Call.PROMPT
    assert trip.head not in (Call.WAITING, Call.IDS)
    assert (trip.then is Then.HEAD_ANSWERS) == (known is Known.TEXT)
    assert (trip.then is Then.REOPEN) == (known is Known.HELD_ELSEWHERE)
    if known is Known.HELD_ELSEWHERE:
        assert trip.empty  # nothing more on this route: it is closed and the holders' opened as IDS
    # a later hop waits only where it may open before the ids, without speculation (the tail drafts from them)
    assert (trip.later is Call.WAITING) == (known is Known.TEXT and not speculates and not alone)
    # the prefix is adopted only by hops whose KV waits, and only where the head may hold one; only the gateway
    # can name it (no node has the root, dgr.seam.keys), so a head that may hold one, alone or not, is named it
    if Call.ADOPT in (trip.head, trip.later):
        assert known is Known.REUSABLE
    assert (trip.head is Call.ADOPT) == (known is Known.REUSABLE)


def _walk(first: Known, speculates: bool, alone: bool, answer: Known, then_speculates: bool,
          then_alone: bool) -> tuple[list[Trip], int]:
    """The trips an opening makes (the holders' route, if it comes to that, speculating and alone as given),
    and how many of them run (a trip whose calls are all NONE makes no round trip)."""
    trips, known, ran = [], first, 0
    while True:
        trip = plan(known, speculates, alone)
        trips.append(trip)
        ran += not trip.empty
        if trip.then is Then.READY:
            return trips, ran
        if trip.then is Then.REOPEN:  # what follows is on the holders' route
            trips, known, speculates, alone = [trip], Known.IDS, then_speculates, then_alone
        else:
            known = answer


_ANSWERS = (Known.ANSWERED, Known.REUSABLE, Known.HELD_ELSEWHERE)


@pytest.mark.parametrize("first, speculates, alone, answer, then_speculates, then_alone",
                         [k for k in itertools.product((Known.IDS, Known.TEXT), (False, True), (False, True),
                                                       _ANSWERS, (False, True), (False, True))])
def test_every_path_opens_every_hop_once_on_one_prefix(first, speculates, alone, answer, then_speculates,
                                                       then_alone) -> None:
    trips, count = _walk(first, speculates, alone, answer, then_speculates, then_alone)
    route = [t for t in trips if t.then is not Then.REOPEN]  # the trips on the route it ends on
    for role in ("head", "later"):
        calls = [getattr(t, role) for t in route]
        if role == "later" and (then_alone if trips[0].then is Then.REOPEN else alone):
            assert calls == [Call.NONE] * len(calls)
            continue
        assert sum(c in _OPENS for c in calls) == 1, (role, calls)  # opened exactly once
        opened = next(c for c in calls if c in _OPENS)
        assert calls.index(opened) == min(i for i, c in enumerate(calls) if c is not Call.NONE)  # open first
    named = {role: any(getattr(t, role) in _NAMES for t in route) for role in ("head", "later")}
    ended_alone = then_alone if trips[0].then is Then.REOPEN else alone
    if not ended_alone:
        assert named["head"] == named["later"]  # every hop starts from the same position
    # the trips: one where the ids are known or nothing follows the head's answer, else two
    reopened = first is Known.TEXT and answer is Known.HELD_ELSEWHERE
    one = first is Known.IDS or (answer is Known.ANSWERED and (alone or not speculates))
    assert count == (2 if reopened else 1 if one else 2), (trips, count)


def test_the_trip_counts_the_opening_tests_measure() -> None:
    """tests/test_opening.py times them on a ring: cold 1, warm 2 (adopt on every hop), 1 node cold 1 and warm 2
    (its prefix is named to it: no node can name its own), speculating 2."""
    def count(known: Known, speculates: bool, alone: bool) -> int:
        return _walk(Known.TEXT, speculates, alone, known, speculates, alone)[1]

    assert count(Known.ANSWERED, False, False) == 1
    assert count(Known.REUSABLE, False, False) == 2
    assert plan(Known.REUSABLE, False, False) == Trip(Call.ADOPT, Call.ADOPT, Then.READY, plan(
        Known.REUSABLE, False, False).why)
    assert count(Known.ANSWERED, False, True) == count(Known.ANSWERED, True, True) == 1
    assert count(Known.REUSABLE, False, True) == count(Known.REUSABLE, True, True) == 2
    assert count(Known.ANSWERED, True, False) == count(Known.REUSABLE, True, False) == 2
