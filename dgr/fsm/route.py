"""Route Session: one client request's life across an Inference Route.

Contract:
- States: created -> routing -> prefill -> decode -> done | failed, and
  repairing, entered from prefill or decode. done and failed are terminal.
  Failure is sticky: it records one `Failure` (reason code, node, phase,
  step, message) and every later event raises.
- routing: the tracker picks a sticky route and opens a node session on each
  hop. prefill: prompt chunks flow through the hops; `prefill_progress`
  counts positions done at the tail. The first generated token moves the
  session to decode. Each further token is a decode step.
- repairing (issue 54, `--resume`): a node was lost and the gateway repairs
  the route instead of failing. NODE_LOST opens a `Repair` (the node, the
  phase it was lost in, the token count and the last token's time);
  ROUTE_REPAIRED names the replacement route once its node sessions are open;
  REPAIR_PROGRESS counts the positions it has rebuilt; the replacement's
  first TOKEN closes the repair (its pause: from the last token before the
  loss, or the loss itself in prefill, to this one) and moves to decode,
  where the session would have gone. A node lost while repairing opens
  another `Repair`. Whether to repair at all (exactness, `--max-repairs`) is
  the driver's: this machine only records.
- Every transition returns a telemetry snapshot, so a driver can publish one
  event per change with no extra bookkeeping.
- The lifecycle facts a driver acts on are recorded here, by events, not
  kept beside the machine: `completion_tokens` (the TOKEN events that do not
  end generation: what the client is billed), `pending` (the first failure
  asked for from outside the driver by ABORT: a client gone, a timeout, a
  node declared dead; the driver then fails the session with it) and `lost`
  (every node a ROUTE_NODE_LOST failure named, by ABORT or FAIL: the nodes
  not to close now, whose close is owed).

Theory: the trio driver (dgr.tracker.gateway) feeds events with the current
time passed in; this module holds no clock and does no I/O. Rolling tokens/s
is computed over the last `RATE_WINDOW` token times.

Left out: the route choice itself (dgr.tracker.routing), text (stop strings
and detokenizing live in dgr.api), and the repair's own work: choosing and
opening the replacement (dgr.tracker.repair).
"""

from __future__ import annotations

import collections
import enum
import functools
from typing import Any

import attrs

from dgr.errors import CallerError, Failure, Reason
from dgr.fsm.machine import Transition, TransitionTable

__all__ = ["RouteState", "RouteEvent", "ROUTE_TABLE", "RouteSession", "Hop", "Repair", "RATE_WINDOW"]

RATE_WINDOW = 16


class RouteState(enum.Enum):
    CREATED = "created"
    ROUTING = "routing"
    PREFILL = "prefill"
    DECODE = "decode"
    REPAIRING = "repairing"
    DONE = "done"
    FAILED = "failed"


class RouteEvent(enum.Enum):
    START_ROUTING = "start_routing"
    ROUTE_READY = "route_ready"
    PREFILL_PROGRESS = "prefill_progress"
    TOKEN = "token"
    FINISH = "finish"
    NODE_LOST = "node_lost"
    ROUTE_REPAIRED = "route_repaired"
    REPAIR_PROGRESS = "repair_progress"
    ABORT = "abort"
    FAIL = "fail"


_LIVE = (RouteState.CREATED, RouteState.ROUTING, RouteState.PREFILL, RouteState.DECODE, RouteState.REPAIRING)
# a snapshot's health by state; a live session past routing is "ok" once it has its route, else "unknown"
_HEALTH = {RouteState.CREATED: "ok", RouteState.ROUTING: "ok", RouteState.REPAIRING: "repairing",
           RouteState.DONE: "closed", RouteState.FAILED: "failed"}

