"""The search: which contiguous layers each node serves (fewest nodes that fit, then balanced headroom).

`plan(layout, nodes, params)` splits a model's layers [0, n) into contiguous
ranges, one per node, in the order the nodes are given, and prices every
node: its layer weights, the global tensors it must load, its Hot KV State
at the given context and session count (per layer kind, see
dgr.plan.layout), the llama.cpp compute and output buffers, and the
runtime. What is left of the node's memory is its headroom.

The rule, in order:
1. Fewest nodes. For k = 1, 2, ... the planner tries the k largest nodes
   (ties: the order given), kept in the order given, and takes the first k
   for which a contiguous split fits. A greedy pass (each node takes as many
   layers as fit) decides it exactly, because giving a node more layers
   never makes a later node's job harder; where a model lets shards start
   only at some layers (ModelLayout.shard_starts, GLM-5.2's full-indexer
   layers), that pass is only a quick necessary test and the dynamic
   program below decides.
2. Balance. Among the splits over those k nodes, it takes one that
   maximises the smallest headroom (a dynamic program over (node, layer);
   ties go to the earliest boundary). Balance is in bytes, not layers: a
   non-tail shard also pays llama.cpp's logits buffer.
3. If even every node cannot hold the model, it refuses with a CallerError

A node with a GPU (Node.gpu_bytes) places each candidate range as
dgr.plan.gpu.fit does (the most slots its GPU holds); the range fits when
what is left fits the node's memory, and its headroom is what is left of
both. Whether it fits is then no longer monotone in the range's end (a range
wholly on the GPU sheds the host's compute buffer), so the dynamic program
decides it.

Also here: `plan_even(layout, n)` balances a prompt's and an answer's work over n
nodes, for `dgr up` (`even_split` says what it weighed). The prices are dgr.plan.cost's.

Left out: pricing (dgr.plan.cost), the table (dgr.plan.render) and the
command (dgr.plan.cli).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.plan.cost import SeamHop, ShardCost, shard_compute_bytes, shard_global_bytes, seam_hops, shard_cost
from dgr.plan.gpu import tables as gpu_tables
from dgr.plan.layout import ModelLayout
from dgr.plan.params import PlanParams
from dgr.plan.sizes import Node, format_size

__all__ = [
    "Plan",
    "fitting_ranges",
    "plan",
    "plan_even",
    "even_split",
    "EvenSplit",
]


@attrs.frozen
class Plan:
    """A split of a model over nodes, with what each node is charged."""

    model: str
    architecture: str
    source: str
    recipe: str | None
    n_layers: int
    seam_width: int
    params: PlanParams
    shards: tuple[ShardCost, ...]
    unused: tuple[Node, ...]
    hops: tuple[SeamHop, ...]

    def ranges(self) -> list[LayerRange]:
        return [s.layers for s in self.shards]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "source": self.source,
            "recipe": self.recipe,
            "n_layers": self.n_layers,
            "seam_width": self.seam_width,
            "params": self.params.to_json(),
            "shards": [s.to_json() for s in self.shards],
            "unused": [{"node": n.name, "memory_bytes": n.memory_bytes, "gpu_memory_bytes": n.gpu_bytes}
                       for n in self.unused],
            "hops": [h.to_json() for h in self.hops],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            model=d["model"],
            architecture=d["architecture"],
            source=d["source"],
            recipe=d["recipe"],
            n_layers=int(d["n_layers"]),
            seam_width=int(d["seam_width"]),
            params=PlanParams(**d["params"]),
            shards=tuple(ShardCost.from_json(s) for s in d["shards"]),
            unused=tuple(Node(n["node"], int(n["memory_bytes"]), int(n.get("gpu_memory_bytes", 0)))
                         for n in d["unused"]),
            hops=tuple(SeamHop(**h) for h in d["hops"]),
        )


# -- the search ----------------------------------------------------------------------


@attrs.frozen
class _Prefix:
    """Prefix sums over layers, so a range [a, b) is priced in O(1)."""

    weights: list[int]
    kv: list[int]

    @classmethod
    def of(cls, layout: ModelLayout, params: PlanParams) -> _Prefix:
        w, kv = [0], [0]
        for layer in layout.layers:
            w.append(w[-1] + layer.weight_bytes)
            kv.append(
                kv[-1]
                + layer.kv_bytes(params.context, params.sessions, params.kv_dtype, params.ubatch, params.swa_full)
            )
        return cls(w, kv)


class _Pricer:
    """Headroom of node j holding [a, b) when it is the head and/or tail of a k-node route."""

    def __init__(self, layout: ModelLayout, params: PlanParams) -> None:
        self.layout, self.params = layout, params
        self.gpu: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # GPU size -> (host need, GPU free)[a, b]
        self.n = layout.n_layers
        self.whole_only = layout.whole_only
        self.pre = _Prefix.of(layout, params)
        self.starts = layout.shard_starts
        self.fixed = {
            (h, t): shard_global_bytes(layout, params, is_head=h, is_tail=t)[0]
            + shard_compute_bytes(layout, params, is_tail=t)
            + params.runtime_bytes
            for h in (False, True)
            for t in (False, True)
        }
        # need and valid for every range at once, [a, b] (a < b), for the split search
        sums = np.asarray(self.pre.weights, dtype=np.int64) + np.asarray(self.pre.kv, dtype=np.int64)
        self.need_table = _range_costs(sums, self.fixed)
        self.valid_table = _valid_table(self)

    def need(self, a: int, b: int) -> int:
        p = self.pre
        return p.weights[b] - p.weights[a] + p.kv[b] - p.kv[a] + self.fixed[(a == 0, b == self.n)]

    def headroom(self, node: Node, a: int, b: int) -> int:
        return int(self.headroom_table(node)[a, b]) if node.gpu_bytes else node.memory_bytes - self.need(a, b)

    def headroom_table(self, node: Node) -> np.ndarray:
        """int64[a, b]: the node's headroom holding [a, b); on a GPU node, host and GPU memory left where the
        host holds what the GPU does not, else (negative) what the host lacks."""
        if not node.gpu_bytes:
            return node.memory_bytes - self.need_table
        if node.gpu_bytes not in self.gpu:
            self.gpu[node.gpu_bytes] = gpu_tables(self.layout, self.params, node.gpu_bytes)
        host, free = self.gpu[node.gpu_bytes]
        left = node.memory_bytes - self.params.runtime_bytes - host
        return np.where(left >= 0, left + free, left)

    def valid(self, a: int, b: int) -> bool:
        """Whether [a, b) may be a shard: it starts where a shard may (ModelLayout.shard_starts),
        and is the whole model where it runs only whole (ModelLayout.whole_only)."""
        if self.whole_only and (a, b) != (0, self.n):
            return False
        return self.starts is None or a == 0 or a in self.starts

    def score_table(self, node: Node) -> np.ndarray:
        """score(node, a, b) for every range at once: float64[a, b], -inf where [a, b) may not be a shard."""
        return np.where(self.valid_table, self.headroom_table(node), -math.inf)

    @property
    def constrained(self) -> bool:
        return self.starts is not None or bool(self.whole_only)

    def score(self, node: Node, a: int, b: int) -> float:
        return self.headroom(node, a, b) if self.valid(a, b) else -math.inf

    def best_split(self, nodes: Sequence[Node]) -> tuple[float, list[int]]:
        """The split of every layer over `nodes` with the largest smallest headroom."""
        return _max_min_split(self.n, len(nodes), lambda j, a, b: self.score(nodes[j], a, b),
                              lambda j: self.score_table(nodes[j]))

    def fits(self, nodes: Sequence[Node]) -> bool:
        """Whether `nodes`, in order, can hold the model (greedy, then the DP when kinds are required)."""
        gpu = any(x.gpu_bytes for x in nodes)
        if not gpu and not _fits_greedy(self, nodes):
            return False
        return not (self.constrained or gpu) or self.best_split(nodes)[0] >= 0


def _fits_greedy(pricer: _Pricer, nodes: Sequence[Node]) -> bool:
    """Whether `nodes`, in order, can hold every layer as contiguous non-empty ranges."""
    n, k, a = pricer.n, len(nodes), 0
    if k > n:
        return False
    for j, node in enumerate(nodes):
        left = k - j - 1  # later nodes each need at least one layer
        if left == 0:
            return pricer.headroom(node, a, n) >= 0
        b = a
        while b + 1 <= n - left and pricer.headroom(node, a, b + 1) >= 0:
            b += 1
        if b == a:
            return False
        a = b
    return False


def _range_costs(prefix: Sequence[int], ends: dict[tuple[bool, bool], int]) -> np.ndarray:
    """int64[a, b]: prefix[b] - prefix[a] + ends[(a == 0, b == n)], the cost of each range [a, b)."""
    p = np.asarray(prefix, dtype=np.int64)
    n = len(p) - 1
    table = p[None, :] - p[:, None] + ends[(False, False)]
    table[0, :] += ends[(True, False)] - ends[(False, False)]
    table[:, n] += ends[(False, True)] - ends[(False, False)]
    table[0, n] += ends[(True, True)] - ends[(True, False)] - ends[(False, True)] + ends[(False, False)]
    return table


def _valid_table(pricer: _Pricer) -> np.ndarray:
    """bool[a, b]: pricer.valid(a, b), False where a >= b."""
    n = pricer.n
    a = np.arange(n + 1)
    ok = a[:, None] < a[None, :]
    if pricer.whole_only:
        ok &= (a[:, None] == 0) & (a[None, :] == n)
    if pricer.starts is not None:
        ok &= np.array([i == 0 or i in pricer.starts for i in a])[:, None]
    return ok


def _max_min_split(n: int, k: int, score: Callable[[int, int, int], float],
                   table: Callable[[int], np.ndarray]) -> tuple[float, list[int]]:
    """Boundaries 0 = c0 < c1 < ... < ck = n maximising min_j score(j, c_j, c_j+1); ties: the earliest cuts.

    `table(j)` is score(j, a, b) for every range as float64[a, b] (exact below 2**53; -inf for no shard,
    and where a >= b). The dynamic programme takes each node's step over every range in a few numpy
    calls: GLM-5.2's 78 layers planned on up to 78 nodes were 1.1e7 calls of `score`, 15 s for its audit.
    `score` gives the values it keeps exactly.
    """
    neg = -math.inf
    best = [[neg] * (n + 1) for _ in range(k)]
    arg = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n - k + 2):
        best[0][b] = score(0, 0, b)
    for j in range(1, k):
        # [a, b]: the first j nodes end at a, node j holds [a, b); best[j - 1][a] is -inf for a < j
        steps = np.minimum(np.asarray(best[j - 1], dtype=np.float64)[:, None], table(j))
        pick = np.argmax(steps, axis=0)  # the first a of the largest value, as a scan keeping strict gains would
        for b in range(j + 1, n - (k - j - 1) + 1):
            a = int(pick[b])
            if steps[a, b] > neg:
                best[j][b], arg[j][b] = min(best[j - 1][a], score(j, a, b)), a
    cuts = [n]
    for j in range(k - 1, 0, -1):
        cuts.append(arg[j][cuts[-1]])
    cuts.append(0)
    return best[k - 1][n], cuts[::-1]


def _largest(nodes: Sequence[Node], k: int) -> list[Node]:
    """The k largest nodes (ties: the order given), kept in the order given."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].memory_bytes - nodes[i].gpu_bytes, i))[:k]
    return [nodes[i] for i in sorted(order)]


