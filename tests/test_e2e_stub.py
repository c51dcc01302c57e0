"""End to end through real processes: `dgr up --backend stub --nodes 3` and the official openai client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.seam.wire import HEADER_SIZE
from dgr.testing.harness import LocalRoute, sse_events
from dgr.testing.reference import expected_greedy

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Describe a shard in a line."}]


@pytest.fixture(scope="module")
def route():
    with LocalRoute(backend="stub", nodes=3, extra=("--stub-delay", "0.0005")) as r:
        yield r


@pytest.fixture(scope="module")
def stub() -> StubBackend:
    return StubBackend(spec=StubSpec(), layers=LayerRange(0, 30))


def _prompt(stub: StubBackend, messages=MESSAGES) -> list[int]:
    return stub.tokenize(stub.render_chat(messages), add_special=True, parse_special=True)


def test_up_splits_layers_over_three_processes(route) -> None:
    nodes = sorted(route.node_table(), key=lambda n: n["layers"])
    assert [n["layers"] for n in nodes] == ["0:10", "10:20", "20:30"]
    assert len({n["pid"] for n in nodes}) == 3 and all(n["alive"] for n in nodes)


def test_chat_nonstream_and_stream_equal_the_stub(route, stub) -> None:
    client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
    want = expected_greedy([stub], _prompt(stub), 48)
    resp = client.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=48, temperature=0)
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == want.finish_reason
    assert resp.usage.prompt_tokens == len(_prompt(stub))
    assert resp.usage.completion_tokens == want.completion_tokens
    chunks = list(client.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == want.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [want.finish_reason]


def test_completions_with_stop_and_seeded_sampling(route, stub) -> None:
    client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
    prompt = "The route"
    ids = stub.tokenize(prompt, add_special=True, parse_special=True)
    free = expected_greedy([stub], ids, 30)
    stop = free.text[5:7]
    want = expected_greedy([stub], ids, 30, stop=(stop,))
    resp = client.completions.create(model="stub", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert resp.choices[0].text == want.text == free.text[: free.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="stub", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == want.text
    a = client.completions.create(model="stub", prompt=prompt, max_tokens=20, temperature=0.9, seed=7)
    b = client.completions.create(model="stub", prompt=prompt, max_tokens=20, temperature=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_models_lists_the_route(route) -> None:
    client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["stub"]
    raw = httpx.get(f"{route.api}/models").json()["data"][0]["dgr"]
    assert raw["n_layers"] == 30 and raw["seam_width"] == 576 and len(raw["nodes"]) == 3


def test_telemetry_arrives_before_the_first_token(route) -> None:
    body = {"model": "stub", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True,
            "dgr_telemetry": True}
    with httpx.stream("POST", f"{route.api}/chat/completions", json=body, timeout=30) as r:
        sid = r.headers["x-dgr-route-session"]
        events = list(sse_events(r))
    first_content = next(i for i, (k, v) in enumerate(events)
                         if k == "data" and isinstance(v, dict) and v.get("choices") and v["choices"][0]["delta"].get("content"))
    kind, first = events[0]
    assert kind == "comment" and first.startswith("dgr-telemetry ")
    snap = json.loads(first.split(" ", 1)[1])
    assert snap["id"] == sid and snap["phase"] == "prefill"
    assert [h["layers"] for h in snap["route"]] == ["0:10", "10:20", "20:30"]
    assert snap["prefill"]["total"] > 0 and snap["health"] == "ok"
    chunk_telemetry = [i for i, (k, v) in enumerate(events) if k == "data" and isinstance(v, dict) and "dgr_telemetry" in v]
    assert chunk_telemetry and chunk_telemetry[0] < first_content
    assert all(events[i][1]["choices"] == [] for i in chunk_telemetry)
    final = httpx.get(f"{route.api}/route-sessions/{sid}").json()
    assert final["phase"] == "done" and final["tokens"] >= 1 and final["ttft_ms"] is not None
    assert set(final["hop_latency_ms"]) == {"node0", "node1", "node2"}


def test_events_stream_shows_progress_until_done() -> None:
    import threading

    # 10 ms per position per node: 60 decode steps over 3 nodes last seconds, far longer than a
    # watcher takes to subscribe; the watcher is subscribed before the answer is read on.
    with LocalRoute(backend="stub", nodes=3, extra=("--stub-delay", "0.01")) as slow:
        body = {"model": "stub", "prompt": "x" * 60, "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True}
        seen: list[dict] = []
        subscribed = threading.Event()
        with httpx.stream("POST", f"{slow.api}/completions", json=body, timeout=60) as r:
            sid = r.headers["x-dgr-route-session"]

            def watch() -> None:
                with httpx.stream("GET", f"{slow.api}/route-sessions/{sid}/events", timeout=60) as ev:
                    for kind, data in sse_events(ev):
                        if kind == "data":
                            seen.append(data)
                            subscribed.set()

            t = threading.Thread(target=watch)
            t.start()
            assert subscribed.wait(30), "the events stream sent nothing"
            for _ in r.iter_lines():
                pass
        t.join(30)
    phases = [s["phase"] for s in seen]
    assert phases[0] != "done", "the watcher subscribed too late to see progress"
    assert phases[-1] == "done"
    assert "decode" in phases
    tokens = [s["tokens"] for s in seen]
    assert tokens == sorted(tokens) and tokens[-1] == 60


@pytest.mark.parametrize("n_prompt", [100, 2000])
def test_decode_seam_bytes_do_not_grow_with_the_prompt(route, n_prompt) -> None:
    client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
    client.completions.create(model="stub", prompt="ab" * (n_prompt // 2), max_tokens=5, temperature=0)
    for name in ("node1", "node2"):
        seam = route.node_status(name)["seam"]
        # measured on the wire: one position of 576 float32 plus the header
        assert seam["last_decode_frame_bytes"] == HEADER_SIZE + 576 * 4
        assert seam["last_decode_hidden_bytes"] == 576 * 4
    head = route.node_status("node0")["seam"]
    assert head["last_decode_frame_bytes"] == HEADER_SIZE + 4  # the head gets one token id


def test_sessions_are_freed_after_each_request(route) -> None:
    client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)

    def decodes() -> dict[str, int]:
        return {n["node"]: route.node_status(n["node"])["seam"]["frames_in"].get("DECODE", 0)
                for n in route.node_table()}

    for stream in (False, True):
        before = decodes()
        out = client.completions.create(model="stub", prompt="free me", max_tokens=12, temperature=0, stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            assert "".join(c.choices[0].text for c in out if c.choices)
        # every node ran this session's 11 decode steps, holding its KV, and frees it as the session ends
        assert {k: v - before[k] for k, v in decodes().items()} == {"node0": 11, "node1": 11, "node2": 11}
        route.wait_sessions_freed(["node0", "node1", "node2"])
