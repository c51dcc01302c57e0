"""Prefix affinity: where a prompt's prefix is likely kept, and how far a node's word for it is believed.

Two sources, each a hint that the nodes' own answers settle (they reuse only what they hold):
- what this tracker saw: the route a session closed on, keeping its KV (`kept`). Every block key of its
  chain, or its first position's mark where it has no whole block, goes to `seen`: whether a route's head
  may hold a prefix of a prompt, so whether naming the prefix is worth a round trip (`may_hold`). Its end
  (its last block key, and the marks of its positions after it) goes to `ends`: a prompt that runs through
  that end to the token continues the conversation.
- what nodes name in their registrations and heartbeats (`NodeEntry.prefixes`, the last block key of each
  prefix they kept): what survives this tracker's restart. These are claims.

Rules:
- A session is routed by affinity (`candidates`) only as a conversation's next turn: its prompt runs
  through an end this tracker recorded, or through a key a node names. Sharing part of a kept prefix (a
  system prompt that many conversations begin with) routes nothing: those sessions take turns
  (dgr.tracker.routing), and the routes come to keep the shared part in turn.
- Every hint routes one session (`take`): the ends the chosen route continues, and the keys its nodes
  named in the prompt's chain, are spent once they have chosen a route; the session's own end is what the
  next turn follows. So an end planted by a caller, or a key a node learned or guessed and names, draws one
  session at most, not every session that shares it.
- A claim is believed only once shown: a session routed for a node's named key names its prefix to that
  node, whose answer says how many positions it holds (`check`). Fewer than its key names (it claimed a
  prefix it did not hold) is a miss: the node's named keys are dropped, its claims are ignored and it is
  kept out of every affinity route for `BAR_S` (doubling with each miss, up to `BAR_MAX_S`), it forgoes a
  turn (`NodeEntry.turns`, dgr.tracker.routing), and the sessions it is trusted with at once are halved
  (`NodeEntry.faulted`). A claim shown held becomes the end
  that session closes with: the tracker's own record from then on.
- Affinity never outweighs the spread (dgr.tracker.routing `prefer_holders`), and a session it routes
  counts as a turn of its route's nodes like any other: the routes that lost it get the next ones.
- Bounded: `RECORD_KEYS` keys in each of `ends` and `seen` (oldest out), `SPENT_KEYS` spent keys a node;
  the spent keys and the bars of nodes the registry forgot go once they outnumber the known nodes twice.

Left out: choosing and opening the route (dgr.tracker.routing, dgr.tracker.admission), the keys and marks
themselves (dgr.seam.keys), time (callers pass trio's clock), I/O.
"""

from __future__ import annotations

import collections
import logging

import attrs

from dgr.seam.keys import BLOCK_TOKENS, MARK_BYTES, decode_marks
from dgr.seam.opening import AdoptRequest
from dgr.tracker.registry import NodeEntry, Registry

__all__ = ["Affinity", "BAR_S", "BAR_MAX_S", "RECORD_KEYS", "SPENT_KEYS"]

log = logging.getLogger("dgr.affinity")

RECORD_KEYS = 65536  # keys each record remembers (32 hex digits and a node set each)
SPENT_KEYS = 4096  # a node's named keys remembered as spent: more than it may name at once (MAX_ADVERTISED)
BAR_S = 60.0  # a claimer's first miss ignores its claims this long; each further miss doubles it
BAR_MAX_S = 3600.0


@attrs.frozen
class _End:
    nodes: frozenset[str]  # the route the session closed on
    at: int  # positions before its tail: its whole blocks'
    tail: bytes  # the marks of its positions after its last whole block


