"""Transition tables as data.

A table maps (state, event) to the next state. A missing key is an illegal
transition: `TransitionTable.next` raises `IllegalTransition` and the caller
has not assigned anything yet, so nothing changes. Terminal states are those
with no outgoing entry. The spec documents are drawn from these tables
(dgr.specgen.protocol), so they cannot drift from the code.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

import attrs

from dgr.errors import IllegalTransition

__all__ = ["Transition", "TransitionTable"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


@attrs.frozen
class Transition(Generic[S, E]):
    source: S
    event: E
    target: S
    why: str = ""


@attrs.frozen
class TransitionTable(Generic[S, E]):
    """Every legal transition of one machine, and nothing else."""

    machine: str
    states: type[S]
    events: type[E]
    initial: S
    transitions: tuple[Transition[S, E], ...]
    # other states a machine may start in (a node session opened before its KV may open starts waiting)
    also_initial: tuple[S, ...] = ()
    _index: dict[tuple[S, E], S] = attrs.field(init=False, eq=False, repr=False)
    # the states with no outgoing entry: fixed with the table, so drawn once (every `ended` check reads it)
    terminal: frozenset[S] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        index: dict[tuple[S, E], S] = {}
        for t in self.transitions:
            key = (t.source, t.event)
            if key in index:
                raise ValueError(f"{self.machine}: duplicate transition {key}")
            index[key] = t.target
        object.__setattr__(self, "_index", index)
        sources = {source for source, _ in index}
        object.__setattr__(self, "terminal", frozenset(s for s in self.states if s not in sources))

    def next(self, state: S, event: E) -> S:
        """The state after `event` in `state`.

        Raises:
            IllegalTransition(ILLEGAL_TRANSITION): no such entry.
        """
        try:
            return self._index[(state, event)]
        except KeyError:
            raise IllegalTransition(self.machine, state.value, event.value) from None

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self._index
