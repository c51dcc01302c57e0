"""`dgr up`: a tracker and N nodes on 127.0.0.1, each its own process.

The layers are split so that every shard's decode step costs about the same
(dgr.plan.plan_even: the tail also carries the LM head), each node gets
cores / nodes threads so llama.cpp's spinning threads never oversubscribe
the machine, and one line on stdout says where the OpenAI API
is once every node has registered. SIGINT or SIGTERM stops every child.
`--spares N` starts N more nodes for each range (`nodeI-spareJ`), holding
layers already covered, each asking to be a spare (`dgr node --spare`), and
tells the tracker to keep N a layer (`dgr tracker --spares N`): it keeps
them idle while the members have room (dgr.tracker.spares), and a tracker
with `--resume` repairs a route that loses or drains a node onto one of them
(dgr.tracker.repair, dgr.tracker.drain). `--drain-s` is each node's.

`dgr up` binds the tracker's socket and hands it to the tracker process
(`--listen-fd`), so the tracker's address is known before it runs and the
nodes start at the same time as the tracker, not after it: a start is mostly
imports and model loads, which then overlap on a machine with cores to spare.

Every local route is a closed cluster with no flags: `dgr up` makes a key
per process (tracker.key, node0.key, ... in `--identity-dir`, by default a
fresh temporary folder removed on exit) and uses the join token it is given
(--join-token-file or $DGR_JOIN_TOKEN) or generates a fresh one, handed to
its children in the environment, never in argv. So nodes sign their
membership with their own keys, and the gateway signs a capability for every
hop of every route it starts. API keys (--api-key-file or $DGR_API_KEYS)
pass through to the tracker, and so do `--trusted-head` keys: a key file already in
the folder is used as it is, so an operator (or `dgr soak --attacker`) can make the
nodes' keys first and name them as the route's trusted heads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import tempfile
from typing import Callable
from pathlib import Path

import trio

from dgr.api.server import listening_socket
from dgr.backends.base import LayerRange
from dgr.backends.factory import model_layer_count, resolve_model
from dgr.backends.placement import Placement
from dgr.errors import CallerError, Reason
from dgr.forks import ForkedProcess, fork_dgr, preload
from dgr.procs import run_child
from dgr.serve import run_until_signal
from dgr.progress import terminal_progress
from dgr.security.secrets import JOIN_ENV, load_join_token, new_secret
from dgr.security.certs import pin_text
from dgr.security.tls import TlsTrust, httpx_default_trust

__all__ = ["run_up", "even_split", "route_splits", "node_args", "tracker_args", "node_names", "READY_TIMEOUT_S"]

READY_TIMEOUT_S = 900.0  # a node's first start on a large model hashes its file (dgr.digest)
TRACKER_HOST = "127.0.0.1"


def route_splits(model: Path | None, n_layers: int, n_nodes: int, prompt_positions: int | None = None,
                 answer_tokens: int | None = None) -> list[LayerRange]:
    """The layer ranges of a local route: planned from the GGUF's tensor sizes, or even for the stub.

    A GGUF's are balanced for a prompt of `prompt_positions` and an answer of `answer_tokens` on a full
    pipeline (dgr.plan.plan_even; None: its defaults, a chat turn with a long prompt)."""
    if model is None:
        return even_split(n_layers, n_nodes)
    from dgr.plan import layout_from_gguf, plan_even
    from dgr.plan.search import ANSWER_TOKENS, PROMPT_POSITIONS

    return plan_even(layout_from_gguf(model), n_nodes,
                     PROMPT_POSITIONS if prompt_positions is None else prompt_positions,
                     ANSWER_TOKENS if answer_tokens is None else answer_tokens)


def node_names(n_ranges: int, spares: int = 0) -> list[tuple[str, int]]:
    """(name, the range it holds) of every node of a local route: nodeI for range I, then each range's
    `spares`, nodeI-spareJ."""
    return [(f"node{i}", i) for i in range(n_ranges)] + [(f"node{i}-spare{j}", i) for i in range(n_ranges)
                                                         for j in range(spares)]


def even_split(n_layers: int, n_nodes: int) -> list[LayerRange]:
    if not (1 <= n_nodes <= n_layers):
        raise CallerError(Reason.INVALID_REQUEST, f"cannot split {n_layers} layers over {n_nodes} nodes")
    bounds = [round(i * n_layers / n_nodes) for i in range(n_nodes + 1)]
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


async def _print_example(url: str, cert: Path) -> None:
    """A ready-to-paste request, for the model the route actually serves (stderr: stdout stays one line); over
    https, trusting the tracker's certificate `cert` by its key."""
    import httpx

    headers = {}
    keys = os.environ.get("DGR_API_KEYS", "").split(",")[0].strip()
    if keys:
        headers["Authorization"] = f"Bearer {keys}"
    verify, pinned = httpx_default_trust(), ""
    if url.startswith("https://"):
        try:
            pem = cert.read_text()
        except OSError:
            return
        verify, pinned = TlsTrust().context(pem), f" -k --pinnedpubkey '{pin_text(pem)}'"
    try:
        async with httpx.AsyncClient(timeout=5, verify=verify) as client:
            models = (await client.get(f"{url}/v1/models", headers=headers)).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return
    if not models:
        return
    model = models[0]["id"]
    auth = " -H 'Authorization: Bearer $DGR_API_KEY'" if keys else ""
    print(
        f"dgr up: try it:\n  curl -sN{pinned} {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"stream\": true, \"max_tokens\": 64, "
        f"\"messages\": [{{\"role\": \"user\", \"content\": \"What is a shard?\"}}]}}'\n"
        f"  dashboard: {url}/   telemetry: {url}/v1/route-sessions   metrics: {url}/metrics",
        file=sys.stderr, flush=True,
    )


