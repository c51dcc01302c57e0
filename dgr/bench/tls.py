"""What encrypting every link costs a route's decode: a plain route and a TLS one, measured side by side.

`python -m dgr.bench.tls [--backend llama_shard] [--nodes 2] [--rounds 10] [--tokens 128] --out DIR`

Two `dgr up` routes of the same shape run at once on loopback: one plain (what loopback gets by default)
and one with `--tls`, where every link (client to tracker, tracker to node, node to node, tail to
tracker) is TLS 1.3 with the certificates made from the keys and client certificates: what links off
loopback get by default. Idle, a route takes no CPU. Each round streams one greedy completion of
`tokens` tokens from each, the order alternating by round (the machine's speed drifts within minutes),
and the figure is the median over rounds of that round's TLS / plain decode tok/s. The cost per token
is the difference of the median ms per token; per hop, that over the ring's hops (a token crosses each
of the ring's N links once on its critical path; its delivery to the tracker is off it). Beside it, the
CPU each route's processes (tracker and nodes) spent per token, from /proc: on a shared machine whose
other tenants move the wall-clock figures, what the encryption itself costs. Nodes do not busy-poll
(`--busy-poll-ms 0`, as in the tests), so a node's CPU is its work, not its waiting.

`--links` adds one link's round trip, in this process: a frame of `--frame-bytes` each way over a plain
trio socket, over trio.SSLStream and over dgr.seam.tlsstream's SocketTLS, in alternation.

Writes `tls.json` and `REPORT.md` to `--out`. Left out: the handshakes (a route's connections are kept
alive; the first is paid at its first session) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from dgr.bench.measure import stream_once
from dgr.security.certs import LinkCert, identity_cert
from dgr.security.identity import Identity
from dgr.security.tls import TlsTrust, server_context
from dgr.seam.tlsstream import SocketTLS
from dgr.testing.harness import LocalRoute

__all__ = ["measure", "link_round_trips", "main"]

PROMPT = "Tell me a long story about a lighthouse keeper and the ships she saw."


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of `pid` and every process under it (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _model(route: LocalRoute) -> str:
    return route.http.get(f"{route.url}/v1/models", timeout=10).json()["data"][0]["id"]


def measure(backend: str, nodes: int, rounds: int, tokens: int, log=print) -> dict[str, Any]:
    """Start both routes, warm them, then `rounds` alternating rounds; the per-round rates and the summary."""
    with ExitStack() as stack:
        # no busy-polling (LocalRoute's default): a polling node's CPU would grow with the wall time it waits
        routes = {"plain": LocalRoute(backend=backend, nodes=nodes),
                  "tls": LocalRoute(backend=backend, nodes=nodes, extra=("--tls",))}
        for route in routes.values():
            stack.enter_context(route)
        if routes["tls"].scheme != "https" or routes["plain"].scheme != "http":
            raise RuntimeError("the TLS route does not serve https, or the plain one does")
        model = _model(routes["plain"])
        for route in routes.values():  # connections and their handshakes, before the first round
            stream_once(route.api, model, PROMPT, 8, verify=route.trust)
        rates: dict[str, list[float]] = {name: [] for name in routes}
        cpu_ms: dict[str, list[float]] = {name: [] for name in routes}  # per token, the route's processes
        for r in range(rounds):
            order = list(routes) if r % 2 == 0 else list(reversed(routes))
            for name in order:
                route = routes[name]
                before = _cpu_s(route.proc.pid)
                result = stream_once(route.api, model, PROMPT, tokens, verify=route.trust)
                rates[name].append(result.decode_tok_s)
                cpu_ms[name].append((_cpu_s(route.proc.pid) - before) * 1e3 / max(1, result.tokens))
            log(f"round {r + 1}/{rounds}: plain {rates['plain'][-1]:.1f}, tls {rates['tls'][-1]:.1f} tok/s; CPU "
                f"{cpu_ms['plain'][-1]:.2f}, {cpu_ms['tls'][-1]:.2f} ms a token")
    per_round = [t / p for t, p in zip(rates["tls"], rates["plain"]) if t and p]
    plain, tls = statistics.median(rates["plain"]), statistics.median(rates["tls"])
    per_token_ms = 1e3 / tls - 1e3 / plain
    return {"backend": backend, "nodes": nodes, "rounds": rounds, "tokens": tokens, "model": model,
            "rates": rates, "per_round_ratio": per_round, "ratio": statistics.median(per_round),
            "ratio_range": [min(per_round), max(per_round)], "plain_tok_s": plain, "tls_tok_s": tls,
            "per_token_ms": per_token_ms, "per_hop_ms": per_token_ms / nodes, "cpu_ms": cpu_ms,
            "plain_cpu_ms": statistics.median(cpu_ms["plain"]), "tls_cpu_ms": statistics.median(cpu_ms["tls"])}


async def _round_trip_us(kind: str, frame: bytes, n: int) -> float:
    """Microseconds for `frame` to a server on loopback and back, over `kind`: plain, trio or socket."""
    key = Identity.generate()
    own = LinkCert(identity_cert(key, "node"), key.private)
    server_ctx, client_ctx = server_context(own=own), TlsTrust().context(own.chain)

    async def read(stream: trio.abc.Stream) -> None:
        got = 0
        while got < len(frame):
            got += len(await stream.receive_some(65536))

    async def echo(stream: trio.SocketStream) -> None:
        s: trio.abc.Stream = stream
        if kind == "trio":
            s = trio.SSLStream(stream, server_ctx, server_side=True)
        elif kind == "socket":
            s = SocketTLS.wrap(stream, server_ctx, server_side=True)
        for _ in range(n):
            await read(s)
            await s.send_all(frame)

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, echo, listeners)
        raw = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
        client: trio.abc.Stream = raw
        if kind == "trio":
            client = trio.SSLStream(raw, client_ctx, server_hostname="dgr")
            await client.do_handshake()
        elif kind == "socket":
            client = SocketTLS.wrap(raw, client_ctx, server_side=False, server_hostname="dgr")
            await client.do_handshake()
        started = time.perf_counter()
        for _ in range(n):
            await client.send_all(frame)
            await read(client)
        took = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return took / n * 1e6


def link_round_trips(frame_bytes: int, rounds: int = 5, n: int = 5000) -> dict[str, Any]:
    """One link's round trip (us) over a plain socket, trio.SSLStream and SocketTLS: `rounds` alternations of
    `n` round trips each; the medians and every round."""
    frame = bytes(frame_bytes)
    runs: dict[str, list[float]] = {"plain": [], "trio": [], "socket": []}
    for _ in range(rounds):
        for kind in runs:
            runs[kind].append(trio.run(_round_trip_us, kind, frame, n))
    return {"frame_bytes": frame_bytes, "n": n, "runs": runs,
            "median_us": {kind: statistics.median(v) for kind, v in runs.items()}}


def _report(runs: list[dict[str, Any]], links: dict[str, Any] | None = None) -> str:
    lines = ["# Every link TLS against every link plain: decode tok/s, side by side", "",
             "| backend | nodes | rounds x tokens | plain tok/s | TLS tok/s | TLS / plain (median, range) | "
             "ms per token | ms per hop | CPU ms a token, plain -> TLS |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        lo, hi = run["ratio_range"]
        lines.append(f"| {run['backend']} | {run['nodes']} | {run['rounds']} x {run['tokens']} | "
                     f"{run['plain_tok_s']:.1f} | {run['tls_tok_s']:.1f} | {run['ratio']:.3f}x ({lo:.3f} to "
                     f"{hi:.3f}) | {run['per_token_ms']:+.3f} | {run['per_hop_ms']:+.3f} | "
                     f"{run['plain_cpu_ms']:.3f} -> {run['tls_cpu_ms']:.3f} |")
    if links is not None:
        med = links["median_us"]
        lines += ["", f"One link, a {links['frame_bytes']}-byte frame each way on loopback (median of "
                      f"{len(links['runs']['plain'])} x {links['n']} round trips): plain {med['plain']:.1f} us, "
                      f"trio.SSLStream {med['trio']:.1f} us, SocketTLS {med['socket']:.1f} us."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.bench.tls", description=__doc__.split("\n")[0])
    p.add_argument("--backend", action="append", choices=("stub", "llama_shard"),
                   help="repeatable (default: llama_shard, then stub)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--links", action="store_true", help="also one link's round trip, three ways")
    p.add_argument("--frame-bytes", type=int, default=2368,
                   help="--links: bytes each way (default: a SmolLM2 decode frame, 576 f32 and its header)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    links = link_round_trips(args.frame_bytes) if args.links else None
    runs = [measure(b, args.nodes, args.rounds, args.tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
            for b in args.backend or ["llama_shard", "stub"]]
    (args.out / "tls.json").write_text(json.dumps({"started": started, "runs": runs, "links": links}, indent=1)
                                       + "\n")
    (args.out / "REPORT.md").write_text(_report(runs, links))
    print(_report(runs, links))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
