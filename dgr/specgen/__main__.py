"""`python -m dgr.specgen [--check]`: rewrite every generated file, or exit 1 naming the stale ones."""

from __future__ import annotations

import argparse
import sys

from dgr.specgen.files import GENERATED, ROOT, expected

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.specgen", description=__doc__)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from the code")
    args = ap.parse_args(argv)
    stale = 0
    for rel in GENERATED:  # in order: the audits read the layouts written before them
        path = ROOT / rel
        new = expected(rel)
        if path.exists() and path.read_text(encoding="utf-8") == new:
            continue
        if args.check:
            print(f"{rel} is stale: run python -m dgr.specgen", file=sys.stderr)
            stale = 1
            continue
        path.write_text(new, encoding="utf-8")
        print(f"wrote {rel}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