def node_args(args, layers: LayerRange, tracker: str, name: str, threads: int, identity: Path | None = None,
              tail: bool = False, placement: Placement = Placement(), spare: bool = False) -> list[str]:
    """The arguments of `dgr` (after the command itself) that start one node of the route, on the devices
    `placement` names; the `tail` also takes the draft model, and a `spare` asks to be kept as one."""
    cmd = [
        "node", "--tracker", tracker, "--layers", str(layers), "--backend", args.backend,
        "--name", name, "--threads", str(threads), "--port", "0", "--ctx", str(args.ctx),
        "--max-sessions", str(args.max_sessions), "--stub-delay", str(args.stub_delay),
        "--stub-model", args.stub_model, "--idle-timeout", str(getattr(args, "idle_timeout", 120.0)),
    ]
    if getattr(args, "snapshot_dir", None):
        cmd += ["--snapshot-dir", str(Path(args.snapshot_dir) / name)]
    if getattr(args, "snapshot_max_mb", None) is not None:
        cmd += ["--snapshot-max-mb", str(args.snapshot_max_mb)]
    if getattr(args, "prefix_cache_mb", None) is not None:
        cmd += ["--prefix-cache-mb", str(args.prefix_cache_mb)]
    if getattr(args, "journal_mb", None) is not None:
        cmd += ["--journal-mb", str(args.journal_mb)]
    if getattr(args, "busy_poll_ms", None) is not None:
        cmd += ["--busy-poll-ms", str(args.busy_poll_ms)]
    if getattr(args, "iteration_target_ms", None) is not None:
        cmd += ["--iteration-target-ms", str(args.iteration_target_ms)]
    if args.model:
        cmd += ["--model", str(args.model)]
    if placement.offloads:
        cmd += ["--gpu-layers", str(placement.to_json()["gpu_layers"])]
        cmd += ["--device", placement.device] if placement.device else []
        cmd += ["--cpu-moe"] if placement.cpu_moe else []
    if tail and getattr(args, "draft_model", None):
        cmd += ["--draft-model", str(args.draft_model)]
        if getattr(args, "draft_threads", None):
            cmd += ["--draft-threads", str(args.draft_threads)]
    if getattr(args, "manifest", None):
        cmd += ["--manifest", str(args.manifest)]
    if identity is not None:
        cmd += ["--identity", str(identity)]
    if getattr(args, "tls", False):
        cmd.append("--tls")
    if getattr(args, "drain_s", None) is not None:
        cmd += ["--drain-s", str(args.drain_s)]
    return cmd + (["--spare"] if spare else [])


