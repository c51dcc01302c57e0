"""Every generated file in the repository, and how to draw it from the code.

One table, `GENERATED`: a path (relative to the repository root) and a
function from the file's committed text to the text it should have. Whole
documents ignore the committed text; spliced ones (the artifact tables, the
audits' pasted `dgr plan` output, README.md's performance block) rewrite only
their generated blocks.
The order matters: the layout fixtures come before the audits drawn from them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dgr.specgen import artifact, audit_layouts, audits, dsv4_layout, protocol, ranges, readme

__all__ = ["GENERATED", "ROOT", "expected"]

ROOT = Path(__file__).resolve().parents[2]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


GENERATED: dict[str, Callable[[str], str]] = {
    _rel(dsv4_layout.OUT): lambda _text: dsv4_layout.render(),
    **{_rel(p): (lambda _text, p=p: audit_layouts.render(p)) for p in audit_layouts.OUTPUTS},
    **{rel: (lambda _text, r=render: r()) for rel, render in protocol.DOCUMENTS.items()},
    _rel(artifact.SPEC_PATH): artifact.splice,
    _rel(ranges.OUT): lambda _text: ranges.render(),
    **{_rel(a.spec): (lambda text, a=a: audits.render(text, a)) for a in audits.AUDITS.values()},
    _rel(readme.README): readme.splice,
}


def expected(rel: str) -> str:
    """What the file at `rel` should hold, given what it holds now."""
    path = ROOT / rel
    return GENERATED[rel](path.read_text(encoding="utf-8") if path.exists() else "")
