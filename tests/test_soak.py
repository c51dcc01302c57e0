"""`dgr soak` end to end: a mix of normal, cancelled, disconnected and node-killed sessions leaves nothing behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from dgr.procs import dgr_command
from dgr.bench.soak import MAX_RSS_GROWTH


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


def test_short_soak() -> None:
    _soak(60, 25, timeout_s=240)


@pytest.mark.slow
def test_full_soak() -> None:
    _soak(500, 50, timeout_s=1200)
