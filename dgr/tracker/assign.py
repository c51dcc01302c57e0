"""Automatic layer assignment: the contiguous layers a joining node should serve.

A node started with `--manifest M --memory SIZE` and no `--layers` asks its
tracker (`POST /v1/assign`) before it loads anything. The tracker counts, per
layer of M's model, the live nodes that claim it (proven or still proving),
prices every contiguous range with the planner's cost model (dgr.plan:
weights, the globals a shard loads, Hot KV State at the node's context and
session count, llama.cpp's buffers, the runtime) and answers with the range
that fits the node's memory and most improves coverage:
1. a range that starts at a boundary of the coverage: layer 0, or a layer
   served by another number of nodes than the one before it. Coverage then
   grows from where routes end, and a replica lines up with the nodes it can
   stand in for. (A range loads only the globals it computes with, so a range
   that skips the head's token_embd fits a few more layers: without this rule
   the first node would take 1:N and leave layer 0 to a later node, and a
   replica would take a range no running node can hand over to);
2. then the most layers that nobody serves yet;
3. then the largest sum of 1 / (1 + servers) over its layers (thinly served
   layers count more than well served ones);
4. then the earliest start.

A node with a GPU also gives its GPU memory (and whether it keeps routed
experts in host memory, `--cpu-moe`): a range then fits where what its GPU
does not hold fits the host, with as many of its layers on the GPU as fit
there (dgr.plan.gpu), and the answer names the `--gpu-layers` to start with.

Pure functions over values; the tracker's app does the I/O. Left out: a
node's speed (every node is priced by memory alone), and reassigning nodes
that already serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.plan import Node, PlanParams, fitting_ranges, format_size, shard_cost
from dgr.plan.gpu import fit
from dgr.plan.layout import ModelLayout
from dgr.fsm.proof import ProofState
from dgr.tracker.registry import NodeEntry

__all__ = ["Assignment", "coverage", "assign_layers"]


@attrs.frozen
class Assignment:
    layers: LayerRange
    newly_covered: int  # layers nobody served before
    headroom_bytes: int  # the node's memory left over under the cost model (host and GPU)
    gpu_layers: str | None = None  # a GPU node's --gpu-layers for the range ("all" or a count); None: no GPU

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"layers": str(self.layers), "newly_covered": self.newly_covered,
                                  "headroom_bytes": self.headroom_bytes}
        if self.gpu_layers is not None:
            out["gpu_layers"] = self.gpu_layers
        return out


def coverage(entries: Iterable[NodeEntry], manifest_id: str, n_layers: int) -> list[int]:
    """How many live nodes claim each layer of the manifest (claims that failed their proof do not count)."""
    counts = [0] * n_layers
    for e in entries:
        if e.alive and e.manifest_id == manifest_id and e.proof.state is not ProofState.FAILED:
            for i in range(max(0, e.start), min(n_layers, e.stop)):
                counts[i] += 1
    return counts


def assign_layers(layout: ModelLayout, params: PlanParams, memory_bytes: int, counts: Sequence[int],
                  gpu_bytes: int = 0) -> Assignment:
    """The range a node with `memory_bytes` of host memory (and `gpu_bytes` of GPU memory) should serve, given how
    many nodes serve each layer.

    Raises:
        CallerError(INVALID_REQUEST): not even one layer fits the memory.
    """
    node = Node("joining", memory_bytes, gpu_bytes)
    best: tuple[tuple[bool, int, float, int], LayerRange, int] | None = None
    for layers, headroom in fitting_ranges(layout, params, node):
        held = counts[layers.start:layers.stop]
        boundary = layers.start == 0 or counts[layers.start] != counts[layers.start - 1]
        key = (boundary, sum(c == 0 for c in held), sum(1.0 / (1 + c) for c in held), -layers.start)
        if best is None or key > best[0]:
            best = (key, layers, headroom)
    if best is None:
        smallest = min(shard_cost(layout, params, node, LayerRange(i, i + 1)).total_bytes
                       for i in range(layout.n_layers))
        gpu = f" and a GPU of {format_size(gpu_bytes)}" if gpu_bytes else ""
        raise CallerError(Reason.INVALID_REQUEST,
                          f"{format_size(memory_bytes)}{gpu} holds no layer of {layout.name} at context "
                          f"{params.context} x {params.sessions} sessions: the smallest shard needs "
                          f"{format_size(smallest)} of host memory without a GPU")
    key, layers, headroom = best
    flag = fit(layout, params, layers, gpu_bytes).flag if gpu_bytes else None
    return Assignment(layers, key[1], headroom, flag)
