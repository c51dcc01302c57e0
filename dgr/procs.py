"""Child processes that announce readiness with one `dgr-ready {json}` line.

Used by `dgr up`. A child is stopped with SIGTERM, then SIGKILL after a
grace period. `die_with_parent` is for children forked from a main thread
(the test harness).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable

import attrs
import trio

from dgr.errors import PeerError, Reason
from dgr.serve import READY_PREFIX

__all__ = ["Child", "run_child", "dgr_command", "die_with_parent", "run_until_signal"]


def dgr_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dgr", *args]


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: children are still stopped by the parent's finally


@attrs.define
class Child:
    name: str
    process: trio.Process
    ready: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.process.pid


async def _lines(stream):
    buf = b""
    async for chunk in stream:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode(errors="replace")
    if buf:
        yield buf.decode(errors="replace")


async def run_child(name: str, cmd: list[str], *, env: dict[str, str] | None = None, fatal: bool = True,
                    grace_s: float = 5.0, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Start `cmd`, report `Child` once it prints its ready line, stop it when cancelled.

    A child that is not `fatal` may exit after it was ready (a node lost on
    purpose, say): that is reported on stderr and the others keep running.

    Raises:
        PeerError(NODE_ERROR): the child exited before it was ready, or a fatal one exited.
    """
    # no PR_SET_PDEATHSIG here: trio forks from a worker thread, and the signal
    # fires when that *thread* exits, which kills healthy children after ~10 s
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
    started = False
    try:
        async for line in _lines(proc.stdout):
            if not started and line.startswith(READY_PREFIX):
                started = True
                task_status.started(Child(name, proc, json.loads(line[len(READY_PREFIX):])))
            elif line:
                print(f"[{name}] {line}", file=sys.stderr)
        code = await proc.wait()
        if trio.current_effective_deadline() == -float("inf"):
            return  # we are being cancelled (dgr up is stopping): an exit is expected
        if started and not fatal:
            print(f"dgr: {name} exited with code {code}; the rest keep serving", file=sys.stderr)
            return
        raise PeerError(Reason.NODE_ERROR, f"{name} exited with code {code}", node=name)
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(grace_s):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


def run_until_signal(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """trio.run(fn, ...), cancelled cleanly by SIGINT or SIGTERM.

    Returns fn's result, or None when a signal stopped it first.
    """
    result: list[Any] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            result.append(await fn(*args, **kwargs))
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result[0] if result else None
