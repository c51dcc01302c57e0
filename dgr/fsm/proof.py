"""Proof Status: where one node registration's layer-possession claim stands.

Contract:
- States: none (no claim) -> pending -> passed | failed; none -> failed when
  the tracker requires proofs and the node claims nothing. passed and failed
  are terminal. Only none and passed are routable.
- A registration starts a new status (a new claim): a node never moves back
  from failed; it registers again.
- A verdict (held, refuted) decides a pending claim once. A verdict for a
  claim that is not pending is a late result (a prover racing a second
  decision) and is discarded: `decide` returns False and changes nothing.
  Every other illegal event raises `IllegalTransition` and changes nothing.

Theory: the registry (dgr.tracker.registry) creates a status per registration
and claims it; the prover (dgr.tracker.proofs) challenges the node in a trio
task and decides. This module holds no clock and does no I/O.

Left out: the challenges themselves (dgr.artifact.proof) and routing
(dgr.tracker.routing reads `routable`).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dgr.errors import IllegalTransition
from dgr.fsm.machine import Transition, TransitionTable

__all__ = ["PROOF_TABLE", "ProofEvent", "ProofState", "ProofStatus"]


class ProofState(enum.Enum):
    """Where a node's layer-possession proof stands. Values appear in GET /v1/nodes."""

    UNCLAIMED = "none"  # no manifest claimed: routable unless proofs are required
    PENDING = "pending"  # claimed, challenges not finished: not routable yet
    PASSED = "passed"  # every challenge held: routable
    FAILED = "failed"  # a challenge failed, or the claim cannot be checked: never routable


class ProofEvent(enum.Enum):
    CLAIM = "claim"
    PROOF_REQUIRED = "proof_required"
    HELD = "held"
    REFUTED = "refuted"


PROOF_TABLE: TransitionTable[ProofState, ProofEvent] = TransitionTable(
    machine="proof_status",
    states=ProofState,
    events=ProofEvent,
    initial=ProofState.UNCLAIMED,
    transitions=(
        Transition(ProofState.UNCLAIMED, ProofEvent.CLAIM, ProofState.PENDING,
                   "the registration claims layers of a manifest"),
        Transition(ProofState.UNCLAIMED, ProofEvent.PROOF_REQUIRED, ProofState.FAILED,
                   "the tracker requires proofs and the node claims nothing"),
        Transition(ProofState.PENDING, ProofEvent.HELD, ProofState.PASSED, "every challenge held"),
        Transition(ProofState.PENDING, ProofEvent.REFUTED, ProofState.FAILED,
                   "a challenge failed, or the claim cannot be checked here"),
    ),
)

_VERDICTS = (ProofEvent.HELD, ProofEvent.REFUTED)


@attrs.define
class ProofStatus:
    """One registration's claim and what came of it. Pure: no I/O, no clock."""

    state: ProofState = PROOF_TABLE.initial
    reason: str | None = None  # wire code of a failure: proof_failed, artifact_mismatch, ...
    message: str = ""
    verdict: str | None = None  # dgr.artifact.proof.Verdict value of the deciding challenge, if one decided
    challenges: int = 0  # challenges that passed
    seconds: float | None = None  # time the challenges took

    @property
    def routable(self) -> bool:
        return self.state in (ProofState.UNCLAIMED, ProofState.PASSED)

    def _move(self, event: ProofEvent, message: str, reason: str | None) -> None:
        self.state = PROOF_TABLE.next(self.state, event)  # raises first: nothing below runs on an illegal event
        self.message, self.reason = message, reason

    def claim(self) -> None:
        """The registration claims a manifest: challenges follow.

        Raises:
            IllegalTransition: the status is not new.
        """
        self._move(ProofEvent.CLAIM, "challenges not finished", None)

    def require(self, message: str, reason: str) -> None:
        """The tracker routes only proven nodes and this one claims nothing: it fails at once.

        Raises:
            IllegalTransition: the status is not new.
        """
        self._move(ProofEvent.PROOF_REQUIRED, message, reason)

    def decide(self, event: ProofEvent, message: str, *, reason: str | None = None, verdict: str | None = None,
               challenges: int = 0, seconds: float | None = None) -> bool:
        """Record the claim's verdict (HELD or REFUTED); False, and nothing changes, if it is not pending.

        Raises:
            IllegalTransition: `event` is not a verdict.
        """
        if event not in _VERDICTS:
            raise IllegalTransition(PROOF_TABLE.machine, self.state.value, event.value)  # claims are not verdicts
        if not PROOF_TABLE.allows(self.state, event):
            return False  # a late verdict: the claim was decided already
        self._move(event, message, reason)
        self.verdict, self.challenges, self.seconds = verdict, challenges, seconds
        return True

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value, "challenges": self.challenges}
        if self.message:
            out["message"] = self.message
        if self.reason is not None:
            out["reason"] = self.reason
        if self.verdict is not None:
            out["verdict"] = self.verdict
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 4)
        return out
