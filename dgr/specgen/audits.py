"""Regenerate the generated parts of the model audits in spec/ from `dgr plan`.

One generator for every audit (spec/deepseek-v4-flash.md, spec/glm-5.2.md,
spec/ornith.md), so no figure in them is typed by hand. Three kinds of
generated block:
- a ```console block whose first line is `$ dgr plan ...`: the command is
  run in-process and the block gets its exact output;
- `<!-- table: node-counts -->` ... `<!-- /table -->`: nodes used for each
  recipe, context and node size, from dgr.plan.plan (fewest that fit);
- `<!-- table: split-2-4-8 -->` ... `<!-- /table -->`: the memory each node
  needs when the model is split over exactly 2, 4 and 8 nodes (balanced:
  the largest shard as small as it can be).

`python -m dgr.specgen` rewrites them with every other generated file;
tests/test_spec.py checks them, and tests/test_plan.py and
tests/test_plan_audits.py check the figures they rest on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import attrs

from dgr import plan as dgr_plan
from dgr.errors import CallerError
from dgr.plan.cli import register
from dgr.plan.layout import ModelLayout
from dgr.plan.sources import layout_from_json

__all__ = ["AUDITS", "Audit", "node_counts", "render", "render_node_counts", "render_splits", "run_cli", "splits"]

ROOT = Path(__file__).resolve().parents[2]

_CONSOLE = re.compile(r"(```console\n)(\$ dgr plan [^\n]*)\n(.*?)(```)", re.DOTALL)
_TABLE = re.compile(r"(<!-- table: ([a-z0-9-]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)

SPLITS = (2, 4, 8)  # the node counts of the split-2-4-8 table


@attrs.frozen
class Audit:
    """One audit: its spec, its layout fixture, and the cases its tables cover."""

    spec: Path
    fixture: Path
    recipes: tuple[str, ...]
    node_gib: tuple[int, ...]
    cases: tuple[tuple[int, int], ...]  # (context, sessions)

    def layout(self, recipe: str) -> ModelLayout:
        data = json.loads(self.fixture.read_text())
        return layout_from_json(data, recipe=recipe, source=str(self.fixture.relative_to(ROOT)))


AUDITS = {
    "deepseek-v4-flash": Audit(
        spec=ROOT / "spec" / "deepseek-v4-flash.md",
        fixture=ROOT / "tests" / "fixtures" / "deepseek-v4-flash.layout.json",
        recipes=("q2-antirez", "mxfp4-q8", "q4k-antirez", "q8_0"),
        node_gib=(24, 64, 128),
        # a working context, a long one with several sessions, the model's maximum
        cases=((32768, 1), (131072, 4), (1048576, 1)),
    ),
    "glm-5.2": Audit(
        spec=ROOT / "spec" / "glm-5.2.md",
        fixture=ROOT / "tests" / "fixtures" / "glm-5.2.layout.json",
        recipes=("iq2s-iq4nl", "q4k-q8", "q8_0"),
        node_gib=(64, 128, 256),
        cases=((32768, 1), (131072, 4), (1048576, 1)),
    ),
    "ornith": Audit(
        spec=ROOT / "spec" / "ornith.md",
        fixture=ROOT / "tests" / "fixtures" / "ornith-1.0-35b.layout.json",
        recipes=("q4k-q8", "q8_0", "bf16"),
        node_gib=(8, 16, 32),
        cases=((32768, 1), (131072, 4), (262144, 1)),
    ),
}


def run_cli(command: str) -> str:
    """`dgr plan ...` run in-process from the repo root: its stdout and stderr, as a console shows them."""
    argv = shlex.split(command)[1:]  # drop "dgr"
    parser = argparse.ArgumentParser(prog="dgr")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = args.func(args)
    finally:
        os.chdir(cwd)
    text = out.getvalue() + err.getvalue()
    return text + ("" if rc == 0 else f"[exit {rc}]\n")


def node_counts(audit: Audit) -> dict[tuple[str, int, int, int], dgr_plan.Plan | None]:
    """The plan (or None: does not fit on one node per layer) for each recipe, case and node size."""
    out: dict[tuple[str, int, int, int], dgr_plan.Plan | None] = {}
    for recipe in audit.recipes:
        layout = audit.layout(recipe)
        for context, sessions in audit.cases:
            params = dgr_plan.PlanParams(context=context, sessions=sessions)
            for gib in audit.node_gib:
                nodes = [dgr_plan.Node(f"node{i + 1}", gib * 2**30) for i in range(layout.n_layers)]
                try:
                    out[(recipe, context, sessions, gib)] = dgr_plan.plan(layout, nodes, params)
                except CallerError:
                    out[(recipe, context, sessions, gib)] = None
    return out


def splits(audit: Audit) -> dict[tuple[str, int, int, int], dgr_plan.Plan | None]:
    """The balanced plan over exactly k large nodes (None: the model cannot be cut into k shards)."""
    out: dict[tuple[str, int, int, int], dgr_plan.Plan | None] = {}
    for recipe in audit.recipes:
        layout = audit.layout(recipe)
        for context, sessions in audit.cases:
            params = dgr_plan.PlanParams(context=context, sessions=sessions, fewest=False)
            for k in SPLITS:
                nodes = [dgr_plan.Node(f"node{i + 1}", 2**50) for i in range(k)]
                try:
                    out[(recipe, context, sessions, k)] = dgr_plan.plan(layout, nodes, params)
                except CallerError:
                    out[(recipe, context, sessions, k)] = None
    return out


def _rows(audit: Audit, head: list[str], cell) -> str:
    lines = ["| recipe | weights | context x sessions | " + " | ".join(head) + " |", "|" + "---|" * (3 + len(head))]
    for recipe in audit.recipes:
        size = audit.layout(recipe).tensor_bytes()
        for context, sessions in audit.cases:
            cells = [cell(recipe, context, sessions, i) for i in range(len(head))]
            lines.append(
                f"| {recipe} | {dgr_plan.format_size(size)} | {context:,} x {sessions} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def render_node_counts(audit: Audit) -> str:
    plans = node_counts(audit)

    def cell(recipe: str, context: int, sessions: int, i: int) -> str:
        p = plans[(recipe, context, sessions, audit.node_gib[i])]
        if p is None:
            return "does not fit"
        free = min(s.headroom_bytes for s in p.shards)
        return f"**{len(p.shards)}** ({dgr_plan.format_size(free)} free on the tightest)"

    return _rows(audit, [f"{g} GiB nodes" for g in audit.node_gib], cell)


def render_splits(audit: Audit) -> str:
    plans = splits(audit)

    def cell(recipe: str, context: int, sessions: int, i: int) -> str:
        p = plans[(recipe, context, sessions, SPLITS[i])]
        if p is None:
            return "cannot be cut so"
        largest = max(p.shards, key=lambda s: s.total_bytes)
        smallest = min(s.total_bytes for s in p.shards)
        return (
            f"**{dgr_plan.format_size(largest.total_bytes)}** (layers {largest.layers}); "
            f"smallest {dgr_plan.format_size(smallest)}"
        )

    return _rows(audit, [f"{k} nodes" for k in SPLITS], cell)


_TABLES = {"node-counts": render_node_counts, "split-2-4-8": render_splits}


def render(text: str, audit: Audit) -> str:
    """`text` (the audit's spec) with every generated block brought up to date."""
    text = _CONSOLE.sub(lambda m: m.group(1) + m.group(2) + "\n" + run_cli(m.group(2)[2:]) + m.group(4), text)
    return _TABLE.sub(lambda m: m.group(1) + _TABLES[m.group(2)](audit) + m.group(4), text)
