"""Seam journals: the frames a node sent on for each live session, so that a repair feeds a replacement from them.

Why (issue 54): a route that loses node k goes on with a spare of k's layers. The spare must hold the KV of
every position the session has, and its input for each is exactly what node k-1 sent node k: hidden states
already encoded (quantised, where the seam runs f16) as they crossed the seam. Kept here, they feed the spare
without any upstream node computing a position again, bit for bit what the lost node took, in its steps
(the same chunking: llama.cpp rounds a one-position step differently from a chunk).

Rules:
- Every non-tail node journals every step it computes and sends on (a tail's answers are the gateway's,
  and a lost head's replacement is fed token ids, which the gateway holds): the frame as sent, by step.
- One byte budget for the whole node (`dgr node --journal-mb`). A step that does not fit refuses the
  session's journal: it is dropped whole (a journal with a hole feeds no one) and the session says why
  (`refused`), so a repair of its route computes every position again, as without a journal.
- A repair resumes a session under a fresh id (dgr.node.sessions `resume`): its journal goes with it, cut
  to the steps the session keeps (`keep`), and what the hop after it lacks is sent on first (`frames`),
  readdressed to the new id (dgr.seam.frame `readdressed`).
- A session that ends frees its journal (`release`).

Left out: what a repair asks of a node (dgr.seam.opening `ResumeOrder`) and the gateway's plan
(dgr.tracker.resume).
"""

from __future__ import annotations

import attrs

from dgr.seam.frame import readdressed

__all__ = ["Journal", "JournalBook"]


@attrs.define(eq=False)
class Journal:
    """One session's frames sent on, by step: `first` is the seq of `frames[0]`, each next one the next step."""

    first: int = 0
    frames: list[bytes] = attrs.field(factory=list)
    nbytes: int = 0
    refused: str | None = None  # why it holds nothing (over the node's budget); None: whole

    @property
    def end(self) -> int:
        """The step after its last."""
        return self.first + len(self.frames)

    def covers(self, start: int, stop: int) -> bool:
        """It holds every step in [start, stop) (an empty range always)."""
        return start >= stop or (self.refused is None and self.first <= start and stop <= self.end)


@attrs.define
class JournalBook:
    """The node's journals' byte budget, and what they did: the counters node status shows."""

    limit: int  # bytes all live sessions' journals may hold together; 0: no journals
    used: int = 0
    sessions: int = 0  # journals held
    refused: int = 0  # journals dropped for the budget
    resumed: int = 0  # sessions a repair resumed on this node
    replayed: int = 0  # frames sent again from a journal
    repeats: int = 0  # frames dropped unread: steps a resumed session held already

    def open(self) -> Journal | None:
        """A new session's journal; None where the node keeps none."""
        if self.limit <= 0:
            return None
        self.sessions += 1
        return Journal()

    def add(self, journal: Journal, seq: int, frame: bytes) -> None:
        """Step `seq`'s frame as sent; over the budget, the whole journal is refused."""
        if journal.refused is not None:
            return
        end = journal.first + len(journal.frames)  # not `end`: this runs for every step sent on
        if seq != end:  # a step it never saw (it was opened later, or trimmed): a hole
            self._refuse(journal, f"step {seq} after step {end - 1}")
        elif self.used + len(frame) > self.limit:
            self._refuse(journal, f"the node's journals hold {self.used} of {self.limit} bytes, step {seq} "
                                  f"needs {len(frame)} more (dgr node --journal-mb)")
        else:
            journal.frames.append(frame)
            journal.nbytes += len(frame)
            self.used += len(frame)

    def keep(self, journal: Journal, steps: int) -> None:
        """Cut to the steps before `steps` (a resumed session that keeps no more)."""
        drop = journal.frames[max(0, steps - journal.first):]
        if drop:
            gone = sum(map(len, drop))
            del journal.frames[len(journal.frames) - len(drop):]
            journal.nbytes -= gone
            self.used -= gone

    def frames(self, journal: Journal, start: int, stop: int, session: str) -> list[bytes]:
        """Steps [start, stop) as session `session`'s frames, to send on again (`covers` them first)."""
        out = [readdressed(f, session) for f in journal.frames[start - journal.first:stop - journal.first]]
        self.replayed += len(out)
        return out

    def release(self, journal: Journal | None) -> None:
        """A session ended: its bytes are free."""
        if journal is None:
            return
        self.used -= journal.nbytes
        self.sessions -= 1
        journal.frames, journal.nbytes = [], 0

    def _refuse(self, journal: Journal, why: str) -> None:
        self.used -= journal.nbytes
        journal.frames, journal.nbytes, journal.refused = [], 0, why
        self.refused += 1

    def to_json(self) -> dict[str, int]:
        return {"limit": self.limit, "bytes": self.used, "sessions": self.sessions, "refused": self.refused,
                "resumed": self.resumed, "replayed": self.replayed, "repeats": self.repeats}
