"""Schemathesis against the tracker's own /openapi.json, on a live stub route: never a 5xx, never a hang.

The campaign runs schemathesis's CLI (its examples, coverage and fuzzing
phases, valid and invalid requests, every HTTP method) with the single check
`not_a_server_error`; a request that hangs counts as an error too. After it
the tracker and both nodes still run, hold no session, and answer a normal
request. `DGR_SLOW=1` runs a longer campaign.

(schemathesis's pytest plugin, `from_fixture`, does not run under pytest 9,
so the CLI it ships is driven instead; its JSON report gives the counts.)
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dgr.testing.harness import LocalRoute


@pytest.fixture(scope="module")
def route():
    # a small --max-tokens-cap: generated requests ask for up to 16 tokens; keeps the campaign quick
    with LocalRoute(nodes=2, extra=("--stub-delay", "0", "--max-tokens-cap", "8")) as r:
        yield r


def _campaign(route: LocalRoute, tmp: Path, examples: int, timeout_s: float, base: str | None = None) -> dict:
    """One schemathesis run against `base`/openapi.json (the tracker by default, or a node)."""
    report = tmp / "schemathesis.json"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base or route.url}/openapi.json",
           "--checks", "not_a_server_error", "--max-examples", str(examples), "--seed", "7", "--workers", "1",
           "--phases", "examples,coverage,fuzzing", "--generation-database", "none", "--request-timeout", "20",
           "--no-color", "--report", "json", "--report-json-path", str(report)]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    summary = done.stdout[done.stdout.find("SUMMARY"):]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    print(f"\nschemathesis, {examples} examples per operation, {time.monotonic() - t0:.1f} s:\n{summary}")
    return json.loads(report.read_text())


def _healthy(route: LocalRoute) -> None:
    assert route.proc is not None and route.proc.poll() is None
    assert all(n["alive"] for n in route.node_table())
    route.wait_sessions_freed(["node0", "node1"], timeout_s=10)
    stats = httpx.get(f"{route.api}/stats", timeout=5).json()
    assert stats["active"] == 0 and "internal_error" not in stats["failures"], stats
    r = httpx.post(f"{route.api}/completions", json={"model": "stub", "prompt": "still here?", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    print(f"route sessions by outcome {stats['sessions']}, failures {stats['failures']}")


def test_no_operation_answers_5xx_and_the_route_survives(route, tmp_path) -> None:
    _campaign(route, tmp_path, 25, timeout_s=240)
    _healthy(route)


@pytest.mark.slow
def test_no_operation_answers_5xx_long_campaign(route, tmp_path) -> None:
    _campaign(route, tmp_path, 500, timeout_s=1800)
    _healthy(route)


@pytest.mark.parametrize("node", ["node0", "node1"])  # the head (tokenize) and the tail
def test_no_node_operation_answers_5xx(route, tmp_path, node) -> None:
    """A node's own routes (the seam step has its hypothesis properties); the membership routes are in the tracker's."""
    _campaign(route, tmp_path, 10, timeout_s=240, base=route.node(node)["url"])
    _healthy(route)


@pytest.mark.slow
def test_no_node_operation_answers_5xx_long_campaign(route, tmp_path) -> None:
    _campaign(route, tmp_path, 300, timeout_s=1800, base=route.node("node0")["url"])
    _healthy(route)


@pytest.mark.parametrize("method", ["OPTIONS", "TRACE", "PUT"])
def test_answer_before_the_body_does_not_wedge_the_connection(route, method) -> None:
    """The hang schemathesis found: a body that arrives after its request was answered."""
    body = b'{"model": "stub", "prompt": "x"}'
    with socket.create_connection(("127.0.0.1", route.port), timeout=5) as s:
        s.sendall(f"{method} /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode())
        time.sleep(0.05)  # the server can answer before the body
        s.sendall(body)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)  # a wedged connection times out here
            if not chunk:
                break
            data += chunk
    assert data.count(b"HTTP/1.1 ") == 2 and b'"ok": true' in data, data
