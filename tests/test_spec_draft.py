"""Drafts from a draft model on the ring's tail (issue 42, `--draft-model`).

The draft's bookkeeping against a recording model (what it feeds, where it drops refused drafts), then real
`dgr up` routes of tiny random llama models: `draft-exact` answers equal decoding without speculation token
for token, whatever the draft proposes; a draft equal to the target has its drafts taken; the draft's
sequences are freed with the session; a draft of another vocabulary, a draft on a node that is not a tail,
and `draft` speculation on a route whose tail has none are refused with their reasons.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from dgr.node.draft import DraftModel, ModelDrafter
from dgr.testing.harness import LOSS_BOUND_S, LocalRoute, first_error, first_text, sse_events
from dgr.testing.tiny_gguf import tiny_prompt, write_tiny_gguf

VOCAB = 16


class Recording:
    """A whole model whose next token is (the last token + 1) mod VOCAB, recording its KV as positions."""

    info = None

    def __init__(self) -> None:
        self.kv: dict[str, list[int]] = {}
        self.calls: list[tuple[str, int, list[int]]] = []

    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None:
        self.kv[sid] = []

    def close_session(self, sid: str) -> None:
        self.kv.pop(sid, None)

    def trim_session(self, sid: str, positions: int) -> None:
        del self.kv[sid][positions:]

    def forward(self, sid: str, pos0: int, token_ids: np.ndarray | None, hidden: np.ndarray | None,
                want_logits: int) -> np.ndarray:
        assert pos0 == len(self.kv[sid]), "a draft fed at a position its sequence does not end at"
        fed = [int(t) for t in token_ids]
        self.calls.append((sid, pos0, fed))
        self.kv[sid] += fed
        out = np.zeros(VOCAB, np.float32)
        out[(fed[-1] + 1) % VOCAB] = 1.0
        return out

    def max_positions(self) -> int:
        return 64


def test_a_draft_feeds_only_what_is_new_and_drops_refused_drafts() -> None:
    model = Recording()
    draft = DraftModel(model, path=None, vocabulary="v", bytes_per_position=10)
    d = ModelDrafter(draft, "s")
    d.extend([1, 2, 3])
    assert d.draft(3) == [4, 5, 6]
    assert model.calls == [("s", 0, [1, 2, 3]), ("s", 3, [4]), ("s", 4, [5])]
    assert model.kv["s"] == [1, 2, 3, 4, 5]  # the last draft is never fed
    # the target took 4, refused 5 and sampled 9 in its place: 5 goes, 9 is fed
    d.append(4)
    d.append(9)
    model.calls.clear()
    assert d.draft(2) == [10, 11]
    assert model.calls == [("s", 4, [9]), ("s", 5, [10])]
    assert model.kv["s"] == [1, 2, 3, 4, 9, 10]
    # every draft taken, then the bonus: nothing dropped, the last draft and the bonus fed at once
    d.append(10)
    d.append(11)
    d.append(0)
    model.calls.clear()
    assert d.draft(1) == [1]
    assert model.calls == [("s", 6, [11, 0])]
    assert draft.kv_bytes() == 8 * 10 and draft.sessions() == 1
    assert d.draft(0) == [] and not model.calls[1:]
    d.close()
    assert draft.sessions() == 0 and draft.kv_bytes() == 0 and "s" not in model.kv


def test_a_warmed_draft_has_read_the_prompt_at_the_first_step() -> None:
    model = Recording()
    d = ModelDrafter(DraftModel(model, path=None, vocabulary="v"), "s")
    d.extend([1, 2, 3])
    d.warm()
    assert model.calls == [("s", 0, [1, 2, 3])]
    d.append(7)  # the prompt's last chunk sampled 7
    assert d.draft(2) == [8, 9]
    assert model.calls[1:] == [("s", 3, [7]), ("s", 4, [8])]
    d.warm()  # once drafting, a warm is nothing
    assert len(model.calls) == 3


def test_a_draft_that_would_overrun_its_context_drafts_nothing() -> None:
    model = Recording()
    d = ModelDrafter(DraftModel(model, path=None, vocabulary="v"), "s")
    d.extend(range(62))
    assert d.draft(3) == []  # 62 + 3 > 64
    assert d.draft(2) == [62 % VOCAB, 63 % VOCAB]  # after the last token, 61


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("draft")
    return {"target": str(write_tiny_gguf(folder / "target.gguf", "llama", seed=3)),
            "other": str(write_tiny_gguf(folder / "other.gguf", "llama", seed=4))}


def _ask(route: LocalRoute, speculation: str) -> tuple[str, dict]:
    model = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": tiny_prompt(30)}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "speculation": speculation}
    r = httpx.post(f"{route.api}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    snap = route.wait_session_ended(r.headers["x-dgr-route-session"])
    assert snap["phase"] == "done", snap
    return r.json()["choices"][0]["message"]["content"], snap["speculation"]


@pytest.mark.serial
@pytest.mark.parametrize("draft", ["target", "other"])
def test_draft_exact_answers_as_decoding_without_speculation(tiny, draft) -> None:
    """A draft equal to the target has its drafts taken; another one mostly refused; either way the answer is
    the one without speculation, and the draft's sequences go with the session."""
    extra = ("--model", tiny["target"], "--draft-model", tiny[draft], "--ctx", "512", "--spec-k", "3",
             "--spec-allow", "draft,draft-exact")
    with LocalRoute(backend="llama_shard", nodes=2, ready_timeout_s=120, extra=extra) as route:
        plain, _ = _ask(route, "off")
        same, spec = _ask(route, "draft-exact")
        assert same == plain
        assert spec["drafted"] > 0 and spec["steps"] > 0, spec
        if draft == "target":
            assert spec["accepted"] >= 0.9 * spec["drafted"], spec
        else:
            assert spec["rejected"] > 0, spec
        _, batched = _ask(route, "draft")  # the step's rows in one batch: rounding may differ, drafts still flow
        assert batched["drafted"] > 0, batched
        status = route.node_status("node1")["draft"]
        assert status["file"].endswith(".gguf") and status["ms_a_token"] > 0, status
        route.wait_sessions_freed(["node0", "node1"])  # node1's KV counts its draft model's sequences
        assert route.node_status("node1")["draft"]["sessions"] == 0


