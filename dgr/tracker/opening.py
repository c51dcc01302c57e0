"""One chosen route's node sessions, opened in the round trips dgr.fsm.opening's table plans.

The head tokenizes the prompt inside its open (dgr.seam.opening), so the ids are known only when it
answers; which hop gets what in each trip, from what is known, is dgr.fsm.opening's `PLAN`.
`RouteOpening` runs one planned trip (`trip`): it builds each hop's `OpenRequest` (or names the
prefix, `AdoptRequest`), makes the calls at once, and records what opened (to close on failure),
what may have opened unseen (a lost answer: owed a close), the positions each holds, and the head's
ids. What is known, and so which trip comes next, is dgr.tracker.admission's.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import trio

from dgr.errors import DgrError, Reason, first_dgr_error
from dgr.fsm.opening import Call, Trip
from dgr.fsm.phases import RoutePhases
from dgr.fsm.route import Hop
from dgr.sampling import SamplingParams
from dgr.seam.opening import AdoptRequest, OpenAnswer, OpenRequest, PromptPlan, RelayOrder, ResumeOrder, SpecPlan
from dgr.speculative.ngram import WINDOW
from dgr.tracker.clients import NodeClients
from dgr.tracker.credentials import Credentials
from dgr.tracker.patience import Patience

__all__ = ["RouteOpening", "Bounds"]


@attrs.frozen
class Bounds:
    """What every open of a Route Session shares: its sampling, and what bounds the prompt."""

    sampling: SamplingParams
    context: int  # the positions every hop has (the smallest --ctx on the route)
    max_new: int  # the answer's positions at most
    vocab_size: int
    max_prompt: int | None  # the gateway's limit on the prompt's tokens


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
    bounds: Bounds
    relays: dict[str, RelayOrder]  # node id -> its relay
    spec: SpecPlan | None  # the session's speculation (dgr.node.speculation); None: none
    board: RoutePhases  # the route's phase groups (dgr.fsm.phases), which the session holds a lane of
    lane: int  # that lane
    caps: dict[str, str]  # node id -> the session's capability there (dgr.tracker.credentials)
    opened: list[Hop] = attrs.field(factory=list)
    attempted: list[str] = attrs.field(factory=list)  # asked and not refused: they may hold the session
    held: dict[str, int] = attrs.field(factory=dict)  # node id -> the prefix positions it opened on
    tokens: list[int] | None = None  # the head's ids for the prompt it was given
    # a speculating tail is sent the prompt's last ids to draft from (GatewayConfig.prompt_to_tail); else it drafts
    # from the answer alone and never sees the prompt's ids
    prompt_to_tail: bool = False
    # a repair's (dgr.tracker.resume): node id -> the session its survivor goes on with, and the first step the
    # tail answers; what each survivor answered it holds
    resume: dict[str, ResumeOrder] = attrs.field(factory=dict)
    sample_from: int = 0
    resumed: dict[str, OpenAnswer] = attrs.field(factory=dict)

    async def trip(self, trip: Trip, prompt: dict[str, Any], ids: list[int] | None, offer: AdoptRequest,
                   waves: tuple[frozenset[str], ...] = ()) -> None:
        """Run one planned trip: each hop's call (`trip.head` for the head, `trip.later` for the rest) at once.

        `prompt` is the request's prompt (dgr.api.openai `prompt_body`), `ids` its ids where they are known,
        `offer` the prefix they offer (none without ids or a root). With `waves` (node ids), the opens go wave
        after wave instead (a repair's: dgr.tracker.resume).

        Raises: as `open` and `adopt`: the first typed error itself, never an exception group that holds one.
        """
        head, rest = self.hops[0], self.hops[1:]
        calls = {head: trip.head} | {h: trip.later for h in rest}
        opens = {h: self._request(h, call, prompt, ids, offer) for h, call in calls.items()
                 if call not in (Call.NONE, Call.ADOPT)}
        adopts = [h for h, call in calls.items() if call is Call.ADOPT]
        for wave in waves:
            await self.open({h: body for h, body in opens.items() if h.node_id in wave})
        if waves:
            return
        try:
            async with trio.open_nursery() as nursery:
                if opens:
                    nursery.start_soon(self.open, opens)
                if adopts:
                    nursery.start_soon(self.adopt, adopts, offer)
        except BaseExceptionGroup as group:
            # the nursery wraps what its calls raised: callers catch the typed refusal itself (a repair's reopen
            # caught nothing else, and a refused open crossed the gateway's nursery: the tracker exited, issue 54)
            refused = first_dgr_error(group)
            if isinstance(refused, DgrError):
                raise refused from None
            raise

    def _request(self, hop: Hop, call: Call, prompt: dict[str, Any], ids: list[int] | None,
                 offer: AdoptRequest) -> OpenRequest:
        """`hop`'s open for `call` (dgr.fsm.opening): the head's of the prompt (or its ids, on their prefix); a
        later hop's waiting (a bound and `max_new`), or with the ids, their exact positions and prefix."""
        b = self.bounds
        base = OpenRequest(self.sid, b.context, self.relays[hop.node_id], b.sampling, lane=self.lane,
                           spec=self.spec, sample_from=self.sample_from if hop == self.hops[-1] else 0)
        order = self.resume.get(hop.node_id)
        if order is not None:  # a survivor: it goes on with what it holds, for the positions the route needs
            n = len(ids or ())
            return attrs.evolve(base, max_positions=n + min(b.max_new, b.context - n), resume=order)
        if hop == self.hops[0]:
            if call is Call.PROMPT:  # its KV waits: the gateway names its prefix once it has the ids
                return attrs.evolve(base, prompt=PromptPlan.of(prompt, max_new=b.max_new, max_prompt=b.max_prompt))
            return attrs.evolve(base, reuse=offer, prompt=PromptPlan.of({"ids": ids}, max_new=b.max_new,
                                                                        max_prompt=None))
        if call is Call.WAITING:
            return attrs.evolve(base, max_new=b.max_new)
        ids = ids or []  # the plan gives a later hop these calls only once the ids are known
        spec = self.spec
        if spec is not None and hop == self.hops[-1] and self.prompt_to_tail:  # the tail drafts from them
            spec = attrs.evolve(spec, history=tuple(ids[-WINDOW:]))
        return attrs.evolve(base, max_positions=len(ids) + min(b.max_new, b.context - len(ids)), spec=spec,
                            reuse=offer if call is Call.ON_PREFIX else AdoptRequest())

    async def open(self, bodies: dict[Hop, OpenRequest]) -> None:
        """Open each hop with its request (dgr.tracker.seam_client `NodeClient.open`), at once.

        A refusal does not cut the other opens short: each still answers (within the wait), so what opened
        is closed at once, not owed a close until its node's next heartbeat.

        Raises: the refusal of the first hop to refuse, in route order; else PeerError naming a silent node
        when the wait ran out.
        """
        refusals: dict[Hop, DgrError] = {}

        async def one(hop: Hop) -> None:
            self.attempted.append(hop.node_id)
            try:
                answer = await self.clients.get(hop).open(
                    bodies[hop], self.caps.get(hop.node_id), self.credentials.ticketer(self.sid, hop),
                    vocab_size=self.bounds.vocab_size)
            except DgrError as refused:
                answered.add(hop.node_id)
                if refused.reason is not Reason.ROUTE_NODE_LOST:
                    self.attempted.remove(hop.node_id)  # the node answered: it holds nothing
                refusals[hop] = refused
                return
            self.held[hop.node_id] = answer.positions
            if answer.steps is not None:
                self.resumed[hop.node_id] = answer
            if answer.tokens is not None:
                self.tokens = answer.tokens
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

    async def adopt(self, hops: list[Hop], offer: AdoptRequest) -> None:
        """Name the prompt's prefix to hops whose KV waits for it; each answers the positions it opened on."""
        async def one(hop: Hop) -> None:
            self.held[hop.node_id] = await self.clients.get(hop).adopt_prefix(self.sid, offer,
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
