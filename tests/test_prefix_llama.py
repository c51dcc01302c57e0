"""Prefix reuse on the real model: llama.cpp sequence copies on a 2-shard split, and a multi-turn chat
through real processes on a 2-node llama_shard route."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from dgr.backends.base import LayerRange
from dgr.backends.llama_shard import LlamaShardBackend
from dgr.errors import CallerError, Reason
from dgr.models import default_model_path
from dgr.seam.keys import BLOCK_TOKENS
from dgr.pipeline import Pipeline
from dgr.testing.harness import LocalRoute

pytestmark = [pytest.mark.llama, pytest.mark.serial]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
N_NEW = 12


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DGR_CACHE_DIR", str(tmp_path_factory.mktemp("dgr-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def stages():
    out = [LlamaShardBackend(default_model_path(), LayerRange(a, b), n_threads=1, n_ctx=1024, max_sessions=3)
           for a, b in ((0, 15), (15, 30))]
    yield out
    for s in out:
        s.close()


def _greedy(p: Pipeline, sid: str, ids: list[int], pos0: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after feeding ids[pos0:] to `sid` (which holds ids[:pos0]), and their logits."""
    logits = p.prefill(sid, ids, pos0=pos0)
    toks, rows, pos = [], [], len(ids)
    for _ in range(N_NEW):
        rows.append(logits)
        toks.append(int(np.argmax(logits)))
        logits = p.decode(sid, toks[-1], pos)
        pos += 1
    return toks, np.stack(rows)


def test_a_copied_prefix_answers_as_a_full_prefill(stages) -> None:
    """Turn 1 runs whole and is kept; turn 2 starts from a copy of it on both shards."""
    text = stages[0].render_chat([{"role": "system", "content": "You describe lighthouses. " * 20},
                                  {"role": "user", "content": "What does a keeper do?"}])
    turn1 = stages[0].tokenize(text, add_special=True, parse_special=True)
    p = Pipeline(stages)
    p.open("t1", 1024)
    answer, _ = _greedy(p, "t1", turn1, 0)
    fed = turn1 + answer  # _greedy feeds every token it samples
    blocks = len(fed) // BLOCK_TOKENS
    for s in stages:
        s.keep_prefix("t1", "k", blocks * BLOCK_TOKENS)
        assert s.session_count() == 0 and s.kv_bytes() == 0 and s.prefix_bytes() > 0
    turn2 = fed + stages[0].tokenize(" And at night?", add_special=False, parse_special=False)
    for s in stages:
        s.open_from_prefix("t2", 1024, "k", blocks * BLOCK_TOKENS, take=False, lane=2)
        assert s._seq("t2") == 2  # the copy lands in its phase lane's slot (dgr.fsm.phases)
    p.open("ref", 1024)
    got, got_logits = _greedy(p, "t2", turn2, blocks * BLOCK_TOKENS)
    want, want_logits = _greedy(p, "ref", turn2, 0)
    diff = float(np.max(np.abs(got_logits - want_logits)))
    print(f"reused {blocks * BLOCK_TOKENS} of {len(turn2)} positions: max abs logit difference {diff}")
    assert got == want
    assert diff < 0.05  # the prefix's rows were computed in another chunk (and some as decode steps)
    for s in stages:
        assert s.positions_computed("t2") == len(turn2) - blocks * BLOCK_TOKENS + N_NEW
    # taking the kept KV over (no free slot) gives the same answer again
    p.close("t2")
    p.close("ref")
    for s in stages:
        s.open_from_prefix("t3", 1024, "k", blocks * BLOCK_TOKENS, take=True)
        assert s.prefix_bytes() == 0
    again, _ = _greedy(p, "t3", turn2, blocks * BLOCK_TOKENS)
    assert again == got
    p.close("t3")
    assert all(s.session_count() == 0 and s.free_slots() == 3 for s in stages)


SYSTEM = ("You are the harbour master's assistant. You keep answers short and exact, you name ships by their "
          "registry names, and you never guess a tide time. ") * 6
QUESTIONS = ["Which ships came in today?", "And which left?", "Is the tide high at noon?",
             "Summarise the day in one line."]


