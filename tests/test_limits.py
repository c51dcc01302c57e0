"""The gateway's limits through real processes: what only `dgr up` and real sockets show.

The limits' rules and timing are proven exactly on trio's MockClock on the default ring in process
(tests/test_gateway_clock.py: the session time limit and its 504, a full node's 429 and its idle
session freed, a stalled reader cancelled as a slow client). What stays here: the limit flags reach
the gateway through `dgr up`, and a reader whose real TCP window fills (the server's send blocks, as
no in-process test can make it) is cancelled while the tracker serves everyone else.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from dgr.testing.harness import LocalRoute

LONG = {"max_tokens": 6000, "ignore_eos": True, "temperature": 0}


def _post(route: LocalRoute, body: dict, timeout: float = 30) -> httpx.Response:
    return route.http.post(f"{route.api}/completions", json={"model": "stub", **body}, timeout=timeout)


def _sessions(route: LocalRoute) -> dict:
    return route.http.get(f"{route.api}/route-sessions", timeout=5).json()


@pytest.fixture(scope="module")
def limited():
    with LocalRoute(nodes=2, extra=("--stub-delay", "0.0005", "--max-prompt-tokens", "64", "--max-tokens-cap", "8")) as r:
        yield r


def test_prompt_limit_refuses_and_max_tokens_is_clamped(limited) -> None:
    r = _post(limited, {"prompt": "word " * 100, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt") and "at most 64" in err["message"]
    r = _post(limited, {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    limited.wait_sessions_freed(["node0", "node1"])


def test_reader_that_stops_reading_is_cancelled_and_its_kv_freed() -> None:
    with LocalRoute(nodes=2, extra=("--stub-delay", "0", "--slow-client-s", "1")) as route:
        body = json.dumps({"model": "stub", "prompt": "never read", "stream": True, "dgr_telemetry": True,
                           **LONG}).encode()
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a tiny window
        try:
            reader.connect(("127.0.0.1", route.port))
            reader.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            t0 = time.monotonic()
            while True:  # never read: the server's socket fills and its stream stalls
                recent = _sessions(route)["recent"]
                if recent:
                    break
                assert time.monotonic() - t0 < 30, "the stalled stream was never cancelled"
                time.sleep(0.1)
            snap = recent[-1]
            assert snap["phase"] == "failed" and snap["failure"]["code"] == "slow_client", snap
            assert "for over 1s" in snap["failure"]["message"]
            assert 0 < snap["tokens"] < LONG["max_tokens"]
            route.wait_sessions_freed(["node0", "node1"])
            # the stuck connection is still open, and the tracker serves everyone else
            r = _post(route, {"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
        finally:
            reader.close()
        print(f"\nslow client cancelled {time.monotonic() - t0:.2f} s after its request, "
              f"after {snap['tokens']} tokens")
