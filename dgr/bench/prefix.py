"""`dgr bench --only prefix`: a 10-turn chat with a long system prompt, with and without prefix reuse.

Every setup answers the same conversation: the messages of each turn are
the system prompt, the earlier questions, and the answers dgr gave with
reuse on (the first setup run), so every setup prefills the same tokens.
TTFT is request start to the first streamed content chunk, per turn:
- dgr, 2-node llama_shard route (the default topology), reuse on (the default);
- the same route started with `--no-prefix-reuse`;
- llama-server with `cache_prompt` (it keeps its one slot's prompt and
  answer, and prefills what differs), the same total threads;
- "prefill only the new tokens": right after each reuse-on turn, on the same
  route, a completion whose prompt is only the tokens that turn did not
  reuse (its `prompt_tokens - cached_tokens`), from position 0;
- "node compute of the new tokens": what the route's nodes spent on that
  turn's prefill steps (their `dgr_node_compute_seconds{kind="PREFILL"}`),
  the new tokens computed where they are, after the reused prefix: attention
  over the long context makes this dearer than the same tokens at position 0.

Left out: sampling (greedy throughout), concurrency (tests/test_prefix.py
holds the 8-conversation budget check).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import httpx

from dgr.models import default_model_path
from dgr.seam.wire import DEFAULT_TOPOLOGY
from dgr.testing.harness import LocalRoute

__all__ = ["QUESTIONS", "run_prefix", "stream_chat", "system_prompt"]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTIONS = (
    "Which ships came in first?", "Which of them carried timber?", "When was the tide highest?",
    "Did any ship leave at night?", "Which berth was busiest?", "Was there fog?",
    "Who signed the log at noon?", "Which ship was late?", "What did the pilot report?",
    "Summarise the day in one line.",
)
_SHIPS = ("Aurora", "Cormorant", "Meridian", "Saltmarsh", "Kestrel", "Wayfarer", "Halcyon", "Northstar")
_CARGO = ("timber", "grain", "coal", "salt", "wool", "iron", "fish", "lamp oil")


def system_prompt(tokens: int = 1500) -> str:
    """A harbour log of about `tokens` tokens: varied enough that no two blocks of it repeat."""
    from dgr.backends.gguf_text import GgufText

    text = GgufText.load(default_model_path())
    lines = ["You are the harbour master's assistant. Answer from the log below, briefly.", ""]
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
    """One streamed greedy chat completion: TTFT, its text and its usage block."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with httpx.stream("POST", f"{api}/chat/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "text": "".join(text), "usage": usage}


def _turns(system: str, answers: list[str] | None, ask: Callable[[list[dict[str, str]]], dict[str, Any]]
           ) -> list[dict[str, Any]]:
    """The conversation, one `ask` per turn; with `answers`, those are replayed as the assistant's turns."""
    messages = [{"role": "system", "content": system}]
    rows = []
    for t, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        r = ask(messages)
        rows.append(r)
        messages.append({"role": "assistant", "content": answers[t] if answers else r["text"]})
    return rows


def _route(threads: int, extra: tuple[str, ...] = ()) -> LocalRoute:
    return LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=600, busy_poll_ms=None,  # the product's default
                      extra=("--threads", str(threads), "--ctx", "4096", "--prefill-chunk", "512",
                             "--max-sessions", "4", "--topology", DEFAULT_TOPOLOGY.value, *extra))