def test_multi_turn_chat_with_reuse_equals_without_on_a_sharded_route() -> None:
    """With --prefix-exact (prompts' KV only), bit-identical answers. One route; a fresh API key per turn sees
    no prefix of the conversation's key (isolation), so it is the no-reuse answer."""
    with LocalRoute(backend="llama_shard", nodes=2, extra=("--ctx", "1024", "--max-sessions", "8", "--prefix-exact"),
                    ready_timeout_s=300) as route:
        conv = openai.OpenAI(base_url=route.api, api_key="conversation", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}]
        cached, prompts = [], []
        for t, q in enumerate(QUESTIONS[:3]):  # turn 1 fills the cache; turns 2 and 3 reuse it
            messages.append({"role": "user", "content": q})
            fresh = openai.OpenAI(base_url=route.api, api_key=f"fresh-{t}", max_retries=0, timeout=120)
            want = fresh.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            got = conv.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            assert got.choices[0].message.content == want.choices[0].message.content
            assert want.usage.prompt_tokens_details.cached_tokens == 0
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
            prompts.append(got.usage.prompt_tokens)
            messages.append({"role": "assistant", "content": got.choices[0].message.content})
        print(f"cached tokens per turn: {cached}")
        assert cached[0] == 0 and all(c >= 3 * BLOCK_TOKENS for c in cached[1:])
        # the prompts' KV only: each turn computes the last one's answer again, which a kept answer would spare
        assert all(c <= p for c, p in zip(cached[1:], prompts))
        route.wait_sessions_freed(["node0", "node1"])
        for name in ("node0", "node1"):
            status = route.node_status(name)
            assert status["sessions"] == 0 and status["kv_bytes"] == 0
            assert status["prefix"]["hits"] >= 2 and status["prefix"]["bytes"] > 0


def test_answer_reuse_on_a_sharded_route() -> None:
    """By default a turn reuses the last one's prompt and answer, to the token: the template renders the
    answer as it was generated, so everything the route computed is reused. The answers are compared with
    the no-reuse ones (a fresh API key) and the differences printed: the answer's positions were computed
    one at a time, a cold prefill computes them in one chunk, and llama.cpp rounds the two a little apart."""
    with LocalRoute(backend="llama_shard", nodes=2, extra=("--ctx", "1024", "--max-sessions", "8"),
                    ready_timeout_s=300) as route:
        conv = openai.OpenAI(base_url=route.api, api_key="conversation", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}]
        cached, want_cached, same = [], [0], []
        for t, q in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": q})
            fresh = openai.OpenAI(base_url=route.api, api_key=f"fresh-{t}", max_retries=0, timeout=120)
            want = fresh.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            got = conv.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            same.append(got.choices[0].message.content == want.choices[0].message.content)
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
            # what the next turn may reuse: this prompt and every answer token fed back (not the last sampled)
            fed = got.usage.completion_tokens - (got.choices[0].finish_reason == "length")
            want_cached.append(got.usage.prompt_tokens + fed)
            messages.append({"role": "assistant", "content": got.choices[0].message.content})
        print(f"cached tokens per turn: {cached}; answers equal to the no-reuse ones: {same}")
        assert cached == want_cached[:-1]
        route.wait_sessions_freed(["node0", "node1"])


def test_torch_shards_reuse_a_copied_prefix() -> None:
    """The torch backend keeps the same interface: a kept prefix copied into a new session's cache."""
    from dgr.backends.torch_backend import TorchBackend

    stages = [TorchBackend(default_model_path(), LayerRange(a, b), capacity=2) for a, b in ((0, 15), (15, 30))]
    ids = list(range(1000, 1000 + 2 * BLOCK_TOKENS + 9))
    p = Pipeline(stages)
    p.open("a", 256)
    want = p.prefill("a", ids)
    for s in stages:
        s.keep_prefix("a", "k", BLOCK_TOKENS)
        assert s.prefix_bytes() == BLOCK_TOKENS * s.kv_bytes_per_position() and s.free_slots() == 1
        s.open_from_prefix("b", 256, "k", BLOCK_TOKENS, take=False)
    got = p.prefill("b", ids, pos0=BLOCK_TOKENS)
    print(f"torch: max abs logit difference with a reused block: {float(np.max(np.abs(got - want)))}")
    assert int(np.argmax(got)) == int(np.argmax(want)) and np.allclose(got, want, atol=1e-3)
    assert all(s.positions_computed("b") == len(ids) - BLOCK_TOKENS for s in stages)
    for s in stages:
        s.trim_session("b", BLOCK_TOKENS)  # what a route reusing less than this node holds does
    assert np.allclose(p.prefill("b", ids, pos0=BLOCK_TOKENS), want, atol=1e-3)
    p.close("b")
    for s in stages:
        s.drop_prefix("k")
        assert s.free_slots() == 2 and s.prefix_bytes() == 0


