"""What the gateway counts, fed by its Route Sessions' events: metrics, per-hop overhead, ended sessions.

Every Route Session event the gateway publishes (dgr.fsm.route: route ready,
a token, done, failed) also comes here (`observe`), so counting is one
listener, not calls spread through the driver:
- route ready: prompt tokens, prefix tokens reused;
- a token: generated tokens, the time to the first and between the rest, and,
  where the token's answer measured it, each hop's seam overhead (its share
  of the round trip less every hop's compute) into /v1/stats percentiles and
  the /metrics histogram;
- done or failed: sessions by outcome, failures by reason, the last 50
  failures.
An ended session the gateway let go is kept for lookups (`retire`, the
newest `keep_ended`).
Per node, what it keeps goes when the node is forgotten.

Left out: the live sessions themselves (dgr.tracker.gateway) and the metric
types (dgr.metrics).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import attrs

from dgr.fsm.route import RouteEvent, RouteSession
from dgr.metrics import TrackerMetrics
from dgr.tracker.live import HopStats

__all__ = ["Accounting"]


@attrs.define
class Accounting:
    metrics: TrackerMetrics = attrs.field(factory=TrackerMetrics)
    keep_ended: int = 1000
    hop_stats: dict[str, HopStats] = attrs.field(factory=lambda: collections.defaultdict(HopStats))
    recent_failures: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=50))
    ended: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # sid -> RouteSession
    _last_token: dict[str, float] = attrs.field(factory=dict)  # sid -> when its last token came
    _hop_latency: dict[str, Any] = attrs.field(factory=dict)  # node -> its hop latency histogram's child

    def observe(self, rs: RouteSession, event: RouteEvent, now: float, hop_ms: dict[str, float] | None = None) -> None:
        """One event of `rs` at `now`; `hop_ms`: each hop's seam overhead, where the event's answer measured it."""
        if event is RouteEvent.ROUTE_READY:
            self.metrics.prompt_tokens_total.inc(rs.prompt_tokens)
            self.metrics.prefix_reused_tokens_total.inc(rs.prefix_reused)
        elif event is RouteEvent.TOKEN:
            self.metrics.generated_tokens_total.inc()
            last = self._last_token.get(rs.sid)
            if last is None:
                self.metrics.ttft_seconds.observe(now - rs.created_at)
            else:
                self.metrics.token_latency_seconds.observe(now - last)
            self._last_token[rs.sid] = now
            for node_id, ms in (hop_ms or {}).items():
                self.hop_stats[node_id].overhead_ms.append(ms)
                hop = self._hop_latency.get(node_id)
                if hop is None:  # its labels looked up once per node, not per token
                    hop = self._hop_latency[node_id] = self.metrics.hop_latency_seconds.labels(node=node_id)
                hop.observe(ms / 1e3)
        elif event is RouteEvent.NODE_LOST:
            self.metrics.repairs_total.inc()
        elif event in (RouteEvent.FINISH, RouteEvent.FAIL):
            self._last_token.pop(rs.sid, None)
            self.metrics.sessions_total.labels(outcome=rs.state.value).inc()
            if rs.failure is not None:
                self.metrics.failures_total.labels(reason=rs.failure.reason.value).inc()
                self.recent_failures.append({"session": rs.sid, "model": rs.model, "at": time.time(),
                                             **rs.failure.to_json()})

    def retire(self, rs: RouteSession) -> None:
        """An ended session the gateway no longer holds: kept for lookups, the newest `keep_ended`."""
        self.ended[rs.sid] = rs
        while len(self.ended) > self.keep_ended:
            self.ended.popitem(last=False)

    def sent(self, node_id: str, kind: str, n_bytes: int) -> None:
        """Seam bytes the gateway sent a node (a ring's prompt chunks to its head)."""
        self.metrics.seam_bytes_total.labels(node=node_id, kind=kind).inc(n_bytes)

    def forget_node(self, node_id: str) -> None:
        self.hop_stats.pop(node_id, None)
        self._hop_latency.pop(node_id, None)  # its series go: a child kept here would count where nobody reads
        self.metrics.forget_node(node_id)

    def stats(self, live: list[RouteSession], slow_waits: int) -> dict[str, Any]:
        states = collections.Counter(rs.state.value for rs in live)
        states.update(rs.state.value for rs in self.ended.values())
        return {
            "sessions": dict(states),
            "active": len(live),
            "failures": self.metrics.failure_counts(),
            "recent_failures": list(self.recent_failures),
            "hops": {k: v.to_json() for k, v in self.hop_stats.items()},
            "slow_waits": slow_waits,
        }
