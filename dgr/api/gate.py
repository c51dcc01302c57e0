"""Who may hold a connection to dgr's HTTP server, and who leaves when a newcomer needs the room.

Rules:
- A connection is a guest until one of its requests proves a credential
  (dgr.api.server `authenticated`: an API key, a node's signature, a
  capability); from then on it is a member, and its address is a member's
  (the last `KNOWN_PEERS` such addresses are remembered).
- At most `max_connections` connections in all. The last `member_slots` of
  them are reserved: for members, and for newcomers from a member's address
  (a node that opens another connection, or comes back after losing one).
  Guests from any other address hold at most `max_connections -
  member_slots` between them. Before, any 4 addresses filled the 1,024
  slots, and a node's next heartbeat connection was refused.
- At most `max_per_peer` guests from one address (an IPv4 address, or an IPv6
  /64: one host's usual share). Members do not count there: each proved a
  credential, and on a loopback route every member shares 127.0.0.1 with
  whoever else connects from that machine.
- A newcomer over a cap makes room instead of being refused: the oldest idle
  guests under that cap (the address's own for the per-address cap, any for
  the others) are closed until it fits, and it comes in. Idle: waiting for its
  next request's head, with nothing of the app running for it. Before, 300
  idle connections from one address kept that address's health probes out
  for the first 8 s (the guest head deadline). A newcomer is closed at once,
  unread, only where no guest under the cap is idle: every one is sending a
  body (bounded by the guest body deadlines) or being answered, or the slots
  are members'.
- Every operation is O(1) (amortized: a connection is evicted once): counts,
  and insertion-ordered sets of the idle guests (all, and per address),
  oldest first.

Pure bookkeeping, no I/O and no clock: closing an evicted connection is the
`evict` hook its server set. Left out: a connection's deadlines
(dgr.api.server), what proves a credential (the apps).
"""

from __future__ import annotations

import collections
import socket
from typing import Callable

import attrs

__all__ = ["Gate", "Seat", "KNOWN_PEERS", "peer_of"]

KNOWN_PEERS = 4096  # members' addresses remembered: a tracker's nodes, a node's neighbours and its tracker


def peer_of(client: tuple[str, int] | None) -> str:
    """What the per-address cap counts by: the IPv4 address, or the IPv6 /64 (one host's usual share)."""
    if client is None:
        return ""
    host = client[0]
    if ":" not in host:
        return host
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    except OSError:
        return host
    if packed[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 peer on a dual-stack socket
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return packed[:8].hex()


def _stay() -> None:
    """The eviction hook of a seat whose server set none."""


@attrs.define(eq=False)
class Seat:
    """One admitted connection's place: its address, whether it is a member, and how to close it."""

    peer: str
    member: bool = False
    gone: bool = False  # left, or evicted: its counts are released
    evict: Callable[[], None] = _stay  # closes the connection (its server sets it)


@attrs.define
class Gate:
    """Counts connections (in all, guests, guests per address), remembers members' addresses, and keeps the idle
    guests in age order."""

    max_connections: int
    max_per_peer: int  # guests from one address
    member_slots: int = 0  # of max_connections: members', and their addresses' newcomers'
    total: int = 0
    guests: int = 0
    per_peer: dict[str, int] = attrs.field(factory=dict)  # guests per address; no entry at 0
    evicted: int = 0  # guests closed to make room, since start
    _known: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # members' addresses
    _idle: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # Seat -> None, oldest first
    _idle_by_peer: dict[str, collections.OrderedDict] = attrs.field(factory=dict)

    @property
    def max_guests(self) -> int:
        """What guests from addresses no member came from may hold between them."""
        return max(0, self.max_connections - self.member_slots)

    def enter(self, peer: str) -> Seat | None:
        """A seat for a newcomer from `peer`, closing the oldest idle guests where a cap is full; None: refused
        (no guest under the full cap is idle)."""
        while self.per_peer.get(peer, 0) >= self.max_per_peer:
            if not self._evict(self._idle_by_peer.get(peer)):
                return None
        known = peer in self._known
        while self.total >= self.max_connections or (not known and self.guests >= self.max_guests):
            if not self._evict(self._idle):
                return None
        self.total += 1
        self.guests += 1
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        return Seat(peer)

    def promote(self, seat: Seat) -> None:
        """`seat`'s connection proved a credential: it is a member from now on, and its address a member's."""
        if seat.gone or seat.member:
            return
        self.busy(seat)
        self.guests -= 1
        self._release_guest(seat.peer)
        seat.member = True
        self._known[seat.peer] = None
        self._known.move_to_end(seat.peer)
        if len(self._known) > KNOWN_PEERS:
            self._known.popitem(last=False)

    def idle(self, seat: Seat) -> None:
        """`seat`'s connection waits for a request head: a guest's may be closed to make room from now on."""
        if seat.gone or seat.member:
            return
        self._idle[seat] = None
        self._idle_by_peer.setdefault(seat.peer, collections.OrderedDict())[seat] = None

    def busy(self, seat: Seat) -> None:
        """`seat`'s connection has a request to answer: it is not closed to make room."""
        if self._idle.pop(seat, 0) is None:
            of_peer = self._idle_by_peer[seat.peer]
            del of_peer[seat]
            if not of_peer:
                del self._idle_by_peer[seat.peer]

    def leave(self, seat: Seat) -> None:
        """`seat`'s connection is closed (a no-op for one evicted: its counts went then)."""
        seat.evict = _stay  # its hook holds the connection, which holds the seat: a cycle only gen-2 GC would free
        if seat.gone:
            return
        self.busy(seat)
        seat.gone = True
        self.total -= 1
        if not seat.member:
            self.guests -= 1
            self._release_guest(seat.peer)

    def _release_guest(self, peer: str) -> None:
        held = self.per_peer[peer] - 1
        if held:
            self.per_peer[peer] = held
        else:
            del self.per_peer[peer]  # no entry outlives its address's guests

    def _evict(self, idle: collections.OrderedDict | None) -> bool:
        """Close the oldest seat of `idle`, releasing its counts now; False where `idle` holds none."""
        if not idle:
            return False
        seat = next(iter(idle))
        evict = seat.evict  # taken before `leave` drops it
        self.leave(seat)
        self.evicted += 1
        evict()
        return True
