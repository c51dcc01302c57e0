"""Stub ceiling: a 2-node stub ring, one session then 32 at once; prints tok/s as JSON."""
import json, os, sys, time
from dgr.bench.measure import concurrent, stream_once
from dgr.testing.harness import LocalRoute

PROMPT = "The lighthouse keeper wrote down every ship that passed the point"
one_tokens = int(os.environ.get("ONE_TOKENS", "512"))
many_tokens = int(os.environ.get("MANY_TOKENS", "128"))
sessions = int(os.environ.get("SESSIONS", "32"))
rounds = int(os.environ.get("ROUNDS", "2"))
which = os.environ.get("WHICH", "one,many").split(",")
with LocalRoute(backend="stub", nodes=2, ready_timeout_s=120, busy_poll_ms=None,
                extra=("--ctx", "2048", "--max-sessions", str(max(sessions, 8)))) as route:
    stream_once(route.api, "stub", PROMPT, 8)
    out = {"tree": os.environ.get("PYTHONPATH", ""), "load": open("/proc/loadavg").read().split()[0]}
    if "one" in which:
        out["one"] = [round(stream_once(route.api, "stub", PROMPT, one_tokens).decode_tok_s, 1) for _ in range(rounds)]
    if "many" in which:
        runs = [concurrent(route.api, "stub", PROMPT, many_tokens, sessions) for _ in range(rounds)]
        out["many"] = [round(r["aggregate_tok_s"], 1) for r in runs]
        out["errors"] = sum(r["errors"] for r in runs)
    if os.environ.get("PAUSE"):
        input()
print(json.dumps(out), flush=True)
