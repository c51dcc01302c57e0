"""Progress bars on stderr for long jobs: hashing, verifying, moving, building shards, starting routes.

Hashing a large GGUF or fetching its layers takes minutes, so the CLI shows
a bar. It uses `rich` when it is installed and stderr is a terminal, and is
silent otherwise, so that logs, pipes and tests get no control characters.
Library functions take a `Progress` (or None) instead of printing; a
service's one-line status messages go through `say`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = ["LineProgress", "Progress", "NullProgress", "terminal_progress", "say"]


def say(message: str) -> None:
    """One status line of a node on stderr, for its operator."""
    print(f"dgr node: {message}", file=sys.stderr, flush=True)


class Progress(Protocol):
    """What the artifact functions report to."""

    def start(self, description: str, total: int | None) -> None:
        """Begin a new step of `total` units (bytes), or an open-ended one."""

    def advance(self, amount: int) -> None:
        """Units done since the last call."""

    def update(self, completed: int, total: int | None = None, description: str | None = None) -> None:
        """Absolute position, for sources that report totals (libtorrent)."""


class NullProgress:
    """Reports nowhere."""

    def start(self, description: str, total: int | None) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def update(self, completed: int, total: int | None = None, description: str | None = None) -> None:
        pass


class _RichProgress:
    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._task: Any = None

    def start(self, description: str, total: int | None) -> None:
        if self._task is not None:
            # An open-ended step (reading metadata) has no useful final line.
            if self._bar.tasks[self._task].total is None:
                self._bar.remove_task(self._task)
            else:
                self._bar.stop_task(self._task)
        self._task = self._bar.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, amount)

    def update(self, completed: int, total: int | None = None, description: str | None = None) -> None:
        if self._task is None:
            self.start(description or "", total)
        fields: dict[str, Any] = {"completed": completed}
        if total is not None:
            fields["total"] = total
        if description is not None:
            fields["description"] = description
        self._bar.update(self._task, **fields)


@contextlib.contextmanager
def terminal_progress(enabled: bool = True) -> Iterator[Progress]:
    """A rich progress bar on stderr when it is a TTY and rich is installed, else NullProgress."""
    if not enabled or not sys.stderr.isatty():
        yield NullProgress()
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import (
            Progress as RichBar,
        )
    except ImportError:
        yield NullProgress()
        return
    bar = RichBar(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with bar:
        yield _RichProgress(bar)


class LineProgress:
    """Progress as plain lines on stderr (logs, pipes, `dgr up` children): at most one a second."""

    def __init__(self, every_s: float = 1.0, emit: Callable[[str], None] | None = None) -> None:
        self._say = emit or (lambda line: print(line, file=sys.stderr, flush=True))
        self._every = every_s
        self._desc = ""
        self._total: int | None = None
        self._done = 0
        self._next = 0.0

    def _emit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self._every
        if self._total:
            self._say(f"{self._desc}: {self._done / 1e6:.1f} / {self._total / 1e6:.1f} MB "
                f"({100 * self._done / self._total:.0f}%)")
        elif self._desc:
            self._say(f"{self._desc}...")

    def start(self, description: str, total: int | None) -> None:
        self._desc, self._total, self._done = description, total, 0
        self._next = 0.0
        self._emit()

    def advance(self, amount: int) -> None:
        self._done += amount
        self._emit(force=self._total is not None and self._done >= self._total)

    def update(self, completed: int, total: int | None = None, description: str | None = None) -> None:
        finished = total is not None and completed >= total > 0 and self._done < completed
        self._done = completed
        if total is not None:
            self._total = total
        if description is not None:
            self._desc = description
        self._emit(force=finished)
