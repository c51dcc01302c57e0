"""A conversation re-routed to its prefix's holders over a shared node, with the tickets on (issue 55, item 5).

The cluster: `dgr up` (stub, ring, the tracker's key, so every open carries a single-use ticket,
dgr.security.tickets) with node0 (0:15) and node1 (15:30), then a third member `b1` (15:30) that
joins later. Two routes, node0 -> node1 and node0 -> b1, share the head. Turn 1 takes node0 -> node1
(b1 joined after it, so it waits its turn), whose nodes keep the turn's KV. A follow-up's route is
first chosen by the spread (b1 has waited longest, or wins the tie), and once the head answered the
prompt's ids, admission moves it to the holders' route (dgr.tracker.admission, `Then.REOPEN`), whose
head is the node it just opened and closed. Every node is honest.

Before the fix the second open reused the Route Session's id, and node0 refused it as a replayed
ticket: the turn failed with 502 naming node0.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from dgr.procs import dgr_command
from dgr.testing.harness import LocalRoute
from dgr.testing.launcher import launch

SYSTEM = "You answer in one line, and you keep it short. " * 5  # ~240 stub tokens: whole blocks to keep


def _ask(route: LocalRoute, prompt: str) -> tuple[str, dict]:
    r = route.http.post(f"{route.api}/completions", json={"model": "stub", "prompt": prompt, "temperature": 0,
                                                          "max_tokens": 8}, headers=route.headers, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body


def _route_of(body: dict) -> tuple[str, ...]:
    return tuple(h["node"] for h in body["dgr"]["telemetry"]["route"])


def _metric(route: LocalRoute, name: str) -> float:
    families = text_string_to_metric_families(route.http.get(f"{route.url}/metrics", timeout=5).text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def test_follow_ups_rerouted_to_the_holders_over_a_shared_head_complete_every_turn() -> None:
    with LocalRoute(nodes=2) as route:
        assert [route.node(n)["layers"] for n in ("node0", "node1")] == ["0:15", "15:30"]
        late = launch(dgr_command("node", "--backend", "stub", "--layers", "15:30", "--name", "b1",
                                  "--tracker", route.url, "--busy-poll-ms", "0"), env=route.env())
        try:
            route.wait_nodes_alive(["b1"], timeout_s=60)
            prompt, turns = SYSTEM, []
            for turn in range(4):
                prompt += f" Q{turn}: and then?"
                text, body = _ask(route, prompt)
                turns.append(body)
                prompt += text
            # every follow-up ended on the holders' route, at least one moved there after opening over b1
            assert [_route_of(b) for b in turns] == [("node0", "node1")] * 4
            assert _metric(route, "dgr_route_reopens_total") >= 1
            assert _metric(route, "dgr_route_session_failures_total") == 0
            # each reused, to the token, what the turn before computed: the abandoned open on node0 kept its KV
            assert all(b["choices"][0]["finish_reason"] == "length" for b in turns)  # the last token is not fed
            fed = [b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"] - 1 for b in turns]
            assert [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in turns] == [0, *fed[:-1]]
            # the id the client saw names the session that ran, and the abandoned opens hold nothing anywhere
            for b in turns:
                snap = route.session(b["id"].removeprefix("cmpl-"))
                assert snap["phase"] == "done" and [h["node"] for h in snap["route"]] == ["node0", "node1"], snap
            route.wait_sessions_freed(["node0", "node1", "b1"], timeout_s=10)
        finally:
            late.kill()
            late.wait(timeout=10)
