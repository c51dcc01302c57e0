"""The shard planner: which contiguous layers each node serves, and whether the model fits.

`plan(layout, nodes, params)` splits a model's layers [0, n) into contiguous
ranges, one per node, in the order the nodes are given, and prices every
node: its layer weights, the global tensors it must load, its Hot KV State
at the given context and session count (per layer kind, see
dgr.plan_layout), the llama.cpp compute and output buffers, and the
runtime. What is left of the node's memory is its headroom.

The rule, in order:
1. Fewest nodes. For k = 1, 2, ... the planner tries the k largest nodes
   (ties: the order given), kept in the order given, and takes the first k
   for which a contiguous split fits. A greedy pass (each node takes as many
   layers as fit) decides it exactly, because giving a node more layers
   never makes a later node's job harder; where a model requires layer
   kinds in every shard (ModelLayout.shard_needs, DeepSeek-V4) or lets
   shards start only at some layers (ModelLayout.shard_starts, GLM-5.2's
   full-indexer layers), that pass is only a quick necessary test and the
   dynamic program below decides.
2. Balance. Among the splits over those k nodes, it takes one that
   maximises the smallest headroom (a dynamic program over (node, layer);
   ties go to the earliest boundary). Balance is in bytes, not layers: a
   non-tail shard also pays llama.cpp's logits buffer.
3. If even every node cannot hold the model, it refuses with a CallerError
   that says how much memory is missing and, for identical nodes, how many
   would do.

Globals: with `GlobalNeed.LOADER` (the default, what dgr's llama_shard
backend does today) every shard loads every global tensor, because
llama.cpp's loader requires token_embd, output_norm and output in each
shard file (dgr.backends.shardfile). `GlobalNeed.COMPUTE` charges each
global only where it is computed with (the upstream layer-range API's case).

The seam: `seam_hops` prices the frames that cross each boundary, with the
model's seam width (DeepSeek-V4: 4 x hidden_size, its hyper-connection
streams) and the token ids that hash-routed layers need. `decode_latency`
turns a plan into a per-token latency from stated assumptions.

Also here: `plan_even(layout, n)` balances weight bytes over n nodes, for
`dgr up`, and `register(subparsers)`, the `dgr plan` command.

Left out: measuring nodes. A plan predicts; bench/plan_overhead.py checks
the prediction against the RSS of real llama.cpp shards.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from dgr.artifact.constants import GlobalNeed, Role
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, DgrError, Reason
from dgr.plan_layout import DEFAULT_UBATCH, KV_DTYPES, ModelLayout, load_layout
from dgr.seam.wire import DTYPE_SIZE, HEADER_SIZE, MAX_FRAME_BYTES, TOKEN_RESULT, DType

__all__ = [
    "LLAMA_CPU_RUNTIME_BYTES",
    "LatencyEstimate",
    "Node",
    "Plan",
    "PlanParams",
    "SeamHop",
    "ShardCost",
    "decode_latency",
    "fitting_ranges",
    "format_size",
    "parse_nodes",
    "parse_size",
    "plan",
    "plan_even",
    "register",
    "render_plan",
    "seam_hops",
    "shard_cost",
]

# RSS of a dgr node process before it loads a model: Python, numpy, trio, quart,
# hypercorn, httpx and llama.cpp's libraries. Measured by bench/plan_overhead.py
# (73 to 74 MiB with llama-cpp-python 0.3.36 on this machine), rounded up.
LLAMA_CPU_RUNTIME_BYTES = 80 * 2**20

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from '24GiB', '24G' (binary), '24GB' (decimal), '512MiB' or a plain number.

    Raises:
        CallerError(INVALID_REQUEST)
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise CallerError(Reason.INVALID_REQUEST, f"not a size: {text!r} (try 24GiB, 64GB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Bytes for people: GiB with two decimals from 1 GiB up, else MiB or KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


@attrs.frozen
class Node:
    """A machine that can serve one shard: a name and the memory dgr may use on it."""

    name: str
    memory_bytes: int


def parse_nodes(count: int | None, memory: str | None, specs: Sequence[str]) -> list[Node]:
    """Nodes from `--nodes N --memory SIZE` or from `--node name=SIZE` (repeated).

    Raises:
        CallerError(INVALID_REQUEST)
    """
    if specs and (count is not None or memory is not None):
        raise CallerError(Reason.INVALID_REQUEST, "give either --node name=SIZE ... or --nodes N --memory SIZE")
    if specs:
        nodes = []
        for spec in specs:
            name, sep, size = spec.partition("=")
            if not sep or not name:
                raise CallerError(Reason.INVALID_REQUEST, f"--node wants name=SIZE, got {spec!r}")
            nodes.append(Node(name, parse_size(size)))
        if len({n.name for n in nodes}) != len(nodes):
            raise CallerError(Reason.INVALID_REQUEST, "node names must be distinct")
        return nodes
    if count is None or memory is None:
        raise CallerError(Reason.INVALID_REQUEST, "give --nodes N --memory SIZE, or --node name=SIZE for each node")
    if count < 1:
        raise CallerError(Reason.INVALID_REQUEST, f"--nodes must be at least 1, got {count}")
    size = parse_size(memory)
    return [Node(f"node{i + 1}", size) for i in range(count)]


@attrs.frozen
class PlanParams:
    """What the plan is for: context and sessions per node, KV dtype, and what a node costs to run."""

    context: int = 4096  # positions per session
    sessions: int = 1  # concurrent Route Sessions each node keeps KV for
    kv_dtype: str = "f16"
    ubatch: int = DEFAULT_UBATCH
    # llama.cpp's default keeps sliding-window caches at full context; DeepSeek-V4 needs it off
    # (llama_context_params.swa_full = false), or every layer's 128-token window costs a full cache.
    swa_full: bool = False
    globals_need: GlobalNeed = attrs.field(default=GlobalNeed.LOADER, converter=GlobalNeed)
    runtime_bytes: int = LLAMA_CPU_RUNTIME_BYTES
    seam_width: int | None = None  # None: the model's own
    seam_dtype: str = "f32"
    prefill_chunk: int = 512
    fewest: bool = True  # False: use every node given

    def __attrs_post_init__(self) -> None:
        if self.context < 1 or self.sessions < 1 or self.ubatch < 1 or self.prefill_chunk < 1:
            raise CallerError(Reason.INVALID_REQUEST, "context, sessions, ubatch and prefill chunk must be positive")
        if self.kv_dtype not in KV_DTYPES:
            raise CallerError(Reason.INVALID_REQUEST, f"KV dtype must be one of {', '.join(KV_DTYPES)}")
        if self.seam_dtype.upper() not in DType.__members__:
            raise CallerError(Reason.INVALID_REQUEST, "seam dtype must be f32 or f16")

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["globals_need"] = self.globals_need.value
        return d


@attrs.frozen
class ShardCost:
    """One node's shard and every byte it is charged."""

    node: Node
    layers: LayerRange
    weight_bytes: int  # the layers' tensors
    global_bytes: int  # global tensors this shard loads
    kv_bytes: int  # Hot KV State for all sessions at full context
    compute_bytes: int  # llama.cpp compute buffer (+ the output buffer of a non-tail shard)
    runtime_bytes: int
    kv_by_kind: dict[str, int]  # layer kind -> KV bytes, so per-kind rates show
    active_bytes: int  # weight bytes one decode token reads on this shard

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.global_bytes + self.kv_bytes + self.compute_bytes + self.runtime_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.node.memory_bytes - self.total_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node.name,
            "memory_bytes": self.node.memory_bytes,
            "layers": str(self.layers),
            "weight_bytes": self.weight_bytes,
            "global_bytes": self.global_bytes,
            "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes,
            "runtime_bytes": self.runtime_bytes,
            "kv_by_kind": dict(self.kv_by_kind),
            "active_bytes": self.active_bytes,
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardCost:
        return cls(
            node=Node(d["node"], int(d["memory_bytes"])),
            layers=LayerRange.parse(d["layers"]),
            weight_bytes=int(d["weight_bytes"]),
            global_bytes=int(d["global_bytes"]),
            kv_bytes=int(d["kv_bytes"]),
            compute_bytes=int(d["compute_bytes"]),
            runtime_bytes=int(d["runtime_bytes"]),
            kv_by_kind={k: int(v) for k, v in d["kv_by_kind"].items()},
            active_bytes=int(d["active_bytes"]),
        )


