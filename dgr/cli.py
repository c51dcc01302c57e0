"""The `dgr` command line: tracker, node, up, and the tools that register here."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys

from dgr.errors import CallerError, DgrError, Reason, first_dgr_error
from dgr.forks import exit_now
from dgr.node.drain import DRAIN_S
from dgr.serve import run_until_signal

__all__ = ["main"]


def _threads_default() -> int:
    return max(1, (os.cpu_count() or 1))


def cmd_tracker(args) -> int:
    from dgr.artifact.manifest import Manifest
    from dgr.seam.wire import DType
    from dgr.security.auth import Admission
    from dgr.security.identity import claim_identity, parse_public_key
    from dgr.security.secrets import load_api_keys, load_join_token
    from dgr.security.tls import check_server_files
    from dgr.tracker.blame import SlowPolicy
    from dgr.tracker.gateway import GatewayConfig
    from dgr.tracker.pieces import Vocabularies
    from dgr.tracker.proofs import Prover
    from dgr.tracker.run import run_tracker

    config = GatewayConfig(
        prefill_chunk=args.prefill_chunk,
        pipeline_cuts=args.pipeline_cuts,
        step_deadline_s=args.step_deadline,
        slow_cap=args.slow_cap,
        seam_dtype=DType[args.seam_dtype.upper()],
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_cap=args.max_tokens_cap,
        max_prompt_bytes=args.max_prompt_bytes,
        max_session_s=args.max_session_s or None,
        slow_client_s=args.slow_client_s or None,
        admission_wait_s=args.admission_wait_s,
        prefix_reuse=not args.no_prefix_reuse,
        share_prefixes=args.share_prefixes,
        prefix_keep_generated=not args.prefix_exact,
        speculation=args.spec,
        spec_k_max=args.spec_k_max,
        spec_k=args.spec_k,
        spec_exact=args.spec_exact,
        spec_allow=frozenset(args.spec_allow.split(",")) - {"none"},
        resume=args.resume,
        max_repairs=args.max_repairs,
    )
    admission = Admission(load_join_token(args.join_token_file),
                          frozenset(parse_public_key(k) for k in args.allow_node))
    tls_files = check_server_files(args.tls_cert, args.tls_key)
    identity = claim_identity(args.identity, "tracker")
    api_keys = load_api_keys(args.api_key_file)
    manifests = [Manifest.load(m) for m in args.manifest]
    for m in manifests:
        print(f"dgr tracker: checking layer proofs against manifest {m.id[:12]} ({m.file.name})", file=sys.stderr)
    prover = Prover.from_manifests(manifests, challenges=args.proof_challenges, deadline_s=args.proof_deadline)
    vocabularies = Vocabularies.builtin()
    for path in args.vocab:
        print(f"dgr tracker: checking answers against the vocabulary of {path} "
              f"({vocabularies.add_gguf(path)[:12]})", file=sys.stderr)
    listening, host = None, args.host
    if args.listen_fd is not None:
        try:
            listening = socket.socket(fileno=args.listen_fd)
            host = listening.getsockname()[0]  # the exposure rule judges the address really bound
        except OSError as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"--listen-fd {args.listen_fd} is not an open socket: "
                                                      f"{exc.strerror or exc}") from None
    return run_until_signal(run_tracker, host=host, port=args.port, config=config, dead_after_s=args.dead_after,
                            prover=prover, require_proof=bool(manifests) if args.require_proof is None else args.require_proof,
                            trusted_ends=frozenset(parse_public_key(k) for k in args.trusted_head),
                            max_node_sessions=args.max_node_sessions, spares=args.spares, identity=identity,
                            admission=admission,
                            slow=SlowPolicy(ban_after=args.slow_ban_after, ban_s=args.slow_ban_s),
                            api_keys=api_keys, tls_files=tls_files, tls=_trust(args), listening=listening,
                            vocabularies=vocabularies)


def cmd_node(args) -> int:
    from dgr.backends.factory import make_backend, resolve_model
    from dgr.backends.placement import Placement
    from dgr.node.run import run_node
    from dgr.node.run import advertised_url, check_transport
    from dgr.security.identity import claim_identity, parse_public_key
    from dgr.security.pins import TrackerPin
    from dgr.security.secrets import load_join_token
    from dgr.security.tls import check_server_files

    # before loading a model: fail fast
    join_token = load_join_token(args.join_token_file)
    tls_files = check_server_files(args.tls_cert, args.tls_key)
    advertised_url("http://127.0.0.1:1", args.advertise)  # refuse a malformed --advertise now
    tls = _trust(args)
    check_transport(tls, args.tracker, tls_files, args.advertise, args.host)
    identity = claim_identity(args.identity, "node")
    pin = None
    if args.tracker:  # read (and a bad pin file refused) before loading a model
        pin = TrackerPin.beside(identity.path, args.tracker, parse_public_key(args.tracker_key)
                                if args.tracker_key else None)
    layers = args.layers
    assigned = layers is None and bool(args.memory or args.gpu_memory or (args.tracker and args.manifest))
    if args.tracker and args.tracker.startswith("https://") and (assigned or args.fetch):  # asked before it serves
        import trio

        from dgr.node.membership import wait_for_tracker_trust

        tls = trio.run(wait_for_tracker_trust, tls, args.tracker, pin)
    if assigned:
        layers = _assigned_layers(args, identity, join_token, tls)
    artifact = None
    if args.manifest or args.fetch:
        from dgr.node.artifact import prepare_node_artifact

        artifact = prepare_node_artifact(
            args.manifest, layers, backend=args.backend, model=args.model, fetch=args.fetch, tracker=args.tracker,
            model_dir=args.model_dir, fetch_timeout_s=args.fetch_timeout, tls=tls,
        )
        model, layers = artifact.path, artifact.layers
    else:
        model = resolve_model(args.backend, args.model)
    backend = make_backend(
        args.backend, layers, model, threads=args.threads, n_ctx=args.ctx, max_sessions=args.max_sessions,
        stub_delay_s=args.stub_delay, stub_model=args.stub_model, placement=Placement.per_node(args)[0],
    )
    if artifact is not None:
        artifact.check_backend(backend)
    draft = _draft_model(args, backend) if args.draft_model else None
    node_id = args.name or identity.node_id
    return run_until_signal(run_node, backend, node_id=node_id, host=args.host, port=args.port,
                            tracker=args.tracker, identity=identity, idle_timeout_s=args.idle_timeout,
                            artifact=artifact, seed_port=args.seed_port, join_token=join_token,
                            advertise=args.advertise, tls_files=tls_files, tls=tls, pin=pin,
                            prefix_cache_mb=args.prefix_cache_mb, snapshot_dir=args.snapshot_dir,
                            snapshot_max_mb=args.snapshot_max_mb,
                            busy_poll_s=busy_poll_ms(args.busy_poll_ms, args.backend, args.threads) / 1e3,
                            iteration_target_s=args.iteration_target_ms / 1e3, draft=draft, spare=args.spare,
                            drain_s=args.drain_s, signals=(signal.SIGINT,) if args.drain_s > 0 else None,
                            journal_bytes=int(args.journal_mb * 1024 * 1024))


def _draft_model(args, backend):
    """`--draft-model`: loaded beside a route tail's shard, with a vocabulary checked equal to the model's.

    Raises:
        CallerError(INVALID_REQUEST): the node is not a tail, or the vocabularies differ.
        CallerError(MODEL_LOAD_FAILED): llama.cpp cannot load the file.
    """
    from dgr.errors import CallerError, Reason
    from dgr.node.draft import DraftModel, vocabulary_digest

    if not backend.is_tail:
        raise CallerError(Reason.INVALID_REQUEST, f"--draft-model: layers {backend.layers} are not a route's tail, "
                                                  "and only the tail drafts")
    target = vocabulary_digest(backend.info.vocab_size, backend.token_bytes)
    return DraftModel.load(args.draft_model, target, threads=args.draft_threads or args.threads, n_ctx=args.ctx,
                           max_sessions=args.max_sessions)


# llama.cpp backends whose steps compute on one thread: their node idles while the rest of the
# route computes, and the core it sleeps on is slow to wake (dgr.node.scheduler, busy_poll_s)
_BUSY_POLL_BACKENDS = ("llama", "llama_shard")
# dgr.node.scheduler.DEFAULT_ITERATION_TARGET_S, here so that parsing arguments imports no trio or numpy
ITERATION_TARGET_MS = 250.0
# dgr.tracker.live.PIPELINE_CUTS and MIN_PIPELINE_CHUNK, here for the same reason
PIPELINE_CUTS = 32
MIN_PIPELINE_CHUNK = 64
BUSY_POLL_MS = 100.0  # covers a token's trip through the rest of a 2- or 3-node SmolLM2 route


def busy_poll_ms(given: float | None, backend: str, threads: int) -> float:
    """`--busy-poll-ms` as given, else its default: BUSY_POLL_MS for a one-thread llama.cpp node, 0 otherwise.

    With 2 threads a node's idle core was level with and without it (0.98x, paired rounds), and the
    stub and torch backends have nothing to gain, so they sleep as before.
    """
    if given is not None:
        return max(0.0, given)
    return BUSY_POLL_MS if backend in _BUSY_POLL_BACKENDS and threads == 1 else 0.0


def _trust(args):
    """The links' rules and trust a tracker or node is started with (dgr.security.tls).

    Raises:
        CallerError(INVALID_REQUEST): --insecure beside --require-tls.
    """
    from dgr.security.tls import TlsTrust

    if args.insecure and args.require_tls:
        raise CallerError(Reason.INVALID_REQUEST, "--insecure allows plain http off loopback, --require-tls refuses "
                                                  "it everywhere: give one")
    return TlsTrust(args.tls_ca, args.require_tls, encrypt=not args.insecure, force=args.tls)


def _assigned_layers(args, identity=None, join_token: bytes | None = None, tls=None):
    """No `--layers`, with `--tracker` and `--manifest` (or `--memory`): the range the tracker picks for this node's
    memory, `--memory` or a share of what the machine has available, asked under the node's key `identity` (and
    its `join_token`'s proof).

    Raises:
        CallerError(INVALID_REQUEST): `--memory` without a tracker and a manifest to ask; no --memory and the
            available memory cannot be read.
        CallerError: the tracker's refusal, with its reason.
    """
    from dgr.artifact.manifest import Manifest
    from dgr.errors import CallerError, Reason
    from dgr.node import assign
    from dgr.plan import format_size, parse_size

    if not (args.manifest and args.tracker):
        raise CallerError(Reason.INVALID_REQUEST, "--memory without --layers asks the tracker which layers to serve: "
                                                  "give --tracker and --manifest")
    manifest = Manifest.load(args.manifest)
    if args.memory:
        memory = parse_size(args.memory)
    else:
        memory, available = assign.read_memory_budget()
        print(f"dgr node: no --layers or --memory: asking the tracker for layers that fit {format_size(memory)}, "
              f"{assign.MEMORY_SHARE:.0%} of the {format_size(available)} this machine has available",
              file=sys.stderr)
    gpu = parse_size(args.gpu_memory) if args.gpu_memory else 0
    layers, answer = assign.ask_layers(args.tracker, manifest.id, memory, context=args.ctx,
                                       sessions=args.max_sessions, gpu_memory_bytes=gpu, cpu_moe=args.cpu_moe,
                                       tls=tls or _trust(args), identity=identity, join_token=join_token)
    placed = ""
    if gpu and str(answer.get("gpu_layers", "0")) != "0" and args.gpu_layers == "0":
        args.gpu_layers = str(answer["gpu_layers"])  # checked with the other placement flags (Placement.per_node)
        placed = f", --gpu-layers {args.gpu_layers}"
    print(f"dgr node: the tracker assigned layers {layers}{placed} ({answer.get('newly_covered', 0)} not served "
          "before)", file=sys.stderr)
    return layers


def cmd_up(args) -> int:
    from dgr.up import run_up

    return run_up(args, main)  # the entry point each forked tracker and node runs


def spec_allow(text: str) -> str:
    """argparse type of `--spec-allow`: grants from dgr.api.openai SPEC_GRANTS, comma-separated, or none; kept
    as text (sorted), which `dgr up` hands on as it is."""
    from dgr.api.openai import SPEC_GRANTS

    grants = sorted({g.strip() for g in text.split(",") if g.strip()} - {"none"})
    unknown = [g for g in grants if g not in SPEC_GRANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(SPEC_GRANTS)} (or none)")
    return ",".join(grants) or "none"


def positive_int(text: str) -> int:
    """argparse type of a count that must be at least 1 (a context, sessions, threads, nodes, a chunk): a bad
    one is a usage error at once, not a node that its tracker refuses again and again."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _add_node_model_args(p: argparse.ArgumentParser) -> None:
    from dgr.backends.factory import BACKENDS
    from dgr.node.snapshot import SNAPSHOT_MAX_MB

    p.add_argument("--backend", default="stub", choices=BACKENDS)
    p.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--ctx", type=positive_int, default=4096, help="context positions per session")
    p.add_argument("--max-sessions", type=positive_int, default=8, help="Route Sessions a node holds at once")
    p.add_argument("--stub-delay", type=float, default=0.0, help="stub: seconds of fake compute per position")
    p.add_argument("--snapshot-dir", metavar="DIR",
                   help="write kept prefixes' KV here as verifiable Prefix Snapshots, and reload matching ones at "
                        "start (dgr up: one subfolder per node)")
    p.add_argument("--snapshot-max-mb", type=float, default=None, metavar="MB",
                   help="with --snapshot-dir: keep its snapshots within this many MiB, deleting the least recently "
                        f"used first; a larger snapshot is not written (default: {SNAPSHOT_MAX_MB}; dgr up: per node)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="KV of ended sessions kept for reuse, at most this many MiB (default: whatever sequence "
                        "slots live sessions leave free; 0: keep none)")
    p.add_argument("--journal-mb", type=float, default=256.0, metavar="MB",
                   help="the seam frames a node sent on for its live sessions, at most this many MiB, so that a "
                        "repaired route's spare takes them instead of nodes computing again (tracker --resume; 0: none)")
    p.add_argument("--draft-model", metavar="GGUF",
                   help="a smaller GGUF sharing the model's vocabulary, for `draft` speculation: the route's tail "
                        "runs it beside its layers to draft tokens (dgr up: the last node)")
    p.add_argument("--draft-threads", type=positive_int, default=None, metavar="N",
                   help="threads the draft model computes with (default: --threads)")
    p.add_argument("--gpu-layers", default="0", metavar="N|all",
                   help="llama.cpp backends: the layers of the node's range on its GPU, counted from the range's "
                        "end ('all': every one; 0, the default: the CPU alone). dgr up: one value for every node, "
                        "or one per node, comma-separated (all,0: node0 on the GPU, node1 on the CPU)")
    p.add_argument("--device", help="with --gpu-layers: the ggml device, e.g. CUDA0 or Vulkan0 (default: llama.cpp's "
                                    "choice; a wrong name is refused with the devices this build sees)")
    p.add_argument("--cpu-moe", action="store_true",
                   help="with --gpu-layers: the routed experts of the range's layers stay in host memory (attention, "
                        "shared experts and the KV cache on the GPU), as llama.cpp's own --cpu-moe")
    p.add_argument("--stub-model", default="default", choices=("default", "dsv4"),
                   help="stub: 'dsv4' has a 4 x hidden seam and needs token ids, like DeepSeek-V4")
    p.add_argument("--busy-poll-ms", type=float, default=None, metavar="MS",
                   help="after computing a step, wait this long for the next one without letting the core "
                        "sleep (it yields to any other runnable work): a sleeping core is slow to wake. "
                        f"Default: {BUSY_POLL_MS:.0f} for a llama or llama_shard node with 1 thread, else 0")
    p.add_argument("--iteration-target-ms", type=float, default=ITERATION_TARGET_MS, metavar="MS",
                   help="while other sessions wait, cut prefill chunks so that one scheduler iteration computes for "
                        "about this long at the node's measured prefill rate: the longest an open, a close or "
                        f"another session's token waits behind a long prompt (0: never cut; default: "
                        f"{ITERATION_TARGET_MS:.0f})")


def _add_join_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join-token-file", metavar="F",
                   help="file holding the join token that admits nodes to the tracker (chmod 600); default: "
                        "$DGR_JOIN_TOKEN. Never on the command line, where ps shows it")


