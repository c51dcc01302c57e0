"""Single-use open tickets: the tracker signs each node session's open, and a node accepts each once.

A capability (dgr.security.auth) says who may act on a session; it does not
say what an open may ask for, and it lives as long as the session may. An
open asks for a lot: the relay plan (the next node's id, URL and
certificate, a ring tail's loop head, the capability to deliver with), the
prefix offer, the lane. So the tracker signs each open it sends, as an
`OpenTicket` in the `X-Dgr-Ticket` header:

- It binds the session id, the node id, its layer range, a short expiry
  (`TICKET_TTL_S`: the gateway's open deadline and the clock skew
  allowed) and the SHA-256 of the exact body bytes. So every field of the
  body (max_positions, sampling, relay plan, prefix, lane) is what the
  tracker sent, and a node never parses a body the tracker did not sign.
- A node checks the ticket's signature, node, layers, session and expiry
  from the headers alone, before reading any of the body (`TicketBook.check`),
  then the body's digest once its bytes are in, before they are parsed
  (`TicketBook.redeem`).
- A node accepts each session id once: it remembers the ids it opened until
  their ticket expires, so a replayed ticket is refused while it is valid,
  and is expired by the time it is forgotten.
- A node that restarts forgets the ids it opened, so a ticket also binds the
  node's boot nonce (dgr.security.auth `new_boot`), as the tracker last heard
  it: the restarted process, with a new nonce, refuses every ticket issued
  before it started, however long it has left.

Signatures are domain-separated (`TICKET_DOMAIN`), so no other signed
message of the tracker's is a ticket. Pure: no I/O, wall-clock times passed
in.

Left out: who may open at all (the gateway, with its CONTROL capability: a
node checks both), and what a node does with the plan (dgr.node.relay).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from typing import Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.security.auth import sign_json, verify_json
from dgr.security.identity import Identity, b64d, b64e

__all__ = ["TICKET_DOMAIN", "TICKET_TTL_S", "OpenTicket", "issue_ticket", "TicketBook"]

TICKET_DOMAIN = b"dgr/v1/open-ticket"
# The gateway's open deadline (step_deadline_s, 10 s by default) with room for the clocks (auth.MAX_SKEW_S)
# on both sides, rounded up: a ticket is used within seconds of its issue, or never.
TICKET_TTL_S = 120.0


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@attrs.frozen
class OpenTicket:
    """What the tracker signed for one open on one node."""

    session: str
    node: str
    start: int
    stop: int
    expires: float  # wall clock
    digest: str  # SHA-256 (hex) of the open's body bytes
    boot: str = ""  # the node's boot nonce, as the tracker last heard it

    def claims(self) -> dict[str, Any]:
        return {"s": self.session, "n": self.node, "l": [self.start, self.stop], "e": self.expires, "b": self.digest,
                "i": self.boot}


def issue_ticket(identity: Identity, session: str, node: str, start: int, stop: int, body: bytes, now: float,
                 ttl_s: float = TICKET_TTL_S, boot: str = "") -> str:
    """The tracker's ticket for opening `session` on `node` (layers [start, stop), boot `boot`) with exactly
    `body`."""
    claims = OpenTicket(session, node, start, stop, round(now + ttl_s, 3), _digest(body), boot).claims()
    return b64e(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()) + "." + \
        sign_json(identity, TICKET_DOMAIN, claims)


@attrs.define
class TicketBook:
    """A node's check of open tickets with its pinned tracker key, and its memory of the ids it opened."""

    public: bytes  # the tracker's key, pinned at join
    used: dict[str, float] = attrs.field(factory=dict)  # session id -> its ticket's expiry

    def check(self, token: str | None, *, session: str, node: str, start: int, stop: int, now: float,
              boot: str = "") -> OpenTicket:
        """The ticket, from the headers alone: the tracker's, for this open on this boot (`boot`), unexpired and
        unused.

        Raises: CallerError(FORBIDDEN) naming what is wrong.
        """
        self._forget(now)
        if not token:
            raise CallerError(Reason.FORBIDDEN, "an open needs the tracker's ticket (X-Dgr-Ticket)")
        encoded, _, sig = token.partition(".")
        try:
            claims = json.loads(b64d(encoded))
            ticket = OpenTicket(str(claims["s"]), str(claims["n"]), int(claims["l"][0]), int(claims["l"][1]),
                                float(claims["e"]), str(claims["b"]), str(claims.get("i", "")))
        except (ValueError, KeyError, TypeError, IndexError):
            raise CallerError(Reason.FORBIDDEN, "malformed open ticket") from None
        if not math.isfinite(ticket.expires) or not verify_json(self.public, TICKET_DOMAIN, ticket.claims(), sig):
            raise CallerError(Reason.FORBIDDEN,
                              "open ticket signature does not verify with the tracker's key (forged or altered)")
        if ticket.expires < now:
            raise CallerError(Reason.FORBIDDEN, "open ticket expired: an open is used within seconds of its issue")
        if ticket.session != session:
            raise CallerError(Reason.FORBIDDEN, "open ticket is for another Route Session")
        if ticket.node != node or (ticket.start, ticket.stop) != (start, stop):
            raise CallerError(Reason.FORBIDDEN, "open ticket is for another node or layer range")
        if ticket.boot != boot:
            raise CallerError(Reason.FORBIDDEN, "open ticket was issued for another boot of this node: it restarted "
                                                "since (a replay)")
        self._refuse_used(session)
        return ticket

    def redeem(self, ticket: OpenTicket, body: bytes, now: float) -> None:
        """Take `ticket` for `body` (its bytes, not yet parsed): refused unless they are what was signed.

        Raises: CallerError(FORBIDDEN): the body differs from the signed one, or the ticket expired or was used
            meanwhile.
        """
        if not hmac.compare_digest(_digest(body), ticket.digest):
            raise CallerError(Reason.FORBIDDEN, "the open's body is not the one its ticket was signed for "
                                                "(altered plan, prefix or parameters)")
        if ticket.expires < now:  # the body took that long
            raise CallerError(Reason.FORBIDDEN, "open ticket expired while its body was being sent")
        self._forget(now)
        self._refuse_used(ticket.session)
        self.used[ticket.session] = ticket.expires

    def _refuse_used(self, session: str) -> None:
        if session in self.used:
            raise CallerError(Reason.FORBIDDEN, f"session {session} was already opened here: an open ticket is "
                                                "used once (replay)")

    def _forget(self, now: float) -> None:
        """Drop the oldest ids whose ticket has expired: such a ticket is refused as expired from now on.

        One tracker stamps every expiry at issue + TICKET_TTL_S, so ids come in nearly in expiry order;
        one that came out of order is kept a little longer, which only refuses what is expired anyway.
        """
        while self.used:
            sid, until = next(iter(self.used.items()))
            if until >= now:
                return
            del self.used[sid]
