"""The PyTorch reference route through real processes, and what it proves about the cache."""

from __future__ import annotations

import openai
import pytest

from dgr.backends.base import LayerRange
from dgr.backends.torch_backend import TorchBackend
from dgr.models import default_model_path
from dgr.testing.harness import LocalRoute
from dgr.testing.reference import expected_greedy

pytestmark = [pytest.mark.llama, pytest.mark.serial]  # the tokenizer comes from llama.cpp's vocabulary loader
import llama_cpp  # noqa: F401  a hard dependency: a broken build fails here

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of Italy is"


def test_torch_route_answers_like_the_single_node_model() -> None:
    single = TorchBackend(default_model_path(), LayerRange(0, 30), n_threads=1)
    ids = single.tokenize(PROMPT, add_special=True, parse_special=True)
    want = expected_greedy([single], ids, 12)
    single.close()
    with LocalRoute(backend="torch", nodes=2, ready_timeout_s=300, extra=("--ctx", "512")) as route:
        client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0, timeout=120)
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert resp.choices[0].text == want.text
        assert resp.usage.prompt_tokens == len(ids)
        # each shard computed each position exactly once: the prompt, then one per decode step
        for node in ("node0", "node1"):
            seam = route.node_status(node)["seam"]
            assert seam["frames_in"]["DECODE"] == want.completion_tokens - 1
        assert route.node_status("node1")["seam"]["last_decode_frame_bytes"] == 48 + 576 * 4
