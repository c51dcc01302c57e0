"""Measure a running route through its OpenAI API, the way a client sees it.

A streamed completion with `ignore_eos` gives a fixed number of tokens; TTFT
is request start to the first text chunk, and the decode rate is taken over
the chunks after the first (so prefill is not in it). Concurrency runs N
streams at once from threads and reports the aggregate decode rate.
"""

from __future__ import annotations

import json
import ssl
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx

from dgr.seam.wire import ROUTE_SESSION_HEADER

__all__ = ["StreamResult", "cached_tokens", "stream_once", "concurrent", "short_ttft", "hop_stats", "tree_commit"]

_ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class StreamResult:
    ttft_s: float
    decode_tok_s: float
    tokens: int
    total_s: float
    prompt_tokens: int
    session: str
    reused: int = 0  # prompt tokens a kept prefix supplied


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens a kept prefix supplied, as a usage block says (`prompt_tokens_details`)."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def stream_once(api: str, model: str, prompt: str | list[int], max_tokens: int,
                headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
                verify: ssl.SSLContext | bool = True) -> StreamResult:
    """One streamed completion of exactly max_tokens tokens; `extra` adds server-specific body fields; `verify`
    is how an https server is checked."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                            **(extra or {})}
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict[str, int] = {}
    with httpx.stream("POST", f"{api}/completions", json=body, headers=headers, timeout=600, verify=verify) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        sid = r.headers.get(ROUTE_SESSION_HEADER, "")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices", []):
                if choice.get("text"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    n = usage.get("completion_tokens", len(times))
    # chunks can hold several tokens (a UTF-8 character split over tokens); rate over tokens, not chunks
    decode = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return StreamResult(times[0] - t0 if times else end - t0, decode, n, end - t0,
                        usage.get("prompt_tokens", 0), sid, cached_tokens(usage))


def concurrent(api: str, model: str, prompt: str, max_tokens: int, n: int,
               extra: dict[str, Any] | None = None) -> dict[str, float]:
    """N simultaneous streams; aggregate tokens/s over the wall time they all took."""
    results: list[StreamResult] = []
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            results.append(stream_once(api, model, f"{prompt} ({i})", max_tokens, extra=extra))
        except (RuntimeError, httpx.HTTPError) as exc:
            errors.append(str(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    return {
        "sessions": n,
        "ok": len(results),
        "errors": len(errors),
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "per_session_tok_s": statistics.mean(r.decode_tok_s for r in results) if results else 0.0,
        "wall_s": wall,
    }


def short_ttft(api: str, model: str, prompt: list[int], extra: dict[str, Any] | None = None,
               repeats: int = 3) -> float:
    """Median TTFT of a short prompt: the fixed costs before the first token, with little compute."""
    return statistics.median(stream_once(api, model, prompt, 2, extra=extra).ttft_s for _ in range(repeats))


def hop_stats(api_root: str) -> dict[str, Any]:
    return httpx.get(f"{api_root}/v1/stats", timeout=10).json()["hops"]


def tree_commit() -> str:
    """The commit of the tree a bench measures (its HEAD, "+dirty" with uncommitted changes), so that a result says
    which code it measured; "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"