ROUTE_TABLE: TransitionTable[RouteState, RouteEvent] = TransitionTable(
    machine="route_session",
    states=RouteState,
    events=RouteEvent,
    initial=RouteState.CREATED,
    transitions=(
        Transition(RouteState.CREATED, RouteEvent.START_ROUTING, RouteState.ROUTING, "request accepted"),
        Transition(RouteState.ROUTING, RouteEvent.ROUTE_READY, RouteState.PREFILL, "route chosen, node sessions open"),
        Transition(RouteState.PREFILL, RouteEvent.PREFILL_PROGRESS, RouteState.PREFILL, "a prompt chunk left the tail"),
        Transition(RouteState.PREFILL, RouteEvent.TOKEN, RouteState.DECODE, "first token sampled"),
        Transition(RouteState.DECODE, RouteEvent.TOKEN, RouteState.DECODE, "one more token"),
        Transition(RouteState.DECODE, RouteEvent.FINISH, RouteState.DONE, "stop, EOS or max_tokens"),
        Transition(RouteState.PREFILL, RouteEvent.NODE_LOST, RouteState.REPAIRING, "a node lost mid-prompt: repair"),
        Transition(RouteState.DECODE, RouteEvent.NODE_LOST, RouteState.REPAIRING, "a node lost mid-answer: repair"),
        Transition(RouteState.REPAIRING, RouteEvent.NODE_LOST, RouteState.REPAIRING,
                   "another node lost before the repair ended: one repair more"),
        Transition(RouteState.REPAIRING, RouteEvent.ROUTE_REPAIRED, RouteState.REPAIRING,
                   "the replacement route is open; it rebuilds the KV"),
        Transition(RouteState.REPAIRING, RouteEvent.REPAIR_PROGRESS, RouteState.REPAIRING,
                   "a rebuilt chunk left the replacement's tail"),
        Transition(RouteState.REPAIRING, RouteEvent.TOKEN, RouteState.DECODE,
                   "the replacement's first token: repaired, the answer goes on"),
        *(Transition(s, RouteEvent.ABORT, s, "a failure asked for from outside the driver (the first is kept)")
          for s in _LIVE),
        *(Transition(s, RouteEvent.FAIL, RouteState.FAILED, "structured failure") for s in _LIVE),
    ),
)


@attrs.frozen
class Hop:
    """One node of a route: who serves which layers."""

    node_id: str
    url: str
    start: int
    stop: int


@attrs.frozen
class Repair:
    """One repair of a Route Session's route (issue 54): the node lost, what replaced it, and the pause.

    Times are the driver's clock. `since` is the last token's time before the loss (the loss's own where no
    token had come), so `pause` is what a streaming client saw between two tokens.
    """

    lost: str  # the node lost
    phase: str  # the state the session was in: prefill, decode, or repairing (a loss during a repair)
    at_token: int  # tokens streamed before the loss
    since: float
    lost_at: float  # when the driver learned of the loss
    route: tuple[str, ...] = ()  # the replacement route, once open
    replacement: tuple[str, ...] = ()  # its nodes that were not on the route before
    routed_at: float | None = None
    reused: int = 0  # positions the replacement route held already (a kept prefix on every hop)
    total: int = 0  # positions it needs before its first token: the prompt and every token streamed
    rebuilt: int = 0  # positions it has computed of those (REPAIR_PROGRESS)
    # (node, positions) of each hop that kept its KV (a survivor resumed, dgr.tracker.resume): it computes only
    # the positions past them; every other hop computes all `total`
    kept: tuple[tuple[str, int], ...] = ()
    resumed_at: float | None = None  # its first token
    drained: bool = False  # the node was not lost but drained (SIGTERM): its sessions handed over (dgr.tracker.drain)

    def to_json(self) -> dict[str, Any]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1e3, 3)

        return {"lost": self.lost, "drained": self.drained, "phase": self.phase, "at_token": self.at_token, "route": list(self.route),
                "replacement": list(self.replacement), "rebuild": {"reused": self.reused, "done": self.rebuilt,
                                                                   "total": self.total, "kept": dict(self.kept)},
                "pause_ms": ms(self.since, self.resumed_at), "detect_ms": ms(self.since, self.lost_at),
                "reroute_ms": ms(self.lost_at, self.routed_at), "rebuild_ms": ms(self.routed_at, self.resumed_at)}


def _route_json(route: tuple[Hop, ...]) -> list[dict[str, Any]]:
    return [{"node": h.node_id, "url": h.url, "layers": f"{h.start}:{h.stop}"} for h in route]


