"""`python -m dgr.bench.opening`: time to first token as a route opens, at an RTT between machines (issue 41).

How many round trips come before compute depends on what the prompt shares with what the route kept
(dgr.tracker.opening): this bench asks a namespaced ring (dgr.bench.netns: any two machines see the
same RTT; the client and the tracker share one) for, in each round and at each RTT:
- `cold`: a completion from an API key not used before (kept prefixes are not shared between keys);
- `new key's chat`: a chat's first message, from another key not used before;
- `first turn`: a chat's first message from a key that chatted before (the template's opening is kept);
- `follow-up`: the same chat's second turn (its first turn and answer are kept);
- `follow-up, busy`: another chat's second turn, sent while a third session prefills a long prompt.
Each figure is the median over rounds of the time from sending the request to its first streamed token,
with the prompt tokens the route reused. Greedy, 8 tokens, the default model, 1 thread a node.

`--tree PATH` runs the route's processes from another checkout of dgr (its `PYTHONPATH`), so one
command measures the code before a change beside the code after it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


from dgr.bench.measure import cached_tokens, stream_once
from dgr.bench.netns import NetnsRoute, prerequisites
from dgr.bench.prefix import stream_chat

__all__ = ["run_opening", "markdown"]

KINDS = ("cold", "new key's chat", "first turn", "follow-up", "follow-up, busy")
_WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper")
_LONG = "The keeper wrote down every ship that passed the light, its flag, its cargo and its hour. " * 40


def _chat(api: str, model: str, messages: list[dict[str, str]], headers: dict[str, str]) -> dict[str, Any]:
    r = stream_chat(api, model, messages, 8, headers=headers)
    return {"ttft_s": r["ttft_s"], "prompt_tokens": r["usage"].get("prompt_tokens", 0),
            "reused": cached_tokens(r["usage"]), "text": r["text"]}


def _completion(api: str, model: str, prompt: str, headers: dict[str, str], max_tokens: int = 8) -> dict[str, Any]:
    r = stream_once(api, model, prompt, max_tokens, headers=headers)
    return {"ttft_s": r.ttft_s, "prompt_tokens": r.prompt_tokens, "reused": r.reused}


def _round(route: NetnsRoute, model: str, n: int, fresh: list[str]) -> dict[str, dict[str, Any]]:
    api, h = route.api, route.headers
    word = f"{_WORDS[n % len(_WORDS)]}{secrets.token_hex(2)}"
    out = {"cold": _completion(api, model, f"{word} is a word I made up. It means",
                               {"Authorization": f"Bearer {fresh.pop()}"})}
    ask = [{"role": "user", "content": f"In one line: what could a {word} be?"}]
    out["new key's chat"] = _chat(api, model, ask, {"Authorization": f"Bearer {fresh.pop()}"})
    out["first turn"] = first = _chat(api, model, ask, h)
    follow = [*ask, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And why?"}]
    out["follow-up"] = _chat(api, model, follow, h)
    other = [{"role": "user", "content": f"Name a colour like {word}."}]
    said = _chat(api, model, other, h)["text"]
    long = threading.Thread(target=_completion, args=(api, model, f"{word} {_LONG}", h, 1))
    long.start()
    time.sleep(0.3)  # its prompt is in prefill on the head by now
    out["follow-up, busy"] = _chat(api, model, [*other, {"role": "assistant", "content": said},
                                                {"role": "user", "content": "Why that one?"}], h)
    long.join()
    return out


def run_opening(log, nodes: int, rtts_ms: tuple[float, ...], rounds: int, tree: str | None = None) -> dict[str, Any]:
    """Each kind's TTFT at each RTT on one `nodes`-node ring of the default model (see the module)."""
    why = prerequisites()
    if why is not None:
        return {"skipped": why}
    here = Path.cwd()
    if tree is not None:
        # `python -m dgr` puts its working directory ahead of PYTHONPATH: the processes start in the tree
        os.environ["PYTHONPATH"] = str(Path(tree).resolve())
        os.chdir(tree)
        got = subprocess.run([sys.executable, "-c", "import dgr; print(dgr.__file__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if not Path(got).resolve().is_relative_to(Path(tree).resolve()):
            raise RuntimeError(f"a process started in {tree} imports dgr from {got}")
    try:
        return _measure(log, nodes, rtts_ms, rounds, tree)
    finally:
        os.chdir(here)


def _measure(log, nodes: int, rtts_ms: tuple[float, ...], rounds: int, tree: str | None) -> dict[str, Any]:
    res: dict[str, Any] = {"nodes": nodes, "rounds": rounds, "tree": tree or "this one",
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    fresh = ["dgrb-" + secrets.token_hex(16) for _ in range(2 * rounds * len(rtts_ms))]
    with NetnsRoute(backend="llama_shard", nodes=nodes, threads=1, ready_timeout_s=600.0,
                    other_keys=tuple(fresh)) as route:
        model = route.model_id()
        for rtt in rtts_ms:
            route.set_rtt(rtt)
            _completion(route.api, model, "Warm up.", route.headers)
            runs = [_round(route, model, n, fresh) for n in range(rounds)]
            for kind in KINDS:
                got = [r[kind] for r in runs]
                row = {"rtt_ms": rtt, "kind": kind, "ttft_s": statistics.median(g["ttft_s"] for g in got),
                       "ttft_all_s": [round(g["ttft_s"], 4) for g in got],
                       "reused": statistics.median(g["reused"] for g in got),
                       "prompt_tokens": statistics.median(g["prompt_tokens"] for g in got)}
                res["rows"].append(row)
                log(f"{nodes} nodes, {rtt:g} ms, {kind}: TTFT {row['ttft_s'] * 1e3:.0f} ms, "
                    f"reused {row['reused']:g} of {row['prompt_tokens']:g}")
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return res


def markdown(res: dict[str, Any]) -> list[str]:
    if "skipped" in res:
        return [f"Skipped: {res['skipped']}"]
    lines = [f"{res['nodes']}-node ring, the route's processes from {res['tree']}, {res['rounds']} rounds: "
             "TTFT is the median time from sending the request to its first token; reused, the median prompt "
             "tokens a kept prefix supplied.", "",
             "| RTT ms | request | TTFT ms | each round, ms | reused / prompt tokens |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        each = ", ".join(f"{t * 1e3:.0f}" for t in r["ttft_all_s"])
        lines.append(f"| {r['rtt_ms']:g} | {r['kind']} | {r['ttft_s'] * 1e3:.0f} | {each} | "
                     f"{r['reused']:g} / {r['prompt_tokens']:g} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.bench.opening", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rtt", type=float, action="append", help="ms between machines (repeat; default 0 and 50)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tree", help="run the route's processes from this checkout of dgr")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    res = run_opening(lambda line: print(f"[bench] {line}", flush=True), args.nodes, tuple(args.rtt or (0.0, 50.0)),
                      args.rounds, args.tree and str(Path(args.tree).resolve()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    command = " ".join(argv if argv is not None else sys.argv[1:])
    (out / "REPORT.md").write_text("\n".join(["# dgr benchmark: time to first token as a route opens", "",
                                              f"Run {res.get('started')} to {res.get('finished')}: "
                                              f"`python -m dgr.bench.opening {command}`.", "", *markdown(res), ""]))
    print(f"report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
