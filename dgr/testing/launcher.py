"""`dgr` processes for tests, forked from one server that has already imported what they run.

`make test` starts about 90 `dgr up` routes and restarted nodes. As `python -m dgr`, each paid its
imports again (about 0.9 CPU-seconds for a `dgr up`, which then forks its tracker and nodes from
itself: dgr.forks). A test process instead starts one launcher, a `python -m dgr.testing.launcher`
that imports that stack once (`dgr.forks.preload`) and forks a child per command, so the command
starts where `python -m dgr` would be once its imports are done: `dgr.cli.main(argv)`.

The launcher keeps the rules of dgr.forks:
- It forks only while it is single-threaded: it serves requests on one thread, and learns of
  its children's exits from SIGCHLD through a wakeup descriptor, not from a thread.
- A child gets stdin, stdout and stderr from the test process (passed over the socket with
  SCM_RIGHTS), the environment it asked for (the whole of it: the launcher's own is dropped),
  and closes the launcher's descriptors before it runs anything.
- A child dies with the launcher, and the launcher with the test process (PR_SET_PDEATHSIG, and
  the socket's end of file).

The test process sees a child through `LaunchedProcess`, which answers as `subprocess.Popen` does
(pid, poll, wait, send_signal, kill, returncode, stdout): the launcher reports each exit status on
the socket, because only the launcher can reap its children.

Protocol, one datagram each way (SOCK_SEQPACKET): {"argv": [...], "env": {...}} with three
descriptors, answered by {"pid": N}; then, whenever a child exits, {"exit": pid, "code": c} (code
as Popen.returncode has it: negative for a signal).

Left out: commands other than `dgr`'s, and a way back to a fresh interpreter per command (the
suite still starts one wherever it runs `python -m dgr` itself, as tests/test_cli.py does).
"""

from __future__ import annotations

import array
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

import attrs

__all__ = ["LaunchedProcess", "Launcher", "launch", "prestart"]

_MAX_MESSAGE = 1 << 20  # an environment and a command line fit many times over


# -- the test process's side -------------------------------------------------------
@attrs.define(eq=False)
class LaunchedProcess:
    """A child of the launcher, as `subprocess.Popen` shows a child of one's own."""

    pid: int
    args: list[str]
    stdout: IO[str] | None
    _launcher: Launcher
    returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._launcher.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._launcher.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # exited since: its status is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@attrs.define(eq=False)
class Launcher:
    """The test process's end of one launcher server."""

    server: subprocess.Popen
    sock: socket.socket
    _codes: dict[int, int] = attrs.field(factory=dict)
    _changed: threading.Condition = attrs.field(factory=threading.Condition)
    _replies: list[int] = attrs.field(factory=list)
    _send: threading.Lock = attrs.field(factory=threading.Lock)
    _lost: bool = False

    @classmethod
    def start(cls) -> Launcher:
        from dgr.procs import die_with_parent

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = subprocess.Popen([sys.executable, "-m", "dgr.testing.launcher", str(theirs.fileno())],
                                  pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
        theirs.close()
        self = cls(server, ours)
        threading.Thread(target=self._read, daemon=True, name="dgr launcher").start()
        return self

    def spawn(self, cmd: list[str], *, env: dict[str, str], stdout: Any = None, stderr: Any = None,
              stdin: Any = None) -> LaunchedProcess:
        """Start `cmd`, a `dgr` command line (`dgr_command(...)`). stdout may be subprocess.PIPE (the
        process's `stdout` is then its read end, as text), DEVNULL or None (this process's); stderr
        subprocess.STDOUT, DEVNULL or None; stdin DEVNULL or None."""
        argv = _dgr_argv(cmd)
        opened: list[int] = []
        read_end = None

        def target(spec: Any, default: int) -> int:
            if spec is None:
                return default
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
                return fd
            raise ValueError(f"unsupported stream {spec!r}")

        try:
            if stdout == subprocess.PIPE:
                read_end, out = os.pipe()
                opened.append(out)
            else:
                out = target(stdout, 1)
            err = out if stderr == subprocess.STDOUT else target(stderr, 2)
            fds = [target(stdin, 0), out, err]
            message = json.dumps({"argv": argv, "env": env}).encode()
            with self._send:
                self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                pid = self._reply()
        except BaseException:
            if read_end is not None:
                os.close(read_end)
            raise
        finally:
            for fd in opened:
                os.close(fd)
        reader = os.fdopen(read_end, "r", encoding="utf-8", errors="replace") if read_end is not None else None
        return LaunchedProcess(pid, cmd, reader, self)

    def _reply(self) -> int:
        deadline = time.monotonic() + 30
        with self._changed:
            while not self._replies:
                if self._lost or not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("the dgr launcher did not answer (see its stderr above)")
            return self._replies.pop(0)

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._codes.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._codes:
                if self._lost:
                    raise RuntimeError("the dgr launcher exited; its children's statuses are lost")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._codes[pid]

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._lost = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "pid" in message:
                    self._replies.append(message["pid"])
                else:
                    self._codes[message["exit"]] = message["code"]
                self._changed.notify_all()


_LAUNCHER: Launcher | None = None
_LAUNCHER_LOCK = threading.Lock()


def launch(cmd: list[str], **kw: Any) -> LaunchedProcess:
    """`Launcher.spawn` on this process's launcher, started on first use."""
    return _running().spawn(cmd, **kw)


def prestart() -> None:
    """Start this process's launcher now, from the calling thread.

    PR_SET_PDEATHSIG ends a child when the thread that forked it ends, not the process: a caller that starts
    routes from worker threads (dgr.bench.gpu_run) calls this from its main thread first, or the launcher, and
    every route of it, dies with the first worker that exits.
    """
    _running()


def _running() -> Launcher:
    global _LAUNCHER
    with _LAUNCHER_LOCK:
        if _LAUNCHER is None or _LAUNCHER.server.poll() is not None:
            _LAUNCHER = Launcher.start()
        return _LAUNCHER


def _dgr_argv(cmd: list[str]) -> list[str]:
    from dgr.procs import dgr_command

    prefix = dgr_command()
    if cmd[:len(prefix)] != prefix:
        raise ValueError(f"the launcher starts dgr commands only, not {cmd[:3]}")
    return cmd[len(prefix):]


# -- the launcher server ------------------------------------------------------------
def serve(fd: int) -> None:
    """Preload, then fork a child per request until the test process's end of the socket closes."""
    from dgr.forks import preload

    preload("llama_shard")
    importlib.import_module("dgr.up")  # dgr up's own modules, beyond what its children run

    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the loop: the wakeup fd carries it
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(sock)
        if sock in ready:
            message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            if not message:
                return  # the test process is gone: PDEATHSIG stops the children
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                _child(request["argv"], request["env"], fds, (fd, wake_r, wake_w))
            for received in fds:
                os.close(received)
            sock.send(json.dumps({"pid": pid}).encode())
            _report_exits(sock)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _child(argv: list[str], env: dict[str, str], fds: list[int], ours: tuple[int, ...]) -> None:
    import traceback

    from dgr.cli import main
    from dgr.forks import run_forked
    from dgr.procs import die_with_parent

    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent()  # the launcher forks from its only thread: the signal follows the process
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in {*fds, *ours} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_forked(argv, main)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