def _check_params(layout: ModelLayout, params: PlanParams) -> None:
    if layout.context_length and params.context > layout.context_length:
        raise CallerError(
            Reason.CONTEXT_LENGTH_EXCEEDED,
            f"context {params.context} exceeds {layout.name}'s trained context of {layout.context_length}",
        )


def _refusal(layout: ModelLayout, params: PlanParams, pricer: _Pricer, nodes: Sequence[Node]) -> CallerError:
    """The clearest true statement of why `nodes` cannot hold the model."""
    for k in range(min(len(nodes), layout.n_layers), 0, -1):
        use = _largest(nodes, k)
        head_room, cuts = pricer.best_split(use)
        if head_room > -math.inf:
            break
    else:
        return CallerError(
            Reason.INVALID_REQUEST,
            f"{layout.name} cannot be split: {layout.split_rule()}",
        )
    costs = [shard_cost(layout, params, use[j], LayerRange(cuts[j], cuts[j + 1])) for j in range(k)]
    need = sum(c.total_bytes for c in costs)
    have = sum(n.memory_bytes + n.gpu_bytes for n in use)
    what = (
        f"{layout.name} ({layout.recipe or layout.architecture}) at context {params.context} x "
        f"{params.sessions} session(s), KV {params.kv_dtype}"
    )
    if need > have:
        msg = (
            f"{what} does not fit: on {k} node(s) it needs {format_size(need)} "
            f"(weights {format_size(sum(c.weight_bytes + c.global_bytes for c in costs))}, "
            f"KV {format_size(sum(c.kv_bytes for c in costs))}, "
            f"buffers and runtime {format_size(sum(c.compute_bytes + c.runtime_bytes for c in costs))}) "
            f"and the nodes have {format_size(have)}: {format_size(need - have)} missing"
        )
    else:
        # a GPU node's host memory is what falls short: its GPU holds what fits it
        worst = min(costs, key=lambda c: c.node.memory_bytes - c.host_bytes)
        msg = (
            f"{what} does not fit: the {k} node(s) have enough memory in total but no contiguous split "
            f"fits; the best split leaves {worst.node.name} (layers {worst.layers}) "
            f"{format_size(worst.host_bytes - worst.node.memory_bytes)} short"
        )
    sizes = {(n.memory_bytes, n.gpu_bytes) for n in nodes}
    if len(sizes) == 1:
        size, gpu = sizes.pop()
        fit = next(
            (m for m in range(len(nodes) + 1, layout.n_layers + 1)
             if pricer.fits([Node("n", size, gpu)] * m)),
            None,
        )  # fmt: skip
        what = format_size(size) + (f" with a {format_size(gpu)} GPU" if gpu else "")
        msg += (
            f"; {fit} nodes of {what} would hold it"
            if fit
            else f"; no number of {what} nodes holds it (one layer per node is too much)"
        )
    return CallerError(Reason.INVALID_REQUEST, msg, missing_bytes=max(need - have, -min(head_room, 0)))


