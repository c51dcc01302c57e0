"""`python -m dgr.bench.repair`: a route repaired under kills, answer for answer, with its pauses (issue 54).

A local route (`dgr up --resume --spares 1`, 3 ranges of the default model
by default) answers greedy and seeded prompts of about 50 and about 2,000
tokens. Each answer is first run whole, then again while one node of its
route is killed with SIGKILL at token `--kill-at` (the head, the middle and
the tail in turn, `--kills` times each), and must equal the whole run token
for token. The killed node is started again before the next kill, so a spare
of every range is there for each.

Figures, per prompt size: the pause a client saw (the last token before the
kill to the first after, from the Route Session's telemetry and, beside it,
from the client's own clock), split into detection (kill to the gateway
learning it: the telemetry's `detect_ms` counts from the last token, so the
kill's own time is taken from this process), re-routing and KV rebuild, each
as p50 and p99; and kills during the prefill of the long prompt. The
control (`--no-resume`): the same kill ends the stream with
`route_node_lost`, and the time from the kill to that error is the figure.

One job: drive the kills and report; the route is dgr.testing.harness's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import attrs

from dgr.testing.harness import LocalRoute, sse_events

__all__ = ["RepairBench", "main"]

SHORT = ("Write a short story about a lighthouse keeper who finds a message in a bottle on the beach. The "
         "message is written in an old hand, and it names the keeper, his village and a ship that sank a "
         "hundred years ago. Begin with the morning he finds it. ")  # about 50 tokens
LONG_UNIT = ("The history of the lighthouse goes back to the ancient world, when fires on hilltops guided ships "
             "into harbour, and the keepers who tended them wrote down every ship that passed. ")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 1)


@attrs.define
class RepairBench:
    route: LocalRoute
    model: str
    tokens: int = 128
    kill_at: int = 40
    kills: int = 10
    resume: bool = True
    rows: list[dict[str, Any]] = attrs.field(factory=list)

    def _body(self, prompt: str, sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.tokens, "ignore_eos": True, **sampling}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def whole(self, prompt: str, sampling: dict[str, Any]) -> str:
        r = self.route.http.post(f"{self.route.api}/completions", json=self._body(prompt, sampling, False),
                                 headers=self.route.headers, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def killed(self, prompt: str, sampling: dict[str, Any], hop: int, in_prefill: bool) -> dict[str, Any]:
        """One stream whose route's node at `hop` is SIGKILLed at token `kill_at` (or mid-prefill)."""
        route, out = self.route, {"node": None, "kill_t": None, "error": None, "gap_ms": None}
        pieces: list[str] = []
        stamps: list[float] = []

        def kill(sid: str) -> None:
            out["node"] = route.session(sid)["route"][hop]["node"]
            out["kill_t"] = route.kill(out["node"])

        with route.http.stream("POST", f"{route.api}/completions", json=self._body(prompt, sampling, True),
                               headers=route.headers, timeout=600) as r:
            sid = r.headers["X-Dgr-Route-Session"]
            if in_prefill:
                route.when(sid, lambda snap: snap["phase"] == "prefill" and snap["prefill"]["done"] > 0,
                           lambda: kill(sid), timeout_s=120).join(120)
            for kind, data in sse_events(r):
                if kind != "data" or not isinstance(data, dict):
                    continue
                if "error" in data:
                    out["error"] = data["error"]
                    out["error_ms"] = round((time.monotonic() - out["kill_t"]) * 1e3, 1) if out["kill_t"] else None
                    continue
                if data.get("choices") and data["choices"][0].get("text"):
                    pieces.append(data["choices"][0]["text"])
                    stamps.append(time.monotonic())
                    if len(pieces) == self.kill_at and out["node"] is None and not in_prefill:
                        kill(sid)
        if out["kill_t"] is not None:
            after = [t for t in stamps if t > out["kill_t"]]
            before = [t for t in stamps if t <= out["kill_t"]]
            if after and before:
                out["gap_ms"] = round((after[0] - before[-1]) * 1e3, 1)
        snap = route.wait_session_ended(sid, 120)
        out |= {"text": "".join(pieces), "repairs": snap.get("repairs", []), "phase": snap["phase"]}
        if out["repairs"] and out["kill_t"] is not None:
            # the telemetry's detect_ms counts from the last token; the kill itself came later than that
            rep = out["repairs"][0]
            out["detect_from_kill_ms"] = round(rep["detect_ms"] - (out["kill_t"] - before[-1]) * 1e3, 1) \
                if out["gap_ms"] is not None and rep.get("detect_ms") is not None else None
        return out

    def revive(self, node: str) -> None:
        """Start the killed node again, so that the next kill finds a spare of its range."""
        layers = next(n["layers"] for n in self.route.node_table() if n["node"] == node)
        self.route.restart_node(node, layers)

    def run(self, label: str, prompt: str, sampling: dict[str, Any], hops: list[int], in_prefill: bool = False,
            kills: int | None = None) -> None:
        want = self.whole(prompt, sampling)
        for _ in range(kills if kills is not None else self.kills):
            for hop in hops:
                got = self.killed(prompt, sampling, hop, in_prefill)
                row = {"case": label, "hop": hop, "node": got["node"], "equal": got["text"] == want,
                       "phase": got["phase"], "error": (got["error"] or {}).get("code"),
                       "error_ms": got.get("error_ms"), "gap_ms": got["gap_ms"],
                       "detect_from_kill_ms": got.get("detect_from_kill_ms")}
                if got["repairs"]:
                    rep = got["repairs"][0]
                    row |= {k: rep.get(k) for k in ("pause_ms", "detect_ms", "reroute_ms", "rebuild_ms")}
                    row |= {"rebuilt": rep["rebuild"]["total"] - rep["rebuild"]["reused"],
                            "repairs": len(got["repairs"])}
                self.rows.append(row)
                print(json.dumps(row), file=sys.stderr)
                if got["node"] is not None:
                    self.revive(got["node"])

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for case in dict.fromkeys(r["case"] for r in self.rows):
            rows = [r for r in self.rows if r["case"] == case]
            s = {"runs": len(rows), "equal": sum(r["equal"] for r in rows),
                 "failed": sum(r["phase"] != "done" for r in rows)}
            for key in ("pause_ms", "gap_ms", "detect_ms", "detect_from_kill_ms", "reroute_ms", "rebuild_ms",
                        "error_ms"):
                vals = [r[key] for r in rows if r.get(key) is not None]
                if vals:
                    s[key] = {"p50": _pct(vals, 0.5), "p99": _pct(vals, 0.99), "max": round(max(vals), 1)}
            out[case] = s
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.bench.repair", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("llama_shard", "stub"), default="llama_shard")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--kills", type=int, default=10, help="kills of each hop, per case")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--kill-at", type=int, default=40)
    p.add_argument("--long-units", type=int, default=62, help="repeats of a 32-token sentence: the long prompt")
    p.add_argument("--no-resume", action="store_true", help="the control: no --resume, each kill must fail fast")
    p.add_argument("--cases", default="short,seeded,long,prefill", help="which of short,seeded,long,prefill")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="nodes keep no prefix (--prefix-cache-mb 0): the killed run computes its prompt instead of "
                        "reusing the whole run's, so a repair feeds its spare from journals (a reused prefix is "
                        "in none: that repair computes every position on every hop)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    extra = ["--spares", "1", "--dead-after", "1", "--ctx", "4096"]
    if not args.no_resume:
        extra.append("--resume")
    if args.no_prefix_cache:
        extra += ["--prefix-cache-mb", "0"]
    if args.backend == "stub":  # 2 ms a position a node: an answer long enough to be killed mid-way
        extra += ["--stub-delay", "0.002"]
    hops = list(range(args.nodes))
    with LocalRoute(backend=args.backend, nodes=args.nodes, extra=tuple(extra), ready_timeout_s=300) as route:
        model = route.http.get(f"{route.api}/models", headers=route.headers).json()["data"][0]["id"]
        bench = RepairBench(route, model, args.tokens, args.kill_at, args.kills, not args.no_resume)
        long_prompt = LONG_UNIT * args.long_units
        cases = args.cases.split(",")
        if "short" in cases:
            bench.run("short greedy", SHORT, {"temperature": 0}, hops)
        if "seeded" in cases:
            bench.run("short seeded", SHORT, {"temperature": 0.8, "top_p": 0.95, "seed": 54}, hops,
                      kills=max(1, args.kills // 5))
        if "long" in cases:
            bench.run("long greedy", long_prompt, {"temperature": 0}, hops)
        if "prefill" in cases:
            bench.run("long greedy, killed in prefill", long_prompt, {"temperature": 0}, hops, in_prefill=True,
                      kills=max(1, args.kills // 5))
        prompt_tokens = {}
        for label, prompt in (("short", SHORT), ("long", long_prompt)):
            r = route.http.post(f"{route.api}/completions", headers=route.headers, timeout=600,
                                json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            prompt_tokens[label] = r.json()["usage"]["prompt_tokens"]
    summary = bench.summary()
    print(f"repair bench: {args.backend}, {args.nodes} ranges + 1 spare each, resume={not args.no_resume}, "
          f"{args.tokens} tokens, kill at {args.kill_at}, prompts {prompt_tokens}")
    for case, s in summary.items():
        print(f"  {case}: {s['equal']}/{s['runs']} equal to the whole run, {s['failed']} failed")
        for key in ("pause_ms", "gap_ms", "detect_ms", "detect_from_kill_ms", "reroute_ms", "rebuild_ms", "error_ms"):
            if key in s:
                print(f"    {key:20s} p50 {s[key]['p50']:>9} p99 {s[key]['p99']:>9} max {s[key]['max']:>9}")
    if args.json:
        print(json.dumps({"prompt_tokens": prompt_tokens, "summary": summary, "rows": bench.rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
