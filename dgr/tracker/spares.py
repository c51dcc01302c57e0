"""Which nodes are spares: decided by layers alone, over the registry's live entries (issue 54).

A spare holds layers that members already cover. Routing keeps it idle
while members have room (dgr.tracker.routing), a repair takes it first
(`repair_route`), and when a member dies or drains, a spare covering its
layers becomes a member. So `dgr up --spares N` needs no flag of its own for
this, and a node that joins a running cluster can be a spare too.

The rule (`settle`), per model and file (name, weight digest, manifest): the
candidates are the live, proven, unbanned entries that are not draining,
taken in this order: those that did not ask to be spares before those that
did (`dgr node --spare`), members before others (a member stays one while
it lives), then the oldest registration first, then the node id. Each in
turn is:
- a member, if some layer of its range is held by no member chosen so far
  (coverage wins over asking);
- else a spare, if it asked to be one, or if some layer of its range has
  fewer than `keep` spares so far (the tracker's `--spares N`: spares kept
  per layer);
- else a member (a replica beyond the spares kept: it takes its share).
With `keep` 0 and no node asking, every node is a member: routing is as it
was before spares.

Pure: no I/O, no clock. A draining entry keeps its role (it is terminal);
entries that are not candidates (dead, unproven, banned) keep theirs until
they are again.

Left out: when to settle (dgr.tracker.registry, on each registration,
death, drain and sweep), and what routing does with a role.
"""

from __future__ import annotations

from typing import Iterable

from dgr.tracker.entry import NodeEntry, Role

__all__ = ["settle"]


def _order(n: NodeEntry) -> tuple[bool, bool, float, str]:
    return (n.wants_spare, n.role is not Role.MEMBER, n.registered_at, n.node_id)


def settle(entries: Iterable[NodeEntry], keep: int) -> list[tuple[NodeEntry, Role]]:
    """Set the role of every candidate among `entries` (see the module's rule); the entries whose role changed,
    each with its role before."""
    groups: dict[tuple[str, str, str], list[NodeEntry]] = {}
    for n in entries:
        if n.alive and n.proof.routable and not n.standing.banned and n.role is not Role.DRAINING:
            groups.setdefault((n.model.name, n.model.digest, n.manifest_id or ""), []).append(n)
    changed = []
    for group in groups.values():
        n_layers = group[0].model.n_layers
        members, spares = [0] * n_layers, [0] * n_layers
        for n in sorted(group, key=_order):
            layers = range(n.start, min(n.stop, n_layers))
            if any(members[i] == 0 for i in layers):
                role, counts = Role.MEMBER, members
            elif n.wants_spare or any(spares[i] < keep for i in layers):
                role, counts = Role.SPARE, spares
            else:
                role, counts = Role.MEMBER, members
            for i in layers:
                counts[i] += 1
            if role is not n.role:
                changed.append((n, n.role))
                n.role = role
    return changed
