"""The stub ceiling: how fast a route goes when its nodes compute (almost) nothing.

`dgr bench --only ceiling` starts a 2-node ring of the stub backend (the product's defaults, room for 32
sessions) and, in each of ROUNDS rounds, streams one session of ONE_TOKENS tokens and then MANY sessions of
MANY_TOKENS at once. The stub's own step is a few array operations a layer, so what the rates measure is the
route's own cost a token: seam framing, the scheduler, sampling, the sends, the gateway and its stream to the
client. Each run also reads every process's CPU time from /proc (dgr.bench.cpu), per token it delivered;
the client is this process.

Issue 58's targets: at least ONE_TARGET tok/s for one session and MANY_TARGET for 32 together. A verdict
takes the median of the rounds.

Linux only (procfs).
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable

from dgr.bench.cpu import _cpu_s, _processes
from dgr.bench.measure import concurrent, stream_once
from dgr.testing.harness import LocalRoute

__all__ = ["run_ceiling", "markdown", "ONE_TARGET", "MANY_TARGET"]

PROMPT = "The lighthouse keeper wrote down every ship that passed the point"
ROUNDS = 3
ONE_TOKENS = 512
MANY = 32
MANY_TOKENS = 128
ONE_TARGET = 1000.0  # tok/s, one session
MANY_TARGET = 3000.0  # tok/s in all, MANY sessions


def _run(route: LocalRoute, sessions: int) -> dict[str, Any]:
    procs = _processes(route)
    before = {name: _cpu_s(pid) for name, pid in procs.items()}
    client = sum(os.times()[:2])
    if sessions == 1:
        got = stream_once(route.api, "stub", PROMPT, ONE_TOKENS)
        rate, tokens, errors = got.decode_tok_s, got.tokens, 0
    else:
        many = concurrent(route.api, "stub", PROMPT, MANY_TOKENS, sessions)
        rate, errors = many["aggregate_tok_s"], many["errors"]
        tokens = round(many["aggregate_tok_s"] * many["wall_s"])
    client = sum(os.times()[:2]) - client
    per_token = {name: (_cpu_s(pid) - before[name]) / max(1, tokens) * 1e6 for name, pid in procs.items()}
    per_token["client"] = client / max(1, tokens) * 1e6
    return {"sessions": sessions, "tok_s": rate, "tokens": tokens, "errors": errors, "cpu_us_per_token": per_token}


def run_ceiling(log: Callable[[str], None]) -> dict[str, Any]:
    """ROUNDS rounds of one session, then MANY at once, on a 2-node stub ring."""
    out: dict[str, Any] = {"nodes": 2, "rounds": [], "one_tokens": ONE_TOKENS, "many": MANY,
                           "many_tokens": MANY_TOKENS, "load_before": list(os.getloadavg())}
    with LocalRoute(backend="stub", nodes=2, ready_timeout_s=120, busy_poll_ms=None,  # the product's default
                    extra=("--ctx", "2048", "--max-sessions", str(MANY))) as route:
        stream_once(route.api, "stub", PROMPT, 8)  # first requests load what they load
        for r in range(ROUNDS):
            one, many = _run(route, 1), _run(route, MANY)
            log(f"ceiling: round {r + 1}: one session {one['tok_s']:.0f} tok/s, {MANY} sessions {many['tok_s']:.0f}")
            out["rounds"].append({"one": one, "many": many})
    out["load_after"] = list(os.getloadavg())
    out["one_tok_s"] = statistics.median(r["one"]["tok_s"] for r in out["rounds"])
    out["many_tok_s"] = statistics.median(r["many"]["tok_s"] for r in out["rounds"])
    out["one_pass"], out["many_pass"] = out["one_tok_s"] >= ONE_TARGET, out["many_tok_s"] >= MANY_TARGET
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    rounds = res["rounds"]
    names = list(rounds[0]["one"]["cpu_us_per_token"])
    lines = ["## The stub ceiling (`dgr bench --only ceiling`)", "",
             f"A 2-node ring of the stub backend (no real compute: the route's own cost a token), {len(rounds)} rounds "
             f"of one session of {res['one_tokens']} tokens and then {res['many']} sessions of {res['many_tokens']} at "
             f"once. CPU is each process's, per token delivered, in microseconds (/proc, 10 ms ticks); the client is the "
             f"bench. Load average (1 min) {res['load_before'][0]:.1f} before, {res['load_after'][0]:.1f} after.", "",
             "| run | round | tok/s | " + " | ".join(f"{n} CPU us/token" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for key, label in (("one", "1 session"), ("many", f"{res['many']} sessions")):
        for i, r in enumerate(rounds):
            run = r[key]
            cpu = " | ".join(f"{run['cpu_us_per_token'][n]:.0f}" for n in names)
            lines.append(f"| {label} | {i + 1} | {run['tok_s']:.0f} | {cpu} |")
    lines += ["",
              f"- One session: median {res['one_tok_s']:.0f} tok/s against a target of {ONE_TARGET:.0f}: "
              f"**{'pass' if res['one_pass'] else 'FAIL'}**.",
              f"- {res['many']} sessions: median {res['many_tok_s']:.0f} tok/s in all against a target of "
              f"{MANY_TARGET:.0f}: **{'pass' if res['many_pass'] else 'FAIL'}**.", ""]
    return lines
