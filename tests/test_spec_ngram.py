"""n-gram drafts (dgr.speculative.ngram): the incremental index drafts what a brute-force search of the history finds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dgr.speculative.ngram import SUPPORT_CAP, NgramDrafter


def brute_force(seq: list[int], k: int, n_min: int, n_max: int, window: int) -> list[int]:
    """The rule as the module states it, searched from scratch: longest key first, most recent occurrence."""
    length = len(seq)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        key = seq[length - n :]
        for end in range(length - 1, n - 1, -1):  # most recent earlier occurrence, ending before the current end
            if end - n < length - window:
                break
            if seq[end - n : end] == key:
                out = list(seq)
                for i in range(k):
                    out.append(out[end + i])
                return out[length:]
    return []


def test_a_repeated_phrase_drafts_its_continuation() -> None:
    d = NgramDrafter(n_min=2, n_max=3)
    d.extend([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.draft(3) == [4, 5, 9]  # the 3-gram (1, 2, 3) was followed by 4, 5, 9
    assert d.draft(0) == []


def test_a_period_drafts_past_the_end_of_the_history() -> None:
    d = NgramDrafter(n_min=1, n_max=2)
    d.extend([5, 6, 5, 6])
    assert d.draft(5) == [5, 6, 5, 6, 5]  # the copy runs on into its own draft


def test_a_draft_says_how_much_context_it_rests_on() -> None:
    """support: the tokens before the chosen occurrence equal to the session's last ones, counted past n_max
    (up to SUPPORT_CAP); kind: short up to SHORT_SUPPORT, long beyond."""
    d = NgramDrafter(n_min=1, n_max=2)
    d.extend([9, 8, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4])
    assert d.draft(2) == [5, 6] and d.support() == 4 and d.kind() == "long"  # (1, 2, 3, 4) as before, not (8, 1, ...)
    d.extend([0, 4])
    assert d.draft(2) == [0, 4] and d.support() == 1 and d.kind() == "short"  # only (4) matches before its 0
    d = NgramDrafter(n_min=1, n_max=4)
    d.extend([1, 2, 3, 4, 5, 6])
    assert d.draft(3) == [] and d.support() == 0 and d.kind() == "short"
    d = NgramDrafter(n_min=1, n_max=4)
    d.extend([5] * 40)
    assert d.support() == SUPPORT_CAP  # counted back no further


def test_no_recurring_key_drafts_nothing() -> None:
    d = NgramDrafter(n_min=2, n_max=4)
    d.extend([1, 2, 3, 4, 5, 6])
    assert d.draft(4) == []


def test_the_window_forgets_old_occurrences_and_bounds_memory() -> None:
    d = NgramDrafter(n_min=2, n_max=2, window=16)
    d.extend([1, 2, 3])
    d.extend(range(100, 140))  # 40 distinct tokens push (1, 2) out of the window
    d.extend([1, 2])
    assert d.draft(1) == []
    assert len(d._toks) < 2 * 16 and all(len(t) <= 16 for t in d._tables)


def test_an_occurrence_counts_while_it_starts_inside_the_window() -> None:
    d = NgramDrafter(n_min=1, n_max=1, window=3)
    d.extend([1, 2, 1])
    assert d.draft(1) == [2]  # (1) at 0 starts inside the last 3 tokens
    d = NgramDrafter(n_min=1, n_max=1, window=3)
    d.extend([1, 2, 3, 1])
    assert d.draft(1) == []  # now it starts one token before them


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(n_min=3, n_max=2)
    with pytest.raises(ValueError):
        NgramDrafter(n_min=1, n_max=4, window=5)


@settings(max_examples=150)
@given(
    seq=st.integers(2, 8).flatmap(lambda a: st.lists(st.integers(0, a - 1), max_size=60)),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 2),
    slack=st.integers(0, 30),
    k=st.integers(0, 6),
)
def test_incremental_drafts_equal_a_brute_force_search(seq, n_min, extra, slack, k) -> None:
    """Small windows and alphabets of 2 to 8 tokens, so matches at the window's edge are common."""
    n_max = n_min + extra
    window = n_max + 2 + slack
    d = NgramDrafter(n_min=n_min, n_max=n_max, window=window)
    for i, t in enumerate(seq):
        d.append(t)
        assert d.draft(k) == brute_force(seq[: i + 1], k, n_min, n_max, window), (seq[: i + 1], k)
    assert len(d) == len(seq)
