"""Draft tokens by n-gram lookup over one session's own tokens (prompt and output).

The rule (prompt lookup, the family of llama.cpp's `--spec-type ngram-*`):
take the last n tokens of the session as a key, for n from `n_max` down to
`n_min`; the first n whose key occurred earlier wins, at its most recent
earlier occurrence; the draft is what followed that occurrence. The copy may
run on into the tokens it is drafting, as an LZ77 copy does, so a repeating
pattern drafts its next period even when the history holds one period only:
draft[i] = seq[start + i], where seq is the history followed by the draft.
Only occurrences that start in the last `window` tokens count.

Cost: `append` is O(n_max - n_min + 1) dictionary operations (each n-gram
ending at the previous token is registered, and each one leaving the window
is dropped); `draft(k)` is O(n_max) lookups plus O(k) copies. Memory is
O(window x sizes): the history keeps at most 2 x `window` tokens and each
table at most one entry per n-gram start inside the window.

Deterministic: the same tokens give the same drafts, with no randomness and
no dependence on dictionary order.

How much a draft rests on (`kind`): the tokens before the chosen occurrence
that equal the session's last tokens, counted back up to SUPPORT_CAP. A
draft resting on SHORT_SUPPORT tokens or fewer is "short", else "long".
Their acceptance differs, and the tail keeps one estimate for each
(dgr.node.speculation): where a copied run ends, the next drafts rest on
little context and are mostly refused, while drafts inside a run are mostly
taken, so one estimate for both kept drafting many tokens for several steps
after a run ended (docs/spec-decoding.md has the figures).

Why the registration lags one token: the table must hold the most recent
occurrence *before* the current end. An n-gram ending at the current end is
registered only when the next token arrives, so a lookup of the current
key never finds itself.

Left out: frequency statistics across sessions (llama.cpp's dynamic and
static caches); this module only looks at one session (draft models:
dgr.node.draft).
"""

from __future__ import annotations

from typing import Iterable

import attrs

__all__ = ["NgramDrafter", "SHORT_SUPPORT", "SUPPORT_CAP", "WINDOW"]

SHORT_SUPPORT = 2  # a draft resting on this many tokens of context or fewer is "short"
SUPPORT_CAP = 16  # context counted back at most (the cost of `kind` and `support`)
WINDOW = 8192  # tokens an index keeps, and so the most prompt tokens a speculating tail's open carries


@attrs.define
class NgramDrafter:
    """One session's n-gram index and history.

    Raises:
        ValueError: sizes out of order, or a window too short to hold the largest n-gram and its follower.
    """

    n_min: int = 2
    n_max: int = 4
    window: int = WINDOW
    free = True  # a lookup costs nothing next to a step: drafts are made in the shadow too
    draft_s = 0.0
    _toks: list[int] = attrs.field(init=False, factory=list)
    _base: int = attrs.field(init=False, default=0)  # absolute index of _toks[0]
    # _tables[n - n_min]: n-gram -> absolute end (exclusive) of its most recent registered occurrence
    _tables: list[dict[tuple[int, ...], int]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not (1 <= self.n_min <= self.n_max):
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.window < self.n_max + 2:
            raise ValueError(f"window {self.window} cannot hold a {self.n_max}-gram and what follows it")
        self._tables = [{} for _ in range(self.n_max - self.n_min + 1)]

    def __len__(self) -> int:
        """Tokens seen, all told (the absolute length of the session's sequence)."""
        return self._base + len(self._toks)

    def warm(self) -> None:
        """Nothing to ready: the index is built as tokens arrive."""

    def close(self) -> None:
        """Nothing to free beyond the object."""

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        """Add the session's next token (a prompt token or an accepted output token)."""
        self._toks.append(int(token))
        length = len(self)
        end = length - 1  # n-grams ending at the previous token become findable now
        for i, table in enumerate(self._tables):
            n = self.n_min + i
            if end - n >= 0:
                table[self._gram(end - n, n)] = end
            # the n-gram that starts just outside the window leaves it now
            gone = length - self.window - 1
            if gone >= 0 and gone + n <= end:
                key = self._gram(gone, n)
                if table.get(key) == gone + n:  # still its most recent occurrence: none later is in the table
                    del table[key]
        if len(self._toks) >= 2 * self.window:
            cut = len(self._toks) - self.window  # keep the window, amortised O(1) per token
            del self._toks[:cut]
            self._base += cut

    def draft(self, k: int) -> list[int]:
        """Up to k draft tokens to follow the session's last token; [] where no key recurs (or k is 0)."""
        length = len(self)
        start = self._occurrence()
        if k <= 0 or start is None:
            return []
        out: list[int] = []
        for i in range(k):
            j = start + i
            out.append(self._at(j) if j < length else out[j - length])
        return out

    def support(self) -> int:
        """The tokens the next draft rests on: how many before its occurrence equal the session's last ones
        (at most SUPPORT_CAP; 0 where nothing recurs)."""
        start = self._occurrence()
        if start is None:
            return 0
        length, n = len(self), 0
        while n < SUPPORT_CAP and start - 1 - n >= self._base and self._at(start - 1 - n) == self._at(length - 1 - n):
            n += 1
        return n

    def kind(self) -> str:
        """The class of the next draft, for its acceptance estimate: "short" or "long" (see the module)."""
        return "long" if self.support() > SHORT_SUPPORT else "short"

    def _occurrence(self) -> int | None:
        """Where the copy for the next draft starts (absolute index), or None where no key recurs."""
        length = len(self)
        for n in range(self.n_max, self.n_min - 1, -1):
            if length < n + 1:
                continue
            start = self._tables[n - self.n_min].get(self._gram(length - n, n))
            if start is not None:
                return start
        return None

    def _at(self, j: int) -> int:
        return self._toks[j - self._base]

    def _gram(self, start: int, n: int) -> tuple[int, ...]:
        s = start - self._base
        return tuple(self._toks[s : s + n])
