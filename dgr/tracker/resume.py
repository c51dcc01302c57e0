"""What each hop of a repaired route keeps and sends on, so that no survivor computes a position again (issue 54).

Pure: the gateway's plan of a repair from what it knows, and its check of what the hops answered. The steps
are the lost route's own, numbered as it numbered them (dgr.tracker.live `LiveSession.steps`: the prompt's
chunks, then one decode step per token streamed), and the repaired route goes on with them.

Theory. When the loss is noticed the gateway has taken the answers of steps 0..W-1 (`W`: the prompt's chunks
it saw answered, or in decode the step of the last token streamed, which samples the next), so every
survivor computed each of them. A survivor keeps what it holds of the steps the gateway knows (the prompt's
chunks and, in decode, W + 1: a step past the last token it knows is not kept, the tail samples it again),
and a tail all but the last (it must compute that one to answer it: the first token, or the next); the
gateway takes no answer of a step the tail kept (its answer went with the lost route's inbox: an ACK). A hop after a survivor that kept more than that hop holds takes the missing steps from the
survivor's journal (dgr.node.journal: its frames as it sent them), and drops unread a step it holds
already (dgr.fsm.node `repeats`): so a survivor is told to send on its journal from step 0 where the hop
after it is a replacement (which holds nothing), and from W where it is a survivor (which holds at least
W). It sends them as it resumes, so it is opened only once the hop after it is (`waves`: a wave a trip). A replacement computes every step it is sent, in the lost route's steps, so its KV is the lost node's
to the bit. The gateway sends the head what it lacks up to step W (a lost head's replacement: every
step, the prompt's ids and the tokens streamed, which the gateway holds), and takes answers from W on: the
tail samples, answers and loops no step that ends before W's first position (`sample_from`).

When a repair cannot be planned this way (`plan_resume` says why) or the hops' answers break its
assumptions (`check_resumed`: a journal refused for the node's budget, a survivor that holds less than W),
the caller rebuilds as before: every hop of the replacement opens empty and computes every position.

Left out: the opens themselves (dgr.tracker.repair), the wire (dgr.seam.opening `ResumeOrder`).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from dgr.fsm.route import Hop
from dgr.seam.opening import OpenAnswer, ResumeOrder

__all__ = ["Rebuild", "ResumePlan", "plan_resume", "check_resumed"]


@attrs.frozen
class Rebuild:
    """How the gateway drives a repaired route's first steps: it sends the head steps from `feed_from`, and
    takes answers from `answer_from` (the tail samples from there)."""

    feed_from: int
    answer_from: int


@attrs.frozen
class ResumePlan:
    """Each survivor's order (node id -> `ResumeOrder`); every other hop of the replacement opens empty."""

    orders: dict[str, ResumeOrder]
    answer_from: int  # W: the first step whose answer the gateway has not taken
    sample_from: int  # the position it starts at: the tail answers no step that ends before it
    # the hops' opens, wave after wave: a survivor sends on its journal as it resumes, so it opens once the hop
    # after it has (a fresh hop, a tail: the first wave); a step that found no session there would end the route
    waves: tuple[frozenset[str], ...] = ()


def plan_resume(old: Sequence[Hop], new: Sequence[Hop], lost: frozenset[str], old_sid: str,
                ends: Sequence[int], answered: int, start: int, phase: str) -> ResumePlan | str:
    """The plan of a repair of the route `old` onto `new` (its node sessions `old_sid`), or why there is none.

    `ends[k]`: the positions held after step k of the steps known (the prompt's chunks, and a step a token fed);
    `answered`: W; `start`: the position step 0 started at; `phase`: the Route Session's state at the loss.
    """
    if phase not in ("prefill", "decode"):
        return f"lost in {phase}: the survivors may hold fewer steps than were answered"
    if start:
        return (f"its steps start at position {start} (a kept prefix): no journal holds the positions before, "
                "which a replacement lacks")
    before = {h.node_id: h for h in old if h.node_id not in lost}
    kept = [h for h in new if (b := before.get(h.node_id)) is not None and (b.start, b.stop) == (h.start, h.stop)]
    if not kept:
        return "no survivor is on the replacement route"
    names = {h.node_id for h in kept}
    orders = {}
    for i, hop in enumerate(new):
        if hop.node_id not in names:
            continue
        tail = i == len(new) - 1
        cap = len(ends) - 1 if tail else len(ends)
        nxt = None if tail else new[i + 1]
        replay = cap if tail else min(cap, answered if nxt.node_id in names else 0)
        orders[hop.node_id] = ResumeOrder(old_sid, cap, ends[cap - 1] if cap else 0, replay)
    wave = {new[-1].node_id: 0}
    for i in range(len(new) - 2, -1, -1):
        hop = new[i]
        wave[hop.node_id] = wave[new[i + 1].node_id] + 1 if hop.node_id in names else 0
    waves = tuple(frozenset(n for n, w in wave.items() if w == k) for k in range(max(wave.values()) + 1))
    return ResumePlan(orders, answered, ends[answered - 1] if answered else 0, waves)


def check_resumed(plan: ResumePlan, new: Sequence[Hop], answers: dict[str, OpenAnswer]) -> Rebuild | str:
    """How the gateway drives the repaired route, from the survivors' `answers`; or why it cannot go on from
    what they hold (the caller then rebuilds every position)."""
    w = plan.answer_from
    for hop in new:
        order = plan.orders.get(hop.node_id)
        if order is None:
            continue
        got = answers.get(hop.node_id)
        if got is None or got.steps is None:
            return f"{hop.node_id} did not resume its session"
        if got.steps < min(w, order.steps):
            return f"{hop.node_id} holds {got.steps} steps, {w} were answered"
        owes = got.steps > order.replay_from and hop is not new[-1]
        if owes and (got.journal_from is None or got.journal_from > order.replay_from):
            return f"{hop.node_id} keeps no journal from step {order.replay_from} (dgr node --journal-mb)"
    head, tail = answers.get(new[0].node_id), answers.get(new[-1].node_id)
    # a survivor tail answers no step it holds (it answered them on the lost route, whose inbox is gone)
    held = tail.steps if new[-1].node_id in plan.orders and tail is not None else 0
    return Rebuild(head.steps if new[0].node_id in plan.orders and head is not None else 0, max(w, held))