def test_a_llama_snapshot_reloads_in_a_new_context(stages) -> None:
    """llama.cpp's sequence state out of one context and into a fresh one (a restart) answers as before."""
    ids = stages[0].tokenize("The harbour log lists every ship that came in. " * 12, add_special=True,
                             parse_special=False)
    p = Pipeline(stages)
    p.open("s", 1024)
    p.prefill("s", ids)
    blocks = len(ids) // BLOCK_TOKENS
    data = []
    for s in stages:
        s.keep_prefix("s", "k", blocks * BLOCK_TOKENS)
        data.append(s.export_prefix("k"))
        s.drop_prefix("k")
    fresh = [LlamaShardBackend(default_model_path(), s.layers, n_threads=1, n_ctx=1024, max_sessions=2)
             for s in stages]
    try:
        for s, d in zip(fresh, data):
            assert s.import_prefix("k", d, blocks * BLOCK_TOKENS) > 0 and s.free_slots() == 1
            s.open_from_prefix("t", 1024, "k", blocks * BLOCK_TOKENS, take=True)
        q = Pipeline(fresh)
        got, got_logits = _greedy(q, "t", ids, blocks * BLOCK_TOKENS)
        q.open("ref", 1024)
        want, want_logits = _greedy(q, "ref", ids, 0)
        assert got == want and float(np.max(np.abs(got_logits - want_logits))) == 0.0
        q.close("t")
        q.close("ref")
        with pytest.raises(CallerError) as err:  # truncated bytes do not load
            fresh[0].import_prefix("x", data[0][: len(data[0]) // 2], blocks * BLOCK_TOKENS)
        assert err.value.reason is Reason.SNAPSHOT_MISMATCH
        for claimed in ((blocks + 1) * BLOCK_TOKENS, (blocks - 1) * BLOCK_TOKENS):  # a tampered manifest's count
            with pytest.raises(CallerError, match=f"holds {blocks * BLOCK_TOKENS} positions") as err:
                fresh[0].import_prefix("x", data[0], claimed)
            assert err.value.reason is Reason.SNAPSHOT_MISMATCH and fresh[0].free_slots() == 2
    finally:
        for s in fresh:
            s.close()


def test_a_restarted_node_answers_the_next_turn_from_its_snapshot(tmp_path) -> None:
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=300,
                    extra=("--ctx", "1024", "--max-sessions", "4", "--snapshot-dir", str(tmp_path))) as route:
        conv = openai.OpenAI(base_url=route.api, api_key="conversation", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        first = conv.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        route.wait_sessions_freed(["node0", "node1"])
        assert route.node_status("node1")["snapshots"]["written"] == 1
        layers = route.node("node1")["layers"]
        route.kill("node1")
        route.restart_node("node1", layers, extra=("--snapshot-dir", str(tmp_path / "node1")))
        snaps = route.node_status("node1")["snapshots"]
        assert snaps["loaded"] == 1 and snaps["refused"] == []
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": QUESTIONS[1]}]
        second = conv.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= 3 * BLOCK_TOKENS


def test_eight_concurrent_conversations_never_meet_a_429_for_a_kept_prefix() -> None:
    """8 conversations at once on nodes of 4 sequence slots: kept prefixes are evicted for live sessions,
    never the other way round (under this pressure few survive to their next turn), and once it eases the
    last conversation's prefix is there for its next turn."""
    import threading

    errors: list[str] = []
    answers: list[int] = []
    finished: list[tuple[int, list[dict[str, str]]]] = []
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=300,
                    extra=("--ctx", "512", "--max-sessions", "4", "--admission-wait-s", "120")) as route:

        def client(i: int) -> openai.OpenAI:
            return openai.OpenAI(base_url=route.api, api_key=f"user-{i}", max_retries=0, timeout=300)

        def conversation(i: int) -> None:
            messages = [{"role": "system", "content": SYSTEM[: 300 + 40 * i]}]
            try:
                for q in QUESTIONS[:2]:  # two turns each: 16 requests on 4 slots
                    messages.append({"role": "user", "content": q})
                    r = client(i).chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0)
                    answers.append(r.usage.completion_tokens)
                    messages.append({"role": "assistant", "content": r.choices[0].message.content})
                finished.append((i, messages))
            except openai.APIError as exc:
                errors.append(f"{i}: {exc}")

        threads = [threading.Thread(target=conversation, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert errors == [] and len(answers) == 16
        route.wait_sessions_freed(["node0", "node1"])
        for name in ("node0", "node1"):
            status = route.node_status(name)
            assert status["seam"]["refused"].get("node_at_capacity", 0) == 0
            assert status["prefix"]["entries"] <= 4 and status["prefix"]["evictions"] > 0
        last, messages = finished[-1]
        messages.append({"role": "user", "content": QUESTIONS[2]})
        again = client(last).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= BLOCK_TOKENS
