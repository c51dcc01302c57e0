"""The bookkeeping of one speculative step on a route: positions carried, tokens kept, KV trimmed, counters.

A step carries k + 1 positions pos0..pos0+k: the last accepted token (at
pos0, not yet in any node's KV) and k drafts. Every node computes them as
one batch and appends them to its KV, so after the step each node holds
positions [0, pos0 + k + 1). The tail accepts n drafts and emits n + 1
tokens (dgr.speculative.accept); the next step starts at pos0' = pos0 + n + 1 with
the extra token. Its pos0' is the seam's statement "accepted through
position pos0' - 1": every node drops positions >= pos0' before computing
it, so no node ever computes on, or keeps, a refused position. A session
that stops instead (end of generation, max_tokens) closes with the same
number, `Settled.keep`, so a node keeping the KV as a prefix keeps only
accepted positions.

The rules a node checks (`KvWindow.advance`): pos0' is at least the
previous step's pos0 + 1 (the last accepted token is never taken back) and
at most the positions it holds (a step cannot skip a position). Anything
else is refused with POSITION_DISCONTINUITY and changes nothing.

The stop rule is dgr.fsm.stop's, applied to each emitted token in order;
tokens after the one that stops are dropped.

Pure: attrs values and functions; no I/O.

Left out: drafting (dgr.speculative.ngram), acceptance (dgr.speculative.accept), the
choice of k (dgr.speculative.adapt), and the frames themselves (dgr.seam, once
the lead adds the step kind: docs/spec-decoding.md).
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from dgr.errors import CallerError, Reason
from dgr.fsm.stop import next_step
from dgr.speculative.accept import Verdict

__all__ = ["SpecStep", "Settled", "KvWindow", "SpecCounters", "plan_step", "settle"]


@attrs.frozen
class SpecStep:
    """One step's positions: `tokens[0]` (the last accepted token) at pos0, draft i at pos0 + i."""

    seq: int
    pos0: int
    tokens: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if self.pos0 < 0 or not self.tokens:
            raise ValueError(f"a step needs a position and at least its last accepted token: {self}")

    @property
    def k(self) -> int:
        return len(self.tokens) - 1

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.tokens[1:]

    @property
    def accepted_through(self) -> int:
        """The last position every node keeps from earlier steps (-1 before any): pos0 - 1."""
        return self.pos0 - 1

    @property
    def end(self) -> int:
        """One past the last position the step computes: pos0 + k + 1."""
        return self.pos0 + len(self.tokens)


def plan_step(seq: int, pos0: int, last: int, drafts: Sequence[int], *, k: int, room: int) -> SpecStep:
    """The step for `last` at pos0 with at most k of `drafts`, and no more than `room` of them.

    room: drafts that can still be used: tokens the session may still emit less one
    (max_tokens - generated - 1), and positions it may still hold less one (the step's
    own position); the caller passes the smaller. Fewer drafts than k is a normal step.
    """
    n = max(0, min(k, room, len(drafts)))
    return SpecStep(seq, pos0, (int(last),) + tuple(int(d) for d in drafts[:n]))


@attrs.frozen
class Settled:
    """What a verified step leaves: the tokens to emit, and the positions every node keeps."""

    emitted: tuple[int, ...]  # accepted drafts and the extra token, cut after the token that stops
    keep: int  # positions [0, keep) are kept; the next step's pos0, or the close's
    more: bool  # a next step goes out (starting at `keep`, with emitted[-1])
    finish: str | None  # why not, as dgr.fsm.stop says


def settle(
    step: SpecStep,
    verdict: Verdict,
    *,
    generated: int,
    max_tokens: int,
    is_eog: Callable[[int], bool],
    ignore_eos: bool = False,
) -> Settled:
    """Apply the stop rule to a step's emitted tokens. `generated`: tokens emitted before this step.

    Raises:
        ValueError: a verdict that is not of this step (more accepted than drafted, or tokens that
            disagree with the drafts).
    """
    if not 0 <= verdict.accepted <= step.k or len(verdict.tokens) != verdict.accepted + 1:
        raise ValueError(f"verdict {verdict} does not fit a step of {step.k} drafts")
    if verdict.tokens[: verdict.accepted] != step.drafts[: verdict.accepted]:
        raise ValueError(f"verdict {verdict} accepts tokens that were not drafted: {step.drafts}")
    emitted: list[int] = []
    for tok in verdict.tokens:
        emitted.append(tok)
        nxt = next_step(
            eog=is_eog(tok), ignore_eos=ignore_eos, generated=generated + len(emitted), max_tokens=max_tokens
        )
        if not nxt.more:
            return Settled(tuple(emitted), step.pos0 + len(emitted), False, nxt.finish)
    return Settled(tuple(emitted), step.pos0 + len(emitted), True, None)


@attrs.frozen
class KvWindow:
    """What one node's KV holds for a session: positions [0, held), of which [0, committed) are accepted."""

    committed: int = 0
    held: int = 0

    def computed(self, step: SpecStep) -> KvWindow:
        """After computing a step (which `advance` admitted): its positions appended."""
        return KvWindow(committed=step.pos0 + 1, held=step.end)

    def advance(self, pos0: int) -> tuple[range, KvWindow]:
        """A step (or a close's `keep`) at pos0: the positions to drop first, and the window after.

        Raises:
            CallerError(POSITION_DISCONTINUITY): pos0 takes back an accepted position or skips one.
        """
        if not self.committed <= pos0 <= self.held:
            raise CallerError(
                Reason.POSITION_DISCONTINUITY,
                f"step at position {pos0}: this node holds [0, {self.held}) with [0, {self.committed}) accepted",
            )
        return range(pos0, self.held), KvWindow(committed=pos0, held=pos0)


@attrs.frozen
class SpecCounters:
    """A session's speculation telemetry."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    k: int = 0  # drafts in the latest step

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def after(self, step: SpecStep, verdict: Verdict) -> SpecCounters:
        return SpecCounters(
            steps=self.steps + 1,
            drafted=self.drafted + step.k,
            accepted=self.accepted + verdict.accepted,
            k=step.k,
        )

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "acceptance_rate": self.acceptance_rate,
            "k": self.k,
        }
