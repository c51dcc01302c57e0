"""Choosing an Inference Route: a contiguous cover of [0, n_layers).

The rule, in order:
1. Only live, routable nodes serving the requested model (a node whose
   Model Artifact proof is pending or failed is not routable, see
   dgr.tracker.registry), and only nodes of one weight digest and one
   manifest id in a route: nodes with other files of the same model, or
   claiming other manifests, are never mixed.
2. Fewest hops: every hop costs a network round trip per decoded token.
3. Among routes with the fewest hops, the least loaded: the lowest maximum
   session load (sessions / capacity) over the route's nodes, then the lowest
   total, then node ids for a deterministic tie-break.
A node at capacity is skipped; if only full nodes would complete a route the
answer is 429 with Retry-After, else 503 with the missing layer ranges.

Prefix affinity (`prefer_holders`): once the prompt is tokenized, a route
made only of nodes that kept a prefix of it (the gateway's hint, from the
chains its sessions closed with) replaces the first choice, by the same rule
among those nodes. It is a hint: the nodes still answer what they hold.
"""

from __future__ import annotations

import attrs

from dgr.errors import CallerError, PeerError, Reason
from dgr.fsm.route import Hop
from dgr.tracker.registry import NodeEntry

__all__ = ["choose_route", "missing_ranges", "prefer_holders", "RouteChoice"]


@attrs.frozen
class RouteChoice:
    hops: tuple[Hop, ...]
    nodes: tuple[NodeEntry, ...]
    digest: str
    manifest_id: str | None = None


def _group_key(n: NodeEntry) -> tuple[str, str]:
    return (n.model.digest, n.manifest_id or "")


def missing_ranges(nodes: list[NodeEntry], n_layers: int) -> list[str]:
    covered = [False] * n_layers
    for n in nodes:
        for i in range(n.start, min(n.stop, n_layers)):
            covered[i] = True
    gaps, i = [], 0
    while i < n_layers:
        if covered[i]:
            i += 1
            continue
        j = i
        while j < n_layers and not covered[j]:
            j += 1
        gaps.append(f"{i}:{j}")
        i = j
    return gaps


def _best_path(nodes: list[NodeEntry], n_layers: int) -> tuple[NodeEntry, ...] | None:
    # best[b] = best path covering [0, b); layers ascend so one forward pass suffices
    best: dict[int, tuple[tuple[int, float, float, tuple[str, ...]], tuple[NodeEntry, ...]]] = {0: ((0, 0.0, 0.0, ()), ())}
    for boundary in range(n_layers):
        if boundary not in best:
            continue
        (hops, worst, total, ids), path = best[boundary]
        for n in nodes:
            if n.start != boundary:
                continue
            key = (hops + 1, max(worst, n.load()), total + n.load(), ids + (n.node_id,))
            if n.stop not in best or key < best[n.stop][0]:
                best[n.stop] = (key, path + (n,))
    found = best.get(n_layers)
    return None if found is None else found[1]


def choose_route(candidates: list[NodeEntry], model: str) -> RouteChoice:
    """Pick the route for a new Route Session.

    Raises:
        CallerError(MODEL_NOT_FOUND): no live node serves `model`.
        CallerError(NODE_AT_CAPACITY): a route exists but its nodes are full.
        PeerError(NO_ROUTE): live nodes leave layer ranges uncovered.
    """
    named = [n for n in candidates if n.alive and n.model.name == model]
    if not named:
        raise CallerError(Reason.MODEL_NOT_FOUND, f"the model {model!r} does not exist or no live node serves it")
    serving = [n for n in named if n.routable]
    unproven = sorted(f"{n.node_id} ({n.proof.state.value})" for n in named if not n.routable)
    by_digest: dict[tuple[str, str], list[NodeEntry]] = {}
    for n in serving:
        by_digest.setdefault(_group_key(n), []).append(n)
    capacity_blocked = False
    best: RouteChoice | None = None
    for (digest, manifest_id), group in sorted(by_digest.items()):
        n_layers = group[0].model.n_layers
        path = _best_path([n for n in group if not n.full()], n_layers)
        if path is None:
            capacity_blocked |= _best_path(group, n_layers) is not None
            continue
        if best is None or len(path) < len(best.nodes):
            hops = tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path)
            best = RouteChoice(hops, path, digest, manifest_id or None)
    if best is not None:
        return best
    if capacity_blocked:
        raise CallerError(Reason.NODE_AT_CAPACITY, "every route for this model is at its session capacity", retry_after=1)
    if by_digest:
        gaps = sorted({g for group in by_digest.values() for g in missing_ranges(group, group[0].model.n_layers)})
    else:
        gaps = missing_ranges([], named[0].model.n_layers)
    why = f"; not routable (layer proof pending or failed): {', '.join(unproven)}" if unproven else ""
    raise PeerError(
        Reason.NO_ROUTE,
        f"no live route covers all layers of {model!r}; missing layers: {', '.join(gaps)}{why}",
        missing=gaps,
    )


def prefer_holders(candidates: list[NodeEntry], choice: RouteChoice, holders: frozenset[str]) -> RouteChoice | None:
    """A route of the same files as `choice` made only of `holders` with a free slot; None if none, or if
    `choice` is already one."""
    if all(n.node_id in holders for n in choice.nodes):
        return None
    first = choice.nodes[0]
    group = [n for n in candidates if n.alive and n.routable and n.node_id in holders and not n.full()
             and _group_key(n) == _group_key(first) and n.model.name == first.model.name]
    path = _best_path(group, first.model.n_layers)
    if path is None:
        return None
    return RouteChoice(tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path), path, choice.digest,
                       choice.manifest_id)
