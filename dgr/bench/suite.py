"""The side-by-side benchmark suite: one run, one machine, one model, every setup.

Every figure is reported next to its baseline measured in the same run:
decode and prefill against llama-cpp-python called directly (same file,
same total threads, same prompt tokens); routes against the single-node
`llama` backend. Setups are started one at a time so they never compete for
the cores.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import attrs
import httpx

from dgr.bench.direct import direct_llama
from dgr.bench.measure import concurrent, hop_stats, short_ttft, stream_once, tree_commit
from dgr.models import default_model_path
from dgr.seam.wire import HEADER_SIZE
from dgr.testing.harness import LocalRoute

__all__ = ["BenchConfig", "run_suite"]

STORY = ("The lighthouse keeper kept a log of every ship that passed the point, the weather, the colour of the "
         "sea at dawn and the birds that rested on the rail. ")


@attrs.frozen
class BenchConfig:
    quick: bool = False
    threads: int = attrs.field(factory=lambda: os.cpu_count() or 1)
    decode_tokens: int = 128
    prompt_lengths: tuple[int, ...] = (128, 512, 2048)
    concurrency: tuple[int, ...] = (1, 4, 8)
    rtts_ms: tuple[float, ...] = ()
    only: str | None = None  # "rtt": just the namespaced RTT routes; "peers": dgr against llama.cpp's servers;
    # "prefix": just the multi-turn chat with and without prefix reuse (dgr.bench.prefix); "paired": just the
    # single- and 8-session head-to-heads measured in alternation (dgr.bench.paired); "cpu": each route
    # process's CPU per token beside its shards' compute alone (dgr.bench.cpu); "steps": each stage of a
    # decode step on each node and link (dgr.bench.steps); "ceiling": a 2-node stub ring's tok/s and CPU a
    # token (dgr.bench.ceiling); "storm": 8 clients beside a CPU hog (dgr.bench.storm)
    rtt_link: str = "auto"  # netem, tun, or auto (dgr.bench.netns)
    peers: bool = False  # llama.cpp's llama-server and rpc-server beside dgr (dgr.bench.peers)
    big: bool = False  # repeat the head-to-head rows on a random-weight 1B-shape llama (dgr.bench.shapes)
    short_prompt: int = 50  # tokens of the prompt whose TTFT shows the fixed costs before the first token
    storm_kills: bool = False  # the storm kills a node every 10 to 20 s, a spare a range and --resume (issue 54)

    @classmethod
    def make(cls, quick: bool, rtts_ms: tuple[float, ...] = ()) -> "BenchConfig":
        if quick:
            return cls(quick=True, decode_tokens=48, prompt_lengths=(128, 512), concurrency=(1, 4), rtts_ms=rtts_ms)
        return cls(rtts_ms=rtts_ms)


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _prompt_tokens(n: int) -> list[int]:
    """Exactly n token ids of English text, from the model's own tokenizer."""
    from dgr.backends.gguf_text import GgufText

    text = GgufText.load(default_model_path())
    ids = text.tokenize(STORY * (n // 20 + 2), add_special=True, parse_special=False)
    return ids[:n]


def _route(backend: str, nodes: int, threads: int, ctx: int = 4096, extra: tuple[str, ...] = ()) -> LocalRoute:
    return LocalRoute(backend=backend, nodes=nodes, ready_timeout_s=600, busy_poll_ms=None,  # the product's default
                      extra=("--threads", str(threads), "--ctx", str(ctx), "--prefill-chunk", "512",
                             "--max-sessions", "8", *extra))


def run_suite(cfg: BenchConfig) -> dict[str, Any]:
    model = str(default_model_path())
    name = "SmolLM2-135M-Instruct.Q4_1"
    results: dict[str, Any] = {"config": attrs.asdict(cfg), "commit": tree_commit(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "setups": {}, "ttft": {}, "seam": {}, "concurrency": {}, "inprocess": {},
                               "torch": {}, "big": {}}
    prompt = {n: _prompt_tokens(n) for n in cfg.prompt_lengths}
    base_prompt = prompt[cfg.prompt_lengths[0]]
    max_ctx = max(cfg.prompt_lengths) + cfg.decode_tokens + 64

    if cfg.only == "cpu":
        from dgr.bench.cpu import run_cpu

        results["cpu"] = run_cpu(_log)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.only == "storm":
        from dgr.bench.storm import run_storm

        results["storm"] = run_storm(_log, kills=cfg.storm_kills)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.only == "spec":
        from dgr.bench.spec import run_spec

        results["spec"] = run_spec(_log)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.only == "steps":
        from dgr.bench.steps import run_steps

        results["steps"] = run_steps(_log)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.only == "ceiling":
        from dgr.bench.ceiling import run_ceiling

        results["ceiling"] = run_ceiling(_log)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.rtts_ms:
        results["rtt"] = _rtt(cfg, base_prompt, max_ctx)
    if cfg.only == "prefix" or (cfg.only is None and not cfg.quick):
        from dgr.bench.prefix import run_prefix

        results["prefix"] = run_prefix(cfg.threads, _log)
    if cfg.only in ("rtt", "prefix"):
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results
    if cfg.only == "paired":
        results["paired"] = _paired(cfg, model, name, base_prompt, max_ctx)
        results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return results

    _log(f"direct llama-cpp-python, {cfg.threads} threads")
    results["setups"]["llama-cpp-python direct"] = direct_llama(model, base_prompt, cfg.decode_tokens, cfg.threads)
    for n, ids in prompt.items():
        results["ttft"].setdefault("llama-cpp-python direct", {})[n] = direct_llama(model, ids, 2, cfg.threads,
                                                                                   n_ctx=max_ctx)["ttft_s"]

    short = _prompt_tokens(cfg.short_prompt)
    for label, backend, nodes in _DGR_SETUPS:
        threads = max(1, cfg.threads // nodes)
        _log(f"{label} ({threads} thread(s) per node)")
        with _route(backend, nodes, threads, ctx=max_ctx) as route:
            results["setups"][label] = _dgr_row(route, name, base_prompt, short, cfg.decode_tokens, threads)
            for n, ids in prompt.items():
                rr = stream_once(route.api, name, ids, 4)
                results["ttft"].setdefault(label, {})[n] = rr.ttft_s
                if nodes > 1:
                    status = route.node_status("node1")["seam"]
                    results["seam"].setdefault(label, {})[n] = status["last_decode_frame_bytes"]
            if nodes == 2:
                for c in cfg.concurrency:
                    _log(f"{label}: {c} concurrent session(s)")
                    results["concurrency"].setdefault(label, {})[c] = concurrent(
                        route.api, name, STORY, cfg.decode_tokens // 2, c)
    if cfg.peers:
        _peers(results["setups"], results["concurrency"], results["ttft"], cfg, model, base_prompt, short, prompt)
        results["paired"] = _paired(cfg, model, name, base_prompt, max_ctx)
    if cfg.big:
        _big(results["big"], cfg, base_prompt, short)
    if cfg.only != "peers":
        _inprocess(results, cfg)
        _torch(results, cfg)
    results["seam_expected_bytes"] = HEADER_SIZE + 576 * 4
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return results


# label, backend, nodes (every route is a ring: dgr.tracker.ring)
_DGR_SETUPS: tuple[tuple[str, str, int], ...] = (
    ("dgr llama, 1 node", "llama", 1),
    ("dgr llama_shard, 2 nodes, ring", "llama_shard", 2),
    ("dgr llama_shard, 3 nodes, ring", "llama_shard", 3),
)
# llama-server's prompt cache would answer a repeated prompt's TTFT from memory; dgr has none yet.
_NO_PROMPT_CACHE = {"cache_prompt": False}


def _dgr_row(route: LocalRoute, name: str, prompt: list[int], short: list[int], decode_tokens: int,
             threads: int) -> dict[str, Any]:
    stream_once(route.api, name, prompt[:16], 4)  # warm up connections and caches
    r = stream_once(route.api, name, prompt, decode_tokens)
    hops = hop_stats(route.url)
    return {
        "decode_tok_s": r.decode_tok_s, "ttft_s": r.ttft_s, "prefill_tok_s": r.prompt_tokens / r.ttft_s,
        "ttft_short_s": short_ttft(route.api, name, short),
        "hop_p50_ms": {k: v.get("p50_ms") for k, v in hops.items()},
        "hop_p99_ms": {k: v.get("p99_ms") for k, v in hops.items()},
        "threads_per_node": threads,
    }


def _server_row(srv: Any, prompt: list[int], short: list[int], decode_tokens: int, threads: str) -> dict[str, Any]:
    stream_once(srv.api, "x", prompt[:16], 4, extra=_NO_PROMPT_CACHE)
    r = stream_once(srv.api, "x", prompt, decode_tokens, extra=_NO_PROMPT_CACHE)
    return {"decode_tok_s": r.decode_tok_s, "ttft_s": r.ttft_s, "prefill_tok_s": len(prompt) / r.ttft_s,
            "ttft_short_s": short_ttft(srv.api, "x", short, extra=_NO_PROMPT_CACHE), "threads_per_node": threads}


def _peers(setups: dict[str, Any], conc: dict[str, Any], ttft: dict[str, Any] | None, cfg: BenchConfig,
           model: str, prompt: list[int], short: list[int], lengths: dict[int, list[int]] | None = None) -> None:
    """llama-server alone, over RPC, and with parallel slots, on the same prompt and token count as dgr."""
    from contextlib import ExitStack

    from dgr.bench.peers import LlamaServer, RpcServer, ensure_tools

    tools = ensure_tools(_log)
    ctx = max(lengths or {len(prompt): prompt}) + cfg.decode_tokens + 64
    for threads in sorted({1, cfg.threads}):
        label = f"llama-server, {threads} thread(s)"
        _log(label)
        with LlamaServer(tools, model, threads, ctx) as srv:
            setups[label] = _server_row(srv, prompt, short, cfg.decode_tokens, str(threads))
            if ttft is not None and lengths and threads == 1:
                for n, ids in lengths.items():
                    ttft.setdefault(label, {})[n] = stream_once(srv.api, "x", ids, 2, extra=_NO_PROMPT_CACHE).ttft_s
    for n in (2, 3):
        label = f"llama-server over RPC, {n} rpc-servers x 1 thread"
        _log(label)
        with ExitStack() as stack:
            rpcs = [stack.enter_context(RpcServer(tools, 1)) for _ in range(n)]
            srv = stack.enter_context(LlamaServer(tools, model, 1, ctx, rpc=tuple(r.endpoint for r in rpcs)))
            setups[label] = _server_row(srv, prompt, short, cfg.decode_tokens, f"{n} x 1")
    slots = max(cfg.concurrency)
    label = f"llama-server -np {slots}, {cfg.threads} thread(s)"
    _log(label)
    with LlamaServer(tools, model, cfg.threads, ctx, parallel=slots) as srv:
        for c in cfg.concurrency:
            conc.setdefault(label, {})[c] = concurrent(srv.api, "x", STORY, cfg.decode_tokens // 2, c,
                                                       extra=_NO_PROMPT_CACHE)


def _paired(cfg: BenchConfig, model: str, name: str, prompt: list[int], ctx: int) -> dict[str, Any]:
    """The single-session and 8-session head-to-heads again, every setup up at once, in alternating rounds."""
    from dgr.bench.paired import SESSIONS as slots, PairedSetup, run_paired
    from dgr.bench.peers import LlamaServer, RpcServer, ensure_tools

    tools = ensure_tools(_log)

    def start(stack) -> list[PairedSetup]:
        out = []
        for label, backend, nodes in (("dgr 2-node ring", "llama_shard", 2), ("dgr 3-node ring", "llama_shard", 3),
                                      ("dgr llama, 1 node", "llama", 1)):
            threads = max(1, cfg.threads // nodes)
            route = stack.enter_context(_route(backend, nodes, threads, ctx=ctx))
            out.append(PairedSetup(label, route.api, name))
            if nodes == 2:
                out += [PairedSetup(f"{label}, {n} session{'s' * (n > 1)}", route.api, name, sessions=n)
                        for n in (1, slots)]
        rpcs = [stack.enter_context(RpcServer(tools, 1)) for _ in range(2)]
        for label, srv in (("llama-server 1 thread", LlamaServer(tools, model, 1, ctx)),
                           ("llama-server, all threads", LlamaServer(tools, model, cfg.threads, ctx)),
                           ("llama-server over RPC x2", LlamaServer(tools, model, 1, ctx,
                                                                    rpc=tuple(r.endpoint for r in rpcs)))):
            out.append(PairedSetup(label, stack.enter_context(srv).api, "x", _NO_PROMPT_CACHE))
        srv = stack.enter_context(LlamaServer(tools, model, cfg.threads, ctx, parallel=slots))
        out.append(PairedSetup(f"llama-server -np {slots}, all threads, {slots} sessions", srv.api, "x",
                               _NO_PROMPT_CACHE, sessions=slots))
        return out

    rounds = 3 if cfg.quick else 5
    n = cfg.short_prompt
    text = _prompt_tokens(n * (rounds + 1))
    shorts = [text[:1] + text[1 + r * n:(r + 1) * n] for r in range(rounds)]  # BOS, then a slice no round shares
    _log("paired: every setup up at once, measured in alternating rounds")
    return run_paired(start, prompt, cfg.decode_tokens, rounds=rounds, log=_log, story=STORY, shorts=shorts)


def _big(out: dict[str, Any], cfg: BenchConfig, prompt: list[int], short: list[int]) -> None:
    """The head-to-head rows again on a random-weight file with a 1B-parameter llama's shape."""
    from dgr.bench.shapes import LLAMA_1B, random_llama_gguf

    model = str(random_llama_gguf(LLAMA_1B, log=_log))
    out.update(model=LLAMA_1B.name, shape={**attrs.asdict(LLAMA_1B, filter=lambda a, _v: a.name != "quant"), "quant": LLAMA_1B.quant.name},
               setups={}, concurrency={})
    for label, backend, nodes in _DGR_SETUPS:
        if nodes == 3:
            continue
        threads = max(1, cfg.threads // nodes)
        _log(f"{LLAMA_1B.name}: {label}")
        with _route(backend, nodes, threads, ctx=len(prompt) + cfg.decode_tokens + 64,
                    extra=("--model", model)) as route:
            name = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
            out["setups"][label] = _dgr_row(route, name, prompt, short, cfg.decode_tokens, threads)
            if nodes == 2:
                for c in (1, max(cfg.concurrency)):
                    out["concurrency"].setdefault(label, {})[c] = concurrent(
                        route.api, name, STORY, cfg.decode_tokens // 2, c)
    if cfg.peers:
        _peers(out["setups"], out["concurrency"], None, cfg, model, prompt, short)


def _rtt(cfg: BenchConfig, prompt: list[int], ctx: int) -> dict[str, Any]:
    """2- and 3-node llama_shard routes with each node in its own network namespace, at each RTT."""
    from dgr.bench.rtt import rtt_sweep

    return rtt_sweep(backend="llama_shard", node_counts=(2, 3), rtts_ms=cfg.rtts_ms, prompt=prompt,
                     decode_tokens=cfg.decode_tokens, threads=cfg.threads, ctx=ctx, link=cfg.rtt_link,
                     repeats=2 if cfg.quick else 3, log=_log)


def _optional(label: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ImportError as exc:
        _log(f"{label} skipped: {exc}")
        return None


def _inprocess(results: dict[str, Any], cfg: BenchConfig) -> None:
    """llama.cpp shards chained in one process, no HTTP (the layer-boundary cost alone)."""
    from dgr.backends.base import LayerRange
    from dgr.backends.llama import LlamaBackend
    from dgr.backends.llama_shard import LlamaShardBackend
    from dgr.pipeline import Pipeline

    model = default_model_path()
    ids = _prompt_tokens(cfg.prompt_lengths[0])
    splits = {"full model, in process": None, "2 shards, in process": [(0, 15), (15, 30)],
              "3 shards, in process": [(0, 10), (10, 20), (20, 30)]}
    for label, split in splits.items():
        _log(label)
        stages = ([LlamaBackend(model, n_threads=cfg.threads, n_ctx=2048, max_sessions=1)] if split is None else
                  [LlamaShardBackend(model, LayerRange(a, b), n_threads=cfg.threads, n_ctx=2048, max_sessions=1)
                   for a, b in split])
        try:
            pipe = Pipeline(stages)
            pipe.open("b" * 32, len(ids) + cfg.decode_tokens + 1)
            t0 = time.perf_counter()
            logits = pipe.prefill("b" * 32, ids, chunk=512)
            t1 = time.perf_counter()
            tok, pos = int(logits.argmax()), len(ids)
            for _ in range(cfg.decode_tokens):
                tok = int(pipe.decode("b" * 32, tok, pos).argmax())
                pos += 1
            t2 = time.perf_counter()
            pipe.close("b" * 32)
        finally:
            for s in stages:
                s.close()
        results["inprocess"][label] = {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": cfg.decode_tokens / (t2 - t1)}


def _torch(results: dict[str, Any], cfg: BenchConfig) -> None:
    """The readable PyTorch route, 2 shards in process: KV reuse against full recompute."""
    import numpy as np

    from dgr.backends.base import LayerRange
    from dgr.backends.torch_backend import TorchBackend

    model = default_model_path()
    for recompute in (False, True):
        # the baseline costs O(context) per step (about 20 s per token at 2,048 on one core): few steps
        steps = 3 if recompute else (8 if cfg.quick else 16)
        label = "torch, full recompute baseline" if recompute else "torch, 2 shards (KV reuse)"
        _log(label)
        shards = [TorchBackend(model, LayerRange(0, 15), n_threads=cfg.threads, recompute=recompute),
                  TorchBackend(model, LayerRange(15, 30), n_threads=cfg.threads, recompute=recompute)]
        rows = {}
        for n in cfg.prompt_lengths:
            ids = _prompt_tokens(n)
            sid = f"{n:032x}"
            for s in shards:
                s.open_session(sid, n + steps + 1)
            h = shards[0].forward(sid, 0, np.array(ids, np.int32), None, False)
            logits = shards[1].forward(sid, 0, None, h, True)
            tok, pos, seam = int(np.argmax(logits)), len(ids), []
            seq = list(ids)
            t0 = time.perf_counter()
            for _ in range(steps):
                seq.append(tok)
                if recompute:  # the whole sequence again, through every shard and every seam
                    h = shards[0].forward(sid, 0, np.array(seq, np.int32), None, False)
                    logits = shards[1].forward(sid, 0, None, h, True)
                else:  # one position, against each shard's Hot KV State
                    h = shards[0].forward(sid, pos, np.array([tok], np.int32), None, False)
                    logits = shards[1].forward(sid, pos, None, h, True)
                seam.append(int(h.nbytes))
                tok = int(np.argmax(logits))
                pos += 1
            rows[n] = {"decode_ms_per_token": (time.perf_counter() - t0) / steps * 1e3,
                       "seam_bytes_per_step": float(np.mean(seam))}
            for s in shards:
                s.close_session(sid)
        results["torch"][label] = rows
