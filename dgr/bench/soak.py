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
whether the checks held. This module drives the route and its clients; the
settings, the plan and the verdict are dgr.bench.soak_report.

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
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import attrs
import httpx
import trio

from dgr.bench.attacker import HOLDING
from dgr.bench.inside import INSIDE_ID, LURE, start_inside, stop_inside
from dgr.bench.soak_report import (
    HEALTHZ_EVERY_S,
    HEALTHZ_P99_MS,
    NodeProc,
    SoakConfig,
    SoakReport,
    plan,
    rss_kib,
)
from dgr.procs import dgr_command
from dgr.security.identity import Identity
from dgr.testing.harness import LocalRoute, RouteTimeout
from dgr.testing.launcher import LaunchedProcess, launch

__all__ = ["register", "run_soak"]

_HEALTHZ_TIMEOUT_S = 5.0  # a probe that gets no answer counts at this latency, and as an error
# Enough tokens that a cancelled or disconnected session is still generating when its client leaves.
_LONG = 2000


def _lured(text: str) -> bool:
    """An answer the inside attacker wrote: the lure, or (an answer cut short) its first 3 or more characters."""
    return LURE in text or (len(text) >= 3 and LURE.startswith(text))
_WORDS = ("route", "shard", "layer", "token", "cache", "node", "seam", "hidden", "state", "prefill", "decode")


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 40)))


@attrs.define
class _Soak:
    route: LocalRoute
    cfg: SoakConfig
    report: SoakReport
    client: httpx.AsyncClient
    model: str = "stub"
    procs: dict[int, NodeProc] = attrs.field(factory=dict)
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
                self.procs[n["pid"]] = NodeProc(n["node"], n["pid"])
                self.report.procs.append(self.procs[n["pid"]])
        for proc in self.procs.values():
            proc.alive = proc.pid in alive
        for proc in self.procs.values():
            if proc.rss_base is None and proc.alive:
                # The warm-up is counted in the node's own sessions: a node sharing its stage (the attacker's
                # middle) opens fewer than the soak runs, and its heap was still filling when the soak's count
                # took its baseline (node1 +6.4% in 20 sessions, where the ends grew under 1%, then flat)
                try:
                    status = await trio.to_thread.run_sync(self.route.node_status, proc.node)
                except (httpx.HTTPError, ValueError):  # a node restarting after a kill: asked again after the next batch
                    continue
                proc.opened = status["sessions_opened"]
                if proc.served >= self.cfg.warmup and proc.opened >= self.cfg.warmup:
                    proc.rss_base = rss_kib(proc.pid)
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
            return self._failed(r.status_code, r.content)
        if _lured(r.json()["choices"][0]["text"]):
            return "lure"  # a member wrote the client's answer
        usage = r.json()["usage"]
        return "ok" if 1 <= usage["completion_tokens"] <= body["max_tokens"] else "bad_usage"

    def _failed(self, status: int, body: bytes) -> str:
        """The outcome of a session refused or failed before its answer, its message kept for the report."""
        try:
            self.report.note_error(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            self.report.note_error(body[:300].decode("utf-8", "replace"))
        return f"http_{status}"

    async def _stream_to_end(self, body: dict[str, Any]) -> str:
        async with self.client.stream("POST", "/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return self._failed(r.status_code, await r.aread())
            text = ""
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "lure" if _lured(text) else "ok"
                if line.startswith("data: {") and '"choices"' in line:
                    text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
                if line.startswith("data: ") and '"error"' in line:
                    error = json.loads(line[6:])["error"]
                    self.report.note_error(error.get("message"))
                    return "error_" + error["code"]
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
        inside = await _start_inside(route, cfg, await soak._nodes()) if cfg.attacker else None
        async with trio.open_nursery() as watching:
            watching.start_soon(soak.probe_healthz)  # judged only beside an attacker; else a baseline
            await _sessions(soak, cfg, kinds, rng, report, time.monotonic())  # the time limit: the sessions' own
            watching.cancel_scope.cancel()
        if attacker is not None:
            report.attack = await _stop_attacker(attacker)
        if inside is not None:
            report.inside = await trio.to_thread.run_sync(stop_inside, *inside)
            if report.inside is not None:
                entry = next((n for n in await trio.to_thread.run_sync(route.node_table) if n["node"] == INSIDE_ID), {})
                report.inside["strikes"], report.inside["banned_s"] = entry.get("strikes"), entry.get("banned_s")
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
                proc.rss_end = rss_kib(proc.pid)
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
    # and its floods at full strength before any session, so the nodes' RSS baselines (after the warm-up)
    # hold what the held connections cost: at nice 10 on a loaded machine they came in over the first
    # 20 to 40 sessions, and a baseline taken before them read the flood as a leak (8.5% in 40 sessions
    # beside a CPU hog; over 200 sessions RSS stayed within 97 to 102 MB after the ramp)
    with trio.move_on_after(60):
        while (await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)).strip() not in (
                HOLDING, ""):
            pass
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


async def _start_inside(route: LocalRoute, cfg: SoakConfig, nodes: list[dict[str, Any]]) -> tuple[Any, Path]:
    """The member gone bad inside routes (dgr.bench.inside): beside node1, the middle stage, with trusted ends;
    beside the tail (node2) in the control run, where it may answer for the route."""
    beside = "node1" if cfg.trusted_heads else f"node{route.nodes - 1}"
    layers = next(n["layers"] for n in nodes if n["node"] == beside)
    tally = Path(tempfile.mkdtemp(prefix="dgr-soak-inside-")) / "tally.json"
    at = f"3,6,{9 if cfg.inside_slow_s else 0}"  # its forged answer, its report in the head's name, its slow step
    proc = await trio.to_thread.run_sync(start_inside, route, layers, "middle" if cfg.trusted_heads else "tail",
                                         tally, cfg.inside_slow_s, at)
    return proc, tally


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
    nodes = 3 if cfg.attacker else 2  # with the attacker, a middle stage for its member gone bad to share
    if cfg.attacker and cfg.trusted_heads:
        keys = Path(tempfile.mkdtemp(prefix="dgr-soak-keys-"))  # LocalRoute removes it
        extra = (*extra, *[a for key in _trusted_keys(keys, nodes) for a in ("--trusted-head", key)])
    with LocalRoute(backend=cfg.backend, nodes=nodes, extra=extra, ready_timeout_s=600, busy_poll_ms=None,
                    keys=keys) as route:
        return trio.run(_run, route, cfg)


def _main(args) -> int:
    kill_every = args.kill_every if args.kill_every is not None else 0 if args.attacker else 50
    cfg = SoakConfig(sessions=args.sessions, concurrency=args.concurrency, seed=args.seed,
                     time_limit_s=args.time_limit, kill_every=kill_every, stub_delay=args.stub_delay,
                     # with the attacker, twice the warm-up: beside the flood a node's heap was still filling
                     # after 12 to 14 sessions of its own (the middle node, counted before from the soak's)
                     warmup=min(20, max(10, args.sessions // 10)) * (2 if args.attacker else 1),
                     oversized_share=args.oversized_share,
                     backend=args.backend, attacker=args.attacker, healthz_p99_ms=args.healthz_p99_ms,
                     trusted_heads=not args.no_trusted_heads, inside_slow_s=args.inside_slow_s)
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
    p.add_argument("--inside-slow-s", type=float, default=35.0,
                   help="with --attacker: how long the member inside routes holds one session's decode step (0: never)")
    p.add_argument("--healthz-p99-ms", type=float, default=HEALTHZ_P99_MS,
                   help="with --attacker: the bound on each server's /healthz p99, in ms")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.set_defaults(func=_main)
