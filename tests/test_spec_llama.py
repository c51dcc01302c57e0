"""Speculative decoding on a real 2-node llama_shard ring (issue 42): the default model, real processes.

With `--spec-exact` every node computes a step's drafted positions one at a time, so greedy answers equal
decoding without speculation token for token, on a copy-heavy task and on free chat; the tail reports what
it drafted and accepted. (Without it llama.cpp rounds a multi-row step differently: `dgr bench --only spec`
counts how often an answer changes.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from dgr.testing.harness import LocalRoute

pytestmark = pytest.mark.serial

_CODE = (Path(__file__).resolve().parents[1] / "dgr" / "fsm" / "stop.py").read_text()[:1800]
PROMPTS = {
    "copy": "Rewrite this Python module with every comment removed. Output only the code.\n\n" + _CODE,
    "chat": "Tell me a short story about a lighthouse keeper.",
}


def test_exact_speculation_answers_as_decoding_without_it() -> None:
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=600,
                    extra=("--ctx", "2048", "--spec-k", "4", "--spec-exact",
                           "--spec-allow", "ngram,prompt")) as route:  # the tail drafts from the prompt too
        model = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
        accepted = 0
        for name, prompt in PROMPTS.items():
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
                    "temperature": 0}
            plain = httpx.post(f"{route.api}/chat/completions", json=body, timeout=300)
            spec = httpx.post(f"{route.api}/chat/completions", json={**body, "speculation": "ngram"}, timeout=300)
            assert spec.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"], name
            snap = route.wait_session_ended(spec.headers["x-dgr-route-session"])
            assert snap["phase"] == "done" and snap["speculation"]["steps"] > 0, snap
            accepted += snap["speculation"]["accepted"]
        assert accepted > 0  # the copy task's drafts are taken
        route.wait_sessions_freed(["node0", "node1"])
