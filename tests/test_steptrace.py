"""Stage timestamps of a route's steps (dgr.node.steptrace) and the bench that lines them up (dgr.bench.steps)."""

from __future__ import annotations

from pathlib import Path

from dgr.bench import steps
from dgr.node import steptrace

SID = "a" * 32
# one node's stages of a step, as offsets in ns from its read
_HEAD = {"read": 0, "admitted": 100_000, "iterate": 200_000, "compute": 250_000, "computed": 8_250_000,
         "finished": 8_350_000, "done": 8_400_000, "woken:on": 8_450_000, "send:on": 8_600_000}
_TAIL = {"read": 0, "admitted": 150_000, "iterate": 250_000, "compute": 300_000, "computed": 7_300_000,
         "finished": 7_700_000, "done": 7_750_000, "woken:answer": 7_900_000, "send:answer": 8_100_000}
_LOOP = {"woken:on": 7_800_000, "send:on": 8_000_000}  # a ring tail's relay to the head marks the next position
_PERIOD = 17_100_000  # the head's send at 8.6 ms, 0.2 ms to the tail, its loop send at 8.0, 0.3 ms back


def _synthetic(n: int) -> dict[str, list[tuple[str, str, int, int]]]:
    """Marks of n decode steps on a 2-node ring whose every gap is known: the head reads step k at k * period,
    the tail 200 us after the head sent it, and the head reads the next step 300 us after the tail sent it."""
    head, tail = [], []
    for k in range(n):
        t0 = k * _PERIOD
        head += [(s, SID, 100 + k, t0 + dt) for s, dt in _HEAD.items()]
        t1 = t0 + _HEAD["send:on"] + 200_000
        tail += [(s, SID, 100 + k, t1 + dt) for s, dt in _TAIL.items()]
        tail += [(s, SID, 101 + k, t1 + dt) for s, dt in _LOOP.items()]
    return {"node0": head, "node1": tail}


def test_analyse_reads_every_gap_link_and_the_period_off_the_marks() -> None:
    res = steps.analyse(_synthetic(20), ["node0", "node1"])
    gaps = {node: {g["gap"]: g["p50"] for g in rows} for node, rows in res["node_gaps"].items()}
    assert gaps["node0"] == {"read and admitted": 100, "waiting for the scheduler": 100, "batch prepared": 50,
                             "compute": 8000, "result encoded": 100, "back on the loop": 50,
                             "relay woken, to the next node": 50, "record encoded, to the next node": 150}
    assert gaps["node1"] == {"read and admitted": 150, "waiting for the scheduler": 100, "batch prepared": 50,
                             "compute": 7000, "result encoded": 400, "back on the loop": 50,
                             "relay woken, to the head": 50, "record encoded, to the head": 200,
                             "relay woken, to the gateway": 150, "record encoded, to the gateway": 200}
    assert [(link["p50"], link["n"]) for link in res["links"]] == [(200, 19), (300, 18)]  # no step after the last
    # the head's first step has no step before it, so 19 of the 20 are decode steps
    assert res["steps"] == 19 and res["period"]["p50"] == 17100 and res["compute"]["p50"] == 15000
    assert res["runtime"] == 2100
    # a ring of one node admits its next step in process (dgr.node.relay.SelfLoop): no link to line up
    alone = [m for m in _synthetic(5)["node0"] if not m[0].endswith(":on")]
    assert steps.analyse({"node0": alone}, ["node0"])["links"] == []


def test_off_unless_the_variable_names_a_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(steptrace, "ON", False)
    monkeypatch.setattr(steptrace, "_folder", None)
    monkeypatch.delenv(steptrace.ENV, raising=False)
    steptrace.start_from_env()
    assert not steptrace.ON and steptrace.dump("node0") is None
    monkeypatch.setenv(steptrace.ENV, str(tmp_path / "trace"))
    monkeypatch.setattr(steptrace, "_marks", [])
    steptrace.start_from_env()
    assert steptrace.ON
    steptrace.mark("read", SID, 7)
    steptrace.mark_frame("read", SID, b"too short for a header")  # never raises where the frame itself is refused
    assert [m[:3] for m in steptrace.read_marks(steptrace.dump("node0"))] == [("read", SID, 7)]
    monkeypatch.setattr(steptrace, "ON", False)


def test_a_stub_ring_traced_end_to_end_lines_up_every_stage(monkeypatch) -> None:
    """Real processes: every decode step passes each node's stages in order, each link's read comes after
    its send, and the runtime's share of a token is what is left of its period after compute."""
    monkeypatch.setattr(steps, "TOKENS", 64)
    monkeypatch.setattr(steps, "ROUNDS", 2)
    monkeypatch.setattr(steps, "SESSIONS", (1, 4))
    res = steps.run_steps(lambda _: None, backend="stub")
    assert [run["sessions"] for run in res["runs"]] == [1, 4]
    for run in res["runs"]:
        streams = 2 * run["sessions"]
        assert run["steps"] >= streams * 60 and len(run["tok_s"]) == 2
        for node, want in (("node0", "to the next node"), ("node1", "to the head")):
            rows = {g["gap"]: g for g in run["node_gaps"][node]}
            assert {"read and admitted", "waiting for the scheduler", "compute", "result encoded",
                    f"relay woken, {want}", f"record encoded, {want}"} <= set(rows)
            # every decode step lined up, bar each stream's last on the ring's way back (it has no next step)
            assert all(g["p10"] >= 0 and g["n"] >= run["steps"] - streams for g in rows.values()), rows
        assert all(link["p10"] > 0 and link["n"] >= run["steps"] - streams for link in run["links"]), run["links"]
        assert 0 < run["compute"]["p50"] < run["period"]["p50"]
