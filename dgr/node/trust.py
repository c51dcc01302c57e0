"""The node's trust: whom it believes (the tracker key it pinned) and what a caller must show.

Rules:
- A node with a tracker (`joining`) pins the tracker's public key when it joins (`join`), once: another
  key later is refused until the node restarts. Before it has joined, every call that names a
  session is refused.
- From then on every call that names a session (open, a prefix named, step, close, status) must carry the
  capability the tracker signed for that session, this node and these layers (dgr.security.auth).
  Steps need any (a neighbour's `STEP` one will do); open, a prefix named, close and status need the
  gateway's `CONTROL` one.
- An open also needs the tracker's single-use ticket for exactly its body (dgr.security.tickets):
  `admit_open` checks it from the headers, `redeem_open` the body's bytes before they are parsed.
- Each check runs before anything else about the session is looked at, so an unauthorized caller
  learns nothing and changes nothing; each refusal is counted once (`refuse`).
- Both are bound to this process's boot nonce (`boot`, fresh at every start, reported in each signed
  registration and heartbeat): one issued for an earlier process of this node is refused, so a capability
  or open captured before a restart does not outlive it.
- A layer-possession challenge is a request signed with the pinned tracker key (dgr.security.auth
  `Signer`): `admit_challenge` checks the signature from the headers, before the body is read,
  `accept_challenge` the body's bytes against it, before they are parsed, then that it is addressed
  to this node.
- A node without a tracker (loopback development) asks for no capability and no ticket.
- The node holds no key that can make either: its own key (`identity`) signs only its messages and
  proof answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.seam.wire import STATUS_SCOPE
from dgr.security.auth import (ANSWER_DOMAIN, SIG_HEADERS, CapabilityAuthority, Scope, SignedHead, Verifier,
                               new_boot, sign_json)
from dgr.security.identity import Identity
from dgr.security.tickets import OpenTicket, TicketBook

__all__ = ["NodeTrust"]


@attrs.define
class NodeTrust:
    """The pinned tracker key, the capabilities and tickets checked with it, and this node's own key."""

    node_id: str
    layers: LayerRange
    refuse: Callable[[CallerError], None]  # counts a refusal (dgr.node.accounting)
    authority: CapabilityAuthority | None = None  # the pinned tracker key; None: not joined (or no tracker)
    tickets: TicketBook | None = None  # open tickets, checked with the pinned tracker key; None: as `authority`
    joining: bool = False  # has a tracker: session calls need its capabilities, refused until joined
    identity: Identity | None = None  # this node's key: signs its membership messages and proof answers
    tracker_key: bytes | None = None  # pinned at join
    advertised: str | None = None  # the URL the tracker recorded for this node
    joined: trio.Event = attrs.field(factory=trio.Event)  # set once the tracker key is pinned
    boot: str = attrs.field(factory=new_boot)  # this process's nonce: what the tracker binds credentials to
    verifier: Verifier = attrs.field(factory=Verifier)  # the tracker's signed challenges (nonces seen)

    def __attrs_post_init__(self) -> None:
        if self.authority is not None and self.tickets is None:  # given a tracker key: its tickets too
            self.tickets = TicketBook(self.authority.public)

    def join(self, tracker_key: bytes) -> None:
        """Pin the tracker's public key: capabilities and challenges must be signed with it from now on.

        Raises:
            CallerError(FORBIDDEN): a different key than the one pinned (another tracker, or an impostor).
        """
        if self.tracker_key is not None and self.tracker_key != tracker_key:
            raise CallerError(Reason.FORBIDDEN, "the tracker answered with another key than the one this node "
                                                "pinned at join: restart the node to join a new tracker")
        if self.tracker_key is None:
            self.tickets = TicketBook(tracker_key)
        self.tracker_key = tracker_key
        self.authority = CapabilityAuthority.verifier(tracker_key)
        self.joined.set()

    async def wait_joined(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the tracker key: the tracker challenges a claim as soon as it registers it,
        which may be before its reply (carrying the key) has reached this node."""
        if self.joining and self.tracker_key is None:
            with trio.move_on_after(wait_s):
                await self.joined.wait()

    @property
    def guarded(self) -> bool:
        """True when session calls need a capability."""
        return self.joining or self.authority is not None

    def admit_challenge(self, method: str, path: str, headers: Mapping[str, str]) -> SignedHead:
        """Check a layer-possession challenge from its headers alone, before its body is read: a request signed
        by this node's tracker (the key it pinned), fresh and not seen before.

        Raises:
            CallerError(FORBIDDEN): not joined, unsigned, or signed by another key, stale or replayed.
        """
        if self.tracker_key is None:
            raise CallerError(Reason.FORBIDDEN, f"{self.node_id} answers challenges only from the tracker it joined")
        try:
            head = self.verifier.check_head(method, path, {h: headers.get(h, "") for h in SIG_HEADERS}, time.time())
        except CallerError as exc:
            raise CallerError(Reason.FORBIDDEN, f"the challenge is not signed by this node's tracker: "
                                                f"{exc.message}") from None
        if head.key != self.tracker_key:
            raise CallerError(Reason.FORBIDDEN, "the challenge is not signed by this node's tracker (another key)")
        return head

    def accept_challenge(self, head: SignedHead, raw: bytes, body: Callable[[bytes], dict[str, Any]]
                         ) -> dict[str, Any]:
        """An admitted challenge's body (`body` parses it), once its bytes are the ones signed and it is addressed
        to this node.

        Raises:
            CallerError(FORBIDDEN): another body than the one signed, a replay, or for another node; as `body`.
        """
        try:
            self.verifier.check_body(head, raw, time.time())
        except CallerError as exc:
            raise CallerError(Reason.FORBIDDEN, f"the challenge is not signed by this node's tracker: "
                                                f"{exc.message}") from None
        data = body(raw)
        if data.get("node") != self.node_id:
            raise CallerError(Reason.FORBIDDEN, f"the challenge is addressed to {str(data.get('node'))[:100]!r}, "
                                                f"not {self.node_id}: a node answers only its own challenges")
        return data

    def sign_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        """The answer, signed with this node's key together with the challenge (and its nonce) it answers."""
        if self.identity is None:
            return answer
        return {**answer, "signature": sign_json(self.identity, ANSWER_DOMAIN, {"challenge": body, "answer": answer})}

    def authorize(self, capability: str | None, sid: str, need: Scope = Scope.STEP) -> None:
        """Check the caller's capability for session `sid` on this node and these layers, allowing `need`.

        Raises:
            CallerError(FORBIDDEN): missing, forged, expired, for another session, node or layer range, or a
                neighbour's (steps only) where `need` is CONTROL.
        """
        if self.authority is None:
            if self.joining:
                exc = CallerError(Reason.FORBIDDEN, f"{self.node_id} has not joined its tracker yet: "
                                                    "it has no tracker key to check capabilities with")
                self.refuse(exc)
                raise exc
            return
        try:
            # wall clock: the tracker that issued the token stamped its expiry with its own
            self.authority.check(capability, session=sid, node=self.node_id, start=self.layers.start,
                                 stop=self.layers.stop, now=time.time(), need=need, boot=self.boot)
        except CallerError as exc:
            self.refuse(exc)
            raise

    def forget(self, sid: str) -> None:
        """`sid` ended here: drop the capabilities verified for it (a late call with one is verified again)."""
        if self.authority is not None:
            self.authority.forget(sid)

    def admit_open(self, capability: str | None, ticket: str | None, sid: str) -> OpenTicket | None:
        """Check an open from its headers alone, before any of its body is read: the gateway's capability
        for `sid` and the tracker's unused ticket for it. None on a node without a tracker (nothing to check).

        Raises:
            CallerError(FORBIDDEN): as `authorize` (CONTROL), or the ticket is missing, forged, expired,
                for another open, or already used.
        """
        self.authorize(capability, sid, Scope.CONTROL)
        if self.tickets is None:
            return None
        try:
            return self.tickets.check(ticket, session=sid, node=self.node_id, start=self.layers.start,
                                      stop=self.layers.stop, now=time.time(), boot=self.boot)
        except CallerError as exc:
            self.refuse(exc)
            raise

    def redeem_open(self, ticket: OpenTicket | None, body: bytes) -> None:
        """Take an admitted open's ticket for its body's bytes, before they are parsed (a no-op without one).

        Raises:
            CallerError(FORBIDDEN): the body is not the one the tracker signed, or the ticket was used meanwhile.
        """
        if ticket is None or self.tickets is None:
            return
        try:
            self.tickets.redeem(ticket, body, time.time())
        except CallerError as exc:
            self.refuse(exc)
            raise

    def status_detail(self, capability: str | None) -> bool:
        """May this caller see the per-kind counters: the tracker's capability for STATUS_SCOPE, or no tracker.

        A refusal here is no seam refusal (not counted).
        """
        if self.authority is None:
            return not self.joining
        try:
            self.authority.check(capability, session=STATUS_SCOPE, node=self.node_id, start=self.layers.start,
                                 stop=self.layers.stop, now=time.time(), boot=self.boot)
        except CallerError:
            return False
        return True
