"""A Route Session as the gateway drives it, and the gateway's settings: the data, no driving.

`GatewayConfig` is every setting the gateway runs with; `LiveSession` is one
Route Session while it runs (its FSM, request, prompt, the channels its
deltas and telemetry leave by, its inbox of the tail's answers, its link to
its head and its phase group), with the pure questions asked of it (its
prefill chunks, what its nodes may keep of their KV, which limit it ran past); `Delta` is one piece of
streamed text; `Answer` one answer of the tail; `HopStats` a node's seam
overhead. dgr.tracker.gateway drives them.
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
from typing import Any, Callable

import attrs
import trio

from dgr.api.openai import SPEC_ALLOW_DEFAULT, SPEC_GRANTS, SPECULATION, GenerationRequest, usage_body
from dgr.api.textstream import TextAssembler
from dgr.errors import CallerError, Failure, Reason
from dgr.fsm.phases import RoutePhases
from dgr.seam.keys import BLOCK_TOKENS, block_chain, encode_marks, token_marks
from dgr.fsm.route import RouteEvent, RouteSession, RouteState
from dgr.seam.frame import Frame
from dgr.seam.link import Link
from dgr.seam.wire import MAX_DRAFTS, DType
from dgr.tracker.patience import Allowance
from dgr.tracker.registry import NodeEntry
from dgr.tracker.resume import Rebuild
from dgr.tracker.telemetry import Broadcast

__all__ = ["GatewayConfig", "LiveSession", "Delta", "Answer", "HopStats", "PROMPT_BYTES_PER_TOKEN", "pipeline_chunk",
           "PIPELINE_CUTS", "MIN_PIPELINE_CHUNK"]

# A prompt on a route of N > 1 nodes is a pipeline: the head computes chunk k + 1 while the next node computes
# chunk k. With stages of equal pace it ends (N - 1) times its largest chunk's time after the sum of one stage's
# chunks, so a prompt is cut into chunks of about 1/PIPELINE_CUTS of it per extra node, none smaller than
# MIN_PIPELINE_CHUNK positions (a chunk's frames and round trips cost about a millisecond) nor larger than the
# ubatch. Measured on SmolLM2 at 15:15, a 2,316-token cold turn, 1 thread a node: 7.78 s in 512-position
# chunks, 6.81 s in 256, 6.42 s in 128; 6.34 to 6.55 s with 16 cuts (145 positions), 6.07 to 6.24 s with 32
# (73), 6.04 to 6.25 s with 64 (64, the least). llama-server, 2 threads: 5.5 to 6.2 s. The answer's logits are
# the same however the prompt is cut (flash attention off: dgr.backends.llama_engine).
PIPELINE_CUTS = 32
MIN_PIPELINE_CHUNK = 64


def pipeline_chunk(positions: int, ubatch: int, nodes: int, cuts: int = PIPELINE_CUTS) -> int:
    """The prefill chunk of a prompt of `positions` to compute on a route of `nodes` nodes: `ubatch` on one node
    (or with `cuts` 0), else about positions / (cuts * (nodes - 1)), within [MIN_PIPELINE_CHUNK, ubatch]."""
    if nodes <= 1 or cuts <= 0:
        return ubatch
    return min(ubatch, max(MIN_PIPELINE_CHUNK, -(-positions // (cuts * (nodes - 1)))))


@attrs.frozen
class GatewayConfig:
    prefill_chunk: int = 512  # one llama.cpp ubatch: the largest prefill chunk
    pipeline_cuts: int = PIPELINE_CUTS  # chunks per extra node of a prompt on a multi-node route (`pipeline_chunk`)
    step_deadline_s: float = 10.0  # a step's base deadline; SIGSTOP is usually caught sooner by heartbeats
    per_token_deadline_s: float = 0.05
    # A step whose nodes all answer /healthz when its deadline comes waits on: a node busy with other
    # sessions' long prompts, or beside another process, is slow, not lost. A session's waits are extended,
    # in all, by at most (slow_cap - 1) times one decode step's deadline on its route (dgr.tracker.patience)
    slow_cap: float = 4.0
    seam_dtype: DType = DType.F32
    sweep_s: float = 0.1
    keep_ended: int = 1000
    max_prompt_tokens: int | None = None  # refused above this (context_length_exceeded); None: the context
    max_tokens_cap: int | None = None  # requests' max_tokens are clamped to it; None: the context left
    max_session_s: float | None = 3600.0  # a Route Session's whole life; None: unbounded
    slow_client_s: float | None = 30.0  # a stream's reader may leave a chunk untaken this long; None: forever
    capability_margin_s: float = 120.0  # capabilities outlive max_session_s by this, for the close after it
    # A request that finds every route full waits this long for a slot before its 429: a client that
    # hangs up and asks again at once must not be refused the slot its last session is giving back.
    admission_wait_s: float = 10.0
    max_prompt_bytes: int | None = None  # prompt text refused above this before tokenizing; None: 16 x token limit
    unclaimed_stream_s: float = 10.0  # a stream whose body nobody starts reading is cancelled after this
    unclosed_ttl_s: float = 600.0  # how long a close owed to a node is remembered (nodes idle sessions out anyway)
    prefix_reuse: bool = True  # offer nodes the prompt's block chain, and let them keep ended sessions' KV
    # One isolation scope for every API key: a prefix one key left is reused for another. Its timing
    # tells a caller whether someone sent the same prefix lately (spec/security.md).
    share_prefixes: bool = False
    # Keep generated tokens' KV too, as llama-server's cache_prompt does, so the next turn, which
    # resends the answer, reuses it. Off (`--prefix-exact`): the prompt's own positions, prefilled in
    # chunks of two or more, reuse bit-identically, but llama.cpp computes a one-position step (decode)
    # with other kernels than a chunk, so a prefix of decoded positions gives logits off a full
    # prefill's. SmolLM2 Q4_1, 2 llama_shard stages, 3 chats of 5 turns, greedy, 32 tokens: logits
    # up to 1.58 apart (0.8 to 1.6 a turn) before any token differs; 2 of 12 follow-up answers differ
    # (in process, from their 7th token: 13 of 272 tokens), and 2 of 12 on a `dgr up` route.
    prefix_keep_generated: bool = True
    # Speculative decoding (issue 42): "ngram" lets a route's tail draft tokens from the session's own and
    # verify k of them a trip (k chosen per session from measured acceptance and trip time, or `spec_k`),
    # "off" none; a request's "speculation" overrides it. Only routes whose every node can drop positions.
    speculation: str = "off"
    spec_k_max: int = 8
    spec_k: int | None = None  # a fixed k (benchmarks); None: adaptive
    # compute a speculative step's positions one at a time on every node, so its answers equal decoding
    # without speculation to the bit (llama.cpp rounds a multi-row batch differently); a trip is still saved
    spec_exact: bool = False
    # What a request's "speculation" may name besides "off" and `speculation` (`--spec-allow`, dgr.api.openai
    # SPEC_GRANTS): the costly modes are the operator's to allow, and "prompt" lets an n-gram tail read the prompt
    spec_allow: frozenset[str] = frozenset(SPEC_ALLOW_DEFAULT)
    # Repair (issue 54, dgr.tracker.repair): a node lost mid-answer moves the session to a replacement route
    # instead of failing it, where the continuation is exact, at most `max_repairs` times a session. Off: the
    # founding rule, a lost node ends the session with its structured failure.
    resume: bool = False
    max_repairs: int = 3

    def __attrs_post_init__(self) -> None:
        if self.speculation not in SPECULATION or not 1 <= self.spec_k_max <= MAX_DRAFTS or not (
                self.spec_k is None or 0 <= self.spec_k <= self.spec_k_max):
            raise CallerError(Reason.INVALID_REQUEST, f"speculation is one of {', '.join(SPECULATION)}, with "
                                                      f"1 <= spec_k_max <= {MAX_DRAFTS} and 0 <= spec_k <= spec_k_max")
        if not self.spec_allow <= set(SPEC_GRANTS):
            raise CallerError(Reason.INVALID_REQUEST, f"spec_allow names {', '.join(SPEC_GRANTS)} only")
        if self.max_repairs < 0:
            raise CallerError(Reason.INVALID_REQUEST, "max_repairs is 0 or more")

    def spec_allowed(self, mode: str) -> bool:
        """May a request ask for speculation `mode`: "off", the tracker's own, or one the operator allowed."""
        return mode in ("off", self.speculation) or mode in self.spec_allow

    def prompt_to_tail(self, mode: str) -> bool:
        """Is a route's tail sent the prompt's ids to draft from in `mode`: a draft model needs them (its mode
        was allowed), n-grams only where the operator allowed "prompt"."""
        return mode.removesuffix("-exact") == "draft" or "prompt" in self.spec_allow


