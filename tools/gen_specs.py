"""Regenerate the generated parts of spec/deepseek-v4-flash.md from `dgr plan`.

Two kinds of generated block, so no figure in the audit is typed by hand:
- a ```console block whose first line is `$ dgr plan ...`: the command is
  run in-process and the block gets its exact output;
- `<!-- table: node-counts -->` ... `<!-- /table -->`: nodes used for each
  recipe, context and node size, from dgr.plan.plan.

    python tools/gen_dsv4_spec.py          # rewrite the spec
    python tools/gen_dsv4_spec.py --check  # exit 1 if the spec is stale

tests/test_plan.py runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dgr import plan as dgr_plan
from dgr.errors import CallerError
from dgr.plan_layout import layout_from_json

SPEC = ROOT / "spec" / "deepseek-v4-flash.md"
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek-v4-flash.layout.json"

_CONSOLE = re.compile(r"(```console\n)(\$ dgr plan [^\n]*)\n(.*?)(```)", re.DOTALL)
_TABLE = re.compile(r"(<!-- table: node-counts -->\n)(.*?)(<!-- /table -->)", re.DOTALL)

RECIPES = ("q2-antirez", "mxfp4-q8", "q4k-antirez", "q8_0")
NODE_GIB = (24, 64, 128)
# (context, sessions): a working context, a long one with several sessions, the model's maximum.
CASES = ((32768, 1), (131072, 4), (1048576, 1))
MAX_NODES = 43  # one layer per node at most


def run_cli(command: str) -> str:
    """`dgr plan ...` run in-process from the repo root: its stdout and stderr, as a console shows them."""
    argv = shlex.split(command)[1:]  # drop "dgr"
    parser = argparse.ArgumentParser(prog="dgr")
    dgr_plan.register(parser.add_subparsers())
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


def node_counts() -> dict[tuple[str, int, int, int], dgr_plan.Plan | None]:
    """The plan (or None: does not fit on 43 nodes) for each recipe, case and node size."""
    data = json.loads(FIXTURE.read_text())
    out: dict[tuple[str, int, int, int], dgr_plan.Plan | None] = {}
    for recipe in RECIPES:
        layout = layout_from_json(data, recipe=recipe, source=str(FIXTURE.relative_to(ROOT)))
        for context, sessions in CASES:
            params = dgr_plan.PlanParams(context=context, sessions=sessions)
            for gib in NODE_GIB:
                nodes = [dgr_plan.Node(f"node{i + 1}", gib * 2**30) for i in range(MAX_NODES)]
                try:
                    out[(recipe, context, sessions, gib)] = dgr_plan.plan(layout, nodes, params)
                except CallerError:
                    out[(recipe, context, sessions, gib)] = None
    return out


def render_table() -> str:
    plans = node_counts()
    head = "| recipe | weights | context x sessions | " + " | ".join(f"{g} GiB nodes" for g in NODE_GIB) + " |"
    lines = [head, "|" + "---|" * (3 + len(NODE_GIB))]
    data = json.loads(FIXTURE.read_text())
    for recipe in RECIPES:
        size = layout_from_json(data, recipe=recipe).tensor_bytes()
        for context, sessions in CASES:
            cells = []
            for gib in NODE_GIB:
                p = plans[(recipe, context, sessions, gib)]
                if p is None:
                    cells.append("does not fit")
                else:
                    free = min(s.headroom_bytes for s in p.shards)
                    cells.append(f"**{len(p.shards)}** ({dgr_plan.format_size(free)} free on the tightest)")
            lines.append(
                f"| {recipe} | {dgr_plan.format_size(size)} | {context:,} x {sessions} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """The spec with every generated block brought up to date."""
    text = _CONSOLE.sub(lambda m: m.group(1) + m.group(2) + "\n" + run_cli(m.group(2)[2:]) + m.group(4), text)
    return _TABLE.sub(lambda m: m.group(1) + render_table() + m.group(3), text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the spec differs from what would be generated")
    args = ap.parse_args()
    text = SPEC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{SPEC.relative_to(ROOT)} is stale: run python tools/gen_dsv4_spec.py", file=sys.stderr)
            return 1
        return 0
    SPEC.write_text(new)
    print(f"wrote {SPEC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
