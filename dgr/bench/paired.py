"""Decode of one session and of 8 at once, and short-prompt TTFT: dgr's routes and llama.cpp's own servers
measured in alternation.

Why: on a shared VM the machine's speed drifts by 10 to 30% within minutes
(steal time), so two setups measured minutes apart give a ratio that is
partly the drift. Here every setup is started first and all of them stay
up (idle, they take no CPU), then each round measures each setup in turn:
one streamed completion for its decode tok/s, or (a setup with `sessions`)
that many streams at once for their aggregate tok/s (TTFT included, as in the
suite's concurrency rows). A ratio is the median over rounds of
that round's ratio, and its spread over rounds is reported beside it.

The ratios are those of issue 13's decode targets: the 2-node and 3-node
routes (the default topology; 1 thread a node) against llama-server with 1
thread and over RPC, one `llama` node against llama-server with the same
threads, and the 2-node route's 8 sessions against llama-server -np 8 with
all threads and against one session on it, measured the same way. The
setups TTFT_RATIOS names also get, each round, the time to first token of a
short prompt that no setup has seen before (no prefix or prompt cache can
answer it), for the short-prompt TTFT target; that ratio must stay under its
target.

Left out: starting the setups (dgr.testing.harness.LocalRoute,
dgr.bench.peers), the report's layout (dgr.bench.report).
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from typing import Any, Callable

import attrs

from dgr.bench.measure import concurrent, stream_once

__all__ = ["PairedSetup", "RATIOS", "SESSIONS", "TTFT_RATIOS", "ratios", "run_paired"]

_T = "ring"  # every route is a ring (dgr.tracker.ring)
SESSIONS = 8  # the concurrent setups' streams: the issue's 8-session figure, quick or not

# (name, numerator setup, denominator setup, target): the decode must-shows
RATIOS: tuple[tuple[str, str, str, float], ...] = (
    (f"2-node {_T} / llama-server 1 thread", f"dgr 2-node {_T}", "llama-server 1 thread", 0.95),
    (f"2-node {_T} / llama-server over RPC x2", f"dgr 2-node {_T}", "llama-server over RPC x2", 1.0),
    (f"3-node {_T} / llama-server 1 thread", f"dgr 3-node {_T}", "llama-server 1 thread", 0.90),
    ("1 `llama` node / llama-server, same threads", "dgr llama, 1 node", "llama-server, all threads", 0.95),
    (f"2-node {_T}, 8 sessions / llama-server -np 8", f"dgr 2-node {_T}, 8 sessions",
     "llama-server -np 8, all threads, 8 sessions", 0.8),
    (f"2-node {_T}, 8 sessions / 1 session", f"dgr 2-node {_T}, 8 sessions", f"dgr 2-node {_T}, 1 session", 2.5),
)
# (name, numerator setup, denominator setup, target): short-prompt TTFT, where the ratio must stay at most the target
TTFT_RATIOS: tuple[tuple[str, str, str, float], ...] = (
    (f"short-prompt TTFT: 2-node {_T} / llama-server 1 thread", f"dgr 2-node {_T}", "llama-server 1 thread", 1.15),
)


@attrs.frozen
class PairedSetup:
    label: str
    api: str
    model: str
    extra: dict[str, Any] | None = None  # body fields for this server (llama-server: its prompt cache off)
    sessions: int | None = None  # that many streams at once (on `story`, half the tokens), rated by aggregate tok/s


def ratios(rates: dict[str, list[float]], table: tuple[tuple[str, str, str, float], ...] = RATIOS,
           at_most: bool = False) -> dict[str, dict[str, Any]]:
    """Per `table` entry: the per-round ratios, their median and the target. Pure.

    `rates[label][r]` is setup `label`'s figure in round r (tok/s of a decode, or
    aggregate tok/s with `sessions`; TTFT seconds for TTFT_RATIOS, with
    `at_most`: the target is a ceiling); a round whose setups were not both
    measured is left out.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, num, den, target in table:
        if num not in rates or den not in rates:
            continue
        per_round = [a / b for a, b in zip(rates[num], rates[den]) if a and b]
        if per_round:
            out[name] = {"per_round": per_round, "median": statistics.median(per_round), "target": target,
                         "at_most": at_most}
    return out


def run_paired(setups: Callable[[ExitStack], list[PairedSetup]], prompt: list[int], decode_tokens: int,
               rounds: int, log: Callable[[str], None], story: str,
               shorts: list[list[int]] | None = None, ttft_labels: set[str] | None = None) -> dict[str, Any]:
    """Start every setup (`setups(stack)` enters them), then `rounds` rounds measuring each, in turn.

    A round's rate is 0 where streams failed (its ratios leave that round out).
    `shorts[r]` is round r's short prompt for the setups TTFT_RATIOS names (or
    `ttft_labels`): every one of them gets the same one, and no earlier round's.
    The TTFT of each single-session decode (its whole `prompt`) is kept too, as
    "prompt_ttft": with no prefix or prompt cache on, a cold prefill each round.
    """
    if shorts is not None and len(shorts) < rounds:
        raise ValueError(f"{len(shorts)} short prompts for {rounds} rounds")
    prompt_ttft: dict[str, list[float]] = {}

    def rate(s: PairedSetup) -> float:
        if s.sessions is None:
            r = stream_once(s.api, s.model, prompt, decode_tokens, extra=s.extra)
            prompt_ttft.setdefault(s.label, []).append(r.ttft_s)
            return r.decode_tok_s
        r = concurrent(s.api, s.model, story, decode_tokens // 2, s.sessions, extra=s.extra)
        if r["errors"]:
            log(f"{s.label}: {r['errors']} of {s.sessions} streams failed")
            return 0.0
        return r["aggregate_tok_s"]

    with ExitStack() as stack:
        running = setups(stack)
        for s in running:  # warm connections and caches before the first round
            stream_once(s.api, s.model, prompt[:16], 4, extra=s.extra)
        rates: dict[str, list[float]] = {s.label: [] for s in running}
        timed = ttft_labels if ttft_labels is not None else {label for _n, num, den, _t in TTFT_RATIOS
                                                            for label in (num, den)}
        ttft: dict[str, list[float]] = {s.label: [] for s in running if s.label in timed and shorts is not None}
        for r in range(rounds):
            for s in running:
                rates[s.label].append(rate(s))
                if s.label in ttft:
                    ttft[s.label].append(stream_once(s.api, s.model, shorts[r], 2, extra=s.extra).ttft_s)
            log(f"paired round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()))
    return {"rounds": rounds, "rates": rates, "ratios": ratios(rates), "ttft": ttft,
            "ttft_ratios": ratios(ttft, TTFT_RATIOS, at_most=True), "prompt_ttft": prompt_ttft}
