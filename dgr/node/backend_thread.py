"""The one OS thread that makes a node's blocking backend calls.

Why one thread for the node's life, and not `trio.to_thread.run_sync` per
call: llama.cpp's CPU backend runs a graph with OpenMP, and libgomp keeps a
team of worker threads for each thread that starts a parallel region. Once
two threads of a process have each decoded with more than one llama.cpp
thread, the process manages more OpenMP threads than it has cores, and
libgomp then cuts its spin-waiting at barriers short: every barrier of the
graph (one per op) sleeps and wakes. Measured on these 2-core VMs, SmolLM2
through `LlamaBackend` with 2 threads, from one thread: 92 to 101 tok/s;
after a second thread had decoded one token, 45 tok/s from the first, for
as long as both threads lived. trio's thread cache hands a call to whichever
worker is idle (the most recent), so any other `to_thread` call on the node
(an artifact piece, a name lookup) could move the next iteration to a new
thread, and halve the node's compute until one of the two threads retired.
One-thread backends start no parallel region, so only they may also run a
short iteration on the loop (dgr.node.scheduler).

Rules:
- Calls run one at a time, in the order they were made.
- `run_sync` cannot be abandoned: a caller cancelled while its call runs
  waits for the call to end, and the cancel lands at its next checkpoint
  (as with `trio.to_thread.run_sync` by default), so a backend call is never
  cut off half-way and never outlives its caller.
- The thread starts when the `with` block is entered and is joined when it
  is left; leave it only once no call is running (the scheduler's loop
  awaits each of its calls).
- A call's Python runs before the loop's: `run_sync` blocks the loop (for at
  most `start_wait_s`) until the thread has taken the call. Both threads need
  the GIL, and the thread only lets go of it once it is inside llama.cpp; a
  woken thread that finds the loop running Python (a relay encoding and
  sending its result) waits for it. On one `llama` node with 2 threads, that
  wait put 0.27 to 0.7 ms p50 (1.1 to 1.2 ms p90) between a step's hand-off
  and its compute; blocking the loop for it, 93 us p50 (137 p90).

Left out: what the calls do, and their order across sessions (the scheduler's).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import attrs
import outcome
import trio

__all__ = ["BackendThread"]

_STOP = object()  # the end of the thread's work: a threading queue has no close


@attrs.define(eq=False)
class BackendThread:
    name: str = "dgr-backend"
    start_wait_s: float = 0.002  # the longest the loop blocks for the thread to take a call
    _calls: queue.SimpleQueue = attrs.field(factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    def __enter__(self) -> "BackendThread":
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._calls.put(_STOP)
        self._thread.join()

    @property
    def queued(self) -> int:
        """Calls made and not yet taken by the thread."""
        return self._calls.qsize()

    @property
    def ident(self) -> int | None:
        """The thread's id once it has started."""
        return None if self._thread is None else self._thread.ident

    def _serve(self) -> None:
        while (call := self._calls.get()) is not _STOP:
            fn, args, deliver, taken = call
            taken.set()  # the loop may go on: this thread holds the GIL until fn is in llama.cpp
            deliver(outcome.capture(fn, *args))

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in this thread; its value, or its exception raised here."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        taken = threading.Event()
        self._calls.put((fn, args, deliver, taken))
        taken.wait(self.start_wait_s)  # blocks the loop, without the GIL
        # Abort.FAILED: a cancel waits for the call, then lands at the caller's next checkpoint.
        # The outcome given to reschedule comes back unwrapped: fn's value, or its exception raised.
        return await trio.lowlevel.wait_task_rescheduled(lambda _raise_cancel: trio.lowlevel.Abort.FAILED)
