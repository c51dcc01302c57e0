"""Child processes that announce readiness with one `dgr-ready {json}` line.

The one home of "wait for a child's ready line, stop it": `run_child` for trio
code (`dgr up`, whose children are forked by dgr.forks), `WatchedChild` for
blocking code (the test harness, tests, `dgr bench`), which starts a command
and reads its stdout from a thread. A child is stopped with SIGTERM, then
SIGKILL after a grace period. `die_with_parent` is for children forked from a
main thread (the test harness).
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import attrs
import trio

from dgr.errors import PeerError, Reason
from dgr.forks import ForkedProcess
from dgr.serve import READY_PREFIX

__all__ = ["Child", "WatchedChild", "run_child", "dgr_command", "die_with_parent", "ready_info"]


def dgr_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dgr", *args]


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: children are still stopped by the parent's finally


def ready_info(line: str) -> dict[str, Any] | None:
    """What a `dgr-ready {json}` line announces, or None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    return json.loads(line[len(READY_PREFIX):])


@attrs.define
class WatchedChild:
    """A child process whose stdout a thread reads until its ready line: for blocking code.

    `is_ready` maps a stdout line to what it announces, or None (default: the
    `dgr-ready` line); every other line is kept in `lines` for error messages,
    and passed to `on_line` (subclasses answer their own protocol there).
    """

    name: str
    popen: subprocess.Popen
    started_at: float
    is_ready: Callable[[str], dict[str, Any] | None] = ready_info
    lines: list[str] = attrs.field(factory=list)
    ready: dict[str, Any] | None = None
    ready_at: float | None = None
    event: threading.Event = attrs.field(factory=threading.Event)

    @classmethod
    def spawn(cls, name: str, cmd: list[str], *, env: dict[str, str] | None = None, stderr: Any = subprocess.STDOUT,
              stdin: bool = False, **kw: Any) -> Any:
        """Start `cmd` (it dies with this process) and the thread that reads its stdout."""
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                 stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, preexec_fn=die_with_parent)
        return cls.watch(name, popen, **kw)

    @classmethod
    def watch(cls, name: str, popen: Any, **kw: Any) -> Any:
        """Watch a started process whose stdout is a text pipe (a Popen, or what answers like one)."""
        child = cls(name, popen, time.monotonic(), **kw)
        threading.Thread(target=child._pump, daemon=True, name=f"stdout of {name}").start()
        return child

    def _pump(self) -> None:
        for raw in self.popen.stdout:
            line = raw.rstrip()
            info = self.is_ready(line) if self.ready is None else None
            if info is not None:
                self.ready, self.ready_at = info, time.monotonic()
                self.event.set()
            else:
                self.lines.append(line)
                self.on_line(line)

    def on_line(self, line: str) -> None:
        """Called with each stdout line that is not the ready line."""

    def output_tail(self) -> str:
        """What the child said last, for an error message."""
        return "\n".join(self.lines[-30:])

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """What the child announced once ready (or `event` was set another way).

        Raises:
            PeerError(NODE_ERROR): it exited, or was not ready within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while not self.event.wait(0.1):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                why = f"exited with code {self.popen.returncode}" if self.popen.poll() is not None else "timed out"
                raise PeerError(Reason.NODE_ERROR, f"{self.name} did not become ready ({why}):\n" + self.output_tail(),
                                node=self.name)
        return self.ready or {}

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. Idempotent."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


@attrs.define
class Child:
    name: str
    process: ForkedProcess
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


async def run_child(name: str, proc: ForkedProcess, *, fatal: bool = True, grace_s: float = 5.0,
                    stop: int = signal.SIGTERM, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Supervise a forked child (dgr.forks): report `Child` once it prints its ready line, stop it when
    cancelled.

    A child that is not `fatal` may exit after it was ready (a node lost on
    purpose, say): that is reported on stderr and the others keep running.
    It is stopped with `stop` (SIGINT for a node that would drain on SIGTERM, dgr.node.drain), then SIGKILL
    after `grace_s`.

    Raises:
        PeerError(NODE_ERROR): the child exited before it was ready, or a fatal one exited.
    """
    started = False
    try:
        async with proc.open_stdout() as stdout:
            async for line in _lines(stdout):
                info = None if started else ready_info(line)
                if info is not None:
                    started = True
                    task_status.started(Child(name, proc, info))
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
                proc.send_signal(stop)
                with trio.move_on_after(grace_s):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

