"""Stage timestamps of a node's chain steps: where a decoded token's time goes, arrival to departure.

Off unless the node starts with DGR_STEP_TRACE naming a folder (`dgr bench --only steps` sets it).
Then every stage a ring step passes is kept in memory as (stage, session, position, monotonic ns),
and the node writes them to FOLDER/NODE.tsv when it stops. CLOCK_MONOTONIC is one clock for every
process of a machine, so the stages of one step on two nodes of a local route line up, and the
gaps between them (a frame on the wire, a task waiting its turn) can be read off.

Stages, in the order a step passes them:
- `read`: its stream record is cut out (NodeReplies.accept_streamed);
- `admitted`: decoded, authorized and accepted by its session's state machine;
- `iterate`: an iteration of the step scheduler takes it (dgr.node.scheduler);
- `compute` and `computed`: around the backend's forward call for its batch;
- `finished`: its result is encoded (on a tail: sampled, and the next step built);
- `done`: back on the loop, its results handed to the relays;
- `woken:R` and `send:R`: relay R (`on`: the next node, or from a ring's tail to its head;
  `answer`: the gateway) has it, and starts writing it to its socket. (Not when the write ends:
  trio lets other tasks run before a send returns, so that moment may be long after the bytes left.)
A relay's marks carry the position of the frame it sends: on a ring's tail the next step's.

Why in memory and written at the end: a mark then costs about a microsecond, where a write per
mark would be a system call on the very path being measured. `MAX_MARKS` bounds the memory.
Left out: the gateway's side (dgr.tracker.gateway times its round trips).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from dgr.seam.wire import HEADER, HEADER_FIELDS

__all__ = ["ON", "ENV", "MAX_MARKS", "start_from_env", "mark", "mark_frame", "dump", "read_marks"]

ENV = "DGR_STEP_TRACE"
MAX_MARKS = 2_000_000  # about 200 MB of tuples at most; a bench run keeps a few hundred thousand
ON = False  # call sites test this first, so a node without the variable pays one global lookup per stage

_POS0 = [name for name, _, _ in HEADER_FIELDS].index("pos0")
_marks: list[tuple[str, str, int, int]] = []
_folder: Path | None = None


def start_from_env() -> None:
    """Turn marking on when DGR_STEP_TRACE names a folder (made if missing)."""
    global ON, _folder
    folder = os.environ.get(ENV)
    if folder:
        _folder = Path(folder)
        _folder.mkdir(parents=True, exist_ok=True)
        ON = True


def mark(stage: str, sid: str, pos: int) -> None:
    if len(_marks) < MAX_MARKS:
        _marks.append((stage, sid, pos, time.monotonic_ns()))


def mark_frame(stage: str, sid: str, frame: bytes) -> None:
    """`mark` with the position read from an encoded frame's header (nothing for a shorter one)."""
    if len(frame) >= HEADER.size:
        mark(stage, sid, HEADER.unpack_from(frame)[_POS0])


def dump(node_id: str) -> Path | None:
    """Write the marks to FOLDER/NODE.tsv (stage, session, position, ns a line); None when off."""
    if not ON or _folder is None:
        return None
    path = _folder / f"{node_id}.tsv"
    path.write_text("".join(f"{s}\t{sid}\t{pos}\t{ns}\n" for s, sid, pos, ns in _marks))
    return path


def read_marks(path: Path) -> list[tuple[str, str, int, int]]:
    """The marks `dump` wrote."""
    out = []
    for line in path.read_text().splitlines():
        stage, sid, pos, ns = line.split("\t")
        out.append((stage, sid, int(pos), int(ns)))
    return out
