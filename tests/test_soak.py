"""`dgr soak` end to end: a mix of normal, cancelled, disconnected and node-killed sessions leaves nothing behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from dgr.procs import dgr_command
from dgr.bench.soak_report import MAX_RSS_GROWTH


def _soak(sessions: int, kill_every: int, timeout_s: float) -> dict:
    done = subprocess.run(dgr_command("soak", "--sessions", str(sessions), "--kill-every", str(kill_every), "--json"),
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    print("\n" + done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    planned = report["planned"]
    assert report["ok"] and report["problems"] == [] and report["sessions"] == sessions
    assert sum(planned.values()) == sessions and planned.get("kill", 0) == sessions // kill_every
    # every session ended the way its client made it end, as the client and as the tracker saw it
    assert report["client_outcomes"] == {f"{k}:ok": n for k, n in planned.items()}
    assert report["tracker_failures"] == {
        k: v for k, v in {"cancelled": planned.get("cancel", 0) + planned.get("disconnect", 0),
                          "route_node_lost": planned.get("kill", 0)}.items() if v}
    assert report["tracker_sessions"]["done"] == planned["complete"]
    # nothing left behind
    assert set(report["sessions_after"].values()) == {0}
    assert report["kv_bytes_after"] == report["kv_bytes_before"] == {"node0": 0, "node1": 0}
    judged = [p for p in report["nodes"] if p["rss_growth_pct"] is not None]
    assert any(p["node"] == "node0" and p["served"] == sessions for p in judged)  # the node never killed
    assert all(p["rss_growth_pct"] < 100 * MAX_RSS_GROWTH for p in judged)
    return report


def test_dgr_up_forwards_trusted_heads_and_uses_the_node_keys_it_finds(tmp_path) -> None:
    """What `dgr soak --attacker` relies on: node keys made before `dgr up` are the ones its nodes sign with, and
    its --trusted-head keys reach the tracker, which then routes through them."""
    from dgr.bench.soak import _trusted_keys
    from dgr.cli import build_parser
    from dgr.testing.harness import LocalRoute
    from dgr.up import tracker_args

    keys = _trusted_keys(tmp_path, 2)
    cmd = tracker_args(build_parser().parse_args(["up", "--trusted-head", keys[0], "--trusted-head", keys[1]]))
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--trusted-head"] == keys
    extra = tuple(a for k in keys for a in ("--trusted-head", k))
    with LocalRoute(backend="stub", nodes=2, extra=extra, keys=tmp_path) as route:
        assert sorted(n["key"] for n in route.node_table()) == sorted(keys)
        r = route.http.post(route.api + "/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 2},
                            timeout=30)
        assert r.status_code == 200, r.text


def test_short_soak() -> None:
    _soak(60, 25, timeout_s=240)


@pytest.mark.slow
def test_full_soak() -> None:
    _soak(500, 50, timeout_s=1200)


# Attacks issue 40 lists that still get through, each by its name in the attacker's tally, with why: the test
# xfails naming them while only these are accepted, and fails for any other. Empty since trust-soak merged main
# (the id 'gateway' was the last one accepted on the branch before: trust-lows reserved it).
_OPEN_FINDINGS: dict[str, str] = {}


def test_short_soak_beside_an_attacker() -> None:
    """`dgr soak --attacker` (issue 40, Must show, in small): honest sessions end as planned beside every attack,
    none reaches the attacker's node, the nodes end empty, and every server's /healthz answered. The p99 bound is
    loose here (a shared 2-core machine runs this beside other tests); the 5-minute run holds it to 100 ms."""
    sessions = 40
    done = subprocess.run(dgr_command("soak", "--attacker", "--sessions", str(sessions), "--time-limit", "30",
                                      "--stub-delay", "0.001", "--inside-slow-s", "0",
                                      "--healthz-p99-ms", "3000", "--json"),
                          capture_output=True, text=True, timeout=150, check=False)
    print("\n" + done.stdout)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    planned, attack = report["planned"], report["attack"]
    assert attack is not None, done.stderr[-3000:]
    # the attacker ran every attack (each tallied), and no honest call ever reached its node
    for name in ("report_none", "report_self_signed", "capture_register", "capture_heartbeat", "hijack_heartbeat",
                 "hijack_register", "gateway_id", "replay_register", "seam_open_self_signed", "seam_stream_expired",
                 "seam_close_keep_other_session", "seam_prompt_none", "idle_conns", "big_prompt", "half_bodies",
                 "browser_plain", "status_poll", "spec_"):
        assert any(k.startswith(name) for k in attack["attacks"]), (name, attack["attacks"])
    assert attack["attacks"]["idle_conns"]["opened"] >= 900  # 300 to each of 3 servers
    assert attack["trap_calls"] == 0
    # honest sessions: as planned, as the client and the tracker saw them (no kills: --attacker's default)
    assert report["sessions"] == sessions and "kill" not in planned
    assert report["client_outcomes"] == {f"{k}:ok": n for k, n in planned.items()}
    cancelled = planned.get("cancel", 0) + planned.get("disconnect", 0)
    # and the tracker's only other failures are the attacker's own completions, refused for their speculation:
    # as many as it tallied, plus the one it may have had in flight when it was stopped (one at a time)
    refused = sum(n for k, v in attack["attacks"].items() if k.startswith("spec_") for a, n in v.items() if a == "403")
    failures = dict(report["tracker_failures"])
    assert refused <= failures.pop("forbidden", 0) <= refused + 1, (refused, report["tracker_failures"])
    assert failures == ({"cancelled": cancelled} if cancelled else {})
    assert report["tracker_sessions"]["done"] == planned["complete"]
    # nothing left behind, every /healthz answered within the (loose) bound
    assert report["sessions_after"] == {"node0": 0, "node1": 0, "node2": 0}
    assert report["kv_bytes_after"] == {"node0": 0, "node1": 0, "node2": 0}
    assert set(report["healthz_ms"]) == {"tracker", "node0", "node1", "node2"}
    # the member gone bad inside routes (issue 55): it shared the middle stage, forged an answer and reported in
    # the head's name with the capabilities it held, was refused both times and struck for each
    inside = report["inside"]
    assert inside["mode"] == "middle" and inside["sessions"] >= 6, inside
    assert inside["attacks"] == {"forge_answer": {"403": 1}, "report_in_anothers_name": {"403": 1}}, inside
    assert inside["accepted"] == {} and inside["made"] == 2 and inside["strikes"] >= 2, inside
    assert all(h["n"] >= 20 and h["errors"] == 0 for h in report["healthz_ms"].values()), report["healthz_ms"]
    accepted = attack["accepted"]
    assert set(accepted) <= set(_OPEN_FINDINGS), f"attacks accepted: {accepted}"
    assert [p for p in report["problems"] if not p.startswith("attacks accepted")] == [], report["problems"]
    if accepted:
        pytest.xfail("still accepted: " + "; ".join(f"{k} {n}x: {_OPEN_FINDINGS[k]}" for k, n in accepted.items()))
    assert report["ok"] and done.returncode == 0


def test_the_attacker_soak_fails_when_the_attacker_captures_sessions() -> None:
    """The control of the test above: without --trusted-head keys the attacker, claiming every layer, takes its
    turn at routes, and the member gone bad holds the tail's range beside the honest tail and answers the lure,
    token by token: the soak must see it (calls reach its trap, answers carry the lure) and fail."""
    done = subprocess.run(dgr_command("soak", "--attacker", "--no-trusted-heads", "--sessions", "8",
                                      "--concurrency", "4", "--time-limit", "30", "--healthz-p99-ms", "3000", "--json"),
                          capture_output=True, text=True, timeout=150, check=False)
    print("\n" + done.stdout)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and not report["ok"]
    assert report["attack"]["trap_calls"] > 0
    assert any("reached the attacker's node" in p for p in report["problems"]), report["problems"]
    assert any("did not end as planned" in p for p in report["problems"]), report["problems"]
    assert report["inside"]["mode"] == "tail" and report["inside"]["lure_tokens"] > 0, report["inside"]
    assert any(k.endswith(":lure") for k in report["client_outcomes"]), report["client_outcomes"]
