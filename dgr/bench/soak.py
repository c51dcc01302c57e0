"""`dgr soak`: many Route Sessions through a real 2-node route, with faults, and what they leave behind.

A soak answers one question: after hundreds of sessions that end every way a
session can end, is anything left over? It starts `dgr up --backend stub
--nodes 2` on loopback (dgr.testing.harness.LocalRoute), then runs a seeded,
shuffled mix of:
- `complete`: a normal completion, streamed or not, read to the end;
- `cancel`: a stream the client closes after the first text (`cancelled`);
- `disconnect`: a non-streaming request whose socket is closed while the
  route is still generating (`cancelled`);
- `kill`: a stream whose tail node is SIGKILLed after the first text
  (`route_node_lost`); the node is then restarted and registers again;
- `oversized`: a prompt past the gateway's limits, in bytes or in tokens,
  which must be refused with a 4xx (never a 5xx) before any node works on it.

Sessions run `concurrency` at a time; a `kill` runs alone, so every failure
the tracker records has exactly one expected cause. Afterwards every node
must hold no session, its KV must be back to its idle baseline, and the RSS
of every node process that served the whole measured window must have grown
by less than `MAX_RSS_GROWTH`. The figures are printed; the exit code says
whether the checks held.

With `--attacker`, an attacker process (`dgr attack`, dgr.bench.attacker: a member
node's operator with the join token) runs beside the sessions the whole time, and
the soak also checks that the attacker harmed no honest session (every outcome as
planned, no tracker failure with another reason, no call ever reached its trap
node), that every server's `/healthz` answered within `HEALTHZ_P99_MS` at the
99th percentile (a fresh connection from 127.0.0.1 every `HEALTHZ_EVERY_S`, so a
server that cannot accept shows it), and that no attack was accepted. (The
/healthz figures are taken without `--attacker` too, as a baseline, and not judged.) The two
nodes' keys are made before `dgr up` and passed as `--trusted-head`, so the
attacker, which claims every layer, can never be a route's head or tail. Kills
are off by default with it (`--kill-every 0`): a kill's `route_node_lost` would
otherwise be indistinguishable from one a forged report caused; `--kill-every N`
still adds them. `--no-trusted-heads` is the control: the attacker then takes
its turn at routes, honest sessions reach its trap, and the soak must fail.

Bounded: `--sessions` caps the count and `--time-limit` the wall time (no
new session starts after it). `--backend llama_shard` soaks the default GGUF
model instead of the stub. Left out: multi-machine routes.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import attrs
import httpx
import trio

from dgr.procs import dgr_command
from dgr.security.identity import Identity
from dgr.testing.harness import LocalRoute, RouteTimeout
from dgr.testing.launcher import LaunchedProcess, launch

__all__ = ["SoakConfig", "SoakReport", "plan", "run_soak", "register", "MAX_RSS_GROWTH", "KINDS", "HEALTHZ_P99_MS",
           "HEALTHZ_EVERY_S"]

MAX_RSS_GROWTH = 0.05
HEALTHZ_P99_MS = 100.0
HEALTHZ_EVERY_S = 0.2
_HEALTHZ_TIMEOUT_S = 5.0  # a probe that gets no answer counts at this latency, and as an error
KINDS = ("complete", "cancel", "disconnect", "kill", "oversized")
# Enough tokens that a cancelled or disconnected session is still generating when its client leaves.
_LONG = 2000
_WORDS = ("route", "shard", "layer", "token", "cache", "node", "seam", "hidden", "state", "prefill", "decode")


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
class _Proc:
    """One node process as the soak saw it."""

    node: str
    pid: int
    alive: bool = True
    served: int = 0  # sessions that ended while it was alive
    rss_base: int | None = None
    rss_end: int | None = None
    rss_trace: list[tuple[int, int]] = attrs.field(factory=list)  # (served, KiB) after the baseline

    def sample(self, every: int) -> None:
        if self.rss_base is not None and self.alive and (not self.rss_trace or self.served - self.rss_trace[-1][0] >= every):
            rss = _rss_kib(self.pid)
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
    procs: list[_Proc] = attrs.field(factory=list)
    kv_before: dict[str, int] = attrs.field(factory=dict)
    kv_after: dict[str, int] = attrs.field(factory=dict)
    sessions_after: dict[str, int] = attrs.field(factory=dict)
    elapsed_s: float = 0.0
    stopped_early: bool = False
    problems: list[str] = attrs.field(factory=list)
    healthz_ms: dict[str, list[float]] = attrs.field(factory=dict)  # server -> latencies (judged with --attacker)
    healthz_errors: Counter = attrs.field(factory=Counter)
    attack: dict[str, Any] | None = None  # the attacker's own tally (dgr.bench.attacker)

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
            p.append(f"sessions that did not end as planned: {dict(unexpected)}")
        allowed = {"cancelled"}  # each other reason only when a planned session ends with it
        if self.planned.get("kill"):
            allowed.add("route_node_lost")
        if self.planned.get("oversized"):
            allowed |= {"prompt_too_large", "context_length_exceeded"}
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
            "problems": self.problems,
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
        lines.append("  result: " + ("ok" if self.ok else "FAILED: " + "; ".join(self.problems)))
        return "\n".join(lines)


def _pct(ms: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank rule (p99 of 100 samples is the 99th smallest)."""
    ordered = sorted(ms)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 40)))


