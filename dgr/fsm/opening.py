"""Opening a route: which round trips run, and what each hop gets in each, from what is known.

Theory (issue 41): the head tokenizes the prompt inside its open, so the ids are known only when it
answers. The later hops need them only to name their reusable prefix and, on a speculating route,
the tail to draft from. So without speculation they open with the head, their KV waiting for the
prefix (`WAITING`), and only where the head may hold a prefix of the prompt (`reusable`: the gateway
judges it, dgr.tracker.affinity) does a second trip name it to every hop (`ADOPT`): every node must
start from the same position. Only the gateway can name a prefix (its keys are rooted in a secret no
node is told, dgr.seam.keys), so a head alone on its route is named its own in that trip too.
With speculation they open once the ids are known, in that second trip. Where the ids are known
before any open (the client's own), or another route's nodes kept the prompt's prefix (the route
is abandoned and the open begins again there, under a fresh session id: a node opens each id once,
and the two routes may share a node), every hop opens at once on its prefix.

`PLAN` is the single source of truth: one row per (what is known, speculates, the head alone on its
route), each the trip to run next (what the head and the later hops each get; `NONE`: nothing, and a
row whose calls are all `NONE` runs no trip) and what follows it (`Then`): the head's answer, to plan
again with what it says; the route abandoned for the holders' (planned again as `IDS` there, whose
length and speculation may differ); or the route ready. spec/states.md draws it (dgr.specgen.protocol).

Invariants (tests/test_fsm_opening.py checks them over every row and every path):
- every hop opens exactly once on the route it ends on, and a lone head has no later hops;
- every hop names the same prefix, or none does: where one is named (`ON_PREFIX` or `ADOPT`), it is
  named to every hop;
- a route opens in 1 trip where the ids are known, or nothing is reusable without speculation (or
  with it, the head alone), and in 2 otherwise: a second names the prefix, opens the speculating
  hops, or opens the holders' route (after the first's sessions are closed).

Left out: building each open (dgr.tracker.opening), choosing routes and checking the head's ids
(dgr.tracker.admission), the wire (dgr.seam.opening).
"""

from __future__ import annotations

import enum
import itertools

import attrs

__all__ = ["Known", "Call", "Then", "Trip", "PLAN", "plan"]


class Known(enum.Enum):
    """What the gateway knows when it plans the next trip."""

    IDS = "ids"  # the prompt's ids, before any open: a client's own
    TEXT = "text"  # only the prompt's text: the head must tokenize it; nothing opened yet
    ANSWERED = "answered"  # the head answered the ids; it holds no prefix of them
    REUSABLE = "reusable"  # the head answered the ids, and may hold a prefix of them
    HELD_ELSEWHERE = "held_elsewhere"  # the head answered the ids; another route's nodes kept their prefix


class Call(enum.Enum):
    """What one hop gets in a trip."""

    NONE = "none"
    PROMPT = "prompt"  # head: the prompt to tokenize; its KV waits
    ON_PREFIX = "on_prefix"  # the ids and the prefix they offer: it opens on what it holds of it, now
    WAITING = "waiting"  # later hop: max_new, before the prompt's length is known; its KV waits
    IDS = "ids"  # later hop: the ids and no prefix (it opens empty)
    ADOPT = "adopt"  # a hop whose KV waits: the prefix, to open on what it holds of it


class Then(enum.Enum):
    """What follows the trip."""

    HEAD_ANSWERS = "head_answers"  # plan again with what the head answered
    # close what opened (its lane given back), and plan again as IDS on the holders' route, under a fresh id
    REOPEN = "reopen"
    READY = "ready"  # every hop is open: the route is ready


@attrs.frozen
class Trip:
    head: Call
    later: Call  # every hop after the head
    then: Then
    why: str = ""

    @property
    def empty(self) -> bool:
        """No call to make: no round trip."""
        return self.head is Call.NONE and self.later is Call.NONE


_N, _P, _O, _W, _I, _A = Call.NONE, Call.PROMPT, Call.ON_PREFIX, Call.WAITING, Call.IDS, Call.ADOPT
_READY, _AWAIT, _REOPEN = Then.READY, Then.HEAD_ANSWERS, Then.REOPEN

# (known, speculates, head alone) -> the next trip
PLAN: dict[tuple[Known, bool, bool], Trip] = {
    (Known.IDS, False, False): Trip(_O, _O, _READY, why="every hop opens at once on the prefix it holds"),
    (Known.IDS, True, False): Trip(_O, _O, _READY, why="the tail drafts from the ids it is given"),
    (Known.IDS, False, True): Trip(_O, _N, _READY, why="a lone head opens on what it holds"),
    (Known.IDS, True, True): Trip(_O, _N, _READY, why="a lone head opens on what it holds"),
    (Known.TEXT, False, False): Trip(_P, _W, _AWAIT, why="the later hops open with the head, their KV waiting"),
    (Known.TEXT, True, False): Trip(_P, _N, _AWAIT, why="the tail needs the ids to draft from: it waits for them"),
    (Known.TEXT, False, True): Trip(_P, _N, _AWAIT, why="a lone head's KV waits too: only the gateway names a prefix"),
    (Known.TEXT, True, True): Trip(_P, _N, _AWAIT, why="a lone head's KV waits too: only the gateway names a prefix"),
    (Known.ANSWERED, False, False): Trip(_N, _N, _READY, why="nothing to name: every KV opens empty at the first step"),
    (Known.ANSWERED, True, False): Trip(_N, _I, _READY, why="the later hops open with the ids, on no prefix"),
    (Known.ANSWERED, False, True): Trip(_N, _N, _READY, why="the lone head is open"),
    (Known.ANSWERED, True, True): Trip(_N, _N, _READY, why="the lone head is open"),
    (Known.REUSABLE, False, False): Trip(_A, _A, _READY, why="the prefix is named to every hop"),
    (Known.REUSABLE, True, False): Trip(_A, _O, _READY, why="named to the head as the later hops open on it"),
    (Known.REUSABLE, False, True): Trip(_A, _N, _READY, why="the prefix is named to the lone head"),
    (Known.REUSABLE, True, True): Trip(_A, _N, _READY, why="the prefix is named to the lone head"),
    (Known.HELD_ELSEWHERE, False, False): Trip(_N, _N, _REOPEN, why="close what opened; open the holders' route"),
    (Known.HELD_ELSEWHERE, True, False): Trip(_N, _N, _REOPEN, why="close what opened; open the holders' route"),
    (Known.HELD_ELSEWHERE, False, True): Trip(_N, _N, _REOPEN, why="close what opened; open the holders' route"),
    (Known.HELD_ELSEWHERE, True, True): Trip(_N, _N, _REOPEN, why="close what opened; open the holders' route"),
}

if set(PLAN) != set(itertools.product(Known, (False, True), (False, True))):  # pragma: no cover - a table edit
    raise ValueError("PLAN must have one row for every (known, speculates, alone)")


def plan(known: Known, speculates: bool, alone: bool) -> Trip:
    """The next trip of an opening, given what is known."""
    return PLAN[(known, speculates, alone)]
