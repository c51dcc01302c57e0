"""`python -m dgr.bench.trace`: follow one chat completion through dgr's code and count its stops.

One chat completion (a short prompt, max_tokens 2, stream off) goes into the
tracker app's ASGI callable on an in-process 2-node stub ring (the default
topology; dgr.testing.inproc) on trio's MockClock, so the count is the same
every run. A profile hook (sys.setprofile, and threading's for any worker
thread) sees every frame entered, from the moment the request goes into the
tracker app until its response is complete; one untraced request before it
pays the first use's imports and caches.

Rules:
- A stop is a distinct function defined under dgr/ (dgr/testing/ and
  dgr/bench/ left out: they are the harness, not the path) that was entered.
- A frame counts once when it is entered: a coroutine resumed after an
  `await` is the same frame, not a new call. A comprehension's frame is
  part of its function's.
- Control enters a module from another one when the nearest dgr frame below
  the new frame (the harness's, or none: trio's scheduler, a framework) is in
  another module. Per module, those entries are what it costs a reader to
  follow the request there and back.

Output: the counts as text, or `--json`. Left out: time (`dgr bench` measures
it) and what each function does.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import trio
import trio.testing

import dgr
from dgr.bench.measure import tree_commit

__all__ = ["Trace", "trace_one_request", "main"]

_ROOT = Path(dgr.__file__).resolve().parent
_HARNESS = (_ROOT / "testing", _ROOT / "bench")
# a comprehension's frame is its function's own work (Python 3.12 inlines them): not a stop
_INLINE = frozenset({"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"})
REQUEST = {"model": "stub", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "stream": False,
           "temperature": 0}


class Trace:
    """What a profile hook saw: frames entered in dgr's modules, and from where."""

    def __init__(self) -> None:
        self.functions: collections.Counter[str] = collections.Counter()  # "module:qualname" -> frames entered
        self.entries: collections.Counter[str] = collections.Counter()  # module -> entries from another module
        self._seen: set[FrameType] = set()  # held until the trace ends, so an id is never reused
        self._modules: dict[str, str | None] = {}  # filename -> its dgr module; None: not on the path

    def module(self, filename: str) -> str | None:
        """The dgr module a file is, "" for the harness (testing/, bench/), None outside dgr."""
        if filename not in self._modules:
            path = Path(filename).resolve()
            if _ROOT not in path.parents:
                self._modules[filename] = None
            elif any(h == path or h in path.parents for h in _HARNESS):
                self._modules[filename] = ""
            else:
                self._modules[filename] = ".".join(("dgr", *path.relative_to(_ROOT).with_suffix("").parts))
        return self._modules[filename]

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = self.module(frame.f_code.co_filename)
        if not module or frame in self._seen or frame.f_code.co_name in _INLINE:
            return
        self._seen.add(frame)
        self.functions[f"{module}:{frame.f_code.co_qualname}"] += 1
        caller = frame.f_back
        while caller is not None and self.module(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is None or self.module(caller.f_code.co_filename) != module:
            self.entries[module] += 1

    def report(self) -> dict[str, Any]:
        modules = sorted({f.split(":", 1)[0] for f in self.functions})
        per_module = {m: {"entries": self.entries[m],
                          "functions": sum(1 for f in self.functions if f.split(":", 1)[0] == m)} for m in modules}
        packages: dict[str, dict[str, int]] = {}
        for m, row in per_module.items():
            p = packages.setdefault(".".join(m.split(".")[:2]), {"entries": 0, "functions": 0, "modules": 0})
            p["entries"] += row["entries"]
            p["functions"] += row["functions"]
            p["modules"] += 1
        return {"stops": len(self.functions), "calls": sum(self.functions.values()), "modules": len(modules),
                "entries": sum(self.entries.values()), "per_package": dict(sorted(packages.items())),
                "per_module": per_module,
                "functions": dict(sorted(self.functions.items()))}


async def _run(trace: Trace) -> int:
    from dgr.testing.inproc import TRACKER_URL, InProcRoute, asgi_client
    from dgr.tracker.live import GatewayConfig

    route = InProcRoute.stub(config=GatewayConfig(sweep_s=3600.0), inline=True)
    route.register_all()
    async with trio.open_nursery() as nursery:
        await nursery.start(route.run)
        async with asgi_client(route.tracker, TRACKER_URL) as http:
            warm = await http.post("/v1/chat/completions", json={**REQUEST, "messages": [
                {"role": "user", "content": "Warm up."}]})
            warm.raise_for_status()
            threading.setprofile(trace.hook)
            sys.setprofile(trace.hook)
            try:
                r = await http.post("/v1/chat/completions", json=REQUEST)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def trace_one_request() -> dict[str, Any]:
    """The trace of one chat completion on an in-process 2-node ring (its counts, `Trace.report`)."""
    trace = Trace()
    tokens = trio.run(_run, trace, clock=trio.testing.MockClock(autojump_threshold=0))
    return {"request": {**REQUEST, "completion_tokens": tokens}, "route": "2-node stub ring, in process",
            "commit": tree_commit(), **trace.report()}



def render(result: dict[str, Any]) -> str:
    lines = [f"commit: {result['commit']}",
             f"request: one chat completion, max_tokens {result['request']['max_tokens']}, stream off, "
             f"{result['request']['completion_tokens']} tokens; {result['route']}",
             f"stops (distinct dgr functions entered): {result['stops']}",
             f"calls (dgr function frames entered): {result['calls']}",
             f"modules: {result['modules']}",
             f"entries from another module: {result['entries']}",
             "", f"{'package':40} {'entries':>7} {'functions':>9} {'modules':>7}"]
    for package, row in result["per_package"].items():
        lines.append(f"{package:40} {row['entries']:>7} {row['functions']:>9} {row['modules']:>7}")
    lines += ["", f"{'module':40} {'entries':>7} {'functions':>9}"]
    for module, row in sorted(result["per_module"].items(), key=lambda kv: (-kv[1]["entries"], kv[0])):
        lines.append(f"{module:40} {row['entries']:>7} {row['functions']:>9}")
    lines += ["", "functions entered (frames):"]
    lines += [f"  {name} {n}" for name, n in result["functions"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr.bench.trace", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args(argv)
    result = trace_one_request()
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
