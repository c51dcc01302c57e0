"""Routing by kept prefix survives a tracker restart (issue 43, item 2), with real processes.

A tracker and four stub nodes (two routes of two, cut at different layers so that no route mixes them)
run apart, as on a LAN. A conversation's turns 1 to
3 go to one route, whose nodes keep each turn's KV. The tracker is stopped and started again on its
address, with its identity, so it knows nothing of where any prefix is but what the nodes' registrations
and heartbeats name. Turn 4 must still go to the nodes that kept turn 3 and reuse exactly what it would
have reused without the restart: turn 3's prompt and its answer but the last token sampled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dgr.procs import WatchedChild, dgr_command
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret

READY_S = 120.0  # a bound on a loaded machine's start-up, not a timing claim
SYSTEM = "You answer in one line, and you keep it short. " * 5  # ~240 stub tokens


def _start(args: list[str], env: dict[str, str]) -> WatchedChild:
    return WatchedChild.spawn(args[0], dgr_command(*args), env=env)


@pytest.fixture
def procs():
    started: list[WatchedChild] = []
    try:
        yield started
    finally:
        # the nodes first, all at once, while a tracker can hear their drains: a node whose tracker is gone waits
        # HEAR_S (2 s) for it, and one after the other that was 10 s of every run
        nodes = [p for p in started if p.name != "tracker"]
        for p in nodes:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in [*nodes, *reversed([p for p in started if p.name == "tracker"])]:
            p.stop()
        for p in started:  # shown by pytest for a failed test
            print(" ".join(p.popen.args[-6:]) if isinstance(p.popen.args, list) else "", *p.lines[-15:], sep="\n  ")


def _nodes(http: httpx.Client, url: str) -> dict[str, dict[str, Any]]:
    try:
        return {n["node"]: n for n in http.get(f"{url}/v1/nodes", timeout=5).json()["nodes"] if n.get("alive", True)}
    except httpx.HTTPError:
        return {}


def _wait(what: str, predicate, timeout_s: float = READY_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s}s")
        time.sleep(0.1)


def _ask(http: httpx.Client, url: str, prompt: str) -> tuple[str, dict[str, Any], frozenset[str]]:
    r = http.post(f"{url}/v1/completions", json={"model": "stub", "prompt": prompt, "temperature": 0,
                                                 "max_tokens": 12}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    sid = body["id"].removeprefix("cmpl-")
    route = http.get(f"{url}/v1/route-sessions/{sid}", timeout=5).json()["route"]
    return body["choices"][0]["text"], body, frozenset(h["node"] for h in route)


def _fed(body: dict[str, Any]) -> int:
    """Answer tokens that went into the KV: all but the last sampled, which did only on an end of generation."""
    n = body["usage"]["completion_tokens"]
    return n if body["choices"][0]["finish_reason"] == "stop" else n - 1


def test_turn_4_reuses_its_prefix_after_the_tracker_restarts(tmp_path: Path, procs) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (JOIN_ENV, API_KEYS_ENV)}
    env[JOIN_ENV] = new_secret()

    def tracker(port: int = 0) -> WatchedChild:
        p = _start(["tracker", "--port", str(port), "--identity", str(tmp_path / "tracker.id"),
                        "--dead-after", "3"], env)
        procs.append(p)
        return p

    first = tracker()
    url = first.wait_ready(READY_S)["url"]
    names = {"a0": "0:15", "a1": "15:30", "b0": "0:10", "b1": "10:30"}
    for name, layers in names.items():
        procs.append(_start(["node", "--tracker", url, "--backend", "stub", "--layers", layers, "--threads", "1",
                                 "--name", name, "--identity", str(tmp_path / f"{name}.key")], env))
    with httpx.Client() as http:
        _wait("four nodes", lambda: set(_nodes(http, url)) == set(names))
        prompt, bodies, routes = SYSTEM, [], []
        for turn in range(3):
            prompt += f" Q{turn}: and then?"
            text, body, route = _ask(http, url, prompt)
            bodies.append(body)
            routes.append(route)
            prompt += text
        cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
        # each turn reused, to the token, everything the turn before computed
        assert cached == [0] + [b["usage"]["prompt_tokens"] + _fed(b) for b in bodies[:-1]]
        holders = routes[-1]
        assert routes[1] == routes[2] == holders and len(holders) == 2
        want = bodies[-1]["usage"]["prompt_tokens"] + _fed(bodies[-1])

        first.stop()
        second = tracker(port=int(url.rpartition(":")[2]))
        assert second.wait_ready(READY_S)["url"] == url
        # the nodes register again, naming the prefixes they kept
        _wait("the holders' prefixes", lambda: (n := _nodes(http, url)).keys() == set(names)
              and all(n[h]["prefixes"] > 0 for h in holders))
        # a new tracker routes in turns: an unrelated prompt on the holders leaves the other route next in line
        for i in range(4):  # each unrelated from its first token: none is routed to where another was kept
            if _ask(http, url, f"{i} zebras. " * 20)[2] == holders:
                break
        else:
            raise AssertionError("no unrelated request went to the holders' route")
        prompt += " Q3: and then?"
        _, body, route = _ask(http, url, prompt)
        assert route == holders
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == want > 0