def _add_identity_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--identity", metavar="PATH",
                   help=f"this {role}'s Ed25519 key file, made on first start (chmod 600); default: the first free "
                        f"{role}[-N].key under $XDG_CONFIG_HOME/dgr or ~/.config/dgr")
    p.add_argument("--tls-cert", metavar="PEM",
                   help="serve https with this certificate (with --tls-key) instead of the one made from --identity")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    plain = p.add_mutually_exclusive_group()
    plain.add_argument("--tls", action="store_true",
                       help="serve https on loopback too (off loopback it always does, unless --insecure), with a "
                            "certificate made from --identity unless --tls-cert is given")
    plain.add_argument("--insecure", action="store_true",
                       help="allow plain http off loopback: serve it there, and accept http:// peers, "
                            f"{'registrations' if role == 'tracker' else '--tracker, --advertise and next hops'}")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="CA bundle (or a self-signed certificate) to trust for https:// peers that registered no "
                        "certificate, the tracker included; default: the system's CAs")
    if role == "tracker":
        p.add_argument("--require-tls", action="store_true",
                       help="refuse node registrations whose URL is http://, so no plain next hop is ever handed "
                            "out (seed addresses stay plain: pieces are checked against the manifest)")
    else:
        p.add_argument("--require-tls", action="store_true",
                       help="refuse an http:// --tracker, an http:// URL of this node's own (give --tls-cert, or "
                            "--advertise https://...), and sessions whose next hop or loop head is http://")
        p.add_argument("--tracker-key", metavar="PUBKEY",
                       help="the tracker's public key (as `dgr tracker` prints it): refuse a tracker that answers "
                            "with another. Default: the key pinned beside --identity (ID.tracker) at the first "
                            "registration, trust on first use")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    from dgr.tracker.registry import DEAD_AFTER_S

    p.add_argument("--api-key-file", metavar="F",
                   help="OpenAI API keys, one per line (chmod 600); default: $DGR_API_KEYS (comma-separated)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="refuse longer prompts (default: the route's context, the smallest --ctx on it)")
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="refuse prompt text longer than this before tokenizing it (default: 16 x the token limit)")
    p.add_argument("--dead-after", type=float, default=DEAD_AFTER_S,
                   help=f"seconds without a heartbeat before a node is dead (default: {DEAD_AFTER_S:g})")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="clamp requests' max_tokens to this")
    p.add_argument("--max-session-s", type=float, default=3600.0,
                   help="fail a Route Session after this many seconds (session_timeout); 0: never")
    p.add_argument("--slow-client-s", type=float, default=30.0,
                   help="cancel a stream whose reader takes nothing for this long (slow_client); 0: never")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="prefill every prompt whole: offer nodes no prefix chain, and let them keep no KV")
    from dgr.api.openai import SPEC_ALLOW_DEFAULT, SPEC_GRANTS, SPECULATION

    p.add_argument("--spec", choices=SPECULATION, default="off",
                   help="speculative decoding: ngram drafts tokens from the session's own prompt and answer at the "
                        "route's tail, draft with the tail's --draft-model, and each trip around the ring verifies k "
                        "of them; -exact: answers equal to decoding without speculation (default off; a request's "
                        "\"speculation\" field overrides it)")
    p.add_argument("--spec-allow", type=spec_allow, default=",".join(SPEC_ALLOW_DEFAULT), metavar="GRANTS",
                   help=f"what a request's \"speculation\" may name besides off and --spec, comma-separated from "
                        f"{', '.join(SPEC_GRANTS)} (none: nothing); prompt lets an n-gram route tail be sent the "
                        f"prompt's ids to draft from (a draft model always reads them). Default: "
                        f"{','.join(SPEC_ALLOW_DEFAULT)}: -exact costs every node and draft the tail CPU")
    p.add_argument("--spec-k-max", type=int, default=8, help="drafts a speculative step carries at most (1 to 8)")
    p.add_argument("--spec-k", type=int, default=None,
                   help="a fixed number of drafts a step (default: chosen per session from the measured acceptance "
                        "rate and trip time, 0 where speculation would not pay)")
    p.add_argument("--spec-exact", action="store_true",
                   help="compute a speculative step's positions one at a time on every node, so answers equal "
                        "decoding without speculation to the bit (llama.cpp rounds a multi-row batch differently)")
    p.add_argument("--prefix-exact", action="store_true",
                   help="keep only prompts' KV, not answers': a follow-up turn then recomputes the previous "
                        "answer, and its answer is bit-identical to a cold one's (answers' positions were computed "
                        "one at a time, and llama.cpp's one-position kernels round a little differently)")
    p.add_argument("--share-prefixes", action="store_true",
                   help="reuse a kept prefix across API keys (default: only for the key that left it); a caller "
                        "can then time whether someone sent the same prefix lately (spec/security.md)")
    p.add_argument("--admission-wait-s", type=float, default=10.0,
                   help="a request that finds every route full waits this long for a slot before its 429")
    p.add_argument("--resume", action="store_true",
                   help="a node lost mid-answer no longer ends the stream: the route is repaired onto a node that "
                        "holds its layers (a spare) and the answer goes on, token for token. Only where the "
                        "continuation is exact (greedy, or seeded sampling, without speculation); otherwise, "
                        "and by default, the session fails route_node_lost")
    p.add_argument("--max-repairs", type=int, default=3, metavar="N",
                   help="with --resume: repairs one Route Session may have; the next loss fails it (default 3)")


