"""Bad input at the OpenAI endpoint and on the seam: typed 4xx, and the server keeps serving."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import pytest

from dgr.seam.frame import encode_frame
from dgr.seam.wire import FrameKind
from dgr.testing.harness import LocalRoute, cut_mid_frame, stream_steps


@pytest.fixture(scope="module")
def route():
    with LocalRoute(nodes=2) as r:
        yield r


def _ok(route: LocalRoute) -> None:
    r = route.http.post(f"{route.api}/chat/completions", timeout=30,
                   json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


CHAT = "/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, status, code, param",
    [
        (CHAT, b"{not json", 400, "invalid_json", None),
        (CHAT, b"[1, 2]", 400, "invalid_request_error", None),
        (CHAT, {"model": "stub"}, 400, "invalid_request_error", "messages"),
        (CHAT, {"model": "stub", "messages": "hi"}, 400, "invalid_request_error", "messages"),
        (CHAT, {"model": "stub", "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error",
         "messages[0].role"),
        (CHAT, {"model": 5, "messages": MSG}, 400, "invalid_request_error", "model"),
        (CHAT, {"model": "nope", "messages": MSG}, 404, "model_not_found", None),
        (CHAT, {"model": "stub", "messages": MSG, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
        (CHAT, {"model": "stub", "messages": MSG, "max_tokens": "9"}, 400, "invalid_request_error", "max_tokens"),
        (CHAT, {"model": "stub", "messages": MSG, "temperature": 7}, 400, "invalid_request_error", "temperature"),
        (CHAT, {"model": "stub", "messages": MSG, "top_p": "x"}, 400, "invalid_request_error", "top_p"),
        (CHAT, {"model": "stub", "messages": MSG, "stop": [1]}, 400, "invalid_request_error", "stop"),
        (CHAT, {"model": "stub", "messages": MSG, "stream": "yes"}, 400, "invalid_request_error", "stream"),
        (CHAT, {"model": "stub", "messages": MSG, "n": 3}, 400, "invalid_request_error", "n"),
        ("/completions", {"model": "stub", "prompt": 42}, 400, "invalid_request_error", "prompt"),
        ("/completions", {"model": "stub", "prompt": "x" * 9000}, 400, "context_length_exceeded", "prompt"),
        ("/completions", {"model": "stub", "prompt": "x" * (5 * 1024 * 1024)}, 413, "body_too_large", None),
        # past 16 bytes per token of the context (4096 positions by default): refused before tokenizing
        ("/completions", {"model": "stub", "prompt": "x" * (3 * 1024 * 1024)}, 413, "prompt_too_large", "prompt"),
        (CHAT, {"model": "stub", "messages": [{"role": "user", "content": "x" * 70_000}]}, 413, "prompt_too_large",
         "messages"),
        ("/nothing", {}, 404, "not_found", None),
    ],
)
def test_bad_requests_get_openai_errors(route, path, body, status, code, param) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = route.http.post(f"{route.api}{path}", timeout=30, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    if param:
        assert err["param"] == param
    _ok(route)


def test_malformed_and_cut_frames_leave_nodes_serving(route) -> None:
    node = route.node("node1")
    url = node["url"]
    sid = uuid.uuid4().hex
    cap = route.capability(sid, "node1")  # the route's nodes pinned its tracker's key: every session call needs one
    frame = encode_frame(FrameKind.PREFILL, sid, 0, 0, 64, 576, hidden=np.ones((64, 576), np.float32))
    r = stream_steps(url, sid, [frame], cap)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_session"
    r = stream_steps(url, sid, [b"garbage"], cap)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_frame"
    # each open carries the tracker's single-use ticket for its body: a refused one is not opened again
    other = uuid.uuid4().hex
    raw, headers = route.opening(other, "node1", {"max_positions": 10 ** 9, "relay": route.relay(other, "node1")})
    r = httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    other = uuid.uuid4().hex
    raw, headers = route.opening(other, "node1", {"max_positions": 100, "sampling": {"bogus": 1},
                                                  "relay": route.relay(other, "node1")})
    assert httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers).status_code == 400
    raw, headers = route.opening(uuid.uuid4().hex, "node1", {"max_positions": 100})  # every session is on a ring
    r = httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error" and "ring" in r.text
    raw, headers = route.opening(sid, "node1", {"max_positions": 100, "relay": route.relay(sid, "node1")})
    r = httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers)
    assert r.status_code == 201
    for fraction in (0.1, 0.5, 0.99):
        cut_mid_frame(url, sid, frame, cap, fraction)
    status = httpx.get(f"{url}/v1/node/status").json()
    assert httpx.get(f"{url}/v1/seam/sessions/{sid}", headers=cap).json()["positions"] == 0  # no partial frame applied
    assert status["sessions"] == 1
    httpx.delete(f"{url}/v1/seam/sessions/{sid}", headers=cap)
    _ok(route)
