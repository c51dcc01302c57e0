"""Blame for slowness: where a late step is held, and what being late costs a node.

Rules:
- A step's deadline comes: the gateway asks every node of the route for its
  progress on the session (`Progress`, the node's own answer to its probe:
  the last step it took, the last it computed, its scheduler's iteration).
  `locate` reads where the step is: the first hop, in route order, that has
  not computed it holds it. A hop that says it never even took it disputes
  the hop that should have sent it (the one before, or a ring's tail for a
  decode step reaching the head); both are suspects, the holder first. A
  step every hop has computed is late on the tail's way to the tracker: the
  tail's.
- Why the probe and not the record's per-hop compute: a record's figures are
  written by the hops it passed, so a later hop could put its own delay on
  an earlier hop's figure. A probe answer is each node's word about itself:
  a node that lies about its progress can only move the blame to the hop
  after it, and then is suspect itself (the dispute above).
- A suspect gets a strike (`Standing.strike`), at most one per session (the
  caller keeps the set): a node busy with another session's long prompt is
  late on every step of a session at once, which is one episode, not many.
- Strikes cost a node, while they last (`SlowPolicy.window_s`): its limit of
  sessions at once halves with each (dgr.tracker.registry `NodeEntry.limit`)
  and its load, as routing compares it, doubles (`NodeEntry.load`); at
  `ban_after` strikes it is banned (not routable) for `ban_s`, doubled for
  every ban before it (up to MAX_BAN_S). A ban is lifted, and strikes
  expire, when the registry sweeps (`refresh`, with the time passed in).

Pure: no I/O, no clock of its own. Left out: the probes (dgr.tracker.clients),
the waits (dgr.tracker.patience), and where a node's standing is kept
(dgr.tracker.registry, by node id and key, so a restart does not clear it).
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Progress", "locate", "SlowPolicy", "Standing", "MAX_BAN_S"]

MAX_BAN_S = 24 * 3600.0  # the longest a ban grows to, however often a node is banned


def _seq(value: Any) -> int:
    """A step number from a probe answer; -1 (none) for anything that is not a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


@attrs.frozen
class Progress:
    """A node's answer to the tracker's probe: it is alive and, when asked about a session, how far it got."""

    node: str
    taken: int = -1  # the last step of the session it accepted; -1: none (or not asked, or not held)
    done: int = -1  # the last step of the session it computed and sent on
    iteration: int | None = None  # its scheduler's iterations so far

    @classmethod
    def read(cls, data: Any, node: str) -> "Progress | None":
        """A probe's JSON answer from `node`; None when it names another node (not the node asked). An answer
        that is not the expected JSON still shows the node alive, with no progress."""
        if not isinstance(data, dict):
            return cls(node)
        named = data.get("node")
        if isinstance(named, str) and named != node:
            return None
        session = data.get("session")
        session = session if isinstance(session, dict) else {}
        it = data.get("iteration")
        return cls(node, _seq(session.get("taken")), _seq(session.get("done")),
                   it if isinstance(it, int) and not isinstance(it, bool) else None)


def locate(route: list[str], answers: dict[str, Progress], seq: int, *, from_gateway: bool) -> tuple[str, ...]:
    """The suspects for step `seq` of a session being late, the node holding it first.

    `route`: node ids in order; `from_gateway`: the head takes this step from the gateway (a prompt chunk),
    not from the ring's tail (a decode step). A node missing from `answers` counts as having done nothing.
    """
    for i, node in enumerate(route):
        p = answers.get(node) or Progress(node)
        if p.done >= seq:
            continue
        if p.taken >= seq or (i == 0 and from_gateway):
            return (node,)
        sender = route[i - 1]  # route[-1] for the head: the tail sends it each decode step
        return (node,) if sender == node else (node, sender)
    return (route[-1],)


@attrs.frozen
class SlowPolicy:
    """What timeouts cost a node (`--slow-ban-after`, `--slow-ban-s`)."""

    ban_after: int = 3  # strikes within `window_s` that ban a node; 0: never banned
    window_s: float = 600.0  # how long a strike counts
    ban_s: float = 600.0  # how long a first ban lasts; each later one twice the one before


@attrs.define
class Standing:
    """A node's record of timeouts: its strikes (their times) and its ban."""

    strikes: tuple[float, ...] = ()
    banned_until: float | None = None
    bans: int = 0

    @property
    def banned(self) -> bool:
        return self.banned_until is not None

    def strike(self, now: float, policy: SlowPolicy) -> bool:
        """One more timeout; True when it bans the node (its strikes are cleared: the ban is their price)."""
        self.refresh(now, policy)
        self.strikes = (*self.strikes, now)
        if policy.ban_after <= 0 or len(self.strikes) < policy.ban_after or self.banned:
            return False
        self.banned_until = now + min(MAX_BAN_S, policy.ban_s * 2 ** self.bans)
        self.bans += 1
        self.strikes = ()
        return True

    def refresh(self, now: float, policy: SlowPolicy) -> bool:
        """Drop strikes older than the window and lift a ban that has run out; True when a ban was lifted."""
        self.strikes = tuple(t for t in self.strikes if now - t < policy.window_s)
        if self.banned_until is not None and now >= self.banned_until:
            self.banned_until = None
            return True
        return False

    @property
    def quiet(self) -> bool:
        """Nothing to remember: no strike, no ban, none before (a node forgotten so loses nothing by it)."""
        return not self.strikes and not self.banned and not self.bans