@attrs.frozen
class SeamHop:
    """The frames crossing one boundary between consecutive shards."""

    boundary: int  # the first layer of the receiving shard
    token_ids: bool  # the receiving shard holds a hash-routed layer, so the frame carries token ids
    decode_bytes: int  # one decode step, header included
    prefill_bytes: int  # one prefill chunk of `prefill_chunk` positions
    max_chunk: int  # most positions one frame may carry (MAX_FRAME_BYTES)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


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
            "unused": [{"node": n.name, "memory_bytes": n.memory_bytes} for n in self.unused],
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
            unused=tuple(Node(n["node"], int(n["memory_bytes"])) for n in d["unused"]),
            hops=tuple(SeamHop(**h) for h in d["hops"]),
        )


# -- pricing ----------------------------------------------------------------------


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


def _global_bytes(layout: ModelLayout, params: PlanParams, *, is_head: bool, is_tail: bool) -> tuple[int, int]:
    """(bytes loaded, bytes read per decode token) of the globals one shard holds."""
    loaded = active = 0
    for g in layout.globals:
        computes = g.needed_by(is_head=is_head, is_tail=is_tail)
        # A next-token-prediction layer lives only on the tail, even in a shard file.
        loads = computes or (params.globals_need is GlobalNeed.LOADER and not g.name.startswith("blk."))
        if loads:
            loaded += g.n_bytes
        if computes and (is_tail or g.role is not Role.HEAD_TAIL):
            active += g.active_bytes  # a head only looks up embedding rows; a tied tail reads them all
    return loaded, active


