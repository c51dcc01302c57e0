"""A ring tail's speculation for one session: drafts out, verdicts in, the next step sized to pay.

The tail is where the tokens are, so drafting and verifying both run here
(issue 42), in the node's backend thread, after the step's logits:

- The tail keeps an n-gram index of the session's tokens (dgr.speculative.ngram):
  the prompt's, which its open carried (`SpecPlan.history`), then every
  token it emits. Or, where the session asked for `draft` and the node has
  one, its draft model drafts them (dgr.node.draft), from the same tokens.
- A step it sends the head carries the last accepted token at `pos0` and k
  drafts after it; every node computes them as one step. Its logits come
  back here as k + 1 rows: the session's own sampler draws each row's token
  in order and the drafts are accepted while they equal it
  (dgr.speculative.accept), so a seeded or greedy request emits the tokens it
  would without speculation, given the same logits.
- The stop rule (dgr.fsm.stop, in positions, as `next_step_frame` counts
  them) is applied to each emitted token in turn (dgr.speculative.step `settle`);
  each emitted token leaves as a TOKEN frame whose SPEC_RESULT says how many
  of the step's tokens follow it.
- The next step starts at the first refused draft's position (`keep`): every
  node drops its KV from there before computing it (dgr.fsm.node), so no node
  keeps a refused position.
- k: fixed where the tracker fixed it, else from the measured acceptance of
  drafts of the next draft's class and the route's measured cost
  (dgr.speculative.adapt `choose_k`). The classes are the drafter's (`kind`): an
  n-gram draft resting on one or two tokens of context is "short", on more
  "long", and each keeps its own estimate (dgr.speculative.ngram says why). The
  cost: the time
  from building a step to having its logits here (every link and node on
  the way), less the extra positions' share, is `step_s`; an extra
  position's share is its compute on every node (the record's hop times),
  learnt from steps of more than one position; a draft model's drafting
  adds its measured time a token. A session at k = 0 drafts n-grams in the
  shadow (they cost nothing), so its estimate still learns; a draft model's
  session starts from a higher prior, as its drafts are the model's own
  guesses of the next token, and at k = 0 drafts one token in the shadow
  now and then, at 1% of the session's time (`_PROBE_SHARE`, counting the
  tokens it must read to catch up), so its cost and acceptance are
  measured again where a trip is long enough for that to pay. The draft
  model reads the prompt at the session's open (`warm`).

Left out: the frames' bytes (dgr.node.replies builds them) and the route's
side (the gateway counts SPEC_RESULTs into Generation Telemetry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import numpy as np

from dgr.node.draft import DraftModel, ModelDrafter
from dgr.sampling import Sampler
from dgr.speculative.accept import Verdict, accept_with_sampler
from dgr.speculative.adapt import Acceptance, RouteCost, Shadow, choose_k
from dgr.speculative.ngram import NgramDrafter
from dgr.speculative.step import Settled, SpecCounters, SpecStep, plan_step, settle
from dgr.seam.opening import SpecPlan  # an open carries the plan (dgr.seam.opening)

__all__ = ["SpecPlan", "TailSpec", "Emitted"]


_WEIGHT = 0.2  # the newest measurement's weight in the route cost's running means
_POSITION_PRIOR = 0.25  # before any multi-position step: an extra position costs this share of a step's compute
# a draft's acceptance before any is seen: low, so a session drafts little until its own steps (or its
# shadow) show that drafts pay; free chat then never pays for drafts it did not need
_PRIOR = 0.3
# a draft model's first acceptance: its drafts are a model's own next tokens, and at k = 0 nothing is learnt
_MODEL_PRIOR = 0.6
# a draft model's session at k = 0 drafts one token in the shadow once the steps since the last took this many
# times that token's cost: the probe costs 1% of the session's time (every 100 steps where a draft costs a step)
_PROBE_SHARE = 0.01
# reading a token the draft model fell behind by costs about this share of drafting one (a batch, not a step
# each): so a long pause at k = 0 makes a probe dearer, and where a trip is under 25 drafted tokens there is none
_CATCH_UP = 0.25


class Drafter(Protocol):
    """A session's source of drafts: dgr.speculative.ngram's index or the node's draft model (dgr.node.draft)."""

    free: bool  # drafting costs nothing to speak of, so drafts are made in the shadow at k = 0
    draft_s: float  # what drafting a token costs, measured

    def extend(self, tokens: Sequence[int]) -> None: ...
    def append(self, token: int) -> None: ...
    def draft(self, k: int) -> list[int]: ...
    def kind(self) -> str: ...  # the next draft's class: each class has its own acceptance estimate
    def warm(self) -> None: ...  # before the first step: a draft model reads the prompt
    def close(self) -> None: ...  # the session ended: a draft model frees its sequence


