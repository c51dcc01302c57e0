"""Token bytes to client text: UTF-8 that is never split, and stop strings.

Tokens carry raw bytes; a multi-byte character may span two tokens, so bytes
go through an incremental UTF-8 decoder that holds an incomplete sequence
back. Text that could still become a stop string is also held back, so a
stream never shows the start of a stop string it later removes.
"""

from __future__ import annotations

import codecs
import functools

import attrs

__all__ = ["TextAssembler"]


@attrs.define
class TextAssembler:
    stop: tuple[str, ...] = ()
    _decoder: codecs.IncrementalDecoder = attrs.field(
        factory=functools.partial(codecs.getincrementaldecoder("utf-8"), "replace"))
    _pending: str = ""  # decoded, not yet emitted
    emitted: str = ""
    stopped: bool = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return text that is safe to emit now."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                self.stopped = True
                return self._emit(self._pending[:at])
        keep = 0  # the longest end of the pending text that begins a stop string: held back
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._pending)), keep, -1):
                if self._pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self._pending) - keep
        return self._emit(self._pending[:cut], rest=self._pending[cut:])

    def finish(self) -> str:
        """End of generation: flush whatever was held back."""
        if self.stopped:
            return ""
        tail = self._pending + self._decoder.decode(b"", final=True)
        return self._emit(tail)

    def _emit(self, text: str, rest: str = "") -> str:
        self._pending = rest
        self.emitted += text
        return text
