"""`dgr bench`: run the side-by-side suite and write the report."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["register"]


def _run(args) -> int:
    from dgr.bench.report import write_report
    from dgr.bench.suite import BenchConfig, run_suite

    cfg = BenchConfig.make(args.quick, tuple(args.rtt or ()))
    if args.threads:
        import attrs

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
    p.add_argument("--rtt", type=float, action="append", help="add a route with this RTT in ms (network namespaces)")
    p.set_defaults(func=_run)
