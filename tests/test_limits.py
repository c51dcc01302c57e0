"""The gateway's and nodes' limits through real processes: each a typed error, KV freed, nothing crashes."""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import pytest

from dgr.testing.harness import LocalRoute, first_error, sse_events

LONG = {"max_tokens": 6000, "ignore_eos": True, "temperature": 0}


def _post(route: LocalRoute, body: dict, timeout: float = 30) -> httpx.Response:
    return route.http.post(f"{route.api}/completions", json={"model": "stub", **body}, timeout=timeout)


def _sessions(route: LocalRoute) -> dict:
    return route.http.get(f"{route.api}/route-sessions", timeout=5).json()


@pytest.fixture(scope="module")
def limited():
    with LocalRoute(nodes=2, extra=("--stub-delay", "0.0005", "--max-prompt-tokens", "64", "--max-tokens-cap", "8",
                                    "--max-sessions", "1", "--idle-timeout", "1")) as r:
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


def test_full_node_answers_429_and_idle_sessions_are_freed(limited) -> None:
    url = limited.node("node0")["url"]
    sid = uuid.uuid4().hex
    cap = limited.capability(sid, "node0")
    raw, opening = limited.opening(sid, "node0", {"max_positions": 8})  # as the gateway opens: with a ticket
    assert httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=opening).status_code == 201
    r = _post(limited, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "node_at_capacity" and r.headers["retry-after"] == "1"
    # idle for over --idle-timeout (1 s; the node looks every second): its KV is freed
    deadline = time.monotonic() + 30  # bounds the wait for the event; not a timing claim
    while limited.http.get(f"{url}/v1/node/status").json()["sessions"]:
        assert time.monotonic() < deadline, "the idle session was never freed"
        time.sleep(0.1)
    r = httpx.get(f"{url}/v1/seam/sessions/{sid}", headers=cap)
    assert r.status_code == 410 and "session_timeout" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/node/status").json()["kv_bytes"] == 0
    deadline = time.monotonic() + 30  # the tracker hears of the free slot with the next heartbeat
    while (r := _post(limited, {"prompt": "hi", "max_tokens": 2})).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_route_session_time_limit() -> None:
    with LocalRoute(nodes=2, extra=("--stub-delay", "0", "--max-session-s", "1")) as route:
        t0 = time.monotonic()
        with httpx.stream("POST", f"{route.api}/completions", timeout=30,
                          json={"model": "stub", "prompt": "go on", "stream": True, **LONG}) as r:
            error, seen = first_error(sse_events(r))
        assert error["code"] == "session_timeout" and "limit of 1s" in error["message"]
        # never before the limit; the upper bound only catches a limit that is not enforced at all
        assert 1.0 <= seen - t0 < 30.0, seen - t0
        route.wait_sessions_freed(["node0", "node1"])
        r = _post(route, {"prompt": "go on", **LONG})
        assert r.status_code == 504 and r.json()["error"]["code"] == "session_timeout"
        route.wait_sessions_freed(["node0", "node1"])
        assert _post(route, {"prompt": "hi", "max_tokens": 3}).status_code == 200


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
