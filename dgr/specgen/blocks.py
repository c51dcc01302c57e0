"""A generated block inside a hand-written file: the text around it, between its two markers.

Used by the files that are only partly generated (spec/artifact-manifest.md's
tables, README.md's performance block): everything outside the markers is
kept as written.
"""

from __future__ import annotations

from dgr.errors import CallerError, Reason

__all__ = ["around"]


def around(text: str, begin: str, end: str, where: str) -> tuple[str, str]:
    """(what comes before `begin`, what comes from `end` on, `end` itself excluded).

    Raises:
        CallerError(INTERNAL): `where` lacks either marker.
    """
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise CallerError(Reason.INTERNAL, f"{where} lacks the {begin!r} ... {end!r} markers")
    return head, tail