def _compute_bytes(layout: ModelLayout, params: PlanParams, *, is_tail: bool) -> int:
    """llama.cpp's compute buffer, plus the logits buffer of a non-tail shard.

    dgr's llama_shard backend marks every row of a non-tail shard as an output
    (llama.cpp keeps only output rows in the last layer), so llama.cpp sizes
    its output buffer for ubatch x vocab f32 logits it never computes.
    """
    out = 0 if is_tail else params.ubatch * layout.vocab_size * 4
    return layout.compute.nbytes(params.context) + out


def shard_cost(layout: ModelLayout, params: PlanParams, node: Node, layers: LayerRange) -> ShardCost:
    """Every byte `node` is charged for serving `layers` of `layout`."""
    is_head, is_tail = layers.start == 0, layers.stop == layout.n_layers
    g_loaded, g_active = _global_bytes(layout, params, is_head=is_head, is_tail=is_tail)
    weights = active = 0
    kinds: dict[str, int] = {}
    for layer in layout.layers[layers.start : layers.stop]:
        weights += layer.weight_bytes
        active += layer.active_bytes
        kv = layer.kv_bytes(params.context, params.sessions, params.kv_dtype, params.ubatch, params.swa_full)
        kinds[layer.kind] = kinds.get(layer.kind, 0) + kv
    return ShardCost(
        node=node,
        layers=layers,
        weight_bytes=weights,
        global_bytes=g_loaded,
        kv_bytes=sum(kinds.values()),
        compute_bytes=_compute_bytes(layout, params, is_tail=is_tail),
        runtime_bytes=params.runtime_bytes,
        kv_by_kind=kinds,
        active_bytes=active + g_active,
    )


