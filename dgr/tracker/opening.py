"""One chosen route's node sessions, opened in as few round trips as the prompt allows.

The head tokenizes the prompt inside its open (dgr.node.prompt), so the ids are known only when it
answers. The later hops need them only to name their reusable prefix, and, on a speculating route,
the tail to draft from. So:
- without speculation they open with the head, their KV waiting (`max_new`, dgr.node.sessions), and
  so does the head's, which answers as soon as it has the ids: one round trip opens the whole route,
  and only where the head may hold a prefix of the prompt does a second name it to every hop
  (`adopt`), each opening its KV on what it holds, as every node must start from the same position;
- with speculation the later hops open once the ids are known (the tail drafts from them), in the
  same second trip;
- where the ids are known before any open (a client's own, or a route chosen again for the prefix
  its nodes hold), every hop opens at once on its prefix.
`RouteOpening` builds each hop's open, and records what opened (to close on failure) and what may
have opened unseen (a lost answer: owed a close). Which rounds run is dgr.tracker.admission's.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import trio

from dgr.errors import DgrError, Reason
from dgr.fsm.route import Hop
from dgr.spec.ngram import WINDOW
from dgr.tracker.clients import NodeClients
from dgr.tracker.credentials import Credentials
from dgr.tracker.patience import Patience

__all__ = ["RouteOpening"]


@attrs.define
class RouteOpening:
    """The node sessions of one Route Session on one route, as they open."""

    sid: str
    hops: tuple[Hop, ...]
    clients: NodeClients
    credentials: Credentials
    patience: Patience
    deadline_s: float
    phase: Callable[[], str]  # the Route Session's state, named in a failure
    common: dict[str, Any]  # every open's: sampling, and what bounds the prompt (context, max_new, vocab_size)
    relays: dict[str, dict[str, Any]]  # node id -> its relay plan
    spec: dict[str, Any] | None  # the session's speculation (dgr.node.speculation); None: none
    lane: int  # the session's lane in the route's phase groups
    caps: dict[str, str] = attrs.field(factory=dict)  # node id -> the session's capability there
    opened: list[Hop] = attrs.field(factory=list)
    attempted: list[str] = attrs.field(factory=list)  # asked and not refused: they may hold the session
    held: dict[str, int] = attrs.field(factory=dict)  # node id -> the prefix positions it opened on
    tokens: list[int] | None = None  # the head's ids for the prompt it was given
    reusable: bool = False  # the head may hold a prefix of them: it is named to every hop

    def __attrs_post_init__(self) -> None:
        self.caps = self.credentials.capabilities(self.sid, self.hops)

    def head(self, prompt: dict[str, Any], max_prompt: int | None = None, root: str | None = None,
             offer: list[str] | None = None, marks: str = "") -> dict[str, Any]:
        """The head's open: the prompt to tokenize (or its ids), and either the prefix the ids offer (it opens
        on it now) or none, its KV then waiting, with the root to say under which it may hold one."""
        c = self.common
        return {**self._common(self.hops[0], None), "max_positions": c["context"], "prompt": prompt,
                "max_new": c["max_new"], "max_prompt": max_prompt, "vocab_size": c["vocab_size"], "root": root,
                "prefix": offer, "marks": marks}

    def later(self, hop: Hop, ids: list[int] | None, offer: list[str], marks: str) -> dict[str, Any]:
        """A later hop's open: with the ids, their prefix and exact positions; without, a bound and `max_new`."""
        c = self.common
        if ids is None:
            return {**self._common(hop, None), "max_positions": c["context"], "max_new": c["max_new"]}
        return {**self._common(hop, ids), "max_positions": len(ids) + min(c["max_new"], c["context"] - len(ids)),
                "prefix": offer, "marks": marks}

    def _common(self, hop: Hop, ids: list[int] | None) -> dict[str, Any]:
        spec = self.spec
        if spec is not None and hop == self.hops[-1] and ids is not None:
            spec = {**spec, "history": ids[-WINDOW:]}  # what its n-gram index keeps
        return {"sampling": self.common["sampling"], "relay": self.relays.get(hop.node_id), "lane": self.lane,
                "ticket": self.credentials.ticketer(self.sid, hop), "spec": spec}

    async def open(self, bodies: dict[Hop, dict[str, Any]]) -> None:
        """Open each hop with its open's arguments (dgr.tracker.seam_client `NodeClient.open`), at once.

        A refusal does not cut the other opens short: each still answers (within the wait), so what opened
        is closed at once, not owed a close until its node's next heartbeat.

        Raises: the refusal of the first hop to refuse, in route order; else PeerError naming a silent node
        when the wait ran out.
        """
        refusals: dict[Hop, DgrError] = {}

        async def one(hop: Hop) -> None:
            self.attempted.append(hop.node_id)
            try:
                answer = await self.clients.get(hop).open(self.sid, capability=self.caps.get(hop.node_id),
                                                          **bodies[hop])
            except DgrError as refused:
                answered.add(hop.node_id)
                if refused.reason is not Reason.ROUTE_NODE_LOST:
                    self.attempted.remove(hop.node_id)  # the node answered: it holds nothing
                refusals[hop] = refused
                return
            self.held[hop.node_id] = answer.positions
            if answer.tokens is not None:
                self.tokens, self.reusable = answer.tokens, answer.reusable
            self.opened.append(hop)
            answered.add(hop.node_id)

        answered: set[str] = set()
        try:
            await self._each(list(bodies), one, answered, "did not answer while the route was being opened")
        except DgrError:
            if not refusals:
                raise
        if refusals:  # the head's refusal names what the client sent: it goes ahead of a later hop gone silent
            raise next(refusals[h] for h in self.hops if h in refusals)

    async def adopt(self, hops: list[Hop], prefix: list[str], marks: str) -> None:
        """Name the prompt's prefix to hops whose KV waits for it; each answers the positions it opened on."""
        async def one(hop: Hop) -> None:
            self.held[hop.node_id] = await self.clients.get(hop).adopt_prefix(self.sid, prefix, marks,
                                                                              self.caps.get(hop.node_id))
            answered.add(hop.node_id)

        answered: set[str] = set()
        await self._each(hops, one, answered, "did not answer while its prefix was being named")

    async def _each(self, hops: list[Hop], call: Callable[[Hop], Any], answered: set[str], what: str) -> None:
        with self.patience.patient([h.node_id for h in hops], self.deadline_s) as wait:
            async with trio.open_nursery() as nursery:
                for hop in hops:
                    nursery.start_soon(call, hop)
        if wait.scope.cancelled_caught:
            silent = wait.silent or next((h.node_id for h in hops if h.node_id not in answered), None)
            raise wait.failed(what, silent, phase=self.phase())