def run_prefix(threads: int, log: Callable[[str], None], peers: bool = True, max_tokens: int = 32,
               repeats: int = 2) -> dict[str, Any]:
    """TTFT per turn for each setup, with the figures they are compared by; each the best of `repeats` runs."""
    system = system_prompt()
    per_node = max(1, threads // 2)
    out: dict[str, Any] = {"threads": threads, "threads_per_node": per_node, "turns": len(QUESTIONS),
                           "topology": DEFAULT_TOPOLOGY.value,
                           "max_tokens": max_tokens, "repeats": repeats, "setups": {}}

    log(f"prefix: dgr llama_shard x2 {DEFAULT_TOPOLOGY.value}, reuse on ({per_node} thread(s) per node), and "
        "prefilling only the new tokens right after each turn on the same route")
    from dgr.backends.gguf_text import GgufText

    text = GgufText.load(default_model_path())  # tokenizes as the route's head does
    answers: list[str] | None = None  # the first run's; later runs replay them, so every prompt is the same
    on_runs: list[list[dict[str, Any]]] = []
    new_runs: list[list[float]] = []
    compute_runs: list[list[float]] = []
    with _route(per_node) as route:
        stream_chat(route.api, MODEL, [{"role": "user", "content": "warm up"}], 2, headers={"Authorization": "x"})
        for r in range(repeats):
            key = {"Authorization": f"Bearer bench-conversation-{r}"}  # a key of its own: no prefix of another run
            new_only: list[float] = []
            compute: list[float] = []

            def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
                c0 = _prefill_compute(route)
                res = stream_chat(route.api, MODEL, messages, max_tokens, headers=key)
                compute.append(_prefill_compute(route) - c0)
                usage = res["usage"]
                n_new = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
                ids = text.tokenize_chat(messages)[0]
                new_only.append(_completion_ttft(route.api, ids[-n_new:], f"new-{r}-{len(new_only)}"))
                return res

            on_runs.append(_turns(system, answers, ask))
            new_runs.append(new_only)
            compute_runs.append(compute)
            answers = answers or [x["text"] for x in on_runs[0]]
    on = on_runs[0]
    out["prompt_tokens"] = [x["usage"].get("prompt_tokens", 0) for x in on]
    out["cached_tokens"] = [(x["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for x in on]
    out["new_tokens"] = [p - c for p, c in zip(out["prompt_tokens"], out["cached_tokens"])]
    out["setups"]["dgr, reuse on"] = [min(run[t]["ttft_s"] for run in on_runs) for t in range(len(QUESTIONS))]
    out["setups"]["dgr, prefill only the new tokens"] = [min(run[t] for run in new_runs) for t in range(len(QUESTIONS))]
    out["setups"]["dgr, node compute of the new tokens"] = [min(run[t] for run in compute_runs)
                                                            for t in range(len(QUESTIONS))]
    out["answers_equal_across_runs"] = all(x["text"] == a for run in on_runs for x, a in zip(run, answers))

    log("prefix: the same route with --no-prefix-reuse")
    key = {"Authorization": "Bearer bench-conversation"}
    with _route(per_node, ("--no-prefix-reuse",)) as route:
        stream_chat(route.api, MODEL, [{"role": "user", "content": "warm up"}], 2)
        off = _turns(system, answers, lambda m: stream_chat(route.api, MODEL, m, max_tokens, headers=key))
    out["setups"]["dgr, reuse off"] = [x["ttft_s"] for x in off]
    out["answers_equal"] = [a["text"] == b for a, b in zip(off, answers)]

    if peers:
        from dgr.bench.peers import LlamaServer, ensure_tools

        log(f"prefix: llama-server with cache_prompt, {threads} thread(s)")
        with LlamaServer(ensure_tools(log), str(default_model_path()), threads, 4096) as srv:
            stream_chat(srv.api, "x", [{"role": "user", "content": "warm up"}], 2)
            server = _turns(system, answers, lambda m: stream_chat(srv.api, "x", m, max_tokens,
                                                                   extra={"cache_prompt": True}))
        out["setups"]["llama-server, cache_prompt"] = [x["ttft_s"] for x in server]
    reuse, new = out["setups"]["dgr, reuse on"], out["setups"]["dgr, prefill only the new tokens"]
    out["reuse_vs_new_only"] = [a / b for a, b in zip(reuse[1:], new[1:])]
    out["worst_ratio_from_turn_2"] = max(out["reuse_vs_new_only"])
    compute = out["setups"]["dgr, node compute of the new tokens"]
    out["reuse_vs_compute"] = [a / b for a, b in zip(reuse[1:], compute[1:])]
    return out


def _prefill_compute(route: LocalRoute) -> float:
    """Seconds the route's nodes have spent on prefill steps so far, from their /metrics."""
    total = 0.0
    for node in route.node_table():
        for line in httpx.get(f"{node['url']}/metrics", timeout=10).text.splitlines():
            if line.startswith('dgr_node_compute_seconds_sum{kind="PREFILL"}'):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _completion_ttft(api: str, ids: list[int], key: str) -> float:
    """TTFT of a prompt of just `ids` on a fresh session (a key of its own: nothing of it is kept)."""
    from dgr.bench.measure import stream_once

    return stream_once(api, MODEL, ids, 2, headers={"Authorization": f"Bearer {key}"}).ttft_s


def markdown(res: dict[str, Any]) -> list[str]:
    setups = res["setups"]
    lines = ["", "## Conversations: prefix reuse (`dgr bench --only prefix`)", "",
             (f"A {res['turns']}-turn chat with a system prompt of {res['prompt_tokens'][0]} tokens (turn 1's whole "
              f"prompt) and answers of at most {res['max_tokens']} tokens, on a 2-node llama_shard "
              f"{res.get('topology', 'chain')} route "  # results from before the key were all chains
              f"({res['threads_per_node']} thread(s) per node) and on llama-server ({res['threads']} threads, "
              "`cache_prompt`). Every setup gets the same messages (dgr's reuse-on answers). 'new tokens' are "
              "the prompt tokens the reuse-on turn prefilled; 'prefill only the new tokens' is the TTFT of a "
              "prompt of just those tokens on a fresh session. dgr keeps the prompt's whole 64-token blocks "
              "(not the answers', see GatewayConfig.prefix_keep_generated). dgr's reuse-on and new-only figures are "
              f"each the best of {res['repeats']} runs, measured turn by turn on the same route."), "",
             "| turn | prompt tokens | reused | new tokens | " + " | ".join(f"{s} ms" for s in setups)
             + " | reuse on / new only | reuse on / node compute |",
             "|---|---|---|---|" + "---|" * len(setups) + "---|---|"]
    for t in range(res["turns"]):
        ratio = "-" if t == 0 else f"{res['reuse_vs_new_only'][t - 1]:.2f}x"
        vs_compute = "-" if t == 0 else f"{res['reuse_vs_compute'][t - 1]:.2f}x"
        lines.append(f"| {t + 1} | {res['prompt_tokens'][t]} | {res['cached_tokens'][t]} | {res['new_tokens'][t]} | "
                     + " | ".join(f"{v[t] * 1e3:.1f}" for v in setups.values()) + f" | {ratio} | {vs_compute} |")
    lines += ["", f"From turn 2 on, TTFT with reuse is at most {res['worst_ratio_from_turn_2']:.2f}x the time to "
                  f"prefill only the new tokens from position 0, and at most {max(res['reuse_vs_compute']):.2f}x "
                  f"the nodes' compute of those tokens after the reused prefix. Reuse-off answers equal reuse-on answers on "
                  f"{sum(res['answers_equal'])} of {res['turns']} turns."]
    return lines


def plot(res: dict[str, Any], save: Callable) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    turns = list(range(1, res["turns"] + 1))
    for label, values in res["setups"].items():
        ax.plot(turns, [v * 1e3 for v in values], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT ms")
    ax.set_title(f"{res['turns']}-turn chat, {res['prompt_tokens'][0]}-token system prompt")
    ax.set_yscale("log")  # turn 1 and reuse off are tens of times the reused turns
    ax.legend()
    save(fig, "prefix_ttft.png")

