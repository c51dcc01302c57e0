"""Write a benchmark run as Markdown, JSON and PNG plots.

Every number in the tables sits next to its ratio to the baseline measured
in the same run. Plots are written with matplotlib's Agg backend (no screen).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["write_report"]

BASE = "llama-cpp-python direct"
ROUTE_BASE = "dgr llama, 1 node"
PEER_BASE = "llama-server, 1 thread(s)"


def _ratio(x: float | None, base: float | None) -> str:
    if not x or not base:
        return "n/a"
    return f"{x / base:.2f}x"


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(res: dict[str, Any], plots: list[str]) -> str:
    setups = res["setups"]
    base = setups.get(BASE, {})
    lines = [f"# dgr benchmark ({'quick' if res['config']['quick'] else 'full'})", "",
             f"Run {res['started']} to {res['finished']} on one machine, SmolLM2-135M-Instruct Q4_1, "
             f"{res['config']['threads']} threads in total per setup, {res['config']['decode_tokens']} decoded tokens. "
             "Ratios are to llama-cpp-python called directly in the same run."]
    if res["config"].get("only") == "prefix":  # one section, whose setups and baselines it states itself
        lines = ["# dgr benchmark: a 6-turn chat beside llama-server", "", f"Run {res['started']} to {res['finished']} on one machine, "
                 f"SmolLM2-135M-Instruct Q4_1, {res['config']['threads']} threads in total per setup."]
    if res["config"].get("only") == "cpu":
        lines = ["# dgr benchmark: where a route's CPU goes", "", f"Run {res['started']} to {res['finished']} on "
                 "one machine, SmolLM2-135M-Instruct Q4_1 (and the stub backend)."]
    if res["config"].get("only") == "storm":
        lines = ["# dgr benchmark: the storm under contention", "", f"Run {res['started']} to {res['finished']} on "
                 "one machine, SmolLM2-135M-Instruct Q4_1."]
    if res["config"].get("only") == "spec":
        lines = ["# dgr benchmark: speculative decoding across the ring", "", f"Run {res['started']} to "
                 f"{res['finished']} on one machine, SmolLM2-135M-Instruct Q4_1."]
    if res["config"].get("only") == "steps":
        lines = ["# dgr benchmark: where a decoded token's time goes", "", f"Run {res['started']} to "
                 f"{res['finished']} on one machine, SmolLM2-135M-Instruct Q4_1."]
    if res["config"].get("only") == "ceiling":
        lines = ["# dgr benchmark: the stub ceiling", "", f"Run {res['started']} to {res['finished']} on one machine, "
                 "the stub backend."]
    if res["config"].get("only") == "paired":
        lines = ["# dgr benchmark: paired decode", "", f"Run {res['started']} to {res['finished']} on "
                 f"one machine, SmolLM2-135M-Instruct Q4_1, {res['config']['threads']} threads in total per setup, "
                 f"{res['config']['decode_tokens']} decoded tokens."]
    if setups:
        lines += ["", "## Decode and prefill", ""] + _setup_table(setups, base)
    if res.get("paired"):
        lines += _paired_markdown(res["paired"])
    if res.get("inprocess"):
        full = res["inprocess"].get("full model, in process", {})
        lines += ["", "## llama.cpp shards in one process (no HTTP)", "",
                  "| setup | decode tok/s | vs full | prefill tok/s | vs full |", "|---|---|---|---|---|"]
        for label, s in res["inprocess"].items():
            lines.append(f"| {label} | {_f(s['decode_tok_s'])} | {_ratio(s['decode_tok_s'], full.get('decode_tok_s'))} "
                         f"| {_f(s['prefill_tok_s'])} | {_ratio(s['prefill_tok_s'], full.get('prefill_tok_s'))} |")
    if res.get("concurrency"):
        lines += ["", "## Concurrent Route Sessions", "",
                  "| setup | sessions | aggregate tok/s | vs 1 session | per-session tok/s | errors |", "|---|---|---|---|---|---|"]
        lines += _concurrency_rows(res["concurrency"])
    if res.get("ttft"):
        lines += ["", "## TTFT by prompt length (ms)", "", "| setup | " + " | ".join(str(n) for n in res["config"]["prompt_lengths"]) + " |",
                  "|---|" + "---|" * len(res["config"]["prompt_lengths"])]
    for label, rows in res["ttft"].items():
        lines.append(f"| {label} | " + " | ".join(_f(rows.get(n, rows.get(str(n))) * 1e3 if rows.get(n, rows.get(str(n))) else None)
                                                   for n in res["config"]["prompt_lengths"]) + " |")
    if res.get("seam") or res.get("torch"):
        lines += ["", "## Seam bytes per decode step, by context length", "",
                  f"Expected for one hidden state: {res['seam_expected_bytes']} bytes (48-byte header + 576 x float32).", "",
                  "| setup | " + " | ".join(str(n) for n in res["config"]["prompt_lengths"]) + " |",
                  "|---|" + "---|" * len(res["config"]["prompt_lengths"])]
    for label, rows in res["seam"].items():
        lines.append(f"| {label} (measured at node1) | " + " | ".join(str(rows.get(n, rows.get(str(n)))) for n in res["config"]["prompt_lengths"]) + " |")
    for label, rows in res.get("torch", {}).items():
        lines.append(f"| {label} (array bytes) | " + " | ".join(_f(r["seam_bytes_per_step"], "{:.0f}") for r in rows.values()) + " |")
    if res.get("torch"):
        lines += ["", "## PyTorch reference: decode ms per token, KV reuse vs full recompute", "",
                  "| setup | " + " | ".join(str(n) for n in res["config"]["prompt_lengths"]) + " |",
                  "|---|" + "---|" * len(res["config"]["prompt_lengths"])]
        for label, rows in res["torch"].items():
            lines.append(f"| {label} | " + " | ".join(_f(r["decode_ms_per_token"]) for r in rows.values()) + " |")
    if res.get("big", {}).get("setups"):
        big = res["big"]
        lines += ["", f"## A 1B-parameter llama shape ({big['model']}, random weights)", "",
                  f"Shape: {big['shape']['n_layers']} layers, hidden size {big['shape']['hidden']}, "
                  f"{big['shape']['heads']} heads ({big['shape']['kv_heads']} KV), FFN {big['shape']['ffn']}, "
                  f"{big['shape']['quant']}. Ratios are to llama-server with 1 thread.", ""]
        lines += _setup_table(big["setups"], big["setups"].get(PEER_BASE, {}), "vs llama-server 1 thread")
        lines += ["", "| setup | sessions | aggregate tok/s | vs 1 session | per-session tok/s | errors |",
                  "|---|---|---|---|---|---|"]
        lines += _concurrency_rows(big["concurrency"])
    if res.get("rtt"):
        lines += _rtt_markdown(res["rtt"])
    if res.get("prefix"):
        from dgr.bench.prefix import markdown as prefix_markdown

        lines += prefix_markdown(res["prefix"])
    if res.get("cpu"):
        from dgr.bench.cpu import markdown as cpu_markdown

        lines += cpu_markdown(res["cpu"])
    if res.get("storm"):
        from dgr.bench.storm import markdown as storm_markdown

        lines += storm_markdown(res["storm"])
    if res.get("spec"):
        from dgr.bench.spec import markdown as spec_markdown

        lines += spec_markdown(res["spec"])
    if res.get("steps"):
        from dgr.bench.steps import markdown as steps_markdown

        lines += steps_markdown(res["steps"])
    if res.get("ceiling"):
        from dgr.bench.ceiling import markdown as ceiling_markdown

        lines += ceiling_markdown(res["ceiling"])
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "Made by `" + _command(res["config"]) + "`."]
    return "\n".join(lines) + "\n"


def _paired_markdown(paired: dict[str, Any]) -> list[str]:
    rounds = paired["rounds"]
    lines = ["", "## Decode and short-prompt TTFT, measured in alternation", "",
             "Every setup below was up at once (idle setups take no CPU) and each round measured each in turn "
             "(one streamed completion; a setup named with N sessions: N streams at once on the bench's story "
             "prompt with half the tokens, rated by their aggregate tok/s), so a slowdown of the machine hits "
             "every setup of a round alike. dgr's routes are rings of 1 "
             "thread a node (2 threads for one "
             "`llama` node). A ratio is the median over rounds of that round's ratio; the range is its lowest "
             "and highest round.", "",
             "| setup | " + " | ".join(f"round {r + 1} tok/s" for r in range(rounds)) + " | median tok/s |",
             "|---|" + "---|" * (rounds + 1)]
    for label, rates in paired["rates"].items():
        lines.append(f"| {label} | " + " | ".join(_f(v) for v in rates) + f" | {_f(statistics.median(rates))} |")
    ttft = paired.get("ttft") or {}
    if ttft:
        lines += ["", "Each round also timed the first token of a short prompt that no setup had seen "
                  "(llama-server's prompt cache off) on the setups below.", "",
                  "| setup | " + " | ".join(f"round {r + 1} TTFT ms" for r in range(rounds)) + " | median ms |",
                  "|---|" + "---|" * (rounds + 1)]
        for label, secs in ttft.items():
            lines.append(f"| {label} | " + " | ".join(_f(v * 1e3) for v in secs)
                         + f" | {_f(statistics.median(secs) * 1e3)} |")
    lines += ["", "| ratio | target | median | range over rounds |", "|---|---|---|---|"]
    for name, r in {**paired["ratios"], **(paired.get("ttft_ratios") or {})}.items():
        bound = "at most" if r.get("at_most") else "at least"
        lines.append(f"| {name} | {bound} {r['target']:.2f}x | {r['median']:.2f}x "
                     f"| {min(r['per_round']):.2f}x to {max(r['per_round']):.2f}x |")
    return lines


def _setup_table(setups: dict[str, Any], base: dict[str, Any], vs: str = "vs direct") -> list[str]:
    lines = [f"| setup | threads per process | decode tok/s | {vs} | prefill tok/s | {vs} | TTFT ms "
             f"| TTFT short prompt ms | hop p50 ms | hop p99 ms | seam bytes/step/hop |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s in setups.items():
        p50 = ", ".join(_f(v, "{:.2f}") for v in (s.get("hop_p50_ms") or {}).values()) or "-"
        p99 = ", ".join(_f(v, "{:.2f}") for v in (s.get("hop_p99_ms") or {}).values()) or "-"
        seam = ", ".join(str(v) for v in list((s.get("seam_bytes_per_step") or {}).values())[1:]) or "-"
        short = s.get("ttft_short_s")
        lines.append(f"| {label} | {s.get('threads_per_node', '-')} | {_f(s.get('decode_tok_s'))} "
                     f"| {_ratio(s.get('decode_tok_s'), base.get('decode_tok_s'))} "
                     f"| {_f(s.get('prefill_tok_s'))} | {_ratio(s.get('prefill_tok_s'), base.get('prefill_tok_s'))} "
                     f"| {_f(s.get('ttft_s', 0) * 1e3)} | {_f(short * 1e3 if short else None)} "
                     f"| {p50} | {p99} | {seam} |")
    return lines


def _concurrency_rows(conc: dict[str, Any]) -> list[str]:
    lines = []
    for label, rows in conc.items():
        one = rows.get(1, rows.get("1", {})).get("aggregate_tok_s")
        for c, r in rows.items():
            lines.append(f"| {label} | {c} | {_f(r['aggregate_tok_s'])} | {_ratio(r['aggregate_tok_s'], one)} "
                         f"| {_f(r['per_session_tok_s'])} | {r['errors']} |")
    return lines


def plots(res: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    if res.get("rtt", {}).get("routes"):
        _rtt_plot(res["rtt"], out, save)
    if res.get("prefix"):
        from dgr.bench.prefix import plot as prefix_plot

        prefix_plot(res["prefix"], save)
    if not res["setups"]:
        return names  # dgr bench --only rtt
    base = res["setups"].get(BASE, {}).get("decode_tok_s")
    labels = list(res["setups"]) + list(res.get("inprocess", {}))
    values = [res["setups"].get(l, res.get("inprocess", {}).get(l, {})).get("decode_tok_s", 0) for l in labels]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.barh(labels, values, color=["#4c72b0" if "in process" not in l else "#55a868" for l in labels])
    for b, v in zip(bars, values):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:.1f} ({v / base:.2f}x)" if base else f" {v:.1f}",
                va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (single session)")
    ax.set_title("Decode speed by setup (ratio to llama-cpp-python direct)")
    ax.set_xlim(0, max(values) * 1.3 if values else 1)
    save(fig, "decode_by_setup.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in res["seam"].items():
        xs = sorted(int(k) for k in rows)
        ax.plot(xs, [rows.get(x, rows.get(str(x))) for x in xs], marker="o", label=f"{label} (per hop, measured)")
    for label, rows in res.get("torch", {}).items():
        xs = sorted(int(k) for k in rows)
        ax.plot(xs, [rows.get(x, rows.get(str(x)))["seam_bytes_per_step"] for x in xs], marker="s", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("seam bytes per decode step")
    ax.set_title("Decode seam traffic vs context length")
    ax.legend(fontsize=8)
    save(fig, "seam_bytes_vs_context.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in res["ttft"].items():
        xs = sorted(int(k) for k in rows)
        ax.plot(xs, [rows.get(x, rows.get(str(x))) * 1e3 for x in xs], marker="o", label=label)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT vs prompt length")
    ax.legend(fontsize=8)
    save(fig, "ttft_vs_prompt.png")

    if res.get("concurrency"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rows in res["concurrency"].items():
            xs = sorted(int(k) for k in rows)
            ax.plot(xs, [rows.get(x, rows.get(str(x)))["aggregate_tok_s"] for x in xs], marker="o", label=label)
        ax.set_xlabel("concurrent Route Sessions")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.set_title("Aggregate throughput vs concurrency")
        ax.legend(fontsize=8)
        save(fig, "aggregate_vs_concurrency.png")
    return names


def _command(cfg: dict[str, Any]) -> str:
    """The command line that makes this report."""
    parts = ["dgr bench"] + (["--quick"] if cfg["quick"] else [])
    parts += (["--peers"] if cfg.get("peers") and cfg.get("only") not in ("peers", "paired") else []) + (["--big"] if cfg.get("big") else [])
    parts += [f"--rtt {r:g}" for r in cfg.get("rtts_ms") or ()]
    if cfg.get("rtt_link", "auto") != "auto":
        parts.append(f"--rtt-link {cfg['rtt_link']}")
    if cfg.get("only"):
        parts.append(f"--only {cfg['only']}")
    return " ".join(parts)


_LINKS = {
    "netem": "a veth pair per endpoint to a forwarding hub namespace, with `tc qdisc ... netem delay RTT/4` on "
             "both ends",
    "tun": "a TUN device per endpoint and a user-space delay line routing each packet to its destination after "
           "RTT/2 (this kernel has no sch_netem); the copy costs tens of microseconds at every RTT, 0 ms included",
}


def _rtt_markdown(rtt: dict[str, Any]) -> list[str]:
    lines = ["", "## Decode vs network RTT (each node in its own network namespace)", ""]
    if "skipped" in rtt:
        return lines + [f"Skipped: {rtt['skipped']}."]
    lines += [
        (f"The tracker stays in the root namespace and each node runs in a namespace of its own; the endpoints "
         f"share one network built from {_LINKS.get(rtt.get('link'), rtt.get('link'))}. Delay placement: "
         f"{rtt['placement']}. On an N-node route a star (the gateway relays every hop) waits N round trips "
         "per decoded token; a chain (each node forwards to the next, the tail answers the gateway) waits "
         "N + 1 one-way trips, (N + 1)/2 round trips; a ring (the tail also sends each next step straight to "
         "the head) N one-way trips, N/2 round trips. Expected ms/token = the route's 0 ms figure + that many "
         "RTTs; 'extra RTTs/token' is what was measured. TTFT pays the round trips before the first token "
         "(the opens, the head tokenizing inside its own, a second trip where it reused a prefix, plus each "
         "prefill chunk through the route) on top of prefill "
         "compute, whose spread from run to run can exceed them. "
         f"Each figure is the best of {rtt.get('repeats', 1)} run(s) at that RTT."),
        "",
        ("| route | hops | RTT ms | decode tok/s | vs 0 ms | expected tok/s | ms/token | expected ms/token "
         "| extra ms/token (expected) | extra RTTs/token (expected) | TTFT ms | TTFT vs 0 ms (expected) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, route in rtt["routes"].items():
        for r in route["rows"]:
            trips = r.get("round_trips_per_token", r["hops"])
            lines.append(
                f"| {label} | {r['hops']} | {r['rtt_ms']:g} | {_f(r['decode_tok_s'])} | {r['decode_vs_0']:.2f}x "
                f"| {_f(r['expected_tok_s'])} | {_f(r['ms_per_token'], '{:.2f}')} "
                f"| {_f(r['expected_ms_per_token'], '{:.2f}')} "
                f"| {_f(r['extra_ms_per_token'], '{:+.2f}')} ({_f(r['expected_extra_ms_per_token'], '{:.2f}')}) "
                f"| {_f(r.get('extra_rtts_per_token'), '{:.2f}') if r.get('extra_rtts_per_token') is not None else '-'} "
                f"({trips:g}) "
                f"| {_f(r['ttft_s'] * 1e3)} | {_f(r['ttft_extra_ms'], '{:+.1f}')} "
                f"({_f(r.get('expected_ttft_extra_ms'), '{:.0f}')}) |")
    return lines


def _rtt_plot(rtt: dict[str, Any], out: Path, save: Callable) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (label, route) in enumerate(rtt["routes"].items()):
        rows = sorted(route["rows"], key=lambda r: r["rtt_ms"])
        xs = [r["rtt_ms"] for r in rows]
        color = f"C{i}"
        name = f"{route['nodes']} nodes, {route.get('topology', 'ring')}"  # runs before issue 41 name theirs
        left.plot(xs, [r["decode_tok_s"] for r in rows], marker="o", color=color, label=f"{name}, measured")
        left.plot(xs, [r["expected_tok_s"] for r in rows], ls="--", color=color, label=f"{name}, expected")
        right.plot(xs, [r["ms_per_token"] for r in rows], marker="o", color=color, label=f"{name}, measured")
        right.plot(xs, [r["expected_ms_per_token"] for r in rows], ls="--", color=color,
                   label=f"{name}, expected")
    left.set_xlabel("tracker-node round-trip time (ms)")
    left.set_ylabel("decode tokens/s (single session)")
    left.set_title("Decode speed vs RTT")
    left.set_ylim(bottom=0)
    right.set_xlabel("tracker-node round-trip time (ms)")
    right.set_ylabel("time per decoded token (ms)")
    right.set_title("Time per token vs RTT")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"llama_shard routes, each node in its own network namespace ({rtt.get('link')} links)")
    save(fig, "decode_vs_rtt.png")


def write_report(res: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    names = plots(res, out)
    path = out / "REPORT.md"
    path.write_text(markdown(res, names))
    return path
