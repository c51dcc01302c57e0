"""DeepSeek-V4 as a route: a tiny random deepseek4 GGUF with the real tensor layout, split across nodes.

The model (dgr.bench.dsv4_tiny): mHC (4 residual streams between layers), hash-routed layers 0 to 2,
window-only, CSA and HCA layers, routed and shared experts, and one MTP layer. Through dgr's third
llama.cpp patch a range of it takes the 4 x 64 streams and the token ids, and every split, down to a
node a layer, answers exactly as the whole model:
- in process (split_greedy): greedy tokens equal, logits max |diff| 0.0;
- through real `dgr up` processes and the OpenAI client: 3 llama_shard nodes answer as 1 llama node,
  and every hop's decode frame is 4 x 64 floats and one token id, whatever the context;
- the MTP layer loads on the tail only, and plain decoding ignores it;
- what llama.cpp holds for each range is what the planner charges for it.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from dgr.backends.base import LayerRange
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.errors import CallerError
from dgr.plan import PlanParams, shard_cost
from dgr.plan.sizes import Node
from dgr.plan.sources import layout_from_json
from dgr.seam.wire import HEADER_SIZE
from dgr.bench.dsv4_tiny import TINY, write_dsv4_gguf
from dgr.testing.harness import LocalRoute
from dgr.testing.reference import split_greedy
from dgr.testing.tiny_gguf import tiny_prompt

N_NEW = 16
WIDTH = TINY.hc * TINY.hidden  # the seam: 4 streams of 64


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, dict]:
    path = tmp_path_factory.mktemp("dsv4") / "dsv4-tiny.gguf"
    layout = write_dsv4_gguf(path)
    return str(path), layout


@pytest.fixture(scope="module")
def whole(model):
    prompt = list((np.arange(40) * 7 + 300) % TINY.vocab)
    return prompt, split_greedy(model[0], [TINY.layers], prompt, N_NEW, n_threads=1, n_ctx=256, max_sessions=1)


@pytest.mark.parametrize("sizes", [[2, 2, 2], [4, 2], [3, 3], [1, 1, 1, 1, 1, 1]],
                         ids=["0:2|2:4|4:6", "0:4|4:6", "0:3|3:6", "every-layer"])
def test_splits_equal_the_whole_model(model, whole, sizes):
    """Boundaries inside the hash-routed layers (2, 1), next to the window->CSA change (2) and between CSA and HCA
    layers (3, 4, 5): the token ids cross with the streams, and ranges lacking a compressed kind run."""
    prompt, ref = whole
    got = split_greedy(model[0], sizes, prompt, N_NEW, n_threads=1, n_ctx=256, max_sessions=1)
    assert got.tokens == ref.tokens and len(set(ref.tokens)) > N_NEW // 2  # words, not one token repeated
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref.logits, got.logits)) == 0.0


def test_a_range_after_layer_0_takes_the_streams_and_the_token_ids(model):
    middle = LlamaShardBackend(model[0], LayerRange(2, 4), n_threads=1, n_ctx=64, max_sessions=1)
    try:
        assert (middle.info.seam_width, middle.info.hidden_size, middle.info.needs_token_ids) == (WIDTH, 64, True)
        middle.open_session("a" * 32, 64)
        hidden = np.zeros((3, WIDTH), np.float32)
        with pytest.raises(CallerError, match="token id"):
            middle.forward("a" * 32, 0, None, hidden, False)
        with pytest.raises(CallerError, match=f"\\[n, {WIDTH}\\]"):
            middle.forward("a" * 32, 0, np.arange(3, dtype=np.int32), np.zeros((3, TINY.hidden), np.float32), False)
        out = middle.forward("a" * 32, 0, np.arange(3, dtype=np.int32), hidden, False)
        assert out.shape == (3, WIDTH) and np.isfinite(out).all()
    finally:
        middle.close()


def test_llama_cpp_holds_what_the_planner_charges(model):
    """Each range's tensors (llama_model_size) against dgr.plan's weights and globals: the MTP layer and the
    hc_head on the tail, the token embedding on the head, only its own layers elsewhere."""
    from dgr.backends.clib import llama_lib

    path, data = model
    layout = layout_from_json(data, recipe="f32")
    params = PlanParams(context=256, sessions=1)
    mtp = sum(t.n_bytes for t in layout.globals if t.name.startswith(f"blk.{TINY.layers}."))
    assert mtp > 0  # the layout prices the MTP layer, to the tail
    for a, b in [(0, 2), (2, 4), (4, 6), (0, 6)]:
        node = LlamaShardBackend(path, LayerRange(a, b), n_threads=1, n_ctx=64, max_sessions=1)
        try:
            held = llama_lib().llama_model_size(node.engine._model)
        finally:
            node.close()
        cost = shard_cost(layout, params, Node("n", 0), LayerRange(a, b))
        assert held == cost.weight_bytes + cost.global_bytes, (a, b)


def test_window_caches_are_window_sized_as_planned(model):
    """A deepseek4 node sizes its 128-token-window caches to the window and a batch (swa_full off), as dgr plan
    prices them, not to the whole context: llama.cpp's logged caches and states equal the plan's."""
    import collections

    from dgr.backends import clib
    from dgr.bench.costs import logged_state

    path, data = model
    layout = layout_from_json(data, recipe="f32")
    clib._LOG = collections.deque(maxlen=100_000)
    node = LlamaShardBackend(path, LayerRange(2, 6), n_threads=1, n_ctx=1024, max_sessions=2)
    try:
        logged, lines = logged_state("".join(clib._LOG))
        n_batch = node.engine.n_batch
    finally:
        node.close()
    planned = shard_cost(layout, PlanParams(context=1024, sessions=2, ubatch=n_batch), Node("n", 0), LayerRange(2, 6))
    full = shard_cost(layout, PlanParams(context=1024, sessions=2, ubatch=n_batch, swa_full=True), Node("n", 0),
                      LayerRange(2, 6))
    assert abs(logged - planned.kv_bytes) <= lines * 0.005 * 2**20 < full.kv_bytes - planned.kv_bytes


def _route(model: str, backend: str, nodes: int) -> LocalRoute:
    return LocalRoute(backend=backend, nodes=nodes, extra=("--model", model, "--ctx", "256", "--threads", "1"),
                      ready_timeout_s=120)


def test_dgr_up_three_nodes_answer_as_one_with_a_flat_seam(model):
    """Through the OpenAI client: 3 llama_shard nodes and 1 llama node give the same text for a short and a
    long prompt and two chat turns; each hop's decode frame is the header, one token id and 4 x 64 float32,
    at any context."""
    prompts = ["The keeper wrote: what", tiny_prompt(60)]

    def ask(backend: str, nodes: int) -> tuple[list[str], list[str], list[list[int]]]:
        with _route(model[0], backend, nodes) as r:
            client = openai.OpenAI(base_url=r.api, api_key="unused", max_retries=0, timeout=120, http_client=r.http)
            name = client.models.list().data[0].id
            texts, frames = [], []
            for p in prompts:
                resp = client.completions.create(model=name, prompt=p, max_tokens=N_NEW, temperature=0)
                assert resp.usage.completion_tokens == N_NEW
                texts.append(resp.choices[0].text)
                frames.append([r.node_status(f"node{i}")["seam"]["last_decode_frame_bytes"] for i in range(1, nodes)])
            # a conversation: the second turn repeats the first, which no node can reuse (the compressor
            # state cannot drop the first answer's positions), so each node computes it again
            chat = [{"role": "user", "content": prompts[1]}]
            for _ in range(2):
                resp = client.chat.completions.create(model=name, messages=chat, max_tokens=N_NEW, temperature=0)
                texts.append(resp.choices[0].message.content)
                chat += [{"role": "assistant", "content": texts[-1]}, {"role": "user", "content": "and then?"}]
            return texts, sorted(n["layers"] for n in r.node_table()), frames

    split, layers, frames = ask("llama_shard", 3)
    whole, _, _ = ask("llama", 1)
    print(f"dgr up --nodes 3 on tiny deepseek4 {layers}: {split!r}; decode frames per hop {frames}")
    assert len(layers) == 3
    assert split == whole and all(len(t) > N_NEW for t in split)
    assert frames == [[HEADER_SIZE + 4 + WIDTH * 4] * 2] * 2
