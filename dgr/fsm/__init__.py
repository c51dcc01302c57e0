"""The pure state machines: no I/O, standard library and attrs only."""

from dgr.fsm.machine import Transition, TransitionTable
from dgr.fsm.node import NodeEvent, NodeSession, NodeState
from dgr.fsm.proof import ProofEvent, ProofState, ProofStatus
from dgr.fsm.route import RouteEvent, RouteSession, RouteState

__all__ = [
    "Transition",
    "TransitionTable",
    "NodeEvent",
    "NodeSession",
    "NodeState",
    "ProofEvent",
    "ProofState",
    "ProofStatus",
    "RouteEvent",
    "RouteSession",
    "RouteState",
]
