"""Phase groups: the decoding sessions of one route travel its ring in groups of consecutive lanes.

Why: a llama.cpp node keeps one KV stream per sequence, and then computes a
batch as one graph only over consecutive sequence ids
(llama_batch_allocr::split_equal, sequential). Decode rows of sequences
0, 2 and 5 cost three passes over the shard's weights, rows of 0, 1 and 2
one. Left alone, the sessions of a busy route drift into random pipeline
phases: on a 2-node SmolLM2 route with 8 sessions (1 thread per node), most of
a node's 4-row batches fell in 2 or 3 runs of ids and took a median 50 to 54 ms,
against 38 to 40 ms for those in one run.

So each session of a route gets a lane (the lowest free), and every node opens
it on the sequence id of that number while it is free. The route's decoding
sessions, in lane order, are cut into one group per node (a 2-node route with
8 sessions: lanes 0-3 and 4-7), and a session's next decode step waits until
every decoding session of its group has its token: a group then reaches each
node together, as one pass, while the other groups are on the other nodes.

Theory: `RoutePhases` is pure (which lane, who may go now); the gateway gives
each session its lane, and a ring's tail (dgr.node.links, its driver) takes the
same lane on its own board and waits on it with a bound, after which a session
goes alone (it only costs speed).

The bound (`hold_for`) is twice the session's own round trip: the time from
when its last step went out, after any hold, to its next token. Counting from
when its last step was ready instead counted the hold into the next bound:
with one member of a group stalled, every other member waited its whole hold
each step, and each hold was twice the last (0.1 s, 0.2 s, 0.4 s ... past a
second within 4 steps). A bound never exceeds MAX_HOLD_S either, whatever a
driver passes in.
Left out: the driver that holds steps (dgr.node.links).
"""

from __future__ import annotations

import math

import attrs

__all__ = ["RoutePhases", "FIRST_HOLD_S", "MAX_HOLD_S", "hold_for"]

FIRST_HOLD_S = 0.25  # how long a session's first decode step may wait for its phase group
# The longest any step waits for its group. Waiting only buys speed (one pass over the weights for the
# group), and no pass costs a second on the routes this serves; a session slower than that goes alone.
MAX_HOLD_S = 1.0


def hold_for(now: float, sent: float | None) -> float:
    """How long a session's step ready at `now` may wait for its group: twice its round trip since its last
    step went out at `sent` (after that step's own hold, so a hold never lengthens the next), at most
    MAX_HOLD_S; FIRST_HOLD_S for its first. A ring's tail holds by this rule."""
    return min(MAX_HOLD_S, 2.0 * max(0.0, now - sent)) if sent is not None else FIRST_HOLD_S


@attrs.define
class RoutePhases:
    """The lanes of one route's sessions and which decoding sessions wait for their group."""

    n_nodes: int
    lanes: dict[str, int] = attrs.field(factory=dict)  # every open session of the route -> its lane
    decoding: set[str] = attrs.field(factory=set)  # sessions in their decode loop
    waiting: set[str] = attrs.field(factory=set)  # decoding sessions with their token, waiting for their group

    def join(self, sid: str, lane: int | None = None) -> int:
        """A new session of the route: its lane, `lane` where that is free (a ring's tail takes the one the
        gateway gave), else the lowest free."""
        used = set(self.lanes.values())
        if lane is None or lane in used:
            lane = next(i for i in range(len(used) + 1) if i not in used)
        self.lanes[sid] = lane
        return lane

    def stop(self, sid: str) -> list[str]:
        """`sid` decodes no more (it keeps its lane until its node sessions close): who may go now."""
        self.decoding.discard(sid)
        self.waiting.discard(sid)
        return self._released()

    def leave(self, sid: str) -> list[str]:
        """`sid` is closed on its nodes: its lane is free. Returns the sessions that may go now."""
        self.lanes.pop(sid, None)
        return self.stop(sid)

    def arrive(self, sid: str) -> list[str]:
        """`sid` has its token and wants to send its next step: the sessions that may go now.

        `sid` is among them when its group is complete; otherwise it waits for a later
        arrive or leave to release it, or withdraws.
        """
        if sid not in self.lanes:
            return [sid]  # not on this route's board (opened before it existed): never waits
        self.decoding.add(sid)
        self.waiting.add(sid)
        return self._released()

    def withdraw(self, sid: str) -> None:
        """`sid` waited long enough and goes alone; its group will wait for it again next time."""
        self.waiting.discard(sid)

    def groups(self) -> list[list[str]]:
        """The decoding sessions in lane order, cut into one group per node (the last may be shorter)."""
        order = sorted(self.decoding, key=self.lanes.__getitem__)
        if not order:
            return []
        size = math.ceil(len(order) / max(1, self.n_nodes))
        return [order[i : i + size] for i in range(0, len(order), size)]

    def _released(self) -> list[str]:
        out: list[str] = []
        for group in self.groups():
            if all(sid in self.waiting for sid in group):
                out += group
        self.waiting.difference_update(out)
        return out