def plan(layout: ModelLayout, nodes: Sequence[Node], params: PlanParams | None = None) -> Plan:
    """Split `layout` over `nodes` (fewest that fit, then balanced headroom).

    Raises:
        CallerError(INVALID_REQUEST): the model does not fit; the message says how much is missing.
        CallerError(CONTEXT_LENGTH_EXCEEDED): the context exceeds the model's.
    """
    params = params or PlanParams()
    if not nodes:
        raise CallerError(Reason.INVALID_REQUEST, "no nodes to plan for")
    _check_params(layout, params)
    pricer = _Pricer(layout, params)
    n = layout.n_layers
    counts = range(1, min(len(nodes), n) + 1) if params.fewest else [min(len(nodes), n)]
    use: list[Node] | None = None
    for k in counts:
        candidate = _largest(nodes, k)
        if pricer.fits(candidate):
            use = candidate
            break
    if use is None:
        raise _refusal(layout, params, pricer, nodes)
    k = len(use)
    _, cuts = pricer.best_split(use)
    ranges = [LayerRange(cuts[j], cuts[j + 1]) for j in range(k)]
    used = {id(x) for x in use}
    return Plan(
        model=layout.name,
        architecture=layout.architecture,
        source=layout.source,
        recipe=layout.recipe,
        n_layers=n,
        seam_width=params.seam_width or layout.seam_width,
        params=params,
        shards=tuple(shard_cost(layout, params, use[j], ranges[j]) for j in range(k)),
        unused=tuple(x for x in nodes if id(x) not in used),
        hops=seam_hops(layout, params, ranges),
    )


