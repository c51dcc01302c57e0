"""Choosing an Inference Route: a contiguous cover of [0, n_layers).

The rule, in order:
1. Only live, routable nodes serving the requested model (a node whose
   Model Artifact proof is pending or failed is not routable, see
   dgr.tracker.registry), and only nodes of one weight digest and one
   manifest id in a route: nodes with other files of the same model, or
   claiming other manifests, are never mixed.
2. With trusted ends (`--trusted-head KEY`), the head and the tail (the
   nodes holding layer 0 and the last layer) must be nodes signed by one of
   those keys: the head reads every prompt in clear, the tail every answer.
3. Spread: the route whose busiest node holds the fewest sessions. Sessions
   are counted, not divided by the capacity a node declares: a node that
   registers a huge capacity (or all the layers) gets no larger share for
   it. Capacity only refuses a node once it is full, and what a node may
   declare is bounded by the tracker (dgr.tracker.registry, `NodeEntry.limit`).
   A node's sessions are weighed by its strikes for late steps
   (`NodeEntry.load`: doubled, plus one, a strike; dgr.tracker.blame), so a
   node blamed for slowness is chosen as if it held more; a banned one is
   not routable at all.
4. Then the route whose most recently routed node was routed longest ago
   (`NodeEntry.routed_at`, which starts at its registration, so a node that
   joins does not draw a burst of sessions): sessions that come one at a
   time take the routes in turn, and a node holding every layer gets its
   turn, not every session.
5. Then fewest hops: every hop costs a network round trip per decoded token.
6. Then the lowest total of sessions over the route, then node ids, for a
   deterministic tie-break.
A node at its limit is skipped; if only full nodes would complete a route the
answer is 429 with Retry-After, else 503 with the missing layer ranges.

Prefix affinity (`prefer_holders`): once the prompt is tokenized, a route
made only of nodes that kept a prefix of it (the gateway's hint, from the
chains its sessions closed with) replaces the first choice, by the same rule
among those nodes. It is a hint: the nodes still answer what they hold.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable

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


def _trusted_ends(nodes: list[NodeEntry], n_layers: int, trusted: frozenset[bytes]) -> list[NodeEntry]:
    """`nodes` without the heads and tails whose key is not trusted (all of them when none is named)."""
    if not trusted:
        return nodes
    return [n for n in nodes if n.key in trusted or (n.start != 0 and n.stop != n_layers)]


def _shortest(nodes: list[NodeEntry], n_layers: int) -> tuple[NodeEntry, ...] | None:
    """The fewest-hops cover of [0, n_layers), then the lowest session total, then node ids."""
    # best[b] = best path covering [0, b); layers ascend so one forward pass suffices, and the key
    # (hops, total, ids) only grows along a path, so the best prefix makes the best path
    best: dict[int, tuple[tuple[int, int, tuple[str, ...]], tuple[NodeEntry, ...]]] = {0: ((0, 0, ()), ())}
    for boundary in range(n_layers):
        if boundary not in best:
            continue
        (hops, total, ids), path = best[boundary]
        for n in nodes:
            if n.start != boundary:
                continue
            key = (hops + 1, total + n.reserved, ids + (n.node_id,))
            if n.stop not in best or key < best[n.stop][0]:
                best[n.stop] = (key, path + (n,))
    found = best.get(n_layers)
    return None if found is None else found[1]


def _lowest(nodes: list[NodeEntry], n_layers: int, key: Callable[[NodeEntry], Any]) -> Any:
    """The lowest ceiling on `key` under which `nodes` still cover [0, n_layers), or None; a higher ceiling
    only admits more nodes, so a binary search: an open on a large swarm costs a few `_shortest`s, not one
    per distinct value."""
    ordered = sorted({key(n) for n in nodes})
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if _shortest([n for n in nodes if key(n) <= ordered[mid]], n_layers) is not None:
            hi = mid
        else:
            lo = mid + 1
    return ordered[lo] if lo < len(ordered) else None


def _best_path(nodes: list[NodeEntry], n_layers: int) -> tuple[NodeEntry, ...] | None:
    """The cover whose busiest node holds the fewest sessions; then the one whose most recently routed node
    was routed longest ago; then `_shortest`'s."""
    most = _lowest(nodes, n_layers, attrgetter("load"))
    if most is None:
        return None
    calm = [n for n in nodes if n.load <= most]
    latest = _lowest(calm, n_layers, attrgetter("routed_at"))
    return _shortest([n for n in calm if n.routed_at <= latest], n_layers)


