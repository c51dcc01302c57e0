"""`dgr bench`: run the side-by-side suite and write the report."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["register"]


def _run(args) -> int:
    import attrs

    from dgr.bench.report import write_report
    from dgr.bench.suite import BenchConfig, run_suite

    if args.only == "rtt" and not args.rtt:
        print("dgr bench: --only rtt needs at least one --rtt MS", file=sys.stderr)
        return 2
    cfg = BenchConfig.make(args.quick, tuple(args.rtt or ()))
    cfg = attrs.evolve(cfg, only=args.only, rtt_link=args.rtt_link, peers=args.peers or args.only in ("peers", "paired"),
                       big=args.big, storm_kills=args.storm_kills)
    if args.threads:
        cfg = attrs.evolve(cfg, threads=args.threads)
    results = run_suite(cfg)
    path = write_report(results, Path(args.out))
    print(path.read_text())
    print(f"report: {path}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="side-by-side benchmarks with a Markdown report and PNG plots")
    p.add_argument("--quick", action="store_true", help="fewer tokens and setups: under 5 minutes on 2 cores")
    p.add_argument("--out", default="results/latest", help="folder for REPORT.md, results.json and plots")
    p.add_argument("--threads", type=int, help="total threads per setup (default: all cores)")
    p.add_argument("--rtt", type=float, action="append", metavar="MS",
                   help="repeatable: run 2- and 3-node llama_shard routes with each node in its own network "
                        "namespace at this tracker-node RTT (0 ms is always added as the baseline); needs root")
    p.add_argument("--rtt-link", default="auto", choices=("auto", "netem", "tun"),
                   help="how --rtt delays links: veth + tc netem, or TUN + a user-space delay line "
                        "(auto: netem when the kernel has it)")
    p.add_argument("--only", choices=("rtt", "peers", "prefix", "paired", "cpu", "steps", "ceiling", "storm", "spec"),
                   help="run only this part of the suite (peers: dgr's routes beside llama.cpp's servers; "
                        "prefix: issue 43's 6-turn chat (a 2,260-token system prompt), each turn's TTFT on a "
                        "2-node route beside llama-server's with cache_prompt, paired, with the issue's bounds; paired: the single- and 8-session head-to-heads and the short-prompt TTFT, with every setup up at "
                        "once, measured in alternating rounds; cpu: each process of a 2-node route's CPU per decoded token, "
                        "beside its layers computed alone; steps: where a 2-node route's token goes, stage by stage "
                        "on each node and link by link, from the nodes' stage timestamps; ceiling: a 2-node stub ring's "
                        "tok/s and each process's CPU a token, one session and 32 at once (the route's own cost, "
                        "issue 58's targets); storm: 8 streaming clients "
                        "on a 2-node llama_shard route beside a CPU hog for 90 s, its 5xx, error events, lost nodes, "
                        "open latency and token gaps while a long prompt prefills; spec: speculative decoding on 2- "
                        "and 3-node rings in network namespaces at 0, 20 and 50 ms, a copy task, a summary and free "
                        "chat, with and without n-gram drafts, beside llama-server's own; needs root)")
    p.add_argument("--storm-kills", action="store_true",
                   help="with --only storm: one spare a range and --resume, and a random node killed (SIGKILL) and "
                        "started again every 10 to 20 s; adds the kills, repairs, their pauses and what the nodes "
                        "hold after the storm")
    p.add_argument("--peers", action="store_true",
                   help="also measure llama.cpp's llama-server (alone, over RPC, with -np slots), built once "
                        "from the llama.cpp vendored in the installed llama-cpp-python's sdist")
    p.add_argument("--big", action="store_true",
                   help="repeat the single-session and 8-session rows on a random-weight 1B-shape llama "
                        "(written once to ~/.cache/dgr/models)")
    p.set_defaults(func=_run)