@attrs.define
class Affinity:
    """What this tracker knows and believes of where prompts' prefixes are kept."""

    registry: Registry
    ends: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # end key -> _End
    seen: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # key -> node ids that kept it
    spent: dict[str, collections.OrderedDict] = attrs.field(factory=dict)  # node id -> its named keys spent
    bars: dict[str, tuple[float, int]] = attrs.field(factory=dict)  # node id -> (its claims ignored until, misses)

    # -- what this tracker saw ----------------------------------------------------------------------------
    def kept(self, nodes: frozenset[str], chain: list[str], marks: str) -> None:
        """A session on `nodes` closed keeping the KV named by `chain` and the encoded `marks` of its positions
        after it (dgr.tracker.live `kv_keep`)."""
        tail = decode_marks(marks, len(marks)) or b""
        end = chain[-1] if chain else _mark_key(tail)
        if end is None:
            return
        _remember(self.ends, end, _End(nodes, len(chain) * BLOCK_TOKENS, tail))
        for key in chain or [end]:
            _remember(self.seen, key, nodes)

    def may_hold(self, node: NodeEntry, offer: AdoptRequest, now: float) -> bool:
        """True where `node` (a route's head) may hold a prefix of the prompt `offer` names: worth a trip to
        name it. A hint: its answer says what it holds."""
        first = _mark_key(offer.marks)
        if any(node.node_id in self.seen.get(k, ()) for k in (*offer.prefix, first) if k is not None):
            return True
        return not self.barred(node.node_id, now) and not node.prefixes.isdisjoint(offer.prefix)

    # -- routing by it --------------------------------------------------------------------------------------
    def candidates(self, offer: AdoptRequest, now: float) -> list[tuple[int, frozenset[str]]]:
        """(index in the chain, the nodes a route for it may be made of), the longest first, where the prompt
        continues a recorded end or runs through a key a live node names; index -1: an end before any whole
        block. Barred nodes are left out."""
        keys = list(offer.prefix)
        at = {k: i for i, k in enumerate(keys)}
        found: dict[int, set[str]] = {}
        for i, key in enumerate(keys):
            end = self.ends.get(key)
            if end is not None and _continues(end, offer):
                found.setdefault(i, set()).update(end.nodes)
        first = _mark_key(offer.marks)
        end = self.ends.get(first) if first is not None else None
        if end is not None and end.at == 0 and _continues(end, offer):
            found.setdefault(-1, set()).update(end.nodes)
        named = {}
        for n in self.registry.alive():
            best = max((at[k] for k in self._usable(n, now) if k in at), default=None)
            if best is not None:
                named[n.node_id] = best
        out = []
        for i in sorted({*found, *named.values()}, reverse=True):
            nodes = found.get(i, set()) | {n for n, j in named.items() if j >= i}
            nodes = {n for n in nodes if not self.barred(n, now)}
            if nodes:
                out.append((i, frozenset(nodes)))
        return out

    def take(self, offer: AdoptRequest, nodes: tuple[NodeEntry, ...], now: float) -> dict[str, int]:
        """The route `nodes` was chosen for the prompt `offer` names: spend the ends it continues and the keys
        its nodes named in its chain; the positions each node whose named key chose it must show it holds."""
        keys = list(offer.prefix)
        at = {k: i for i, k in enumerate(keys)}
        first = _mark_key(offer.marks)
        for key in [*keys, *([first] if first is not None else [])]:
            end = self.ends.get(key)
            if end is not None and _continues(end, offer):
                del self.ends[key]
        expect: dict[str, int] = {}
        for n in nodes:
            named = [k for k in self._usable(n, now) if k in at]
            if not named:
                continue
            expect[n.node_id] = (max(at[k] for k in named) + 1) * BLOCK_TOKENS
            spent = self.spent.setdefault(n.node_id, collections.OrderedDict())
            for k in named:
                _remember(spent, k, None, SPENT_KEYS)
        self._prune(now)
        return expect

    # -- believing claims -------------------------------------------------------------------------------------
    def check(self, expect: dict[str, int], held: dict[str, int], now: float) -> list[str]:
        """Compare what each claimer that chose the route (`take`'s answer) holds with what it claimed; return
        the node ids that held less (each now barred and demoted)."""
        missed = []
        for node_id, positions in expect.items():
            if node_id not in held or held[node_id] >= positions:
                continue  # not named the prefix (the route did not get that far), or it held what it said
            missed.append(node_id)
            until, misses = self.bars.get(node_id, (0.0, 0))
            bar = min(BAR_S * 2 ** misses, BAR_MAX_S)
            self.bars[node_id] = (now + bar, misses + 1)
            entry = self.registry.nodes.get(node_id)
            if entry is not None:
                entry.prefixes = frozenset()
                entry.faulted()
                entry.turns += 1  # the session its claim drew counted as its turn; it forgoes one more
            log.warning("node %s named a prefix of %d positions it did not hold (it held %d): its claims are "
                        "ignored for %gs", node_id, positions, held[node_id], bar)
        return missed

    def barred(self, node_id: str, now: float) -> bool:
        bar = self.bars.get(node_id)
        return bar is not None and now < bar[0]

    def _usable(self, n: NodeEntry, now: float) -> frozenset[str]:
        """The keys `n` names that may still route a session: none while it is barred; none it has spent."""
        if not n.prefixes or self.barred(n.node_id, now):
            return frozenset()
        spent = self.spent.get(n.node_id)
        return n.prefixes if not spent else frozenset(k for k in n.prefixes if k not in spent)

    def _prune(self, now: float) -> None:
        """Forget the spent keys of nodes the registry forgot, and their bars once over (a bar outlives its entry:
        registering again clears none of it)."""
        known = self.registry.nodes
        if len(self.spent) > 2 * len(known) + 64:
            self.spent = {k: v for k, v in self.spent.items() if k in known}
        if len(self.bars) > 2 * len(known) + 64:
            self.bars = {k: v for k, v in self.bars.items() if k in known or now < v[0]}


def _mark_key(marks: bytes) -> str | None:
    """The record key of a sequence with no whole block: its first position's mark (12 hex digits, never a
    block key's 32)."""
    return marks[:MARK_BYTES].hex() if len(marks) >= MARK_BYTES else None


def _continues(end: _End, offer: AdoptRequest) -> bool:
    """True where the prompt runs through every position of `end` (its whole blocks matched by key): its
    marks after them agree to the end's last position."""
    a, b = end.at * MARK_BYTES, end.at * MARK_BYTES + len(end.tail)
    return len(offer.marks) >= b and offer.marks[a:b] == end.tail


def _remember(record: collections.OrderedDict, key: str, value, bound: int = RECORD_KEYS) -> None:
    record[key] = value
    record.move_to_end(key)
    while len(record) > bound:
        record.popitem(last=False)