def tracker_args(args, identity: Path | None = None, listen_fd: int | None = None,
                 model: Path | None = None) -> list[str]:
    """The arguments of `dgr` (after the command itself) that start the route's tracker; `model`, the GGUF the
    nodes load, is its vocabulary too (each answer's text is checked against it: dgr.tracker.pieces)."""
    cmd = ["tracker", "--port", str(args.port), "--prefill-chunk", str(args.prefill_chunk),
           "--step-deadline", str(args.step_deadline), "--slow-cap", str(getattr(args, "slow_cap", 4.0)),
           "--seam-dtype", args.seam_dtype]
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
    if identity is not None:
        cmd += ["--identity", str(identity)]
    if getattr(args, "manifest", None):
        cmd += ["--manifest", str(args.manifest)]
    if model is not None:
        cmd += ["--vocab", str(model)]
    if getattr(args, "api_key_file", None):
        cmd += ["--api-key-file", str(args.api_key_file)]
    for flag in ("pipeline_cuts", "max_prompt_tokens", "max_prompt_bytes", "max_tokens_cap", "max_session_s",
                 "slow_client_s", "admission_wait_s", "dead_after", "spec", "spec_k_max", "spec_k", "spec_allow",
                 "max_repairs", "spares"):
        value = getattr(args, flag, None)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    for key in getattr(args, "trusted_head", None) or ():
        cmd += ["--trusted-head", key]
    for flag in ("no_prefix_reuse", "prefix_exact", "share_prefixes", "spec_exact", "tls", "resume"):
        if getattr(args, flag, False):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def run_up(args, entry: Callable[[list[str]], int]) -> None:
    """`dgr up`: start the route's processes (each runs `entry`, dgr.cli.main, on its own command line), serve
    until SIGINT or SIGTERM or a fatal child exit, stop them."""
    given = load_join_token(getattr(args, "join_token_file", None))
    env = {JOIN_ENV: given.decode() if given is not None else new_secret()}
    with contextlib.ExitStack() as stack:
        keys = getattr(args, "identity_dir", None)
        if keys is None:
            keys = stack.enter_context(tempfile.TemporaryDirectory(prefix="dgr-up-keys-"))
        _run_up(args, env, Path(keys), entry)


