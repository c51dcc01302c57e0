"""`dgr attack`: the attacks of issue 40 as one process, run against a live route beside `dgr soak --attacker`.

The attacker is a member node's operator gone bad: it holds the route's join token (JOIN_ENV, as every
node operator does) and knows the tracker's and the nodes' URLs. Until SIGTERM or `--time-limit` it runs
every attack of dgr.bench.attacks (each its own trio task, a bounded number of requests at a time), then
prints the tally of how each was answered as one JSON line on stdout, the last one at exit. Before it, one line
HOLDING says every held connection has been opened once.

One job: the process: its settings from the command line, its file limit and CPU priority, its time limit
and signals. What it attacks and how an answer is judged are dgr.bench.attacks.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import httpx
import trio

from dgr.bench.attacks import AttackConfig, Attacker, Tally
from dgr.security.secrets import JOIN_ENV

__all__ = ["main", "register", "run_attacker", "HOLDING"]

HOLDING = "holding"


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_attacker(cfg: AttackConfig, token: bytes) -> Tally:
    """Attack until `cfg.time_limit_s` or SIGTERM/SIGINT; the tally of answers."""
    tally = Tally()
    transport = httpx.AsyncHTTPTransport(local_address=cfg.source)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(transport=transport, limits=limits) as client:
        attacker = Attacker(cfg, tally, client, token)
        with trio.move_on_after(cfg.time_limit_s) as scope, trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) \
                as signals:
            async with trio.open_nursery() as nursery:
                async def stop_on_signal() -> None:
                    async for _ in signals:
                        scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                nursery.start_soon(_say_holding, attacker)
                await attacker.run()
    return tally


async def _say_holding(attacker: Attacker) -> None:
    """One line, HOLDING, once the floods are at full strength (`Attacker.holding`): `dgr soak` waits for it."""
    await attacker.holding.wait()
    print(HOLDING, flush=True)


def _main(args) -> int:
    token = os.environ.get(JOIN_ENV)
    if not token:
        print(f"dgr attack: set {JOIN_ENV} to the route's join token", file=sys.stderr)
        return 2
    nodes = dict(n.split("=", 1) for n in args.node)
    cfg = AttackConfig(tracker=args.tracker.rstrip("/"), nodes=nodes, time_limit_s=args.time_limit,
                       concurrency=args.concurrency, idle_conns=args.idle_conns, half_bodies=args.half_bodies,
                       source=args.source, hold_source=args.hold_source)
    _raise_nofile()
    if args.nice:
        os.nice(args.nice)
    tally = trio.run(run_attacker, cfg, token.encode())
    print(json.dumps(tally.to_json()), flush=True)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("attack", help="issue 40's attacks on a live route, as a member node's operator "
                                             "with the join token ($DGR_JOIN_TOKEN); prints a JSON tally")
    p.add_argument("--tracker", required=True, help="the tracker's URL")
    p.add_argument("--node", action="append", default=[], metavar="ID=URL", required=True,
                   help="a node of the route; repeatable")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds to attack (SIGTERM stops it sooner)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per request attack")
    p.add_argument("--idle-conns", type=int, default=300, help="idle TCP connections held to each server")
    p.add_argument("--half-bodies", type=int, default=40, help="connections holding a half-sent 4 MiB body")
    p.add_argument("--source", default="127.0.0.2", help="the local address the attacker's connections leave from")
    p.add_argument("--nice", type=int, default=0,
                   help="lower this process's CPU priority by N: on the route's own machine it then stands for a "
                        "host of its own, and takes only the CPU the servers leave")
    p.add_argument("--hold-source", help="the local address held connections leave from (default: --source)")
    p.set_defaults(func=_main)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="dgr attack")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(["attack", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
