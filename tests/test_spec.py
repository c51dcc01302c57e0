"""spec/ documents and README.md's figures are generated from the code and committed results; drift fails here."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from dgr.specgen import audits, readme
from dgr.specgen.files import GENERATED, expected
from dgr.errors import HTTP_TABLE, Reason
from dgr.seam import wire

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("rel", list(GENERATED))
def test_committed_file_matches_code(rel: str) -> None:
    """Every generated file: the protocol docs, the artifact tables, the layout fixtures, the audits."""
    committed = (ROOT / rel).read_text()
    assert committed == expected(rel), f"{rel} is stale: run `python -m dgr.specgen`"


@pytest.mark.parametrize("name", sorted(audits.AUDITS))
def test_audits_have_generated_blocks(name: str) -> None:
    """An audit with no generated block would pass the drift check with every figure typed by hand."""
    text = audits.AUDITS[name].spec.read_text()
    assert "<!-- table: node-counts -->" in text and "```console\n$ dgr plan" in text
    if name != "deepseek-v4-flash":  # the follow-up audits also tabulate fixed splits
        assert "<!-- table: split-2-4-8 -->" in text


def test_seam_doc_lists_every_header_field_at_its_offset() -> None:
    doc = (ROOT / "spec/seam.md").read_text()
    offset = 0
    for name, code, _ in wire.HEADER_FIELDS:
        size = struct.calcsize("<" + code)
        assert f"| {offset} | {size} | `{name}` |" in doc
        offset += size
    assert offset == wire.HEADER_SIZE == 48
    for enum in (wire.FrameKind, wire.DType, wire.Flag):
        for member in enum:
            assert f"`{member.name}`" in doc


def test_every_reason_has_an_http_mapping_and_a_spec_row() -> None:
    doc = (ROOT / "spec/reasons.md").read_text()
    for r in Reason:
        assert r in HTTP_TABLE
        assert 400 <= HTTP_TABLE[r][0] < 600
        assert f"`{r.value}`" in doc
    assert set(wire.DTYPE_SIZE) == set(wire.DType) == set(wire.DTYPE_NUMPY)


def test_no_assert_on_input_in_the_package() -> None:
    offenders = []
    for path in (ROOT / "dgr").rglob("*.py"):
        if "testing" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("assert "):
                offenders.append(f"{path.relative_to(ROOT)}:{i}")
    assert offenders == []


def test_architecture_layout_lists_the_real_tree() -> None:
    """docs/architecture.md's layout section names every module and package of dgr/, and nothing that is not there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout\n", 1)[1].split("```\n", 2)[1]
    listed, package = set(), None
    for line in block.splitlines():
        head = re.split(r"\s{2,}", line.strip())[0]
        if not line.startswith(" "):
            package = head if head.endswith("/") else None
            listed.add(head)
        elif package is not None:
            listed.update(package + name for name in head.split())
    real = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dgr").rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts}
    real |= {p.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "dgr").iterdir() if (p / "__init__.py").exists()}
    listed_dgr = {p for p in listed if p.startswith("dgr/") and (p.endswith(".py") or p.endswith("/"))}
    assert real - listed_dgr == set(), "modules missing from the layout in docs/architecture.md"
    assert listed_dgr - real == set(), "the layout in docs/architecture.md lists modules that do not exist"


# A number with a unit of measurement: what a hand-typed measurement in prose looks like.
_FIGURE = re.compile(r"(?<![\w.\-/])\d+(?:[.,]\d+)*\s?(?:tok/s|ms|us|s|x|%|[KMGT]i?B)(?![\w/])")


def _readme_prose(text: str) -> str:
    """The README without its generated block, its code blocks and its inline code (commands and flags)."""
    head, _, rest = text.partition(readme.BEGIN)
    _, _, tail = rest.partition(readme.END)
    prose = re.sub(r"```.*?```", "", head + tail, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", prose)


def test_readme_performance_block_is_the_current_run() -> None:
    """The README's figures come from the committed current run (drift: test_committed_file_matches_code)."""
    text = (ROOT / "README.md").read_text()
    assert text.count(readme.BEGIN) == 1 and text.count(readme.END) == 1
    block = text.split(readme.BEGIN, 1)[1].split(readme.END, 1)[0]
    results = json.loads(readme.CURRENT.read_text())
    report = (readme.CURRENT.parent / "REPORT.md").read_text()
    assert block.strip() == readme.render(results, readme.made_by(report))
    for name, r in results["paired"]["ratios"].items():
        assert f"| {name} | {r['median']:.2f}x |" in block


def test_readme_states_no_hand_typed_figure() -> None:
    """Outside the rendered block the README carries no measured figure, so none can go stale."""
    assert _FIGURE.search("decoded at 25.4 tok/s in 12 ms, 0.72x, 80%, 4 MiB")  # the pattern catches each unit
    prose = _readme_prose((ROOT / "README.md").read_text())
    assert _FIGURE.findall(prose) == []


def test_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def _anchors(markdown: str) -> set[str]:
    """The fragment GitHub gives each heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("rel", ["README.md", "docs/architecture.md", "docs/cli.md", "docs/deploy.md",
                                 "docs/perf/README.md"])
def test_local_links_resolve(rel: str) -> None:
    """Every relative link of the front page and the docs names a file or folder that exists, and a heading
    of it where the link names one."""
    path = ROOT / rel
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists() or (anchor and dest.is_file() and anchor not in _anchors(dest.read_text())):
            missing.append(target)
    assert missing == []


def test_every_module_over_400_lines_is_named_in_the_architecture_with_its_reason() -> None:
    """A module of dgr/ keeps to 400 lines; one over must be named, with its reason and its true length, in
    docs/architecture.md's "Modules over 400 lines", and one named there must still need to be."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules over 400 lines", 1)[1].split("\n## ", 1)[0]
    named = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| `(dgr/[\w/]+\.py)` \| (\d+) \| \S", section, re.M)}
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "dgr").rglob("*.py")}
    long = {p: n for p, n in long.items() if n > 400}
    assert set(named) == set(long), f"over 400 lines: {long}; named: {named}"
    assert named == long, "the table's line counts are stale"
