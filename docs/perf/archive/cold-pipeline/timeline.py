"""One cold 2,316-token chat turn on a 2-node ring with stage traces: each node's chunk timeline (env CUTS: --pipeline-cuts, CHUNK: --prefill-chunk, R: turns, HEAD: chunks shown a node)."""
import os, sys, time, tempfile, collections
from pathlib import Path
folder = Path(tempfile.mkdtemp(prefix="cold-")); os.environ["DGR_STEP_TRACE"] = str(folder)
from dgr.bench.prefix import _route, stream_chat, system_prompt, QUESTIONS
from dgr.node import steptrace
from dgr.testing.harness import LocalRoute
ch = os.environ.get("CHUNK", "512"); cuts = os.environ.get("CUTS", "32")
with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=600, busy_poll_ms=None,
                extra=("--threads", "1", "--ctx", "4096", "--max-sessions", "4", "--prefill-chunk", ch, "--pipeline-cuts", cuts)) as route:
    order = None
    res = []
    for r in range(int(os.environ.get("R", "2"))):
        msgs = [{"role": "system", "content": system_prompt(2260, log_no=r + 11)}, {"role": "user", "content": QUESTIONS[0]}]
        t0 = time.monotonic_ns()
        out = stream_chat(route.api, "SmolLM2-135M-Instruct.Q4_1", msgs, 32)
        res.append((t0, out["ttft_s"]))
    order = [n["node"] for n in sorted(route.node_table(), key=lambda n: int(n["layers"].split(":")[0]))]
    print([n["layers"] for n in sorted(route.node_table(), key=lambda n: int(n["layers"].split(":")[0]))])
t0, ttft = res[-1]
print("chunk", ch, "ttfts", [round(x[1], 3) for x in res], "answer", repr(out["text"][:60]))
for node in order:
    marks = [m for m in steptrace.read_marks(folder / f"{node}.tsv") if m[3] >= t0]
    by = collections.defaultdict(dict)
    for stage, sid, pos, ns in marks:
        by[(sid, pos)].setdefault(stage, ns)
    for (sid, pos), st in sorted(by.items(), key=lambda kv: min(kv[1].values()))[:int(os.environ.get("HEAD", "12"))]:
        f = lambda k: "%7.0f" % ((st[k] - t0) / 1e6) if k in st else "      -"
        print(node, "pos %5d" % pos, " ".join(f"{k}={f(k)}" for k in ("read", "iterate", "compute", "computed", "finished", "send:on", "send:answer")))
