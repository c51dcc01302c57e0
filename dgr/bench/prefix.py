"""`dgr bench --only prefix`: issue 43's chat, turn by turn, dgr beside llama-server.

The chat: a system prompt of about 2,260 tokens (of the default model's
tokenizer) and 6 short questions, answers of at most 32 tokens, greedy.
Setups, both up for the whole run, on the same cores:
- dgr: a 2-node llama_shard route in the default topology, 1 thread per node
  (threads // 2), prefix reuse as the product ships it;
- llama-server: `threads` threads, `cache_prompt` on (it keeps its one slot's
  prompt and answer and prefills what differs), built from the same vendored
  llama.cpp (dgr.bench.peers).
TTFT is request start to the first streamed content chunk.

Rules:
- Paired and interleaved: each turn is asked of both setups back to back
  with the same messages (the alternation of who goes first flips each
  turn), so the machine's drift (other processes on the 2 cores) hits both
  alike. The ratio dgr / llama-server is taken pair by pair.
- Every repeat is a fresh conversation: its system prompt starts with a line
  of its own, so neither setup holds any of it, and turn 1 is a cold prefill
  on both (dgr also gets an API key of its own per repeat).
- The history is dgr's answers: each setup's turn t sees the same tokens.
- The verdicts use the median of the paired ratios over the repeats: turn 1
  against `COLD_BOUND`, every later turn against `FOLLOW_UP_BOUND` (issue 43).
  Min and median TTFTs of each setup are reported beside them, and the load
  average of the machine before and after.

Left out: reuse off (`--no-prefix-reuse`: every turn then costs a cold
prefill), sampling, concurrency (tests/test_prefix.py holds the
8-conversation budget check).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from typing import Any, Callable

import httpx

from dgr.bench.measure import cached_tokens
from dgr.models import default_model_path
from dgr.testing.harness import LocalRoute

__all__ = ["COLD_BOUND", "FOLLOW_UP_BOUND", "QUESTIONS", "SYSTEM_TOKENS", "run_prefix", "stream_chat",
           "system_prompt"]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SYSTEM_TOKENS = 2260  # issue 43's system prompt
COLD_BOUND = 1.1  # turn 1: dgr's TTFT at most this times llama-server's
FOLLOW_UP_BOUND = 1.5  # turns 2 on
QUESTIONS = (
    "Which ships came in first?", "Which of them carried timber?", "When was the tide highest?",
    "Did any ship leave at night?", "Which berth was busiest?", "Was there fog?",
)
_SHIPS = ("Aurora", "Cormorant", "Meridian", "Saltmarsh", "Kestrel", "Wayfarer", "Halcyon", "Northstar")
_CARGO = ("timber", "grain", "coal", "salt", "wool", "iron", "fish", "lamp oil")


def system_prompt(tokens: int = SYSTEM_TOKENS, log_no: int = 1) -> str:
    """A harbour log of about `tokens` tokens: varied enough that no two blocks of it repeat.

    `log_no` changes its first line only, so two conversations share none of their prompts' KV.
    """
    from dgr.backends.gguf_text import GgufText

    text = GgufText.load(default_model_path())
    lines = [f"Harbour log {log_no}. You are the harbour master's assistant. Answer from the log below, briefly.", ""]
    i = 0
    while len(text.tokenize("\n".join(lines), add_special=False, parse_special=False)) < tokens:
        ship, cargo = _SHIPS[i % len(_SHIPS)], _CARGO[(i * 3) % len(_CARGO)]
        lines.append(f"Entry {i + 1}: at {6 + i % 14:02d}:{(i * 7) % 60:02d} the {ship} reached berth {1 + i % 5} "
                     f"with {10 + i * 3 % 90} tons of {cargo}; wind {['north', 'west', 'south', 'east'][i % 4]}, "
                     f"tide {['rising', 'high', 'falling', 'low'][(i // 2) % 4]}, signed by officer {chr(65 + i % 26)}.")
        i += 1
    return "\n".join(lines)


def stream_chat(api: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed greedy chat completion: TTFT, its text, its usage block and llama-server's timings."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    first, text, usage, timings = None, [], {}, {}
    with httpx.stream("POST", f"{api}/chat/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            usage = data.get("usage") or usage
            timings = data.get("timings") or timings  # llama-server's: prompt_n is what it prefilled
            for choice in data.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "text": "".join(text), "usage": usage, "timings": timings}


def _route(per_node: int) -> LocalRoute:
    # no --prefill-chunk: the route cuts prefill as the product does
    return LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=600, busy_poll_ms=None,  # the product's default
                      extra=("--threads", str(per_node), "--ctx", "4096", "--max-sessions", "4"))


def run_prefix(threads: int, log: Callable[[str], None], peers: bool = True, max_tokens: int = 32,
               repeats: int = 3) -> dict[str, Any]:
    """Per-turn TTFT of both setups over `repeats` fresh conversations, with the paired ratios and verdicts."""
    per_node = max(1, threads // 2)
    turns = len(QUESTIONS)
    out: dict[str, Any] = {"threads": threads, "threads_per_node": per_node, "turns": turns,
                           "topology": "ring", "max_tokens": max_tokens, "repeats": repeats,
                           "system_tokens_target": SYSTEM_TOKENS, "cold_bound": COLD_BOUND,
                           "follow_up_bound": FOLLOW_UP_BOUND, "load_before": list(os.getloadavg())}
    dgr: list[list[dict[str, Any]]] = []  # [repeat][turn]
    server: list[list[dict[str, Any]]] = []
    log(f"prefix: dgr llama_shard x2 ring ({per_node} thread(s) per node)"
        + (f" beside llama-server ({threads} threads, cache_prompt)" if peers else ""))
    with _route(per_node) as route:
        srv_ctx = None
        if peers:
            from dgr.bench.peers import LlamaServer, ensure_tools

            srv_ctx = LlamaServer(ensure_tools(log), str(default_model_path()), threads, 4096)
            srv_ctx.__enter__()
        try:
            stream_chat(route.api, MODEL, [{"role": "user", "content": "warm up"}], 2, headers={"Authorization": "x"})
            if srv_ctx is not None:
                stream_chat(srv_ctx.api, "x", [{"role": "user", "content": "warm up"}], 2)
            for r in range(repeats):
                messages = [{"role": "system", "content": system_prompt(SYSTEM_TOKENS, log_no=r + 1)}]
                key = {"Authorization": f"Bearer bench-conversation-{r}"}  # no prefix of another repeat
                d_rows, s_rows = [], []
                for t, q in enumerate(QUESTIONS):
                    messages.append({"role": "user", "content": q})

                    def ask_dgr() -> None:
                        c0 = _prefill_compute(route)
                        d_rows.append(stream_chat(route.api, MODEL, messages, max_tokens, headers=key))
                        d_rows[-1]["node_prefill_s"] = _prefill_compute(route) - c0

                    def ask_server() -> None:
                        s_rows.append(stream_chat(srv_ctx.api, "x", messages, max_tokens,
                                                  extra={"cache_prompt": True}))

                    order = [ask_dgr] + ([ask_server] if srv_ctx is not None else [])
                    for ask in (order if (r + t) % 2 == 0 else order[::-1]):
                        ask()
                    log(f"prefix: repeat {r + 1} turn {t + 1}: dgr {d_rows[-1]['ttft_s']:.2f} s"
                        + (f", llama-server {s_rows[-1]['ttft_s']:.2f} s" if s_rows else ""))
                    messages.append({"role": "assistant", "content": d_rows[-1]["text"]})
                dgr.append(d_rows)
                server.append(s_rows)
        finally:
            if srv_ctx is not None:
                srv_ctx.__exit__(None, None, None)
    out["load_after"] = list(os.getloadavg())
    out["prompt_tokens"] = [dgr[0][t]["usage"].get("prompt_tokens", 0) for t in range(turns)]
    out["dgr_cached_tokens"] = [[cached_tokens(run[t]["usage"]) for run in dgr] for t in range(turns)]
    out["dgr_ttft_s"] = [[run[t]["ttft_s"] for run in dgr] for t in range(turns)]
    out["dgr_node_prefill_s"] = [[run[t]["node_prefill_s"] for run in dgr] for t in range(turns)]
    out["answers_equal_across_repeats"] = [len({run[t]["text"] for run in dgr}) == 1 for t in range(turns)]
    # what runs on two trees are compared by: a change of speed must leave every answer as it was
    out["dgr_answers_sha256"] = [[hashlib.sha256(run[t]["text"].encode()).hexdigest()[:16] for run in dgr]
                                 for t in range(turns)]
    if server and server[0]:
        out["server_ttft_s"] = [[run[t]["ttft_s"] for run in server] for t in range(turns)]
        out["server_prefilled"] = [[run[t]["timings"].get("prompt_n") for run in server] for t in range(turns)]
        out["answers_equal_to_server"] = [sum(d[t]["text"] == s[t]["text"] for d, s in zip(dgr, server))
                                          for t in range(turns)]
        ratios = [[a / b for a, b in zip(out["dgr_ttft_s"][t], out["server_ttft_s"][t])] for t in range(turns)]
        out["ratios"] = ratios
        out["ratio_median"] = [statistics.median(x) for x in ratios]
        out["cold_ratio"] = out["ratio_median"][0]
        out["cold_pass"] = out["cold_ratio"] <= COLD_BOUND
        out["worst_follow_up_ratio"] = max(out["ratio_median"][1:])
        out["follow_up_pass"] = out["worst_follow_up_ratio"] <= FOLLOW_UP_BOUND
    return out


def _prefill_compute(route: LocalRoute) -> float:
    """Seconds the route's nodes have spent on prefill steps so far, from their /metrics."""
    total = 0.0
    for node in route.node_table():
        for line in httpx.get(f"{node['url']}/metrics", timeout=10).text.splitlines():
            if line.startswith('dgr_node_compute_seconds_sum{kind="PREFILL"}'):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _ms(values: list[float]) -> str:
    return f"{min(values) * 1e3:.0f} / {statistics.median(values) * 1e3:.0f}"


