"""What a soak planned and what it found: its settings, the run order of session kinds, and the verdict.

One job: the soak's bookkeeping, without I/O. `plan` orders the session kinds
(seeded, kills evenly spaced); `SoakReport` holds what dgr.bench.soak saw
(client outcomes, the tracker's counts, each node process's RSS, /healthz
latencies, the attacker's tally), `check` turns it into problems, and `render`
into the lines `dgr soak` prints. Rules: a run is ok when it recorded no
problem; a node process is judged on RSS only when it served the whole
measured window (`rss_base` and `rss_end` both taken); /healthz latencies are
judged only with the attacker. Reading /proc for a process's RSS is the one
system call here.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import attrs

__all__ = [
    "HEALTHZ_EVERY_S",
    "HEALTHZ_P99_MS",
    "KINDS",
    "MAX_RSS_GROWTH",
    "NodeProc",
    "SoakConfig",
    "SoakReport",
    "plan",
    "rss_kib",
]

MAX_RSS_GROWTH = 0.05
HEALTHZ_P99_MS = 100.0
HEALTHZ_EVERY_S = 0.2
KINDS = ("complete", "cancel", "disconnect", "kill", "oversized")

@attrs.frozen
class SoakConfig:
    sessions: int = 500
    concurrency: int = 4
    seed: int = 0
    time_limit_s: float = 900.0
    kill_every: int = 50  # one session in this many kills and restarts the tail node
    cancel_share: float = 0.12
    disconnect_share: float = 0.12
    max_tokens: int = 48
    warmup: int = 20  # sessions a node process serves before its RSS baseline is taken
    stub_delay: float = 0.0
    oversized_share: float = 0.0
    backend: str = "stub"
    attacker: bool = False
    attack_idle_conns: int = 300
    attack_half_bodies: int = 40
    healthz_p99_ms: float = HEALTHZ_P99_MS  # the bound; a looser one where the machine is shared (tests)
    trusted_heads: bool = True  # with the attacker: False is the control run, where it can capture sessions
    # the inside attacker's slow session holds a decode step this long: past the step's deadline on its 3-node
    # route (3 x 10.05 s) and within the session's one budget of extensions (3 x that), so the session completes
    # and the hop is struck; 0: no slow session (the short soak of make test)
    inside_slow_s: float = 35.0


def plan(cfg: SoakConfig) -> list[str]:
    """The session kinds in run order: seeded, kills evenly spaced mid-period (so the last node
    incarnation still serves a warm-up and gets an RSS baseline)."""
    rng = random.Random(cfg.seed)
    kinds = []
    for i in range(cfg.sessions):
        if cfg.kill_every and i % cfg.kill_every == cfg.kill_every // 2:
            kinds.append("kill")
            continue
        r = rng.random()
        kinds.append("cancel" if r < cfg.cancel_share else
                     "disconnect" if r < cfg.cancel_share + cfg.disconnect_share else
                     "oversized" if r < cfg.cancel_share + cfg.disconnect_share + cfg.oversized_share else "complete")
    return kinds


@attrs.define
class NodeProc:
    """One node process as the soak saw it."""

    node: str
    pid: int
    alive: bool = True
    served: int = 0  # sessions that ended while it was alive
    opened: int = 0  # sessions it opened itself (its status), as of the last batch's end: its own warm-up
    rss_base: int | None = None
    rss_end: int | None = None
    rss_trace: list[tuple[int, int]] = attrs.field(factory=list)  # (served, KiB) after the baseline

    def sample(self, every: int) -> None:
        if self.rss_base is not None and self.alive and (not self.rss_trace or self.served - self.rss_trace[-1][0] >= every):
            rss = rss_kib(self.pid)
            if rss is not None:
                self.rss_trace.append((self.served, rss))

    def to_json(self) -> dict[str, Any]:
        growth = None if not (self.rss_base and self.rss_end) else (self.rss_end - self.rss_base) / self.rss_base
        return {"node": self.node, "pid": self.pid, "served": self.served, "rss_before_kib": self.rss_base,
                "rss_after_kib": self.rss_end, "rss_growth_pct": None if growth is None else round(100 * growth, 2),
                "rss_trace_kib": self.rss_trace}


@attrs.define
class SoakReport:
    config: SoakConfig
    planned: Counter = attrs.field(factory=Counter)  # kind -> sessions started
    outcomes: Counter = attrs.field(factory=Counter)  # "kind:outcome" as the client saw it
    tracker_sessions: dict[str, int] = attrs.field(factory=dict)  # outcome -> count (tracker's view, this run)
    tracker_failures: dict[str, int] = attrs.field(factory=dict)  # reason -> count (tracker's view, this run)
    procs: list[NodeProc] = attrs.field(factory=list)
    kv_before: dict[str, int] = attrs.field(factory=dict)
    kv_after: dict[str, int] = attrs.field(factory=dict)
    sessions_after: dict[str, int] = attrs.field(factory=dict)
    elapsed_s: float = 0.0
    stopped_early: bool = False
    problems: list[str] = attrs.field(factory=list)
    healthz_ms: dict[str, list[float]] = attrs.field(factory=dict)  # server -> latencies (judged with --attacker)
    healthz_errors: Counter = attrs.field(factory=Counter)
    attack: dict[str, Any] | None = None  # the attacker's own tally (dgr.bench.attacker)
    inside: dict[str, Any] | None = None  # the member gone bad's tally, and its strikes (dgr.bench.inside)
    errors: list[str] = attrs.field(factory=list)  # the first messages of sessions that failed, as clients read them

    def note_error(self, message: Any) -> None:
        if len(self.errors) < 10:
            self.errors.append(str(message)[:300])

    def healthz(self) -> dict[str, dict[str, float]]:
        return {name: {"n": len(ms), "p50": round(_pct(ms, 0.50), 1), "p99": round(_pct(ms, 0.99), 1),
                       "max": round(max(ms), 1), "errors": self.healthz_errors[name]}
                for name, ms in sorted(self.healthz_ms.items()) if ms}

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self) -> None:
        """Record every way the run left something behind or ended unexpectedly."""
        p = self.problems
        for node, n in self.sessions_after.items():
            if n:
                p.append(f"{node} still holds {n} session(s)")
        for node, kv in self.kv_after.items():
            if kv != self.kv_before.get(node, 0):
                p.append(f"{node} holds {kv} KV bytes, {self.kv_before.get(node, 0)} before")
        for proc in self.procs:
            if proc.rss_base and proc.rss_end and proc.rss_end > proc.rss_base * (1 + MAX_RSS_GROWTH):
                p.append(f"{proc.node} (pid {proc.pid}) RSS grew {proc.rss_base} -> {proc.rss_end} KiB")
        if not any(proc.rss_base and proc.rss_end for proc in self.procs):
            p.append("no node process served the whole window: no RSS figure to judge")
        unexpected = {k: v for k, v in self.outcomes.items() if not k.endswith(":ok")}
        if unexpected:
            p.append(f"sessions that did not end as planned: {dict(unexpected)}"
                     + (f", the first saying: {self.errors}" if self.errors else ""))
        allowed = {"cancelled"}  # each other reason only when a planned session ends with it
        if self.planned.get("kill"):
            allowed.add("route_node_lost")
        if self.planned.get("oversized"):
            allowed |= {"prompt_too_large", "context_length_exceeded"}
        if self.config.attacker:  # its completions asking for speculation not granted (dgr.bench.attacks)
            allowed.add("forbidden")
        odd = {r: n for r, n in self.tracker_failures.items() if r not in allowed}
        if odd:
            p.append(f"the tracker recorded unexpected failures: {odd}")
        if self.config.attacker:
            self._check_attack()

    def _check_attack(self) -> None:
        p = self.problems
        for name, h in self.healthz().items():
            if h["p99"] >= self.config.healthz_p99_ms or h["errors"]:
                p.append(f"{name} /healthz p99 {h['p99']} ms (max {h['max']}, {h['errors']} unanswered); "
                         f"the bound is {self.config.healthz_p99_ms:g} ms")
        if not self.healthz_ms:
            p.append("no /healthz figure was taken")
        if self.attack is None:
            p.append("the attacker left no tally")
            return
        if self.attack.get("trap_calls"):
            p.append(f"{self.attack['trap_calls']} call(s) of honest sessions reached the attacker's node")
        if self.attack.get("accepted"):
            p.append(f"attacks accepted: {self.attack['accepted']}")
        self._check_inside()

    def _check_inside(self) -> None:
        """The member gone bad (dgr.bench.inside): sessions went through it, nothing it sent was accepted, and
        each attack it made cost it a strike. (What it may have written into answers is each session's outcome.)"""
        p, inside = self.problems, self.inside
        if inside is None:
            p.append("the inside attacker left no tally")
            return
        if not inside["sessions"] and inside["mode"] == "middle":
            p.append("no session went through the inside attacker: nothing was tried inside a route")
        if inside.get("accepted"):
            p.append(f"attacks accepted inside routes: {inside['accepted']}")
        routed = sum(self.planned.values()) - self.planned.get("oversized", 0)
        if inside["sessions"] > routed / 2 + 1:  # two nodes hold the middle stage: its fair share plus one
            p.append(f"the inside attacker drew {inside['sessions']} of {routed} sessions, past its fair share")
        if inside["mode"] == "middle":
            made = inside.get("made", 0)
            if (inside.get("strikes") or 0) < made and inside.get("banned_s") is None:  # a ban clears its strikes
                p.append(f"the inside attacker made {made} attack(s) a strike answers, and has "
                         f"{inside.get('strikes')} strike(s) and no ban")

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "sessions": sum(self.planned.values()),
            "planned": dict(self.planned),
            "client_outcomes": dict(self.outcomes),
            "tracker_sessions": self.tracker_sessions,
            "tracker_failures": self.tracker_failures,
            "nodes": [p.to_json() for p in self.procs],
            "kv_bytes_before": self.kv_before,
            "kv_bytes_after": self.kv_after,
            "sessions_after": self.sessions_after,
            "elapsed_s": round(self.elapsed_s, 2),
            "sessions_per_s": round(sum(self.planned.values()) / self.elapsed_s, 2) if self.elapsed_s else None,
            "stopped_early": self.stopped_early,
            "healthz_ms": self.healthz(),
            "attack": self.attack,
            "inside": self.inside,
            "problems": self.problems,
            "errors": self.errors,
        }

    def render(self) -> str:
        d = self.to_json()
        lines = [
            f"dgr soak: {d['sessions']} sessions in {d['elapsed_s']} s ({d['sessions_per_s']}/s), "
            f"concurrency {self.config.concurrency}, seed {self.config.seed}"
            + (" (stopped at the time limit)" if self.stopped_early else ""),
            "  planned:          " + ", ".join(f"{k} {v}" for k, v in sorted(self.planned.items())),
            "  client outcomes:  " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            "  tracker sessions: " + ", ".join(f"{k} {v}" for k, v in sorted(self.tracker_sessions.items())),
            "  errors by reason: " + (", ".join(f"{k} {v}" for k, v in sorted(self.tracker_failures.items()))
                                      or "none"),
        ]
        for p in d["nodes"]:
            if p["rss_after_kib"] is None:  # killed on purpose: its figures judge nothing
                lines.append(f"  {p['node']} pid {p['pid']}: served {p['served']}, killed")
                continue
            if p["rss_growth_pct"] is None:  # started too late to serve the warm-up: no baseline
                lines.append(f"  {p['node']} pid {p['pid']}: served {p['served']}, RSS {p['rss_after_kib']} KiB "
                             f"(under {self.config.warmup} sessions: not judged)")
                continue
            trace = " ".join(f"{kib}@{n}" for n, kib in p["rss_trace_kib"])
            lines.append(f"  {p['node']} pid {p['pid']}: served {p['served']}, RSS {p['rss_before_kib']} -> "
                         f"{p['rss_after_kib']} KiB ({p['rss_growth_pct']:+}%); KiB@sessions: {trace}")
        lines.append(f"  KV bytes before {d['kv_bytes_before']}, after {d['kv_bytes_after']}; "
                     f"sessions held after {d['sessions_after']}")
        for name, h in d["healthz_ms"].items():
            lines.append(f"  /healthz {name}: n {h['n']}, p50 {h['p50']} ms, p99 {h['p99']} ms, max {h['max']} ms, "
                         f"unanswered {h['errors']}" + ("" if self.config.attacker else " (not judged without --attacker)"))
        if self.attack is not None:
            a = self.attack
            lines.append(f"  attacker: {a.get('total')} attacks in {a.get('elapsed_s')} s; accepted "
                         f"{a.get('accepted') or 'none'}; trap calls {a.get('trap_calls')}; id oracle "
                         f"{a.get('id_oracle')}; describe in /v1/models {a.get('describe_in_models')} "
                         f"(overrides its fields: {a.get('describe_overrides_models')}); held connections "
                         f"never closed {a.get('held_open_at_exit')}, longest before a close "
                         f"{a.get('longest_held_before_close_s')} s")
            for name, answers in a.get("attacks", {}).items():
                lines.append(f"    {name}: " + ", ".join(f"{k} {v}" for k, v in answers.items()))
        if self.inside is not None:
            i = self.inside
            lines.append(f"  inside attacker ({i['mode']}): {i['sessions']} sessions through it, {i['lure_tokens']} "
                         f"lure tokens answered, strikes {i.get('strikes')}, banned for {i.get('banned_s')} s more, "
                         f"accepted {i.get('accepted') or 'none'}")
            for name, answers in i.get("attacks", {}).items():
                lines.append(f"    {name}: " + ", ".join(f"{k} {v}" for k, v in answers.items()))
        lines.append("  result: " + ("ok" if self.ok else "FAILED: " + "; ".join(self.problems)))
        return "\n".join(lines)


def _pct(ms: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank rule (p99 of 100 samples is the 99th smallest)."""
    ordered = sorted(ms)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
