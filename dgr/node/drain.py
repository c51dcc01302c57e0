"""A node's drain: on SIGTERM, hand its sessions over (or let them end), then exit (issue 54).

Theory of operation: the first SIGTERM starts the drain. From then on every
heartbeat says `draining` (dgr.node.membership sends the first at once, not
at the next period), signed like any other, and the tracker stops routing
to this node and, with `--resume` and a spare holding its layers, repairs
each of its live sessions onto the spare (dgr.tracker.drain), closing them
here once the replacement route is open. The node keeps serving meanwhile:
a session not handed over (no `--resume`, no spare, a sampled one without a
seed) goes on here to its end. The node exits once the tracker has heard
of the drain (or said nothing for HEAR_S) and the node has held no session
for QUIET_S, or once
`bound_s` (`--drain-s`) has passed, or at a second SIGTERM or a SIGINT,
whichever comes first; whatever it still holds then is lost as a killed
node's would be.

A drain is not a failure: the tracker records no strike and no loss for it,
and a session handed over records the repair as a drain (its telemetry's
`repairs[].drained`).

Left out: the tracker's side (dgr.tracker.drain), and any state carried to
the spare: the repair computes the session's positions again, as for a loss.
"""

from __future__ import annotations

import enum
import signal
from typing import Callable

import attrs
import trio

from dgr.progress import say

__all__ = ["DRAIN_S", "Drain", "DrainState", "drain_on_signal"]

DRAIN_S = 30.0  # --drain-s: long enough for a spare to take a session over, or a short answer to end
# How often a draining node looks at its session table, which has no event for "now empty": a dict's length,
# read at most 20 times a second for at most --drain-s
_LOOK_S = 0.05
# How long a draining node waits for the tracker to hear of it before going as if it had: a tracker that is gone
# too (dgr up stopping, or down) must not hold every node for --drain-s
HEAR_S = 2.0
# How long a drained node stays empty before it exits: an open the tracker routed here just before it heard of
# the drain may still be on its way (a route's opens take milliseconds), and would find the node gone
QUIET_S = 0.5


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM came: heartbeats say so, and the node waits for its sessions
    HEARD = "heard"  # the tracker answered a draining heartbeat: it routes nothing new here


@attrs.define
class Drain:
    bound_s: float = DRAIN_S
    node: str = ""  # its node id, in what it says on stderr
    # whether a tracker has admitted it, and must hear of the drain before the node may go: one that never
    # joined (no tracker, or one it refused) has no session routed here, and goes at once
    joined: Callable[[], bool] = lambda: True
    state: DrainState = DrainState.SERVING
    since: float | None = None  # when it started draining (trio's clock)
    asked: trio.Event = attrs.field(factory=trio.Event)  # set at the first SIGTERM: the membership loop beats now

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    def heard_of(self, now: float) -> bool:
        """Whether nothing new is routed here: the tracker said so, or there is none, or it said nothing for
        HEAR_S (it is gone too, or down)."""
        return (self.state is DrainState.HEARD or not self.joined()
                or (self.since is not None and now - self.since >= HEAR_S))

    def start(self, now: float) -> None:
        if self.state is DrainState.SERVING:
            self.state, self.since = DrainState.DRAINING, now
            self.asked.set()

    def heard(self, reply: object) -> None:
        """A heartbeat's reply: the tracker says whether it knows this node drains."""
        if self.state is DrainState.DRAINING and isinstance(reply, dict) and reply.get("draining") is True:
            self.state = DrainState.HEARD
            say(f"{self.node}: the tracker knows this node drains: it routes nothing new here; "
                f"{reply.get('handed_over', 0)} session(s) being handed over")


async def drain_on_signal(drain: Drain, held: Callable[[], int], done: trio.CancelScope,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """At the first SIGTERM, drain (see the module), then cancel `done`, the node's scope; `held` counts the
    sessions the node holds."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            break
        started = trio.current_time()
        drain.start(started)
        say(f"{drain.node}: SIGTERM: draining {held()} session(s), for at most {drain.bound_s:g}s (a second SIGTERM exits now)")
        with trio.move_on_after(drain.bound_s):
            async with trio.open_nursery() as waiting:
                waiting.start_soon(_until_empty, drain, held, waiting.cancel_scope)
                async for _ in signals:  # a second signal: stop waiting
                    waiting.cancel_scope.cancel()
                    break
        left = held()
        say(f"{drain.node}: drained in {trio.current_time() - started:.2f}s: exiting" if left == 0 else
            f"{drain.node}: drain ended after {trio.current_time() - started:.2f}s with {left} session(s) still held: exiting")
    done.cancel()


async def _until_empty(drain: Drain, held: Callable[[], int], scope: trio.CancelScope) -> None:
    """Cancel `scope` once the tracker has heard of the drain and the node has held no session for QUIET_S."""
    quiet_since = None
    while quiet_since is None or trio.current_time() - quiet_since < QUIET_S:
        await trio.sleep(_LOOK_S)
        if held() or not drain.heard_of(trio.current_time()):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = trio.current_time()
    scope.cancel()