def fitting_ranges(layout: ModelLayout, params: PlanParams, node: Node) -> list[tuple[LayerRange, int]]:
    """Every contiguous range `node` may serve alone, with its headroom: valid under the model's split
    rules and within the node's memory. For a node joining a running route (dgr.tracker.assign)."""
    pricer = _Pricer(layout, params)
    n = layout.n_layers
    return [(LayerRange(a, b), pricer.headroom(node, a, b)) for a in range(n) for b in range(a + 1, n + 1)
            if pricer.valid(a, b) and pricer.headroom(node, a, b) >= 0]


# A layer costs more than the bytes it reads: dozens of small kernels, each ending in a thread
# barrier. Measured on SmolLM2-135M Q4_1 with 1 thread: a 2.2 MB layer takes about 0.45 ms and the
# tail's 30 MB tied LM head about 2 ms. Counting a layer as its bytes plus 2 MiB prices that head at
# 7 layers, and puts the best two-node cut for decode alone at 18:12, where shards measured 7.1 and
# 7.6 ms a token (15:15, the weight-balanced cut: 6.1 and 8.6 ms).
LAYER_OVERHEAD_BYTES = 2 * 2**20
# The work `dgr up` balances its cut for: a prompt of PROMPT_POSITIONS positions and an answer of
# ANSWER_TOKENS tokens, a chat turn with a long system prompt (issue 43's has 2,260 tokens).
PROMPT_POSITIONS = 2048
ANSWER_TOKENS = 256


@attrs.frozen
class EvenSplit:
    """`plan_even`'s cut and what it weighed: a shard's pace in bytes read, a decoded token's and a prompt
    position's, for the stage that sets each pace (the slowest)."""

    ranges: list[LayerRange]
    decode_bytes: int  # the slowest shard's bytes a decoded token (its layers', LM head and overheads included)
    prefill_bytes: int  # the slowest shard's bytes a prompt position (its layers' weights alone)
    prompt_positions: int
    answer_tokens: int

    def describe(self) -> str:
        return (f"balanced for a prompt of {self.prompt_positions} positions and an answer of {self.answer_tokens} "
                f"tokens: the slowest shard holds {format_size(self.prefill_bytes)} of weights a prompt position "
                f"passes, and reads {format_size(self.decode_bytes)} a decoded token")