@attrs.define
class _Soak:
    route: LocalRoute
    cfg: SoakConfig
    report: SoakReport
    client: httpx.AsyncClient
    model: str = "stub"
    procs: dict[int, _Proc] = attrs.field(factory=dict)
    down: set[str] = attrs.field(factory=set)  # nodes killed on purpose, until restarted: not probed

    async def _nodes(self) -> list[dict[str, Any]]:
        """The route's own nodes (node0, node1, ...), not whatever else registered (an attacker)."""
        ours = {f"node{i}" for i in range(self.route.nodes)}
        return [n for n in await trio.to_thread.run_sync(self.route.node_table) if n["node"] in ours]

    async def probe_healthz(self) -> None:
        """GET /healthz of the tracker and each node every HEALTHZ_EVERY_S, each on a fresh connection, until
        cancelled: a server whose accept queue or event loop an attacker holds shows it in the latency."""
        servers = {"tracker": self.route.url}
        while True:
            try:
                servers.update({n["node"]: n["url"] for n in await self._nodes() if n["alive"]})  # restarts move
            except (httpx.HTTPError, ValueError):
                pass
            async with trio.open_nursery() as nursery:
                for name, url in servers.items():
                    nursery.start_soon(self._healthz_once, name, url)
                nursery.start_soon(trio.sleep, HEALTHZ_EVERY_S)

    async def _healthz_once(self, name: str, url: str) -> None:
        if name in self.down:
            return
        u = urlparse(url)
        request = (f"GET /healthz HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nConnection: close\r\n\r\n").encode()
        t0 = time.perf_counter()
        ok = False
        with trio.move_on_after(_HEALTHZ_TIMEOUT_S):
            try:
                stream = await trio.open_tcp_stream(u.hostname, u.port)
                async with stream:
                    await stream.send_all(request)
                    got = b""
                    while chunk := await stream.receive_some(65536):
                        got += chunk
                ok = got.startswith(b"HTTP/1.1 200")
            except OSError:
                pass
        if name in self.down:  # killed on purpose while probed: its silence says nothing
            return
        self.report.healthz_ms.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
        if not ok:
            self.report.healthz_errors[name] += 1

    async def track_procs(self) -> None:
        """Note new node pids; take the RSS baseline of those that have served the warm-up."""
        nodes = await self._nodes()
        alive = {n["pid"] for n in nodes if n["alive"] and n.get("pid")}
        for n in nodes:
            if n["pid"] in alive and n["pid"] not in self.procs:
                self.procs[n["pid"]] = _Proc(n["node"], n["pid"])
                self.report.procs.append(self.procs[n["pid"]])
        for proc in self.procs.values():
            proc.alive = proc.pid in alive
        for proc in self.procs.values():
            if proc.rss_base is None and proc.alive and proc.served >= self.cfg.warmup:
                proc.rss_base = _rss_kib(proc.pid)
            proc.sample(max(1, min(self.cfg.sessions // 10, 50)))

    def served(self) -> None:
        for proc in self.procs.values():
            proc.served += proc.alive

    async def one(self, kind: str, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": _prompt(rng), "temperature": rng.choice((0.0, 0.8)),
                "seed": rng.randint(0, 2 ** 31)}
        if kind == "complete":
            stream = rng.random() < 0.5
            body["max_tokens"] = rng.randint(1, self.cfg.max_tokens)
            outcome = await (self._stream_to_end(body) if stream else self._complete(body))
        elif kind == "cancel":
            outcome = await self._cancel(body)
        elif kind == "disconnect":
            outcome = await self._disconnect(body)
        elif kind == "oversized":
            outcome = await self._oversized(body, rng)
        else:
            outcome = await self._kill(body)
        self.report.outcomes[f"{kind}:{outcome}"] += 1
        self.served()

    async def _complete(self, body: dict[str, Any]) -> str:
        r = await self.client.post("/completions", json=body)
        if r.status_code != 200:
            return f"http_{r.status_code}"
        usage = r.json()["usage"]
        return "ok" if 1 <= usage["completion_tokens"] <= body["max_tokens"] else "bad_usage"

    async def _stream_to_end(self, body: dict[str, Any]) -> str:
        async with self.client.stream("POST", "/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "ok"
                if line.startswith("data: ") and '"error"' in line:
                    return "error_" + json.loads(line[6:])["error"]["code"]
        return "no_done"

    async def _until_text(self, lines) -> bool:
        """Consume SSE lines up to the first one carrying generated text."""
        async for line in lines:
            if line.startswith("data: {") and '"text": "' in line and '"text": ""' not in line:
                return True
        return False

    async def _cancel(self, body: dict[str, Any]) -> str:
        async with self.client.stream("POST", "/completions",
                                      json={**body, "max_tokens": _LONG, "stream": True}) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            if not await self._until_text(r.aiter_lines()):
                return "no_text"
        return "ok"  # leaving the block closes the connection mid-stream

    async def _oversized(self, body: dict[str, Any], rng: random.Random) -> str:
        """4 MiB of text (past the prompt-byte limit), or words past the token limit: a 4xx, nothing else."""
        if rng.random() < 0.5:
            prompt = "x" * (4 * 1024 * 1024 - 4096)  # refused by its bytes, before the head tokenizes it
        else:
            prompt = "x " * 5000  # few bytes, but more tokens than the context holds: refused after tokenizing
        r = await self.client.post("/completions", json={**body, "prompt": prompt, "max_tokens": 8})
        return "ok" if r.status_code in (400, 413) else f"http_{r.status_code}"

    async def _disconnect(self, body: dict[str, Any]) -> str:
        u = urlparse(self.route.url)
        data = json.dumps({**body, "max_tokens": _LONG}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in self.route.headers.items()) + "\r\n").encode()
        stream = await trio.open_tcp_stream(u.hostname, u.port)
        async with stream:
            await stream.send_all(head + data)
            await trio.sleep(0.2)  # the route is open and generating; then the client vanishes
        return "ok"

    async def _kill(self, body: dict[str, Any]) -> str:
        victim = "node1"
        layers = next(n["layers"] for n in await self._nodes() if n["node"] == victim)
        outcome = "no_error"
        async with self.client.stream("POST", "/completions",
                                      json={**body, "max_tokens": _LONG, "stream": True}) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            lines = r.aiter_lines()  # one iterator: an httpx stream is read once
            if not await self._until_text(lines):
                return "no_text"
            self.down.add(victim)
            await trio.to_thread.run_sync(self.route.kill, victim)
            async for line in lines:
                if line.startswith("data: ") and '"error"' in line:
                    code = json.loads(line[6:])["error"]["code"]
                    outcome = "ok" if code == "route_node_lost" else f"error_{code}"
                    break
        await trio.to_thread.run_sync(self.route.restart_node, victim, layers)
        self.down.discard(victim)
        return outcome

    async def tracker_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Sessions ended by outcome and failures by reason, from the tracker's Prometheus counters."""
        text = (await self.client.get(self.route.url + "/metrics")).text
        return _counter(text, "dgr_route_sessions_total", "outcome"), \
            _counter(text, "dgr_route_session_failures_total", "reason")


def _counter(text: str, name: str, label: str) -> dict[str, int]:
    """{label value: count} of one labelled Prometheus counter (its `_total` samples)."""
    out = {}
    prefix = f"{name}{{{label}=\""
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line[len(prefix):].partition("\"} ")
            out[key] = int(float(value))
    return out


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
            if after.get(k, 0) - before.get(k, 0)}


async def _run(route: LocalRoute, cfg: SoakConfig) -> SoakReport:
    report = SoakReport(cfg)
    kinds = plan(cfg)
    rng = random.Random(cfg.seed + 1)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=route.api, headers=route.headers, timeout=60) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        soak = _Soak(route, cfg, report, client, model=model)
        await soak.track_procs()
        for n in await soak._nodes():
            status = await trio.to_thread.run_sync(route.node_status, n["node"])
            report.kv_before[n["node"]] = status["kv_bytes"]
        before = await soak.tracker_counts()
        attacker = await _start_attacker(route, cfg, await soak._nodes()) if cfg.attacker else None
        async with trio.open_nursery() as watching:
            watching.start_soon(soak.probe_healthz)  # judged only beside an attacker; else a baseline
            await _sessions(soak, cfg, kinds, rng, report, start)
            watching.cancel_scope.cancel()
        if attacker is not None:
            report.attack = await _stop_attacker(attacker)
        names = sorted({p.node for p in report.procs})
        try:
            await trio.to_thread.run_sync(route.wait_sessions_freed, names, 10.0)
        except RouteTimeout as exc:
            report.problems.append(str(exc))
        after = await soak.tracker_counts()
        report.tracker_sessions = _diff(after[0], before[0])
        report.tracker_failures = _diff(after[1], before[1])
        alive = {n["pid"] for n in await soak._nodes() if n["alive"]}
        for n in names:
            status = await trio.to_thread.run_sync(route.node_status, n)
            report.kv_after[n] = status["kv_bytes"]
            report.sessions_after[n] = status["sessions"]
        for proc in report.procs:
            if proc.pid in alive:
                proc.rss_end = _rss_kib(proc.pid)
    report.elapsed_s = time.monotonic() - start
    report.check()
    return report


async def _sessions(soak: _Soak, cfg: SoakConfig, kinds: list[str], rng: random.Random, report: SoakReport,
                    start: float) -> None:
    """Run the planned sessions, `concurrency` at a time (a kill alone), until done or the time limit."""
    i = 0
    while i < len(kinds):
        if time.monotonic() - start > cfg.time_limit_s:
            report.stopped_early = True
            break
        if kinds[i] == "kill":
            batch = ["kill"]
        else:
            batch = []
            while i + len(batch) < len(kinds) and kinds[i + len(batch)] != "kill" and len(batch) < cfg.concurrency:
                batch.append(kinds[i + len(batch)])
        i += len(batch)
        async with trio.open_nursery() as nursery:
            for kind in batch:
                report.planned[kind] += 1
                nursery.start_soon(soak.one, kind, random.Random(rng.random()))
        await soak.track_procs()


async def _start_attacker(route: LocalRoute, cfg: SoakConfig, nodes: list[dict[str, Any]]) -> LaunchedProcess:
    """`dgr attack` on the route, with its join token, for as long as the soak may run (stopped sooner).

    Its requests leave from 127.0.0.2 and its held connections from 127.0.0.3: two addresses, so the servers'
    per-peer caps on the held ones do not also refuse its requests before their handlers judge them, and the
    per-process caps are tried too. It runs at nice 10: on the route's machine it stands for a host of its own, so
    /healthz measures what its requests cost the servers, not a CPU it took from them."""
    cmd = dgr_command("attack", "--tracker", route.url, "--time-limit", str(cfg.time_limit_s + 600),
                      "--source", "127.0.0.2", "--hold-source", "127.0.0.3", "--nice", "10",
                      "--idle-conns", str(cfg.attack_idle_conns), "--half-bodies", str(cfg.attack_half_bodies),
                      *[a for n in nodes for a in ("--node", f"{n['node']}={n['url']}")])
    proc = launch(cmd, env=route.env(), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    # its capture registration lands before the first session, or the control run's sessions could all end
    # before it joined (on a loaded machine the attacker took 3 s to start); a bound, not a timing claim
    ours = {n["node"] for n in nodes}
    with trio.move_on_after(60):
        while not any(n["alive"] and n["node"] not in ours for n in await trio.to_thread.run_sync(route.node_table)):
            await trio.sleep(0.1)
    await trio.sleep(1.0)  # and its first held connections
    return proc


async def _stop_attacker(proc: LaunchedProcess) -> dict[str, Any] | None:
    """SIGTERM it; its tally (the last line it prints)."""
    proc.send_signal(signal.SIGTERM)
    out = ""
    with trio.move_on_after(60):  # to its end of file: it has exited (a hung one is killed, its tally lost)
        out = await trio.to_thread.run_sync(proc.stdout.read, abandon_on_cancel=True)
    try:
        await trio.to_thread.run_sync(proc.wait, 5)
    except subprocess.TimeoutExpired:
        proc.kill()
    lines = out.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def _trusted_keys(folder: Path, nodes: int) -> list[str]:
    """Make the route's node keys before `dgr up` (which uses keys it finds): their public halves, for
    `--trusted-head`."""
    return [Identity.load(folder / f"node{i}.key", create=True).public_text for i in range(nodes)]


def run_soak(cfg: SoakConfig, *, extra: tuple[str, ...] = ()) -> SoakReport:
    """Start a 2-node route (the stub, or the default GGUF with llama_shard), soak it, stop it; return the figures."""
    if cfg.backend == "stub":
        extra = ("--stub-delay", str(cfg.stub_delay), *extra)
    else:
        extra = ("--ctx", "2048", "--max-sessions", str(max(8, cfg.concurrency)), *extra)
    keys = None
    if cfg.attacker and cfg.trusted_heads:
        keys = Path(tempfile.mkdtemp(prefix="dgr-soak-keys-"))  # LocalRoute removes it
        extra = (*extra, *[a for key in _trusted_keys(keys, 2) for a in ("--trusted-head", key)])
    with LocalRoute(backend=cfg.backend, nodes=2, extra=extra, ready_timeout_s=600, busy_poll_ms=None,
                    keys=keys) as route:
        return trio.run(_run, route, cfg)


def _main(args) -> int:
    kill_every = args.kill_every if args.kill_every is not None else 0 if args.attacker else 50
    cfg = SoakConfig(sessions=args.sessions, concurrency=args.concurrency, seed=args.seed,
                     time_limit_s=args.time_limit, kill_every=kill_every, stub_delay=args.stub_delay,
                     warmup=min(20, max(10, args.sessions // 10)), oversized_share=args.oversized_share,
                     backend=args.backend, attacker=args.attacker, healthz_p99_ms=args.healthz_p99_ms,
                     trusted_heads=not args.no_trusted_heads)
    report = run_soak(cfg)
    print(report.render())
    if args.json:
        print(json.dumps(report.to_json()))
    sys.stdout.flush()
    return 0 if report.ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("soak", help="many sessions with faults through a local 2-node stub route; "
                                           "checks nothing is left behind")
    p.add_argument("--sessions", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=900.0, help="start no session after this many seconds")
    p.add_argument("--kill-every", type=int, default=None,
                   help="one session in N kills and restarts a node (0: none); default 50, or 0 with --attacker")
    p.add_argument("--stub-delay", type=float, default=0.0, help="seconds of fake compute per position")
    p.add_argument("--backend", choices=("stub", "llama_shard"), default="stub",
                   help="the route's backend: the stub, or the default GGUF model split over the 2 nodes")
    p.add_argument("--oversized-share", type=float, default=0.0,
                   help="share of sessions that send a prompt past the gateway's limits (expect a 4xx)")
    p.add_argument("--attacker", action="store_true",
                   help="run `dgr attack` (issue 40's attacks, with the join token) beside the sessions; the nodes' "
                        "keys are trusted heads; also checks /healthz p99 and that no attack got through")
    p.add_argument("--no-trusted-heads", action="store_true",
                   help="with --attacker, a control run: no --trusted-head keys, so the attacker's capture of "
                        "sessions shows (and the soak fails)")
    p.add_argument("--healthz-p99-ms", type=float, default=HEALTHZ_P99_MS,
                   help="with --attacker: the bound on each server's /healthz p99, in ms")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.set_defaults(func=_main)
