"""The node's accounting: what it counts about the frames it takes and gives, and the status it reports.

Rules:
- Counting changes nothing but counters: a refusal is counted where it is raised (`refuse`), an
  admitted frame once (`admitted`), a computed step once with its compute time and reply (`count`).
- `status` and the gauges read the node's parts (its session table, scheduler, prefix cache, ring
  phases) as of the scheduler's last iteration; they change none of them.
- Without `detail`, status says only what a load balancer needs (sessions, capacity, KV bytes, the
  devices' memory): the per-kind counters split each request into its prompt and output, not for anyone
  who can reach the port.
- The accelerators' memory (`devices`) is read at start, before the scheduler owns the backend, and
  again every `DEVICE_READ_S` as a scheduler job (`watch_devices`); status, gauges and heartbeats show
  the last reading. A node with none at start (the CPU) never reads again and reports none.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import attrs
import trio

from dgr.backends.base import COMPUTE_ERRORS, Compute
from dgr.errors import CallerError
from dgr.metrics import NodeMetrics, device_gauges, gauge
from dgr.node.draft import DraftModel
from dgr.node.journal import JournalBook
from dgr.node.kv import NodeKV
from dgr.node.links import RingPhases
from dgr.node.scheduler import StepScheduler
from dgr.seam.frame import Frame
from dgr.seam.types import DeviceMemory
from dgr.seam.wire import FrameKind
from dgr.sessions import SessionTable

__all__ = ["DEVICE_READ_S", "NodeAccounting", "SeamStats"]

log = logging.getLogger("dgr.node")

# How often a node reads its accelerators' memory. llama.cpp allocates a node's buffers at load, so what moves
# is mostly other processes on the card; a reading costs a scheduler job (a driver query between iterations).
DEVICE_READ_S = 2.0

_KIND_NAMES = {int(k): k.name for k in FrameKind}  # a frame's kind byte (its header's 6th) -> its name


@attrs.define
class SeamStats:
    """Bytes and counts of frames received, by kind; the decode seam measured on the wire."""

    frames_in: collections.Counter = attrs.field(factory=collections.Counter)
    bytes_in: collections.Counter = attrs.field(factory=collections.Counter)
    bytes_out: collections.Counter = attrs.field(factory=collections.Counter)
    last_decode_frame_bytes: int = 0
    last_decode_hidden_bytes: int = 0
    refused: collections.Counter = attrs.field(factory=collections.Counter)
    # positions computed, by the kind of step: what a repair's survivors must not compute again (issue 54)
    positions: collections.Counter = attrs.field(factory=collections.Counter)
    compute_s: float = 0.0  # summed over steps, each counted with its whole batch's call (the busy time: scheduler.busy_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "frames_in": dict(self.frames_in),
            "bytes_in": dict(self.bytes_in),
            "bytes_out": dict(self.bytes_out),
            "last_decode_frame_bytes": self.last_decode_frame_bytes,
            "last_decode_hidden_bytes": self.last_decode_hidden_bytes,
            "refused": dict(self.refused),
            "positions": dict(self.positions),
            "compute_s": round(self.compute_s, 6),
        }


@attrs.define
class NodeAccounting:
    """The seam's counters and the node's Prometheus metrics; its status, read from the node's parts."""

    node_id: str
    backend: Compute
    described: dict[str, Any]  # the backend's, read once before the scheduler owned it
    table: SessionTable
    scheduler: StepScheduler
    kv: NodeKV
    ring: RingPhases
    stats: SeamStats = attrs.field(factory=SeamStats)
    metrics: NodeMetrics = attrs.field(factory=NodeMetrics)
    started_at: float = attrs.field(factory=time.monotonic)
    draft: DraftModel | None = None  # the tail's draft model: its sequences count as the node's KV too
    devices: tuple[DeviceMemory, ...] = ()  # its accelerators' memory as last read; none on the CPU
    journals: JournalBook | None = None  # its sessions' seam journals (dgr.node.journal)
    _device_error: str | None = None  # the last failed reading's, said once on the log
    _step_metrics: dict[str, tuple[Any, Any, Any]] = attrs.field(factory=dict)  # kind -> `count`'s metric children

    def __attrs_post_init__(self) -> None:
        self.metrics.watch(self._gauges)

    async def watch_devices(self, period_s: float = DEVICE_READ_S) -> None:
        """Read the devices' memory every `period_s` until cancelled, as a scheduler job (the backend's one
        owner); return at once on a node that had none at start.

        A failed reading keeps the last one (telemetry is not worth a node) and is logged once per distinct
        error; a later good reading replaces it.
        """
        if not self.devices:
            return
        while True:
            await trio.sleep(period_s)
            try:
                self.devices = tuple(await self.scheduler.call(self.backend.device_memory))
                self._device_error = None
            except COMPUTE_ERRORS as exc:
                if str(exc) != self._device_error:
                    self._device_error = str(exc)
                    log.warning("could not read the devices' memory (showing the last reading): %s", exc)

    def refuse(self, exc: CallerError) -> None:
        self.stats.refused[exc.reason.value] += 1
        self.metrics.refused_total.labels(reason=exc.reason.value).inc()

    def admitted(self, frame: Frame) -> None:
        """A frame its session accepted: its kind and bytes (a decode frame's sizes kept as the last seen)."""
        self.stats.frames_in[frame.kind.name] += 1
        self.stats.bytes_in[frame.kind.name] += frame.size
        if frame.kind is FrameKind.DECODE:
            self.stats.last_decode_frame_bytes = frame.size
            self.stats.last_decode_hidden_bytes = 0 if frame.hidden is None else frame.hidden.nbytes

    def count(self, frame: Frame, reply: bytes, compute: float) -> None:
        """A computed step: its compute seconds and the bytes of what it sent on."""
        self.stats.compute_s += compute
        kind = frame.kind.name
        self.stats.positions[kind] += frame.n_tokens
        children = self._step_metrics.get(kind)
        if children is None:  # labels looked up once per kind, not per step
            m = self.metrics
            children = self._step_metrics[kind] = (m.frames_total.labels(kind=kind),
                                                   m.frame_bytes_total.labels(kind=kind),
                                                   m.compute_seconds.labels(kind=kind))
        frames, size, seconds = children
        frames.inc()
        size.inc(frame.size)
        seconds.observe(compute)
        self.sent(reply)

    def sent(self, reply: bytes) -> None:
        """Bytes of one more frame a step sent on (a speculative step's tokens after its first; none: a repaired
        route's tail answering no step it answered before)."""
        if reply:
            self.stats.bytes_out[_KIND_NAMES[reply[5]]] += len(reply)

    def status(self, detail: bool = True) -> dict[str, Any]:
        """What the node holds now; backend figures as of the scheduler's last iteration."""
        sched, backend, kv = self.scheduler, self.backend, self.kv
        aggregate = {
            "node": self.node_id,
            "backend": self.described,
            "model": backend.info.to_json(),
            "layers": str(backend.layers),
            "sessions": len(self.table),
            "capacity": self.table.capacity,
            "kv_bytes": sched.kv_bytes + (0 if self.draft is None else self.draft.kv_bytes()),
            "devices": [d.to_json() for d in self.devices],
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        if not detail:
            return aggregate
        return {
            **aggregate,
            "sessions_opened": self.table.opened,  # how busy it has been: for its operator, not for anyone
            "prefix": None if kv.prefix is None else {**kv.prefix.to_json(), "bytes": kv.prefix_bytes},
            "snapshots": None if kv.snapshots is None else kv.snapshots.to_json(),
            "seam": self.stats.to_json(),
            "scheduler": {"iterations": sched.iterations, "batched_steps": sched.batched_steps,
                          "busy_s": round(sched.busy_s, 6), "backend_sessions": sched.session_count,
                          "polls_given_up": sched.polls_given_up, "cuts": sched.cuts, "dropped": sched.dropped,
                          "prefill_rate": None if sched.prefill_rate is None else round(sched.prefill_rate, 1)},
            "ring_phases": {"released": self.ring.released, "alone": self.ring.alone},
            "journal": None if self.journals is None else self.journals.to_json(),
            "draft": None if self.draft is None else {
                **self.draft.describe(), "sessions": self.draft.sessions(), "kv_bytes": self.draft.kv_bytes(),
                "ms_a_token": None if self.draft.cost_s is None else round(self.draft.cost_s * 1e3, 3)},
        }

    def _gauges(self):
        yield gauge("dgr_node_sessions", "Route Sessions holding KV on this node", [], [([], float(len(self.table)))])
        yield gauge("dgr_node_session_capacity", "Sessions this node's KV memory allows", [],
                    [([], float(self.table.capacity))])
        yield gauge("dgr_node_kv_bytes", "Hot KV State bytes held", [], [([], float(self.scheduler.kv_bytes))])
        if self.devices:
            yield from device_gauges([], [([], d) for d in self.devices])
        p = self.kv.prefix
        if p is not None:
            yield gauge("dgr_node_prefix_bytes", "KV bytes of kept prefixes (not in dgr_node_kv_bytes)", [],
                        [([], float(self.kv.prefix_bytes))])
            yield gauge("dgr_node_prefix_entries", "Kept prefixes", [], [([], float(len(p.entries)))])
            yield gauge("dgr_node_prefix_events", "Prefix cache hits, misses, evictions, supersessions", ["event"],
                        [(["hit"], float(p.hits)), (["miss"], float(p.misses)),
                         (["eviction"], float(p.evictions)), (["superseded"], float(p.superseded))])