class _Pricer:
    """Headroom of node j holding [a, b) when it is the head and/or tail of a k-node route."""

    def __init__(self, layout: ModelLayout, params: PlanParams) -> None:
        self.n = layout.n_layers
        self.whole_only = layout.whole_only
        self.pre = _Prefix.of(layout, params)
        # Per required kind, how many layers of it precede each index.
        self.kind_counts = []
        for kind in sorted(layout.shard_needs):
            c = [0]
            for layer in layout.layers:
                c.append(c[-1] + (layer.kind == kind))
            self.kind_counts.append(c)
        self.starts = layout.shard_starts
        self.fixed = {
            (h, t): _global_bytes(layout, params, is_head=h, is_tail=t)[0]
            + _compute_bytes(layout, params, is_tail=t)
            + params.runtime_bytes
            for h in (False, True)
            for t in (False, True)
        }

    def need(self, a: int, b: int) -> int:
        p = self.pre
        return p.weights[b] - p.weights[a] + p.kv[b] - p.kv[a] + self.fixed[(a == 0, b == self.n)]

    def headroom(self, node: Node, a: int, b: int) -> int:
        return node.memory_bytes - self.need(a, b)

    def valid(self, a: int, b: int) -> bool:
        """Whether [a, b) may be a shard: it holds every layer kind a shard must have
        (ModelLayout.shard_needs), starts where a shard may (ModelLayout.shard_starts), and is
        the whole model where it runs only whole (ModelLayout.whole_only)."""
        if self.whole_only and (a, b) != (0, self.n):
            return False
        if self.starts is not None and a != 0 and a not in self.starts:
            return False
        return all(c[b] > c[a] for c in self.kind_counts)

    @property
    def constrained(self) -> bool:
        return bool(self.kind_counts) or self.starts is not None or bool(self.whole_only)

    def score(self, node: Node, a: int, b: int) -> float:
        return self.headroom(node, a, b) if self.valid(a, b) else -math.inf

    def best_split(self, nodes: Sequence[Node]) -> tuple[float, list[int]]:
        """The split of every layer over `nodes` with the largest smallest headroom."""
        return _max_min_split(self.n, len(nodes), lambda j, a, b: self.score(nodes[j], a, b))

    def fits(self, nodes: Sequence[Node]) -> bool:
        """Whether `nodes`, in order, can hold the model (greedy, then the DP when kinds are required)."""
        if not _fits_greedy(self, nodes):
            return False
        return not self.constrained or self.best_split(nodes)[0] >= 0


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


def _max_min_split(n: int, k: int, score: Callable[[int, int, int], float]) -> tuple[float, list[int]]:
    """Boundaries 0 = c0 < c1 < ... < ck = n maximising min_j score(j, c_j, c_j+1)."""
    neg = -math.inf
    best = [[neg] * (n + 1) for _ in range(k)]
    arg = [[0] * (n + 1) for _ in range(k)]
    for b in range(1, n - k + 2):
        best[0][b] = score(0, 0, b)
    for j in range(1, k):
        for b in range(j + 1, n - (k - j - 1) + 1):
            for a in range(j, b):
                v = min(best[j - 1][a], score(j, a, b))
                if v > best[j][b]:
                    best[j][b], arg[j][b] = v, a
    cuts = [n]
    for j in range(k - 1, 0, -1):
        cuts.append(arg[j][cuts[-1]])
    cuts.append(0)
    return best[k - 1][n], cuts[::-1]


