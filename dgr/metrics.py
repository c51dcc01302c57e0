"""Prometheus metrics for the tracker and for nodes.

Each process owns one `CollectorRegistry` (never the global one, so importing
this module has no side effects and tests can run several in one process).
Counters and histograms are updated where things happen; gauges that mirror
state (sessions by state, node up/down, KV bytes) are read at scrape time by
a collector, so they can never drift from the state they describe.

Names follow Prometheus conventions: `dgr_` prefix, base units in the name,
`_total` on counters. A node's accelerators (`device_gauges`) are the same
families on the node (labelled by device) and on the tracker (by node and
device, from heartbeats).
"""

from __future__ import annotations

from typing import Callable, Iterable

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dgr.seam.types import DeviceMemory

__all__ = ["TrackerMetrics", "NodeMetrics", "render", "gauge", "device_gauges", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StateCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._collect = collect

    def collect(self):
        yield from self._collect()


@attrs.define
class TrackerMetrics:
    registry: CollectorRegistry = attrs.field(factory=lambda: CollectorRegistry(auto_describe=True))
    sessions_total: Counter = attrs.field(init=False)
    failures_total: Counter = attrs.field(init=False)
    prompt_tokens_total: Counter = attrs.field(init=False)
    prefix_reused_tokens_total: Counter = attrs.field(init=False)
    generated_tokens_total: Counter = attrs.field(init=False)
    reopens_total: Counter = attrs.field(init=False)
    repairs_total: Counter = attrs.field(init=False)
    ttft_seconds: Histogram = attrs.field(init=False)
    token_latency_seconds: Histogram = attrs.field(init=False)
    hop_latency_seconds: Histogram = attrs.field(init=False)
    seam_bytes_total: Counter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        r = self.registry
        self.sessions_total = Counter("dgr_route_sessions_total", "Route Sessions ended, by outcome", ["outcome"], registry=r)
        self.failures_total = Counter("dgr_route_session_failures_total", "Route Session failures by reason code",
                                      ["reason"], registry=r)
        self.prompt_tokens_total = Counter("dgr_prompt_tokens_total", "Prompt tokens prefilled", registry=r)
        self.prefix_reused_tokens_total = Counter("dgr_prefix_reused_tokens_total",
                                                  "Prompt tokens whose KV a kept prefix supplied", registry=r)
        self.generated_tokens_total = Counter("dgr_generated_tokens_total", "Tokens generated", registry=r)
        self.reopens_total = Counter("dgr_route_reopens_total", "Route Sessions moved, once the head answered, to "
                                     "the route whose nodes kept the prompt's prefix", registry=r)
        self.repairs_total = Counter("dgr_route_repairs_total", "Route Sessions' routes repaired after a node "
                                     "loss (--resume), counted as each repair starts", registry=r)
        self.ttft_seconds = Histogram("dgr_time_to_first_token_seconds", "Request start to first token", registry=r,
                                      buckets=_TTFT_BUCKETS)
        self.token_latency_seconds = Histogram("dgr_token_latency_seconds", "Time between generated tokens",
                                               registry=r, buckets=_LATENCY_BUCKETS)
        self.hop_latency_seconds = Histogram("dgr_seam_hop_latency_seconds",
                                             "Seam round trip minus node compute, per hop", ["node"], registry=r,
                                             buckets=_LATENCY_BUCKETS)
        self.seam_bytes_total = Counter("dgr_seam_bytes_total", "Seam frame bytes sent to nodes", ["node", "kind"],
                                        registry=r)

    def watch(self, collect: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self.registry.register(_StateCollector(collect))

    def failure_counts(self) -> dict[str, int]:
        """Route Session failures so far by reason code, read from the counter: the one tally of them."""
        return {s.labels["reason"]: int(s.value)
                for m in self.failures_total.collect() for s in m.samples if s.name.endswith("_total")}

    def forget_node(self, node_id: str) -> None:
        """Drop every series labelled with `node_id` (a node the registry has forgotten)."""
        for metric in (self.hop_latency_seconds, self.seam_bytes_total):
            # prometheus_client offers no public listing of a metric's label sets
            for labels in [k for k in list(metric._metrics) if k and k[0] == node_id]:
                metric.remove(*labels)


@attrs.define
class NodeMetrics:
    registry: CollectorRegistry = attrs.field(factory=lambda: CollectorRegistry(auto_describe=True))
    frames_total: Counter = attrs.field(init=False)
    frame_bytes_total: Counter = attrs.field(init=False)
    refused_total: Counter = attrs.field(init=False)
    compute_seconds: Histogram = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        r = self.registry
        self.frames_total = Counter("dgr_node_seam_frames_total", "Seam frames applied, by kind", ["kind"], registry=r)
        self.frame_bytes_total = Counter("dgr_node_seam_bytes_total", "Seam bytes received, by frame kind", ["kind"],
                                         registry=r)
        self.refused_total = Counter("dgr_node_seam_refused_total", "Seam frames refused, by reason code", ["reason"],
                                     registry=r)
        self.compute_seconds = Histogram("dgr_node_compute_seconds", "Backend compute per step", ["kind"], registry=r,
                                         buckets=_LATENCY_BUCKETS)

    def watch(self, collect: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self.registry.register(_StateCollector(collect))


def gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, v in rows:
        g.add_metric(values, v)
    return g


def device_gauges(labels: list[str], rows: Iterable[tuple[list[str], DeviceMemory]]) -> list[GaugeMetricFamily]:
    """Accelerators' memory in bytes, one series per (`labels` values, device): total, free, and used (total less
    free: every process's buffers on the device, not the node's alone), and an info series naming each by its
    driver's description."""
    rows = list(rows)
    names = labels + ["device"]

    def each(value: Callable[[DeviceMemory], float]) -> list[tuple[list[str], float]]:
        return [(values + [d.name], value(d)) for values, d in rows]

    return [
        gauge("dgr_node_device_memory_total_bytes", "Memory of an accelerator holding the node's layers", names,
              each(lambda d: float(d.memory_total))),
        gauge("dgr_node_device_memory_free_bytes", "Free memory of the accelerator, as its driver reports", names,
              each(lambda d: float(d.memory_free))),
        gauge("dgr_node_device_memory_used_bytes", "Total less free memory of the accelerator, all processes'",
              names, each(lambda d: float(d.memory_used))),
        gauge("dgr_node_device_info", "An accelerator holding the node's layers, by its driver's description (value 1)",
              names + ["description"], [(values + [d.name, d.description], 1.0) for values, d in rows]),
    ]


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