@attrs.define
class RouteSession:
    """The gateway's view of one Route Session. Pure: time is passed in."""

    sid: str
    model: str
    created_at: float
    state: RouteState = ROUTE_TABLE.initial
    route: tuple[Hop, ...] = ()
    route_json: list[dict[str, Any]] = attrs.field(factory=list)  # the route as snapshots show it, made with it
    prompt_tokens: int = 0
    prefix_reused: int = 0  # prompt positions whose KV came from a kept prefix on every node (not prefilled)
    prefill_done: int = 0
    generated: int = 0
    completion_tokens: int = 0  # TOKEN events that did not end generation
    pending: Failure | None = None  # the first ABORT's failure: the one the driver fails the session with
    lost: frozenset[str] = frozenset()  # nodes named by a ROUTE_NODE_LOST failure (ABORT or FAIL)
    first_token_at: float | None = None
    ended_at: float | None = None
    finish_reason: str | None = None
    failure: Failure | None = None
    updated_at: float = 0.0
    hop_latency_ms: dict[str, float] = attrs.field(factory=dict)  # node -> last step's overhead
    # speculative steps (issue 42): how many, the drafts they carried and the drafts the tail accepted, and
    # the latest step's drafts (k)
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_k: int = 0
    tokens_per_second: float = 0.0  # over the last RATE_WINDOW token times: it changes only when a token comes
    # whose it is: the caller's isolation scope (a hash of its API key), so that only it sees the session's telemetry
    owner: str = ""
    repairs: tuple[Repair, ...] = ()  # every repair of its route, the open one last while repairing
    _token_times: collections.deque[float] = attrs.field(
        factory=functools.partial(collections.deque, maxlen=RATE_WINDOW))

    def _move(self, event: RouteEvent, now: float) -> RouteState:
        if self.state is RouteState.FAILED:
            raise CallerError(
                Reason.SESSION_ENDED,
                f"route session {self.sid} already failed: {self.failure.reason.value if self.failure else '?'}",
            )
        target = ROUTE_TABLE.next(self.state, event)
        self.state = target
        self.updated_at = now
        return target

    # -- events ---------------------------------------------------------------
    def start_routing(self, now: float) -> dict[str, Any]:
        self._move(RouteEvent.START_ROUTING, now)
        return self.snapshot(now)

    def route_ready(self, route: tuple[Hop, ...], prompt_tokens: int, now: float,
                    prefix_reused: int = 0) -> dict[str, Any]:
        if not route:
            raise CallerError(Reason.INVALID_REQUEST, "a route needs at least one hop")
        if prompt_tokens < 1:
            raise CallerError(Reason.INVALID_REQUEST, "a prompt needs at least one token")
        if not (0 <= prefix_reused < prompt_tokens):
            raise CallerError(Reason.INVALID_REQUEST, f"{prefix_reused} reused of {prompt_tokens} prompt positions: "
                                                      "at least one must be prefilled")
        self._move(RouteEvent.ROUTE_READY, now)
        self.route = route
        self.route_json = _route_json(route)
        self.prompt_tokens = prompt_tokens
        self.prefix_reused = self.prefill_done = prefix_reused
        return self.snapshot(now)

    def prefill_progress(self, done: int, now: float) -> dict[str, Any]:
        if not (self.prefill_done <= done <= self.prompt_tokens):
            raise CallerError(
                Reason.INVALID_REQUEST,
                f"prefill progress {done} outside [{self.prefill_done}, {self.prompt_tokens}]",
            )
        self._move(RouteEvent.PREFILL_PROGRESS, now)
        self.prefill_done = done
        return self.snapshot(now)

    def token(self, now: float, completion: bool = True, hop_ms: dict[str, float] | None = None) -> dict[str, Any]:
        """A token came back from the tail; `completion`: it is part of the answer (not the one that
        ends generation); `hop_ms`: each hop's seam overhead, where its answer measured it."""
        previous = self.state
        self._move(RouteEvent.TOKEN, now)
        if previous is not RouteState.DECODE:  # prefill's token, or the first after a repair (in either)
            self.prefill_done = self.prompt_tokens
            if self.first_token_at is None:
                self.first_token_at = now
        if previous is RouteState.REPAIRING:  # the replacement computed every position it lacked
            last = self.repairs[-1]
            self.repairs = (*self.repairs[:-1], attrs.evolve(last, resumed_at=now, rebuilt=last.total))
        self.generated += 1
        self.completion_tokens += completion
        if hop_ms:
            self.hop_latency_ms.update(hop_ms)
        times = self._token_times
        times.append(now)
        self.tokens_per_second = (len(times) - 1) / (times[-1] - times[0]) if times[-1] > times[0] else 0.0
        return self.snapshot(now)

    def node_lost(self, node: str, now: float, drained: bool = False) -> dict[str, Any]:
        """`node` was lost (or, `drained`, is stopping and hands the session over) and the driver repairs the
        route (it judged the repair exact and allowed)."""
        phase = self.state.value
        self._move(RouteEvent.NODE_LOST, now)
        since = self._token_times[-1] if self._token_times else now
        self.repairs = (*self.repairs, Repair(node, phase, self.generated, since, now, drained=drained))
        return self.snapshot(now)

    def route_repaired(self, route: tuple[Hop, ...], reused: int, total: int, now: float,
                       kept: tuple[tuple[str, int], ...] = ()) -> dict[str, Any]:
        """The replacement `route` is open; every hop holds `reused` of the `total` positions it needs before
        it samples (the prompt and every token streamed), the survivors in `kept` (node, positions) more."""
        if not route:
            raise CallerError(Reason.INVALID_REQUEST, "a route needs at least one hop")
        if self.repairs and self.repairs[-1].routed_at is not None and self.state is RouteState.REPAIRING:
            raise CallerError(Reason.INVALID_REQUEST, "this repair's replacement is open already: a loss is "
                                                      "repaired once, a new loss opens a new repair")
        if not 0 <= reused < total:
            raise CallerError(Reason.INVALID_REQUEST, f"{reused} reused of {total} positions: at least one must "
                                                      "be computed")
        self._move(RouteEvent.ROUTE_REPAIRED, now)
        before = {h.node_id for h in self.route}
        self.repairs = (*self.repairs[:-1], attrs.evolve(
            self.repairs[-1], route=tuple(h.node_id for h in route), routed_at=now, reused=reused, total=total,
            rebuilt=reused, kept=kept, replacement=tuple(h.node_id for h in route if h.node_id not in before)))
        self.route, self.route_json = route, _route_json(route)
        return self.snapshot(now)

    def repair_progress(self, done: int, now: float) -> dict[str, Any]:
        """The replacement route has computed its first `done` positions."""
        repair = self.repairs[-1] if self.repairs else None
        if repair is None or repair.routed_at is None or not repair.rebuilt <= done <= repair.total:
            raise CallerError(Reason.INVALID_REQUEST, f"repair progress {done} outside what the open repair rebuilds")
        self._move(RouteEvent.REPAIR_PROGRESS, now)
        self.repairs = (*self.repairs[:-1], attrs.evolve(repair, rebuilt=done))
        return self.snapshot(now)

    def speculated(self, k: int, accepted: int) -> None:
        """The tail verified a step of `k` drafts and accepted `accepted` of them (telemetry only)."""
        if not 0 <= accepted <= k:
            raise CallerError(Reason.INVALID_REQUEST, f"{accepted} drafts accepted of {k}")
        self.spec_steps += 1
        self.drafted += k
        self.accepted += accepted
        self.spec_k = k

    def finish(self, reason: str, now: float) -> dict[str, Any]:
        self._move(RouteEvent.FINISH, now)
        self.finish_reason = reason
        self.ended_at = now
        return self.snapshot(now)

    def abort(self, failure: Failure, now: float) -> dict[str, Any]:
        """Someone other than the driver wants the session failed; the first such failure is kept."""
        phase = self.state.value
        self._move(RouteEvent.ABORT, now)
        if self.pending is None:
            self.pending = failure if failure.phase else attrs.evolve(failure, phase=phase)
        self._note_lost(failure)
        return self.snapshot(now)

    def fail(self, failure: Failure, now: float) -> dict[str, Any]:
        phase = self.state.value
        self._move(RouteEvent.FAIL, now)
        self.failure = failure if failure.phase else attrs.evolve(failure, phase=phase)
        self.ended_at = now
        self._note_lost(failure)
        return self.snapshot(now)

    def _note_lost(self, failure: Failure) -> None:
        if failure.reason is Reason.ROUTE_NODE_LOST and failure.node:
            self.lost = self.lost | {failure.node}

    # -- telemetry ------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.state in ROUTE_TABLE.terminal

    def snapshot(self, now: float) -> dict[str, Any]:
        """Generation Telemetry: everything a client may want to see right now."""
        return {
            "id": self.sid,
            "model": self.model,
            "phase": self.state.value,
            "route": self.route_json,
            "prefill": {"done": self.prefill_done, "total": self.prompt_tokens},
            "prefix_reused_tokens": self.prefix_reused,
            "tokens": self.generated,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "ttft_ms": None if self.first_token_at is None else round((self.first_token_at - self.created_at) * 1e3, 3),
            "hop_latency_ms": dict(self.hop_latency_ms),
            "speculation": {"steps": self.spec_steps, "drafted": self.drafted, "accepted": self.accepted,
                            "rejected": self.drafted - self.accepted,
                            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                            "k": self.spec_k},
            "health": _HEALTH.get(self.state, "ok" if self.route else "unknown"),
            "finish_reason": self.finish_reason,
            "failure": None if self.failure is None else self.failure.to_json(),
            "repairs": [r.to_json() for r in self.repairs],
            "elapsed_ms": round(((self.ended_at or now) - self.created_at) * 1e3, 3),
        }