def _largest(nodes: Sequence[Node], k: int) -> list[Node]:
    """The k largest nodes (ties: the order given), kept in the order given."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].memory_bytes, i))[:k]
    return [nodes[i] for i in sorted(order)]


def seam_hops(layout: ModelLayout, params: PlanParams, ranges: Sequence[LayerRange]) -> tuple[SeamHop, ...]:
    """The frame sizes at each boundary of a route (dgr.seam.wire's frame: header + ids + floats)."""
    width = params.seam_width or layout.seam_width
    value = DTYPE_SIZE[DType[params.seam_dtype.upper()]]
    hops = []
    for r in ranges[1:]:
        ids = r.start < layout.hash_layers
        per_pos = width * value + (4 if ids else 0)
        hops.append(
            SeamHop(
                boundary=r.start,
                token_ids=ids,
                decode_bytes=HEADER_SIZE + per_pos,
                prefill_bytes=HEADER_SIZE + params.prefill_chunk * per_pos,
                max_chunk=(MAX_FRAME_BYTES - HEADER_SIZE) // per_pos,
            )
        )
    return tuple(hops)


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
    have = sum(n.memory_bytes for n in use)
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
        worst = min(costs, key=lambda c: c.headroom_bytes)
        msg = (
            f"{what} does not fit: the {k} node(s) have enough memory in total but no contiguous split "
            f"fits; the best split leaves {worst.node.name} (layers {worst.layers}) "
            f"{format_size(-worst.headroom_bytes)} short"
        )
    sizes = {n.memory_bytes for n in nodes}
    if len(sizes) == 1:
        size = sizes.pop()
        fit = next(
            (m for m in range(len(nodes) + 1, layout.n_layers + 1)
             if pricer.fits([Node("n", size)] * m)),
            None,
        )  # fmt: skip
        msg += (
            f"; {fit} nodes of {format_size(size)} would hold it"
            if fit
            else f"; no number of {format_size(size)} nodes holds it (one layer per node is too much)"
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


def plan_even(layout: ModelLayout, n_nodes: int) -> list[LayerRange]:
    """Contiguous ranges over `n_nodes` nodes that minimise the largest share of layer weight bytes.

    For `dgr up` on one machine: memory is not the limit there, the slowest
    shard is, and a shard's decode time follows the bytes it reads.

    Raises:
        CallerError(INVALID_REQUEST): fewer than 1 node, more nodes than layers, or
            more than the model's split rules allow (ModelLayout.shard_needs, shard_starts).
    """
    if not 1 <= n_nodes <= layout.n_layers:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot split {layout.n_layers} layers over {n_nodes} nodes")
    pricer = _Pricer(layout, PlanParams())
    w = pricer.pre.weights
    best, cuts = _max_min_split(
        layout.n_layers, n_nodes, lambda j, a, b: -(w[b] - w[a]) if pricer.valid(a, b) else -math.inf
    )
    if best == -math.inf:
        raise CallerError(
            Reason.INVALID_REQUEST,
            f"cannot split {layout.name} over {n_nodes} nodes: {layout.split_rule()}",
        )
    return [LayerRange(cuts[j], cuts[j + 1]) for j in range(n_nodes)]


def fitting_ranges(layout: ModelLayout, params: PlanParams, node: Node) -> list[tuple[LayerRange, int]]:
    """Every contiguous range `node` may serve alone, with its headroom: valid under the model's split
    rules and within the node's memory. For a node joining a running route (dgr.tracker.assign)."""
    pricer = _Pricer(layout, params)
    n = layout.n_layers
    return [(LayerRange(a, b), pricer.headroom(node, a, b)) for a in range(n) for b in range(a + 1, n + 1)
            if pricer.valid(a, b) and pricer.headroom(node, a, b) >= 0]


# -- decode latency ------------------------------------------------------------------


@attrs.frozen
class LatencyEstimate:
    """Decode time per token on one route, from stated assumptions (not a measurement)."""

    link_gbit: float
    compute_s: float  # all shards, one after another: bytes read / memory bandwidth
    network_s: float  # every frame of one decode step: latency + serialization + handling
    frames: int
    via_gateway: bool
    prefill_network_s: float  # the seam frames of one prefill chunk (compute not estimated)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.network_s

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "total_s": self.total_s}


def decode_latency(
    p: Plan,
    *,
    link_gbit: float,
    mem_bw_gbs: float = 50.0,
    rtt_ms: float = 0.5,
    frame_ms: float = 0.5,
    via_gateway: bool = True,
) -> LatencyEstimate:
    """Per-token decode latency of a single sequence on the route of `p`.

    Compute: each shard reads its active weight bytes (routed experts in their
    used share) and one session's KV once per token, at `mem_bw_gbs` GB/s.
    Network: each frame costs half an RTT, its bytes at `link_gbit` Gbit/s and
    `frame_ms` of HTTP handling. dgr v1 relays every hop through the gateway
    (a HIDDEN frame to the gateway, then a DECODE frame to the next node), so
    a route of n shards sends 2n frames per token; `via_gateway=False` prices
    direct node-to-node hops (n + 1 frames).
    """
    compute = sum((s.active_bytes + s.kv_bytes / p.params.sessions) / (mem_bw_gbs * 1e9) for s in p.shards)
    small_in = HEADER_SIZE + 4  # gateway -> head: the token id
    small_out = HEADER_SIZE + TOKEN_RESULT.size + 16  # tail -> gateway: the sampled token and its text
    sizes = [small_in, small_out]
    for hop in p.hops:
        sizes += [hop.decode_bytes, hop.decode_bytes] if via_gateway else [hop.decode_bytes]
    per_frame = rtt_ms / 2e3 + frame_ms / 1e3
    network = sum(per_frame + b * 8 / (link_gbit * 1e9) for b in sizes)
    copies = 2 if via_gateway else 1
    prefill = sum(copies * (per_frame + h.prefill_bytes * 8 / (link_gbit * 1e9)) for h in p.hops)
    return LatencyEstimate(link_gbit, compute, network, len(sizes), via_gateway, prefill)


# -- the command ------------------------------------------------------------------------


def render_plan(p: Plan, layout: ModelLayout, estimates: Sequence[LatencyEstimate], assumptions: str) -> str:
    """The human table of `dgr plan`."""
    prm = p.params
    lines = [
        f"model   {p.model} ({p.architecture}, {p.n_layers} layers"
        + (f", recipe {p.recipe}" if p.recipe else "")
        + f"), {format_size(layout.tensor_bytes())} of tensors",
        (
            f"for     context {prm.context} x {prm.sessions} session(s), KV {prm.kv_dtype}, ubatch {prm.ubatch}, "
            f"swa_full {'on' if prm.swa_full else 'off'}, globals: {prm.globals_need.value}"
        ),
        f"uses    {len(p.shards)} of {len(p.shards) + len(p.unused)} node(s)"
        + (" (fewest that fit, then the largest smallest headroom)" if prm.fewest else " (all given)"),
        "",
    ]
    head = ("node", "layers", "weights", "globals", "KV", "buffers", "runtime", "total", "memory", "headroom")
    rows = [head]
    for s in p.shards:
        rows.append(
            (
                s.node.name, str(s.layers), format_size(s.weight_bytes), format_size(s.global_bytes),
                format_size(s.kv_bytes), format_size(s.compute_bytes), format_size(s.runtime_bytes),
                format_size(s.total_bytes), format_size(s.node.memory_bytes), format_size(s.headroom_bytes),
            )
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    kv_kinds: dict[str, int] = {}
    for s in p.shards:
        for kind, b in s.kv_by_kind.items():
            kv_kinds[kind] = kv_kinds.get(kind, 0) + b
    kinds = layout.kinds()
    lines += ["", "KV by layer kind (all sessions):"]
    for kind, b in kv_kinds.items():
        per_layer = layout.layers[kinds[kind][0]].kv_bytes(prm.context, 1, prm.kv_dtype, prm.ubatch, prm.swa_full)
        lines.append(
            f"  {kind:<5} {len(kinds[kind]):>3} layers  {format_size(b):>11}  ({format_size(per_layer)} per layer per session)"
        )
    lines += [
        "",
        f"seam    width {p.seam_width} x {prm.seam_dtype}"
        + (
            f" ({p.seam_width // layout.hidden_size} x hidden {layout.hidden_size})"
            if p.seam_width != layout.hidden_size
            else ""
        )
        + f", {len(p.hops)} hop(s)",
    ]
    for i, h in enumerate(p.hops):
        lines.append(
            f"  hop {i + 1} -> layer {h.boundary}: decode {h.decode_bytes:,} B/token; prefill chunk of "
            f"{prm.prefill_chunk}: {format_size(h.prefill_bytes)}; at most {h.max_chunk} positions per frame"
            + ("; carries token ids" if h.token_ids else "")
        )
    if estimates:
        lines += ["", f"decode latency per token (estimate; {assumptions}):"]
        for e in estimates:
            lines.append(
                f"  {e.link_gbit:g} Gbit/s {'via gateway' if e.via_gateway else 'direct':<11}: compute "
                f"{e.compute_s * 1e3:7.1f} ms + network {e.network_s * 1e3:6.2f} ms ({e.frames} frames) = "
                f"{e.total_s * 1e3:7.1f} ms, {1 / e.total_s:6.2f} tokens/s; seam time per prefill chunk "
                f"{e.prefill_network_s * 1e3:.0f} ms"
            )
    return "\n".join(lines)


def _handler(args: argparse.Namespace) -> int:
    try:
        model = args.model
        if model is None:
            from dgr.models import default_model_path

            model = default_model_path()
        layout = load_layout(Path(model), recipe=args.recipe)
        nodes = parse_nodes(args.nodes, args.memory, args.node or [])
        params = PlanParams(
            context=args.context,
            sessions=args.sessions,
            kv_dtype=args.kv_dtype,
            ubatch=args.ubatch,
            swa_full=args.swa_full,
            globals_need=args.globals,
            runtime_bytes=parse_size(args.runtime) if args.runtime else LLAMA_CPU_RUNTIME_BYTES,
            seam_width=args.seam_width,
            seam_dtype=args.seam_dtype,
            prefill_chunk=args.prefill_chunk,
            fewest=not args.all_nodes,
        )
        result = plan(layout, nodes, params)
    except DgrError as exc:
        print(f"dgr plan: {exc.message}", file=sys.stderr)
        return 2
    estimates = [
        decode_latency(
            result, link_gbit=g, mem_bw_gbs=args.mem_bw, rtt_ms=args.rtt_ms, frame_ms=args.frame_ms, via_gateway=v
        )
        for g in (args.link or [1.0, 10.0])
        for v in (True, False)
    ]
    assumptions = (
        f"{args.mem_bw:g} GB/s memory bandwidth per node, RTT {args.rtt_ms:g} ms, "
        f"{args.frame_ms:g} ms handling per frame, one sequence"
    )
    if args.json:
        out = {
            "plan": result.to_json(),
            "estimates": [e.to_json() for e in estimates],
            "assumptions": {"mem_bw_gbs": args.mem_bw, "rtt_ms": args.rtt_ms, "frame_ms": args.frame_ms},
        }
        print(json.dumps(out, indent=2))
    else:
        print(render_plan(result, layout, estimates, assumptions))
    return 0


def register(subparsers: Any) -> None:
    """Add `dgr plan` to the CLI."""
    p = subparsers.add_parser(
        "plan",
        help="split a model's layers over nodes and check that it fits",
        description=(
            "Split a model's layers into contiguous ranges over nodes: fewest nodes that fit, then the "
            "largest smallest headroom. Prices weights, global tensors, KV per layer kind, llama.cpp "
            "buffers and the runtime per node, the seam frames per hop, and a decode latency estimate."
        ),
    )
    p.add_argument("--model", help="a GGUF file, or a layout/manifest JSON (default: the embedded SmolLM2)")
    p.add_argument("--recipe", help="quantization recipe of a layout JSON (default: the layout's own)")
    p.add_argument("--nodes", type=int, help="how many identical nodes (with --memory)")
    p.add_argument("--memory", help="memory per node, e.g. 24GiB (with --nodes)")
    p.add_argument("--node", action="append", metavar="NAME=SIZE", help="one node, in route order (repeatable)")
    p.add_argument("--context", type=int, default=4096, help="positions per session (default 4096)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent sessions per node (default 1)")
    p.add_argument("--kv-dtype", default="f16", choices=KV_DTYPES, help="KV cache type (default f16)")
    p.add_argument("--ubatch", type=int, default=DEFAULT_UBATCH, help="llama.cpp physical batch (default 512)")
    p.add_argument(
        "--swa-full",
        action="store_true",
        help="price sliding-window caches at full context (llama.cpp's default swa_full=true)",
    )
    p.add_argument(
        "--globals",
        default=GlobalNeed.LOADER.value,
        choices=[g.value for g in GlobalNeed],
        help="loader: every shard loads every global tensor, as llama.cpp needs today (default); "
        "compute: only where they are computed with",
    )
    p.add_argument("--runtime", help="per-node runtime memory (default: the measured llama.cpp CPU node, 80MiB)")
    p.add_argument("--seam-width", type=int, help="floats per position on the seam (default: the model's)")
    p.add_argument("--seam-dtype", default="f32", choices=["f32", "f16"], help="seam value type (default f32)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="positions per prefill frame (default 512)")
    p.add_argument("--all-nodes", action="store_true", help="use every node given instead of the fewest")
    p.add_argument(
        "--link", type=float, action="append", help="link speed in Gbit/s for the estimate (default 1 and 10)"
    )
    p.add_argument("--mem-bw", type=float, default=50.0, help="memory bandwidth per node in GB/s (default 50)")
    p.add_argument("--rtt-ms", type=float, default=0.5, help="round-trip time between hosts (default 0.5 ms)")
    p.add_argument("--frame-ms", type=float, default=0.5, help="HTTP handling per frame (default 0.5 ms)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=_handler)