def choose_route(candidates: list[NodeEntry], model: str, *, trusted: frozenset[bytes] = frozenset()) -> RouteChoice:
    """Pick the route for a new Route Session; with `trusted` keys, only they may be its head and tail.

    Raises:
        CallerError(MODEL_NOT_FOUND): no live node serves `model`.
        CallerError(NODE_AT_CAPACITY): a route exists but its nodes are full.
        PeerError(NO_ROUTE): live nodes leave layer ranges uncovered, or no trusted node holds an end.
    """
    named = [n for n in candidates if n.alive and n.model.name == model]
    if not named:
        raise CallerError(Reason.MODEL_NOT_FOUND, f"the model {model!r} does not exist or no live node serves it")
    serving = [n for n in named if n.routable]
    unproven = sorted(f"{n.node_id} ({'banned: too slow' if n.standing.banned else n.proof.state.value})"
                      for n in named if not n.routable)
    by_digest: dict[tuple[str, str], list[NodeEntry]] = {}
    for n in serving:
        by_digest.setdefault(_group_key(n), []).append(n)
    capacity_blocked = untrusted = False
    best: RouteChoice | None = None
    best_key: tuple[int, float, int] | None = None
    for (digest, manifest_id), everyone in sorted(by_digest.items()):
        n_layers = everyone[0].model.n_layers
        group = _trusted_ends(everyone, n_layers, trusted)
        untrusted |= len(group) < len(everyone) and _best_path(everyone, n_layers) is not None
        path = _best_path([n for n in group if not n.full()], n_layers)
        if path is None:
            capacity_blocked |= _best_path(group, n_layers) is not None
            continue
        key = (max(n.load for n in path), max(n.routed_at for n in path), len(path))
        if best_key is None or key < best_key:
            hops = tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path)
            best, best_key = RouteChoice(hops, path, digest, manifest_id or None), key
    if best is not None:
        return best
    if capacity_blocked:
        raise CallerError(Reason.NODE_AT_CAPACITY, "every route for this model is at its session capacity", retry_after=1)
    if untrusted:
        raise PeerError(Reason.NO_ROUTE, f"no route for {model!r} has a trusted head and tail: the nodes holding its "
                        "first and last layers are not signed by a --trusted-head key")
    if by_digest:
        gaps = sorted({g for group in by_digest.values() for g in missing_ranges(group, group[0].model.n_layers)})
    else:
        gaps = missing_ranges([], named[0].model.n_layers)
    why = f"; not routable (layer proof pending or failed, or banned): {', '.join(unproven)}" if unproven else ""
    raise PeerError(
        Reason.NO_ROUTE,
        f"no live route covers all layers of {model!r}; missing layers: {', '.join(gaps)}{why}",
        missing=gaps,
    )


def prefer_holders(candidates: list[NodeEntry], choice: RouteChoice, holders: frozenset[str], *,
                   trusted: frozenset[bytes] = frozenset()) -> RouteChoice | None:
    """A route of the same files as `choice` made only of `holders` with a free slot; None if none, or if
    `choice` is already one."""
    if all(n.node_id in holders for n in choice.nodes):
        return None
    first = choice.nodes[0]
    group = [n for n in candidates if n.alive and n.routable and n.node_id in holders and not n.full()
             and _group_key(n) == _group_key(first) and n.model.name == first.model.name]
    path = _best_path(_trusted_ends(group, first.model.n_layers, trusted), first.model.n_layers)
    if path is None:
        return None
    return RouteChoice(tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path), path, choice.digest,
                       choice.manifest_id)