def _run_up(args, env: dict[str, str], keys: Path, entry: Callable[[list[str]], int]) -> None:
    """`run_up` once the route's join token and key folder are settled."""
    model = resolve_model(args.backend, args.model)
    n_layers = model_layer_count(args.backend, model, args.stub_model)
    if args.backend == "llama" and args.nodes != 1:
        raise CallerError(Reason.INVALID_REQUEST, "the llama backend serves a whole model: use --nodes 1, or llama_shard")
    if args.backend == "llama_shard":  # refuse an architecture not proven for ranges before any process starts
        from dgr.backends.llama_shard import check_shard_ranges

        check_shard_ranges(model, [LayerRange(0, n_layers)])
    splits = route_splits(model, n_layers, args.nodes, getattr(args, "prompt_positions", None),
                          getattr(args, "answer_tokens", None))
    if args.backend == "llama_shard":
        check_shard_ranges(model, splits)
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.nodes * (1 + getattr(args, "spares", 0))))
    placements = Placement.per_node(args, len(splits))  # refused before any process starts
    try:
        listening = listening_socket(TRACKER_HOST, args.port)
    except OSError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"dgr up cannot listen on {TRACKER_HOST}:{args.port}: "
                                                  f"{exc.strerror or exc}") from None
    url = f"{'https' if getattr(args, 'tls', False) else 'http'}://{TRACKER_HOST}:{listening.getsockname()[1]}"
    spares = getattr(args, "spares", 0)
    if spares < 0:
        raise CallerError(Reason.INVALID_REQUEST, f"--spares {spares}: a count of spare nodes per range is 0 or more")
    print(f"dgr up: tracker at {url}; starting {args.nodes} {args.backend} node(s): "
          + ", ".join(str(s) for s in splits) + (f", and {spares} spare(s) of each" if spares else ""),
          file=sys.stderr)
    # The tracker's socket is bound here and handed over, so its address is known before it runs:
    # the nodes start at the same time (their model loads are most of a start once the imports are
    # done, dgr.forks), and a registration that comes before the tracker serves waits in the
    # socket's backlog.
    preload(args.backend)
    children: list[tuple[str, ForkedProcess]] = []
    try:
        with listening:
            roles = [("tracker", tracker_args(args, keys / "tracker.key", listen_fd=listening.fileno(), model=model))]
            roles += [(name, node_args(args, splits[i], url, name, threads, keys / f"{name}.key",
                                       tail=i == len(splits) - 1, placement=placements[i], spare="-spare" in name))
                      for name, i in node_names(len(splits), spares)]
            for name, argv in roles:
                held = [fd for _, child in children for fd in child.fds()]
                children.append((name, fork_dgr(name, argv, entry, env=env, close_fds=held, detach=[listening],
                                                keep=listening if name == "tracker" else None)))
        run_until_signal(_serve, args, url, children, splits, n_layers, keys / "tracker.crt")
    finally:
        for _, child in children:
            child.stop_now()  # a child trio did not stop already (the parent failed before supervising it)


async def _serve(args, url: str, children: list[tuple[str, ForkedProcess]], splits: list[LayerRange],
                 n_layers: int, cert: Path) -> None:
    """Supervise the forked children: report progress as they get ready, serve until cancelled."""
    async with trio.open_nursery() as nursery:
        with trio.fail_after(READY_TIMEOUT_S):
            ready: list[LayerRange] = []
            layers_of = {name: splits[i] for name, i in node_names(len(splits), getattr(args, "spares", 0))}

            async def start(name: str, child: ForkedProcess) -> None:
                # SIGINT: dgr up stopping stops its nodes now, where a SIGTERM of one alone drains it
                await nursery.start(functools.partial(run_child, fatal=name == "tracker", stop=signal.SIGINT), name,
                                    child)
                if name not in layers_of:
                    return
                if "-spare" in name:  # its layers are covered already: the bar counts the route's own
                    print(f"dgr up: {name} ready (a spare), layers {layers_of[name]}, pid {child.pid}",
                          file=sys.stderr)
                    return
                ready.append(layers_of[name])
                covered = sum(len(r) for r in ready)
                progress.update(covered, description=f"nodes ready {len(ready)}/{len(splits)}, "
                                                     f"layers covered {covered}/{n_layers}")
                print(f"dgr up: {name} ready, layers {layers_of[name]}, pid {child.pid}", file=sys.stderr)

            # a bar on a terminal (quiet otherwise): which nodes are up, how many layers are covered
            with terminal_progress() as progress:
                progress.start(f"nodes ready 0/{len(splits)}, layers covered 0/{n_layers}", n_layers)
                async with trio.open_nursery() as starting:
                    for name, child in children:
                        starting.start_soon(start, name, child)
        print(f"dgr up: serving the OpenAI API at {url}/v1 ({args.backend}, {args.nodes} node(s))", flush=True)
        await _print_example(url, cert)
        # children run until a signal cancels us, or one of them exits and fails the nursery