@attrs.frozen
class Emitted:
    """One token the tail emits: the token, its log-probability, and how many of its step's follow it."""

    token: int
    logprob: float
    left: int


@attrs.define
class TailSpec:
    plan: SpecPlan
    drafter: Drafter = attrs.field(factory=lambda: NgramDrafter(n_min=1))
    prior: float = _PRIOR  # the acceptance a class of drafts starts from
    # the drafter's classes of drafts (`Drafter.kind`: how much context an n-gram draft rests on) -> their estimate
    acceptance: dict[str, Acceptance] = attrs.field(factory=dict)
    shadow: Shadow = attrs.field(factory=Shadow)
    shadow_kind: str = ""  # the class of the shadow's drafts
    counters: SpecCounters = attrs.field(factory=SpecCounters)
    # seq -> (step sent, when built, the class of its drafts)
    inflight: dict[int, tuple[SpecStep, float, str]] = attrs.field(factory=dict)
    step_s: float | None = None  # a one-position step around the route, measured
    compute_1: float | None = None  # every node's compute for a one-position step
    position_s: float | None = None  # one more position's compute, every node together
    clock: Callable[[], float] = time.perf_counter
    # the step verified last, when it was built and when its logits were here, until `measured` takes its cost
    # (after its iteration)
    verified: tuple[SpecStep, float, float] | None = None
    undrafted: int = 0  # steps at k = 0 since a costly drafter last drafted in the shadow

    def __attrs_post_init__(self) -> None:
        self.drafter.extend(self.plan.history)

    @classmethod
    def for_plan(cls, sid: str, plan: SpecPlan, draft: DraftModel | None) -> TailSpec:
        """A session's speculation as its open planned it, drafting from `draft` where it asked for a model.

        Raises:
            ValueError: a plan for a draft model on a node with none (the open refuses it first).
        """
        if plan.source != "draft":
            return cls(plan)
        if draft is None:
            raise ValueError("no draft model on this node")
        return cls(plan, drafter=ModelDrafter(draft, sid), prior=_MODEL_PRIOR)

    @property
    def reads_prompt(self) -> bool:
        """Whether `warm` has work to do: a draft model reads the prompt; the n-gram index has it already."""
        return not self.drafter.free

    def warm(self) -> None:
        """Ready the drafter before the first step (in the scheduler's thread: a draft model reads the prompt)."""
        self.drafter.warm()

    def close(self) -> None:
        """Free what drafting held for the session (in the scheduler's thread: a draft model's sequence)."""
        self.drafter.close()

    def first(self, token: int, logprob: float) -> Emitted:
        """The token the prompt's last chunk sampled: emitted alone, and the history's next token."""
        self._learn_shadow(token)
        self.drafter.append(token)
        return Emitted(token, logprob, 0)

    def verify(self, seq: int, logits: np.ndarray, sampler: Sampler, *, is_eog: Callable[[int], bool],
               ignore_eos: bool, max_positions: int) -> tuple[SpecStep, Verdict, Settled, list[Emitted]]:
        """The verdict on step `seq` from its logits [k + 1, vocab] ([vocab] for k = 0), and what it emits.

        Raises:
            KeyError: no step `seq` in flight (the tail did not send it).
        """
        step, built, kind = self.inflight.pop(seq)
        self.verified = (step, built, self.clock())  # its logits are here: the next step's drafting is no part of it
        rows = logits.reshape(step.k + 1, -1)  # [k + 1, vocab]
        verdict, logprobs = accept_with_sampler(rows, step.drafts, sampler)
        # positions: the step's first token sits at pos0, so the token after it is pos0 + 1's (counted as
        # next_step_frame counts: a token's position plus one against the session's positions)
        done = settle(step, verdict, generated=step.pos0 + 1, max_tokens=max_positions, is_eog=is_eog,
                      ignore_eos=ignore_eos)
        self.counters = self.counters.after(step, verdict)
        if step.k:
            self.acceptance[kind] = self.estimate(kind).after_step(step.k, verdict.accepted)
        n = len(done.emitted)
        out = [Emitted(tok, logprobs[i], n - 1 - i) for i, tok in enumerate(done.emitted)]
        for tok in done.emitted:
            if not step.k:
                self._learn_shadow(tok)
            self.drafter.append(tok)
        return step, verdict, done, out

    def next_step(self, seq: int, pos0: int, last: int, max_positions: int) -> SpecStep:
        """The step to send for `last` at `pos0`: k drafts where they pay (and fit the session's positions)."""
        kind = self.drafter.kind()
        k = self._k(kind)
        room = max(0, max_positions - pos0 - 1)  # positions the step may still add past its own
        step = plan_step(seq, pos0, last, self.drafter.draft(k), k=k, room=room)
        if step.k == 0 and not self.shadow.expecting:  # before the step's clock starts: no part of its trip
            if self.drafter.free:
                self.shadow, self.shadow_kind = Shadow(tuple(self.drafter.draft(self.plan.k_max))), kind
            else:  # a model's draft costs its compute: one token a while, so a session at k = 0 can come back
                self.undrafted += 1
                if self._probe_due():
                    self.undrafted = 0
                    self.shadow, self.shadow_kind = Shadow(tuple(self.drafter.draft(1))), kind
        self.inflight[seq] = (step, self.clock(), kind)
        return step

    def _probe_due(self) -> bool:
        """Whether a k = 0 session's draft model drafts a token in the shadow now: once the steps since it last
        did took 1/_PROBE_SHARE times what the probe costs, a token and reading the tokens since (at
        _CATCH_UP of a token each). At once where its cost is not measured yet."""
        cost = self.drafter.draft_s * (1.0 + _CATCH_UP * self.undrafted)
        return self.undrafted * _PROBE_SHARE * (self.step_s or 0.0) >= cost

    def estimate(self, kind: str) -> Acceptance:
        """The acceptance estimate of drafts of class `kind` (the prior before any is seen)."""
        return self.acceptance.get(kind) or Acceptance(prior=self.prior)

    def _k(self, kind: str) -> int:
        if self.plan.fixed_k is not None:
            return min(self.plan.fixed_k, self.plan.k_max)
        if self.step_s is None:
            return 0  # nothing measured yet: the first step tells what a trip costs
        position = self.position_s if self.position_s is not None else _POSITION_PRIOR * (self.compute_1 or 0.0)
        return choose_k(self.estimate(kind), RouteCost(max(self.step_s, 1e-6), max(position, 0.0), self.drafter.draft_s),
                        k_max=self.plan.k_max)

    def measured(self, compute_s: float) -> None:
        """The step verified last is done: from its building to its logits here it took a time of which
        `compute_s` (every node's) was compute. Nothing where no step was verified since (the prompt's last
        chunk). The drafts of the step after it are not in that time: they are the drafter's cost."""
        if self.verified is None:
            return
        (step, built, verified_at), self.verified = self.verified, None
        took_s = verified_at - built
        if step.k == 0:
            self.compute_1 = _mean(self.compute_1, compute_s)
            self.step_s = _mean(self.step_s, took_s)
            return
        if self.compute_1 is not None:
            self.position_s = _mean(self.position_s, max(0.0, compute_s - self.compute_1) / step.k)
        extra = step.k * (self.position_s or 0.0)
        self.step_s = _mean(self.step_s, max(1e-6, took_s - extra))

    def _learn_shadow(self, token: int) -> None:
        if self.shadow.expecting:
            self.shadow, self.acceptance[self.shadow_kind] = self.shadow.sampled(token, self.estimate(self.shadow_kind))


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + _WEIGHT * (new - old)