# The tools' subcommands, each registered by its own module. Only the one being run is imported (all of
# them for help or a mistyped command): together they cost about 0.5 s of CPU, which every tracker, node
# and `dgr up` process paid at its start.
_TOOLS = {"artifact": "dgr.artifact.cli", "plan": "dgr.plan.cli", "bench": "dgr.bench.cli", "soak": "dgr.bench.soak",
          "attack": "dgr.bench.attacker"}
_CORE = ("tracker", "node", "up")


def _command(argv: list[str]) -> str | None:
    """The subcommand `argv` runs, when it is a known one (the only top-level option, -v, takes no value)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in _CORE or arg in _TOOLS else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or, given `command`, the core commands and that one tool."""
    from dgr.node.assign import MEMORY_SHARE
    from dgr.tracker.registry import MAX_NODE_SESSIONS
    from dgr.backends.base import layers_arg

    parser = argparse.ArgumentParser(prog="dgr", description="dgr: the Distributed GGUF Runtime")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tracker", help="the Tracker Node and Gateway (OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--listen-fd", type=int, metavar="FD",
                   help="serve on this inherited socket, already bound and listening, instead of --host and --port "
                        "(how dgr up starts its nodes while the tracker starts)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt positions per prefill frame (one llama.cpp ubatch)")
    p.add_argument("--pipeline-cuts", type=int, default=PIPELINE_CUTS, metavar="K",
                   help="on a route of N > 1 nodes, cut a prompt into about K chunks per extra node (at least "
                        f"{MIN_PIPELINE_CHUNK} positions, at most --prefill-chunk), so that no node idles long at its "
                        "start and end; 0: chunks of --prefill-chunk")
    p.add_argument("--step-deadline", type=float, default=10.0, help="seconds a node may take for one step")
    p.add_argument("--slow-cap", type=float, default=4.0, metavar="X",
                   help="a step whose nodes still answer their liveness probe (/healthz) at its deadline waits on: "
                        "a busy node is slow, not lost; a session's waits add up to X - 1 times one step's deadline "
                        "on its route, the late hop blamed (1: no patience)")
    p.add_argument("--seam-dtype", default="f32", choices=("f32", "f16"))
    p.add_argument("--manifest", action="append", default=[], metavar="M",
                   help="Model Artifact manifest to check nodes' layer proofs against; repeatable")
    p.add_argument("--require-proof", action=argparse.BooleanOptionalAction, default=None,
                   help="route only nodes that proved their layers (nodes without --manifest are not routed); "
                        "on by default whenever the tracker has a --manifest")
    p.add_argument("--trusted-head", action="append", default=[], metavar="PUBKEY",
                   help="only nodes with this public key may hold a route's first or last layer (the head reads "
                        "every prompt, the tail every answer); repeatable; default: any admitted node")
    p.add_argument("--vocab", action="append", default=[], metavar="GGUF",
                   help="a model file whose vocabulary (only) the tracker loads, to check every answer's text "
                        "against its token id on routes of that file's digest; repeatable (stub models built in)")
    p.add_argument("--max-node-sessions", type=positive_int, default=MAX_NODE_SESSIONS, metavar="N",
                   help="the most sessions routed to one node at once, whatever capacity it declares")
    p.add_argument("--slow-ban-after", type=int, default=3, metavar="N",
                   help="ban a node from routing after it held late steps of N sessions within 10 minutes (0: never)")
    p.add_argument("--slow-ban-s", type=float, default=600.0, metavar="S",
                   help="how long a first ban for slowness lasts; each later one twice the one before")
    p.add_argument("--proof-challenges", type=int, default=8, help="challenges per layer claim")
    p.add_argument("--proof-deadline", type=float, default=2.0, help="seconds a node may take to answer one")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="keep up to N nodes a layer idle as spares, of those whose layers other nodes already cover: "
                        "routed only when the others are full, taken first by a repair (--resume), and made "
                        "members when a member dies or drains (default 0: every node serves; a node started with "
                        "--spare is one all the same)")
    p.add_argument("--allow-node", action="append", default=[], metavar="PUBKEY",
                   help="admit the node with this public key (as `dgr node` prints it) without the join token; "
                        "repeatable")
    _add_join_arg(p)
    _add_identity_args(p, "tracker")
    _add_limit_args(p)
    p.set_defaults(func=cmd_tracker)

    p = sub.add_parser("node", help="serve one Shard (a layer range)")
    p.add_argument("--tracker", help="tracker URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--layers", type=layers_arg,
                   help="A:B, layers [A, B) (default: with --tracker and --manifest, what the tracker "
                                    "assigns; otherwise all the layers of --model)")
    p.add_argument("--memory", metavar="SIZE",
                   help="with --tracker and --manifest and no --layers: memory this node may use, e.g. 24GiB; the "
                        "tracker assigns the contiguous layers that fit it and most improve the route's coverage "
                        f"(default: {MEMORY_SHARE * 100:.0f}%% of MemAvailable in /proc/meminfo)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="with --tracker and --manifest and no --layers: this node's GPU memory, e.g. 24GiB; the "
                        "tracker prices the range with as many of its layers on the GPU as fit (and --cpu-moe's "
                        "experts in host memory), and the node starts with the --gpu-layers it answers unless given")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", help="node id (default: derived from the node's public key); the first key to "
                                  "register a name owns it on that tracker")
    p.add_argument("--threads", type=positive_int, default=_threads_default())
    p.add_argument("--idle-timeout", type=float, default=120.0, help="free a session's KV after this idle time")
    p.add_argument("--manifest", metavar="M",
                   help="Model Artifact manifest: verify the served layers against it, seed the file, and prove "
                        "the layers to the tracker")
    p.add_argument("--fetch", action="store_true",
                   help="with --manifest and --tracker: download only the pieces the layers need from the "
                        "tracker's peers (no --model)")
    p.add_argument("--model-dir", help="where --fetch writes the file (default: ~/.cache/dgr/artifacts/ID)")
    p.add_argument("--fetch-timeout", type=float, default=None, help="give up fetching after this many seconds")
    p.add_argument("--seed-port", type=int, default=0, help="BitTorrent port to seed the artifact on (0: any)")
    p.add_argument("--spare", action="store_true",
                   help="ask the tracker to keep this node idle as a spare while other nodes cover its layers")
    p.add_argument("--drain-s", type=float, default=DRAIN_S, metavar="S",
                   help="on SIGTERM, tell the tracker and wait up to S seconds for this node's sessions to be "
                        "handed over (a tracker with --resume and a spare) or to end, then exit (0: exit at once; "
                        "a second signal too)")
    p.add_argument("--advertise", metavar="URL",
                   help="the URL others reach this node at, e.g. https://node1.example:9000 (default: the bound "
                        "address; bound to 0.0.0.0 or ::, the address the tracker saw the node come from). The "
                        "seed address takes its host too")
    _add_join_arg(p)
    _add_identity_args(p, "node")
    _add_node_model_args(p)
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("up", help="a tracker and N nodes on 127.0.0.1, each its own process")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="N more nodes for each layer range, holding layers already covered (nodeI-spareJ), kept "
                        "idle by the tracker (its --spares N): a tracker with --resume repairs a route that loses "
                        "or drains a node onto one of them")
    p.add_argument("--drain-s", type=float, default=None, metavar="S",
                   help=f"each node's --drain-s: on SIGTERM it hands its sessions over or waits for them up to S "
                        f"seconds (default {DRAIN_S:g})")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=positive_int, help="threads per node (default: cores / nodes)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512)
    p.add_argument("--pipeline-cuts", type=int, default=PIPELINE_CUTS, metavar="K",
                   help="the tracker's --pipeline-cuts")
    p.add_argument("--prompt-positions", type=int, default=None, metavar="P",
                   help="balance the nodes' layers for prompts of about P positions (default 2048: a chat turn "
                        "with a long system prompt; dgr plan prints the cut and what it weighed)")
    p.add_argument("--answer-tokens", type=int, default=None, metavar="D",
                   help="... and answers of about D tokens (default 256); --prompt-positions 0 balances decode "
                        "alone, which suits many concurrent sessions with short prompts")
    p.add_argument("--step-deadline", type=float, default=10.0)
    p.add_argument("--slow-cap", type=float, default=4.0, metavar="X",
                   help="a step whose nodes still answer their liveness probe (/healthz) at its deadline waits on: "
                        "a busy node is slow, not lost; a session's waits add up to X - 1 times one step's deadline "
                        "on its route, the late hop blamed (1: no patience)")
    p.add_argument("--seam-dtype", default="f32", choices=("f32", "f16"))
    p.add_argument("--manifest", metavar="M",
                   help="Model Artifact manifest: the tracker checks layer proofs against it, every node verifies, "
                        "seeds and proves its layers")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="nodes free a session's KV after this idle time")
    p.add_argument("--trusted-head", action="append", default=[], metavar="PUBKEY",
                   help="passed to the tracker: only nodes with this public key may hold a route's first or last "
                        "layer; repeatable (a key of --identity-dir's nodeN.key, made before `dgr up`, names a "
                        "route node)")
    p.add_argument("--identity-dir", metavar="DIR",
                   help="where the route's keys (tracker.key, nodeN.key) are kept (default: a fresh temporary "
                        "folder, removed on exit)")
    p.add_argument("--tls", action="store_true",
                   help="every link over https, with certificates made from the route's keys (dgr up is on "
                        "loopback, where links are otherwise plain)")
    _add_join_arg(p)
    _add_limit_args(p)
    _add_node_model_args(p)
    p.set_defaults(func=cmd_up)

    for name, module in _TOOLS.items():
        if command in (None, name):
            importlib.import_module(module).register(sub)
    return parser


def run() -> None:
    """The `dgr` command (python -m dgr, the console script): main(), then, for a service, exit at once.

    A tracker or node holds about 870 modules and everything it made while serving, and the
    interpreter's teardown frees them one by one, mostly in the garbage collector: SIGTERM to exit
    took 0.64 to 0.80 s for a 2-node stub `dgr up`, and 0.04 to 0.11 s without it. By then the
    service has closed everything it holds (its `with` and `finally` blocks ran inside main:
    sockets, the backend, child processes, key folders), and dgr registers no atexit work. The
    tools exit the usual way, and so does an exception out of main.
    """
    argv = sys.argv[1:]
    code = main(argv)
    if _command(argv) not in _CORE:
        raise SystemExit(code)
    exit_now(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except DgrError as exc:
        print(f"dgr: error: {exc.message}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        # a service's typed error arrives wrapped by the nurseries it passed through
        exc = first_dgr_error(group)
        if not isinstance(exc, DgrError):
            raise
        print(f"dgr: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