# A generous bound on UTF-8 bytes per token: real text averages 3 to 5, and a
# prompt this long cannot fit the token limit whatever it says. It lets the
# gateway refuse a huge prompt before the head spends time tokenizing it.
PROMPT_BYTES_PER_TOKEN = 16


@attrs.frozen
class Delta:
    text: str
    tokens: int  # completion tokens so far


@attrs.frozen
class Answer:
    """The tail's answer to one step, as the tracker took it: its frame, each hop's compute, and, where the
    round trip was measured, each hop's share of it beyond compute (milliseconds)."""

    frame: Frame
    compute_us: tuple[int, ...] = ()
    hop_ms: dict[str, float] | None = None


@attrs.define
class LiveSession:
    rs: RouteSession
    request: GenerationRequest
    prompt: list[int]
    max_tokens: int
    nodes: tuple[NodeEntry, ...]
    model_width: int
    needs_token_ids: bool
    telemetry: Broadcast
    send: trio.MemorySendChannel
    recv: trio.MemoryReceiveChannel
    text: TextAssembler  # the answer's bytes to the client's text, held back at the request's stop strings
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    caps: dict[str, str] = attrs.field(factory=dict)  # node id -> this session's capability there
    writing_since: float | None = None  # trio time a stream chunk was handed to a client not yet taking it
    unclaimed_since: float | None = None  # trio time a stream's response was made, until its body starts
    # the answers (`Answer`) and failure reports the route's nodes delivered, in order; unbounded: a
    # session has at most its prompt's chunks, then one decode step, in flight
    inbox: tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel] = attrs.field(
        factory=functools.partial(trio.open_memory_channel, math.inf))
    prefix_root: str | None = None  # the root of this session's block chains; None: no prefix reuse
    keep_generated: bool = False  # the chain it closes with covers generated tokens too (GatewayConfig)
    fed: list[int] = attrs.field(factory=list)  # generated tokens sent into the KV by decode steps
    head: Link | None = None  # the prompt's chunks to the head (dgr.seam.link), until prefill ends
    answered_at: float | None = None  # trio time the tail's last answer came
    answered_seq: int | None = None  # the step it answered
    phases: RoutePhases | None = None  # the board of the route's phase groups (dgr.fsm.phases)
    # its one budget of deadline extensions, and the nodes blamed for its late steps (dgr.tracker.patience)
    allowance: Allowance | None = None
    # who hears the session's events besides its telemetry (the gateway's accounting)
    listener: Callable[..., None] | None = None
    # The id its node sessions have: the Route Session's own until a repair opens a replacement route under a
    # fresh one (a node opens each id once, dgr.security.tickets); None while none is open (a repair closed the
    # lost route's, and the replacement's has not opened).
    node_sid: str | None = None
    speculates: bool = False  # its node sessions speculate (dgr.node.speculation): a repair is then not exact
    # after a repair: the position its node sessions' step 0 starts at (None: the prefix its route reused), and
    # which of the steps (`steps`) the gateway sends the head and whose answers it takes (dgr.tracker.resume)
    steps_from: int | None = None
    rebuild: Rebuild | None = None
    chunk: int | None = None  # its prompt's chunk size, fixed when first asked for (`chunk_size`)
    # a repair's replacement while it opens: (its node-session id, its hops), whose members' answers and reports
    # are taken before the Route Session records the route (dgr.tracker.repair `_expect`)
    opening_route: tuple[str, tuple] | None = None

    @property
    def reused(self) -> int:
        return self.rs.prefix_reused

    def kv_keep(self) -> tuple[list[str], str] | None:
        """What the route's nodes may keep of their KV: the block chain of its whole blocks and the encoded
        marks of its positions after them (dgr.node.prefix); None without prefix reuse.

        The KV holds the prompt and, with `keep_generated`, every answer token fed back (the last one
        sampled never was).
        """
        if self.prefix_root is None:
            return None
        tokens = self.prompt + self.fed if self.keep_generated else self.prompt
        chain = block_chain(tokens, self.prefix_root)
        # the marks of the positions after the last whole block, chained from that block's key
        tail = token_marks(tokens[len(chain) * BLOCK_TOKENS:], chain[-1] if chain else self.prefix_root)
        return (chain, encode_marks(tail)) if chain or tail else None

    def chunk_size(self, config: GatewayConfig) -> int:
        """The positions a chunk of its prompt holds: chosen once, from the prompt its route computes and the
        route's length (`pipeline_chunk`), so that a repair's steps are cut as the lost route's were."""
        if self.chunk is None:
            self.chunk = pipeline_chunk(len(self.prompt) - self.rs.prefix_reused, config.prefill_chunk,
                                        len(self.rs.route), config.pipeline_cuts)
        return self.chunk

    def steps(self, size: int) -> list[tuple[int, int, list[int], bool]]:
        """Its node sessions' steps as the gateway knows them (seq, pos0, ids, decode): the prompt's chunks of
        `size` positions from where they start (`steps_from`, else the reused prefix), then one decode step
        per token already fed.

        Never a one-position chunk after another: llama.cpp runs one position with other kernels
        than two or more, so the tail moves one position back, and a prompt's KV is the same
        however it was cut (what lets a later session reuse it exactly). A token fed is one decode step,
        as the tail's loop sent it: a repaired route computes each again, if at all, with the kernels it
        was computed with, and its steps keep the lost route's numbers (dgr.tracker.resume).
        """
        prompt = self.prompt
        start = self.rs.prefix_reused if self.steps_from is None else self.steps_from
        bounds = list(range(start, len(prompt), size)) + [len(prompt)] if start < len(prompt) else []
        if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
            bounds[-2] -= 1
        steps = [(a, prompt[a:b], False) for a, b in zip(bounds, bounds[1:])]
        steps += [(len(prompt) + i, [t], True) for i, t in enumerate(self.fed) if len(prompt) + i >= start]
        return [(k, a, ids, decode) for k, (a, ids, decode) in enumerate(steps)]

    def hops(self, sid: str) -> tuple:
        """The hops of node session `sid`: the replacement's while it opens, else the Route Session's route."""
        if self.opening_route is not None and self.opening_route[0] == sid:
            return self.opening_route[1]
        return self.rs.route

    def answered(self) -> int:
        """The steps whose answers the gateway has taken: the next one is the step it waits on."""
        return 0 if self.answered_seq is None else self.answered_seq + 1

    def usage(self) -> dict[str, Any]:
        return usage_body(self.rs.prompt_tokens, self.rs.completion_tokens, self.rs.prefix_reused, len(self.rs.repairs))

    def publish(self, event: RouteEvent, snapshot: dict[str, Any], **facts: Any) -> None:
        """One Route Session event: to its telemetry's watchers, and to the listener with its facts."""
        self.telemetry.publish(snapshot)
        if self.listener is not None:
            self.listener(self.rs, event, self.rs.updated_at, **facts)

    def publish_progress(self, done: int) -> None:
        """The route's tail has answered its first `done` positions: the prompt's, or a repair's rebuild."""
        if self.rs.state is RouteState.REPAIRING:
            self.publish(RouteEvent.REPAIR_PROGRESS, self.rs.repair_progress(done, trio.current_time()))
        else:
            self.publish(RouteEvent.PREFILL_PROGRESS, self.rs.prefill_progress(done, trio.current_time()))

    def over_limit(self, cfg: GatewayConfig, now: float) -> Failure | None:
        """The failure a live session's limits give it at `now` (the gateway's watcher aborts it), or None."""
        if self.unclaimed_since is not None and now - self.unclaimed_since > cfg.unclaimed_stream_s:
            # Its response was made but its body never started: the client left in between.
            failure = Failure(Reason.CANCELLED, "the client went away before its stream started")
        elif cfg.max_session_s is not None and now - self.rs.created_at > cfg.max_session_s:
            blamed = self.allowance.blamed if self.allowance is not None else []
            failure = Failure(Reason.SESSION_TIMEOUT,
                              f"the Route Session ran past this gateway's limit of {cfg.max_session_s:g}s",
                              node=blamed[0] if blamed else None)  # the first node that held a step late
        elif (cfg.slow_client_s is not None and self.writing_since is not None
              and now - self.writing_since > cfg.slow_client_s):
            # The reader holds unread output: its socket is full. Its KV is freed
            # now rather than when it finally reads or hangs up.
            failure = Failure(Reason.SLOW_CLIENT, f"the client took no streamed output for over {cfg.slow_client_s:g}s")
        else:
            return None
        return attrs.evolve(failure, phase=self.rs.state.value)

    def abort(self, failure: Failure) -> None:
        """Fail from outside the driver (node death, client gone): the FSM keeps the first reason."""
        if not self.rs.ended:  # a session that is closing has its outcome already
            self.rs.abort(failure, trio.current_time())
        self.scope.cancel()


@attrs.define
class HopStats:
    """Per-node seam overhead (round trip minus compute) for benchmarks and /v1/stats."""

    overhead_ms: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=4096))

    def to_json(self) -> dict[str, Any]:
        data = sorted(self.overhead_ms)
        if not data:
            return {"samples": 0}
        return {
            "samples": len(data),
            "p50_ms": round(statistics.median(data), 4),
            "p99_ms": round(data[min(len(data) - 1, math.ceil(0.99 * len(data)) - 1)], 4),
        }
