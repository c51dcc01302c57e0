"""CPU per token of each process of a 2-node stub route (its tracker, then its nodes in pid order: head, tail),
one session of 1,024 tokens then 32 sessions of 128; prints JSON. CPU time from /proc (10 ms ticks) holds up
on a loaded machine where tok/s does not."""
import os, sys, time, glob, json
from dgr.bench.measure import concurrent, stream_once
from dgr.testing.harness import LocalRoute
PROMPT = "The lighthouse keeper wrote down every ship that passed the point"
TCK = os.sysconf("SC_CLK_TCK")
def descendants(pid):
    out = []
    for st in glob.glob("/proc/[0-9]*/stat"):
        try:
            f = open(st).read().rsplit(")", 1)[1].split()
            if int(f[1]) == pid:
                c = int(st.split("/")[2]); out.append(c); out += descendants(c)
        except Exception: pass
    return out
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK
def role(pid):
    a = open(f"/proc/{pid}/cmdline").read().split("\0")
    return "tracker" if "tracker" in a else "node" if "node" in a else "up" if "up" in a else "other"
out = {"tree": os.environ.get("PYTHONPATH", ""), "load": open("/proc/loadavg").read().split()[0]}
with LocalRoute(backend="stub", nodes=2, ready_timeout_s=120, busy_poll_ms=None,
                extra=("--ctx", "2048", "--max-sessions", "32")) as route:
    stream_once(route.api, "stub", PROMPT, 8)
    kids = descendants(os.getpid())
    for which in ("one", "many"):
        c0 = {k: cpu(k) for k in kids}
        if which == "one":
            n = 1024; r = stream_once(route.api, "stub", PROMPT, n).decode_tok_s
        else:
            n = 128 * 32; r = concurrent(route.api, "stub", PROMPT, 128, 32)["aggregate_tok_s"]
        ks = sorted(kids)[-3:]
        d = {name: round((cpu(k) - c0[k]) / n * 1e6) for name, k in zip(("tracker", "node1", "node2"), ks)}
        out[which] = {"tok_s": round(r), "cpu_us_per_token": d}
print(json.dumps(out), flush=True)