def markdown(res: dict[str, Any]) -> list[str]:
    if "dgr_ttft_s" not in res:  # a result from before the 6-turn chat
        return ["", "## Conversations: prefix reuse", "", "(a result of an older `dgr bench --only prefix`)"]
    peers = "server_ttft_s" in res
    lines = ["", "## Issue 43's chat (`dgr bench --only prefix`)", "",
             (f"A {res['turns']}-turn chat with a system prompt of about {res['system_tokens_target']} tokens "
              f"(turn 1's whole prompt: {res['prompt_tokens'][0]} tokens) and answers of at most "
              f"{res['max_tokens']} tokens, greedy. dgr: a 2-node llama_shard {res['topology']} route, "
              f"{res['threads_per_node']} thread(s) per node; llama-server: {res['threads']} threads, "
              f"`cache_prompt` on; both up at once on the same cores. {res['repeats']} fresh conversations, each "
              "turn asked of both back to back with the same messages (dgr's answers as the history); the ratio "
              "is dgr / llama-server pair by pair, and the verdicts use its median. TTFTs are min / median over "
              f"the repeats. Load average (1 min) {res['load_before'][0]:.1f} before, {res['load_after'][0]:.1f} "
              "after: other work shared the cores."), "",
             "| turn | prompt tokens | dgr reused (min) | dgr TTFT ms | dgr nodes' prefill compute, both summed, ms (min) | "
             + ("llama-server prefilled | llama-server TTFT ms | ratio (median) | bound | verdict |" if peers else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|---|" if peers else "")]
    for t in range(res["turns"]):
        row = (f"| {t + 1} | {res['prompt_tokens'][t]} | {min(res['dgr_cached_tokens'][t])} | "
               f"{_ms(res['dgr_ttft_s'][t])} | {min(res['dgr_node_prefill_s'][t]) * 1e3:.0f} |")
        if peers:
            bound = res["cold_bound"] if t == 0 else res["follow_up_bound"]
            ratio = res["ratio_median"][t]
            prefilled = [p for p in res["server_prefilled"][t] if p is not None]
            row += (f" {max(prefilled) if prefilled else '-'} | {_ms(res['server_ttft_s'][t])} | {ratio:.2f}x | "
                    f"{bound}x | {'pass' if ratio <= bound else 'FAIL'} |")
        lines.append(row)
    if peers:
        cold_d, cold_s = statistics.median(res["dgr_ttft_s"][0]), statistics.median(res["server_ttft_s"][0])
        lines += ["", f"- Cold first turn: dgr {cold_d:.2f} s, llama-server {cold_s:.2f} s (medians); paired ratio "
                      f"{res['cold_ratio']:.2f}x against a bound of {res['cold_bound']}x: "
                      f"**{'pass' if res['cold_pass'] else 'FAIL'}**.",
                  f"- Turns 2 to {res['turns']}: worst paired ratio {res['worst_follow_up_ratio']:.2f}x against a "
                  f"bound of {res['follow_up_bound']}x: **{'pass' if res['follow_up_pass'] else 'FAIL'}**.",
                  f"- dgr's answers equal llama-server's on {sum(res['answers_equal_to_server'])} of "
                  f"{res['turns'] * res['repeats']} turns (llama-server's own answers; its history is dgr's)."]
    return lines


def plot(res: dict[str, Any], save: Callable) -> None:
    if "dgr_ttft_s" not in res:
        return
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    turns = list(range(1, res["turns"] + 1))
    series = {"dgr, 2-node llama_shard": res["dgr_ttft_s"]}
    if "server_ttft_s" in res:
        series["llama-server, cache_prompt"] = res["server_ttft_s"]
    for label, values in series.items():
        ax.plot(turns, [statistics.median(v) * 1e3 for v in values], marker="o", label=f"{label} (median)")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT ms")
    ax.set_title(f"{res['turns']}-turn chat, {res['prompt_tokens'][0]}-token first prompt")
    ax.set_yscale("log")  # turn 1 is tens of times the reused turns
    ax.legend()
    save(fig, "prefix_ttft.png")
