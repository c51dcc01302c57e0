"""`dgr up`'s tracker and nodes, forked from one process that has already imported what they run.

A tracker or node started as `python -m dgr ...` spends most of its start importing: trio,
quart and hypercorn, httpx, numpy, attrs classes and dgr itself, 0.65 of the 0.87 CPU-seconds a
stub node took to be ready. `dgr up` starts all of its children at once, on one machine, from one
interpreter, so it imports that stack once (`preload`) and forks each child from itself.

The rules a fork without exec needs, and how this module keeps them:
- One thread at the fork. `dgr up` forks before trio runs, so no thread of its own exists. numpy's
  OpenBLAS runs a worker thread, and shuts it down itself before a fork (its own atfork handler),
  starting it again in each process when it is next needed.
- Nothing of the parent's runs twice. Stdout and stderr are flushed before the fork; the child
  never returns into the caller's code: it runs the entry point it is given (`dgr.cli.main`) and
  leaves with `os._exit`.
- No descriptor is owned twice. Each child gets a pipe on stdout (its `dgr-ready` line), shares
  stderr, and closes the descriptors the parent holds for its other children. A socket object
  the parent made (the tracker's listening socket) is detached in the child, never closed by
  a copy of that object: the tracker adopts its descriptor by number (`--listen-fd`).
- A child dies with `dgr up`. It was forked from the main thread, which lives as long as the
  process, so PR_SET_PDEATHSIG follows the process (trio's open_process forks from a worker
  thread, whose exit would fire it).
- `ps` tells them apart by name (PR_SET_NAME: `dgr-tracker`, `dgr-node0`, ...); their command
  line is `dgr up`'s.

The parent supervises a child as trio does a process it spawned: the child's pidfd becomes
readable when it exits, and the parent reaps it then.

Left out: starting a child again later (a fork then would happen under trio, with its threads),
and other platforms than Linux (pidfd_open and prctl).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
import traceback
import logging
from typing import Callable, Iterable, NoReturn

import attrs
import trio

__all__ = ["ForkedProcess", "exit_now", "fork_dgr", "preload", "run_forked"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_BACKEND_MODULES = {"stub": ("dgr.backends.stub",), "llama": ("dgr.backends.llama",),
                    "llama_shard": ("dgr.backends.llama_shard",)}  # which imports dgr.backends.llama


def preload(backend: str) -> None:
    """Import what a tracker and a `backend` node import, so that children forked later need not.

    torch is not preloaded: a torch node imports it itself, as it does any backend not named here.
    """
    # the parser and commands, the node (server, scheduler, seam), the gateway, and the backend
    for module in ("dgr.cli", "dgr.node.run", "dgr.tracker.run", "dgr.backends.factory",
                   *_BACKEND_MODULES.get(backend, ())):
        importlib.import_module(module)
    if backend in ("llama", "llama_shard"):
        from dgr.backends.clib import llama_module

        # loads the shared library (llama.cpp starts threads only for a context), and initialises no backend:
        # a GPU backend's device count would initialise a driver (CUDA's) that the forked children cannot use
        llama_module()


@attrs.define(eq=False)
class ForkedProcess:
    """A forked child as the parent sees it: what `trio.Process` offers `dgr.procs.run_child`.

    `stdout` is the read end of the child's stdout, a trio stream once `open_stdout` made it one.
    """

    pid: int
    stdout_fd: int
    _pidfd: int
    returncode: int | None = None
    stdout: trio.lowlevel.FdStream | None = None

    def fds(self) -> tuple[int, ...]:
        """The descriptors the parent holds for this child (a later child closes them)."""
        return (self.stdout_fd, self._pidfd)

    def open_stdout(self) -> trio.lowlevel.FdStream:
        """The child's stdout as a trio stream (inside trio.run; the stream owns the descriptor)."""
        if self.stdout is None:
            self.stdout = trio.lowlevel.FdStream(self.stdout_fd)
        return self.stdout

    async def wait(self) -> int:
        while self.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
            self._reap(0)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def _reap(self, flags: int) -> None:
        pid, status = os.waitpid(self.pid, flags)
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
            os.close(self._pidfd)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stop_now(self) -> None:
        """SIGKILL and reap, for a parent that fails before trio supervises its children."""
        if self.poll() is None:
            self.kill()
            self._reap(0)
        if self.stdout is None:
            os.close(self.stdout_fd)


def fork_dgr(name: str, argv: list[str], entry: Callable[[list[str]], int], *, env: dict[str, str],
             close_fds: Iterable[int] = (), detach: Iterable[socket.socket] = (),
             keep: socket.socket | None = None) -> ForkedProcess:
    """Fork a child that runs `dgr <argv>` (`entry`: dgr.cli.main) with `env` added to its environment,
    named `dgr-<name>`.

    In the child, every socket object in `detach` gives up its descriptor, which is closed unless it
    is `keep`'s (the tracker's listening socket, adopted by number); the descriptors `close_fds` are
    closed.
    """
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child: measured by the routes it serves)
        _child(name, argv, entry, env, parent, read_fd, write_fd, list(close_fds), list(detach), keep)
    os.close(write_fd)
    return ForkedProcess(pid, read_fd, os.pidfd_open(pid))


def _child(name: str, argv: list[str], entry: Callable[[list[str]], int], env: dict[str, str], parent: int,
           read_fd: int, write_fd: int, close_fds: list[int], detach: list[socket.socket],
           keep: socket.socket | None) -> NoReturn:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        # SIGINT, not SIGTERM: dgr up is gone, so its children stop now; a node would drain on SIGTERM
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT)
        if os.getppid() != parent:  # dgr up died before the line above: nobody would stop this child
            os._exit(1)
        libc.prctl(_PR_SET_NAME, f"dgr-{name}".encode()[:15])
        os.close(read_fd)
        os.dup2(write_fd, 1)
        os.close(write_fd)
        for fd in close_fds:
            os.close(fd)
        for sock in detach:
            fd = sock.detach()
            if sock is not keep:
                os.close(fd)
        os.environ.update(env)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_forked(argv, entry)


def run_forked(argv: list[str], entry: Callable[[list[str]], int]) -> NoReturn:
    """In a forked child: `dgr <argv>` as `python -m dgr` would run it (`entry`: dgr.cli.main), then leave
    the process."""
    code = 1
    try:
        sys.argv = [sys.argv[0], *argv]
        code = entry(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Leave the process with `code` once logs and stdio are flushed, without the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it anyway
            pass
    os._exit(code)