@pytest.mark.serial
def test_a_node_lost_mid_speculation_fails_the_session_and_frees_the_draft(tiny) -> None:
    extra = ("--model", tiny["target"], "--draft-model", tiny["target"], "--ctx", "512", "--spec-k", "3",
             "--spec-allow", "draft")
    with LocalRoute(backend="llama_shard", nodes=3, ready_timeout_s=120, extra=extra) as route:
        model = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": tiny_prompt(20), "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True, "speculation": "draft"}
        with httpx.stream("POST", f"{route.api}/completions", json=body, timeout=120) as r:
            sid = r.headers["x-dgr-route-session"]
            events = sse_events(r)
            first_text(events)
            killed = route.kill("node1")
            error, seen_at = first_error(events)
        assert seen_at - killed < LOSS_BOUND_S
        assert (error["code"], error["node"], error["phase"]) == ("route_node_lost", "node1", "decode"), error
        snap = route.wait_session_ended(sid)
        assert snap["phase"] == "failed" and snap["speculation"]["drafted"] > 0, snap
        route.wait_sessions_freed(["node0", "node2"])  # node2's KV counts its draft model's sequences
        assert route.node_status("node2")["draft"]["sessions"] == 0


@pytest.mark.serial
def test_draft_speculation_needs_a_draft_model_on_the_tail() -> None:
    with LocalRoute(backend="stub", nodes=2, extra=("--spec-allow", "draft")) as route:
        model = httpx.get(f"{route.api}/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{route.api}/chat/completions", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "speculation": "draft"})
        assert r.status_code == 400, r.text
        assert "draft model" in r.json()["error"]["message"]
        route.wait_sessions_freed(["node0", "node1"])


def _node(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr", "node", "--backend", "llama_shard", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_draft_of_another_vocabulary_or_off_the_tail_is_refused(tiny) -> None:
    from dgr.models import default_model_path

    wrong = _node("--model", tiny["target"], "--draft-model", str(default_model_path()))
    assert wrong.returncode != 0 and "vocabulary" in wrong.stderr, wrong.stderr[-500:]
    head = _node("--model", tiny["target"], "--layers", "0:3", "--draft-model", tiny["target"])
    assert head.returncode != 0 and "tail" in head.stderr, head.stderr[-500:]


class _Clocked:
    """A costly drafter on a hand-moved clock: drafting k tokens takes 50 ms each; its drafts are 1, 2, ..."""

    free = False
    draft_s = 0.05

    def __init__(self, now: list[float]) -> None:
        self.now = now

    def extend(self, tokens) -> None:
        pass

    def append(self, token: int) -> None:
        pass

    def draft(self, k: int) -> list[int]:
        self.now[0] += 0.05 * k
        return list(range(1, k + 1))

    def kind(self) -> str:
        return "model"

    def warm(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_steps_measured_time_leaves_out_the_next_steps_drafting() -> None:
    """The drafting that follows a verdict is the drafter's cost (draft_s), not the route's: counting it in
    the step's time too made a draft model look cheap beside a slow-looking trip (k = 3 at 0 ms, 0.73x)."""
    from dgr.node.speculation import SpecPlan, TailSpec
    from dgr.sampling import Sampler, SamplingParams

    now = [0.0]
    spec = TailSpec(SpecPlan(fixed_k=2), drafter=_Clocked(now), clock=lambda: now[0])
    spec.first(7, 0.0)
    spec.next_step(1, 10, 7, 100)  # drafts [1, 2], built at 0.1
    now[0] += 0.03  # around the route
    rows = np.full((3, VOCAB), -10.0, np.float32)
    rows[0, 1] = rows[1, 2] = rows[2, 9] = 10.0  # both drafts taken, then 9
    _, verdict, _, emitted = spec.verify(1, rows, Sampler(SamplingParams(temperature=0.0)), is_eog=lambda t: False,
                                         ignore_eos=True, max_positions=100)
    assert verdict.accepted == 2 and [e.token for e in emitted] == [1, 2, 9]
    spec.next_step(2, 13, 9, 100)  # the next step's drafts: another 100 ms
    spec.measured(compute_s=0.01)
    assert spec.step_s == pytest.approx(0.03)


def test_a_draft_model_at_k_0_probes_only_where_a_trip_pays_for_it() -> None:
    """Drafting one token costs 50 ms here, and catching up a quarter of that a token behind: beside a 20 ms
    trip a probe never pays; beside a 2 s one it comes after a few steps."""
    from dgr.node.speculation import SpecPlan, TailSpec

    spec = TailSpec(SpecPlan(), drafter=_Clocked([0.0]))

    def first_due(step_s: float) -> int | None:
        spec.step_s = step_s
        for n in range(1, 10_000):
            spec.undrafted = n
            if spec._probe_due():
                return n
        return None

    assert first_due(0.02) is None
    assert first_due(2.0) == 7  # 7 x 1% x 2 s >= 50 ms x (1 + 7 / 4)
