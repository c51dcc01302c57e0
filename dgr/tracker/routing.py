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
4. Then turns: the route whose nodes were routed the fewest sessions
   (`NodeEntry.turns`, which starts level with the busiest node of the same
   layers, so a node that joins does not draw a burst), then the one whose
   most recently routed node was routed longest ago (`NodeEntry.routed_at`):
   sessions that come one at a time take the routes in turn, a node holding
   every layer gets its turn, not every session, and a session routed by
   prefix affinity counts as its route's turn like any other.
5. Then fewest hops: every hop costs a network round trip per decoded token.
6. Then the lowest total of sessions over the route, then a random draw
   (the caller's seeded `random.Random`): no name, chosen or derived, sorts
   a node ahead of another.
Rules 3 and 4 compare routes on what differs between them: a node that every
route still in the running uses (a shared stage) is set aside, and the
ceiling is sought again among the others (`_settle`). Before, routes through
a shared stage tied on it, its turn being the latest, and the lowest node id
won every session.
A node at its limit is skipped; if only full nodes would complete a route the
answer is 429 with Retry-After, else 503 with the missing layer ranges.

Spares (issue 54, dgr.tracker.spares): within a group, the route is
chosen among members first; spares (nodes whose layers members cover) are
used only where members alone leave no route with room, so they stay idle
for the repairs that take them first. Affinity never prefers a spare.

Prefix affinity (`prefer_holders`): once the prompt's ids are known, a route
made only of nodes that may hold a prefix of it (dgr.tracker.affinity says
which) replaces the first choice, by the same rule among those nodes, but
only where it ties with the first choice on the spread (rule 3, compared on
what differs): affinity never sends a session to busier nodes. It is a
hint: the nodes still answer what they hold.

Repair (`repair_route`, issue 54): a Route Session that lost nodes moves to
a route of the same files without them. Its live survivors are kept where
nodes that hold only the lost layers can fill the gaps: the registry's
spares among them first, then any such node, chosen among themselves by the
same rule; else any route of the same files that avoids the lost nodes (a
draining node is not routable, so it is avoided like a lost one). A survivor counts this session already, so it is never
refused for being full.

Left out: which nodes may hold what, and how far their word is believed
(dgr.tracker.affinity); time (turns are `routed_at`, stamped by admission).
"""

from __future__ import annotations

import random
from operator import attrgetter
from typing import Any, Callable

import attrs

from dgr.errors import CallerError, PeerError, Reason
from dgr.fsm.route import Hop
from dgr.tracker.entry import NodeEntry, Role

__all__ = ["choose_route", "missing_ranges", "prefer_holders", "repair_route", "RouteChoice"]


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


Ranks = dict[str, float]  # node id -> its draw for the last tie-break (`draw`)


def draw(nodes: list[NodeEntry], rng: random.Random) -> Ranks:
    """A random rank for each of `nodes`: the last tie-break, so that no name sorts first."""
    return {n.node_id: rng.random() for n in nodes}


def _shortest(nodes: list[NodeEntry], n_layers: int, ranks: Ranks | None = None) -> tuple[NodeEntry, ...] | None:
    """The fewest-hops cover of [0, n_layers), then the lowest session total, then the lowest `ranks` in route
    order (node ids where none are given: a test's fixed order)."""
    # best[b] = best path covering [0, b); layers ascend so one forward pass suffices, and the key
    # (hops, total, ranks) only grows along a path, so the best prefix makes the best path
    best: dict[int, tuple[tuple[int, int, tuple[Any, ...]], tuple[NodeEntry, ...]]] = {0: ((0, 0, ()), ())}
    for boundary in range(n_layers):
        if boundary not in best:
            continue
        (hops, total, order), path = best[boundary]
        for n in nodes:
            if n.start != boundary:
                continue
            rank = n.node_id if ranks is None else ranks[n.node_id]
            key = (hops + 1, total + n.reserved, order + (rank,))
            if n.stop not in best or key < best[n.stop][0]:
                best[n.stop] = (key, path + (n,))
    found = best.get(n_layers)
    return None if found is None else found[1]


def _lowest(nodes: list[NodeEntry], n_layers: int, key: Callable[[NodeEntry], Any],
            shared: list[NodeEntry] = ()) -> Any:
    """The lowest ceiling on `key` under which `shared` and the `nodes` under it still cover [0, n_layers), or
    None; a higher ceiling only admits more nodes, so a binary search: an open on a large swarm costs a few
    `_shortest`s, not one per distinct value."""
    ordered = sorted({key(n) for n in nodes})
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if _shortest([*shared, *(n for n in nodes if key(n) <= ordered[mid])], n_layers) is not None:
            hi = mid
        else:
            lo = mid + 1
    return ordered[lo] if lo < len(ordered) else None


_LOAD = attrgetter("load")  # rule 3's key: the sessions a node holds, as routing weighs them
_TURN = attrgetter("turns", "routed_at")  # rule 4's: the sessions routed to it, then when it was last


def _settle(nodes: list[NodeEntry], n_layers: int, key: Callable[[NodeEntry], Any]) -> list[NodeEntry]:
    """The nodes of the covers lowest on `key`, compared on what differs between them (`nodes` must cover).

    The lowest ceiling under which the nodes still cover; a node at the ceiling that every cover under it uses
    (a shared stage) is set aside, and the ceiling is sought again among the others, until the ceiling is set
    by a node some cover can do without.
    """
    shared: list[NodeEntry] = []
    pool = nodes
    while True:
        free = [n for n in pool if not any(n is m for m in shared)]
        if _shortest(shared, n_layers) is not None:  # the shared nodes are the one cover left
            return pool
        ceiling = _lowest(free, n_layers, key, shared)
        pool = [*shared, *(n for n in free if key(n) <= ceiling)]
        forced = [n for n in pool if key(n) == ceiling and not any(n is m for m in shared)
                  and _shortest([m for m in pool if m is not n], n_layers) is None]
        if not forced:
            return pool
        shared += forced


def _best_path(nodes: list[NodeEntry], n_layers: int, ranks: Ranks | None = None) -> tuple[NodeEntry, ...] | None:
    """The cover whose busiest node holds the fewest sessions; then the one whose nodes had the fewest turns, and
    whose most recently routed node was routed longest ago (both compared on what differs, `_settle`); then
    `_shortest`'s."""
    if _shortest(nodes, n_layers) is None:
        return None
    calm = _settle(nodes, n_layers, _LOAD)
    return _shortest(_settle(calm, n_layers, _TURN), n_layers, ranks)



def choose_route(candidates: list[NodeEntry], model: str, *, trusted: frozenset[bytes] = frozenset(),
                 rng: random.Random | None = None) -> RouteChoice:
    """Pick the route for a new Route Session; with `trusted` keys, only they may be its head and tail; `rng`
    breaks the last tie (a fresh unseeded one when not given).

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
    best_key: tuple[int, tuple[int, float], int, float] | None = None
    rng = rng or random.Random()
    ranks = draw(serving, rng)
    for (digest, manifest_id), everyone in sorted(by_digest.items()):
        n_layers = everyone[0].model.n_layers
        group = _trusted_ends(everyone, n_layers, trusted)
        untrusted |= len(group) < len(everyone) and _shortest(everyone, n_layers) is not None
        room = [n for n in group if not n.full()]
        # spares only where the members have no room (or no cover) left: they are kept idle for repairs
        path = (_best_path([n for n in room if n.role is not Role.SPARE], n_layers, ranks)
                or _best_path(room, n_layers, ranks))
        if path is None:
            capacity_blocked |= _shortest(group, n_layers) is not None
            continue
        # groups share no node: their busiest and latest compare whole; a manifest id's spelling breaks no tie
        key = (max(map(_LOAD, path)), max(map(_TURN, path)), len(path), ranks[path[0].node_id])
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
                   trusted: frozenset[bytes] = frozenset(), rng: random.Random | None = None) -> RouteChoice | None:
    """A route of the same files as `choice` made only of `holders` with a free slot, whose nodes that are not
    on `choice` hold no more sessions than those of `choice` that are not on it (it ties on the spread); None
    if none, or if `choice` is already one."""
    if all(n.node_id in holders for n in choice.nodes):
        return None
    first = choice.nodes[0]
    group = [n for n in candidates if n.alive and n.routable and n.node_id in holders and not n.full()
             and n.role is not Role.SPARE and _group_key(n) == _group_key(first)
             and n.model.name == first.model.name]
    path = _best_path(_trusted_ends(group, first.model.n_layers, trusted), first.model.n_layers,
                      draw(group, rng or random.Random()))
    if path is None:
        return None
    ours, theirs = set(map(id, path)), set(map(id, choice.nodes))
    if max((n.load for n in path if id(n) not in theirs), default=-1) > max(
            (n.load for n in choice.nodes if id(n) not in ours), default=-1):
        return None  # busier than the spread's choice where they differ: affinity never outweighs the spread
    return RouteChoice(tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path), path, choice.digest,
                       choice.manifest_id)


def repair_route(candidates: list[NodeEntry], route: tuple[NodeEntry, ...], lost: frozenset[str], *,
                 trusted: frozenset[bytes] = frozenset(), rng: random.Random | None = None) -> RouteChoice:
    """The route a Route Session on `route` moves to once it lost the nodes `lost`: its live survivors, and
    for the layers they do not hold nodes that hold no others (spares); else any route of the same files
    without `lost` (see the module's rule).

    Raises:
        PeerError(NO_ROUTE): no live node outside `lost` holds some of the lost layers.
        CallerError(NODE_AT_CAPACITY): live nodes hold them, but every one is full.
    """
    first = route[0]
    n_layers = first.model.n_layers
    same = [n for n in candidates if n.alive and n.routable and n.node_id not in lost
            and _group_key(n) == _group_key(first) and n.model.name == first.model.name]
    ours = {id(n) for n in route}
    survivors = [n for n in same if id(n) in ours]
    free = [n for n in same if id(n) not in ours and not n.full()]
    # a spare holds no layer a survivor holds: the cover keeps every survivor
    spares = [n for n in free if all(n.stop <= s.start or n.start >= s.stop for s in survivors)]
    kept = [n for n in spares if n.role is Role.SPARE]  # the registry's spares first: idle, kept for this
    for pool in ([*survivors, *kept], [*survivors, *spares], [*survivors, *free]):
        pool = _trusted_ends(pool, n_layers, trusted)
        path = _best_path(pool, n_layers, draw(pool, rng or random.Random()))
        if path is not None:
            return RouteChoice(tuple(Hop(n.node_id, n.url, n.start, n.stop) for n in path), path,
                               first.model.digest, first.manifest_id)
    gaps = missing_ranges([*survivors, *free], n_layers)
    if gaps and not missing_ranges(same, n_layers):  # live nodes hold them, all full: room comes as sessions end
        raise CallerError(Reason.NODE_AT_CAPACITY, f"every node that could replace {', '.join(sorted(lost))} "
                                                   f"is full (layers {', '.join(gaps)})")
    raise PeerError(Reason.NO_ROUTE, f"no live node replaces {', '.join(sorted(lost))}: "
                                     f"{'missing layers ' + ', '.join(gaps) if gaps else 'every other node is full'}",
                    missing=gaps)