def plan_even(layout: ModelLayout, n_nodes: int, prompt_positions: int = PROMPT_POSITIONS,
              answer_tokens: int = ANSWER_TOKENS) -> list[LayerRange]:
    """`even_split(...).ranges`: the cut `dgr up` gives its nodes."""
    return even_split(layout, n_nodes, prompt_positions, answer_tokens).ranges


def even_split(layout: ModelLayout, n_nodes: int, prompt_positions: int = PROMPT_POSITIONS,
               answer_tokens: int = ANSWER_TOKENS) -> EvenSplit:
    """Contiguous ranges over `n_nodes` nodes that minimise the time of a prompt of `prompt_positions` and an
    answer of `answer_tokens` on a full pipeline: positions times the slowest shard's prefill pace, plus tokens
    times the slowest shard's decode pace.

    For `dgr up` on one machine: memory is not the limit there, the slowest shard is (concurrent sessions and
    a long prompt's chunks both run at its pace). A shard's decode step is priced as the bytes it reads per
    token (its layers' active weights, and on the tail the output norm and LM head) plus LAYER_OVERHEAD_BYTES
    per layer; a prompt position as its layers' active weights alone: a chunk's positions share each kernel,
    and the LM head runs once a chunk. The two paces disagree on the tail, which decode charges for the head:
    on SmolLM2, 2 nodes, decode alone balances at 18:12, prefill at 15:15, where a 2,316-token cold turn
    measured 7.45 to 7.53 s at 18:12 and 6.38 to 6.47 s at 15:15 (128-position chunks, 1 thread a node) and 8
    decoding sessions about 6% slower. A single session's decode does not care: its token passes every shard.

    Raises:
        CallerError(INVALID_REQUEST): fewer than 1 node, more nodes than layers, or
            more than the model's split rules allow (ModelLayout.shard_starts, whole_only).
    """
    if not 1 <= n_nodes <= layout.n_layers:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot split {layout.n_layers} layers over {n_nodes} nodes")
    params = PlanParams()
    pricer = _Pricer(layout, params)
    n = layout.n_layers
    read, weights = [0], [0]
    for layer in layout.layers:
        read.append(read[-1] + layer.active_bytes + LAYER_OVERHEAD_BYTES)
        weights.append(weights[-1] + layer.active_bytes)
    ends = {(h, t): shard_global_bytes(layout, params, is_head=h, is_tail=t)[1]
            for h in (False, True) for t in (False, True)}
    decode = _range_costs(read, ends)
    prefill = _range_costs(weights, {k: 0 for k in ends})
    valid = pricer.valid_table

    def balanced(cost: np.ndarray, ok: np.ndarray) -> tuple[float, list[int]]:
        """The cut whose costliest shard by `cost` is the cheapest, of shards `ok` allows: (-that cost, cuts)."""
        table = np.where(ok, -cost, -math.inf).astype(np.float64)
        return _max_min_split(n, n_nodes, lambda j, a, b: float(table[a, b]), lambda j: table)

    best, cuts = balanced(decode, valid)
    if best == -math.inf:
        raise CallerError(
            Reason.INVALID_REQUEST,
            f"cannot split {layout.name} over {n_nodes} nodes: {layout.split_rule()}",
        )

    def paces(c: list[int]) -> tuple[int, int]:
        return (max(int(decode[a, b]) for a, b in zip(c, c[1:])), max(int(prefill[a, b]) for a, b in zip(c, c[1:])))

    def turn(c: list[int]) -> int:  # a prompt's and an answer's time, in bytes read
        d, p = paces(c)
        return answer_tokens * d + prompt_positions * p

    # Bounding the shards' prefill trades decode for it: every bound from the decode-balanced cut's prefill
    # down to the prefill-balanced cut's is tried (the ranges' own prefill costs between the two), each with
    # the decode-balanced cut under it.
    least, top = -balanced(prefill, valid)[0], paces(cuts)[1]
    for bound in np.unique(prefill[valid & (prefill >= least) & (prefill < top)]):
        value, c = balanced(decode, valid & (prefill <= bound))
        if value > -math.inf and turn(c) < turn(cuts):
            cuts = c
    d, p = paces(cuts)
    return EvenSplit([LayerRange(cuts[j], cuts[j + 1]) for j in range(n_nodes)], d, p, prompt_positions,
                     answer_tokens)
