"""Phase groups of a chain route (dgr.fsm.phases): the pure rules, then the gateway's wait on trio's MockClock."""

from __future__ import annotations


import trio

from dgr.tracker.gateway import Gateway
from dgr.fsm.phases import RoutePhases
from dgr.tracker.registry import Registry


def _board(n_nodes: int, n: int) -> tuple[RoutePhases, list[str]]:
    board = RoutePhases(n_nodes)
    sids = [f"s{i}" for i in range(n)]
    assert [board.join(s) for s in sids] == list(range(n))
    return board, sids


def test_lanes_are_the_lowest_free_and_come_back_when_a_session_leaves() -> None:
    board, sids = _board(2, 4)
    board.leave("s1")
    assert board.join("new") == 1
    assert board.join("newer") == 4


def test_a_lone_session_and_one_per_node_never_wait() -> None:
    board, _ = _board(2, 1)
    assert board.arrive("s0") == ["s0"]
    board, _ = _board(2, 2)  # two sessions on two nodes: a group each
    assert board.arrive("s1") == ["s1"]
    assert board.arrive("s0") == ["s0"]


def test_eight_sessions_on_two_nodes_go_in_two_groups_of_consecutive_lanes() -> None:
    board, sids = _board(2, 8)
    for s in sids:  # every session decoding: the first arrivals wait for their group
        board.decoding.add(s)
    assert board.groups() == [sids[:4], sids[4:]]
    assert board.arrive("s5") == [] and board.arrive("s0") == []
    assert board.arrive("s1") == [] and board.arrive("s2") == []
    assert sorted(board.arrive("s3")) == sids[:4]  # the last of lanes 0-3 releases them together
    assert board.waiting == {"s5"}
    for s in ("s4", "s6"):
        assert board.arrive(s) == []
    assert sorted(board.arrive("s7")) == sids[4:]
    assert board.waiting == set()


def test_groups_follow_the_number_of_nodes_and_decoding_sessions() -> None:
    board, sids = _board(3, 8)
    board.decoding.update(sids)
    assert board.groups() == [sids[:3], sids[3:6], sids[6:]]
    board.decoding -= {"s0", "s1"}  # still in prefill, or ended: not waited for
    assert board.groups() == [sids[2:4], sids[4:6], sids[6:]]


def test_a_session_that_leaves_releases_the_group_that_waited_for_it() -> None:
    board, sids = _board(2, 4)
    board.decoding.update(sids)
    assert board.arrive("s0") == []
    assert board.leave("s1") == []  # 3 decoding: groups s0 s2 | s3, and s2 has no token yet
    assert board.groups() == [["s0", "s2"], ["s3"]]
    assert board.arrive("s3") == ["s3"]
    assert board.leave("s2") == ["s0"]  # s0's group is now s0 alone, and it is waiting


def test_a_session_that_stops_decoding_is_not_waited_for_and_keeps_its_lane() -> None:
    board, sids = _board(2, 4)
    board.decoding.update(sids)
    assert board.arrive("s1") == []  # waits for s0
    assert board.stop("s0") == []  # 3 decoding: groups s1 s2 | s3, and s2 has no token yet
    assert sorted(board.arrive("s2")) == ["s1", "s2"]
    assert board.join("new") == 4  # lane 0 is still held until s0's nodes close


def test_a_session_that_withdrew_is_waited_for_again_next_time() -> None:
    board, sids = _board(2, 4)
    board.decoding.update(sids)
    assert board.arrive("s0") == []
    board.withdraw("s0")  # its wait timed out: it went alone
    assert board.arrive("s1") == []  # s0 is in flight again, and s1 waits for it
    assert sorted(board.arrive("s0")) == ["s0", "s1"]


def test_a_session_not_on_the_board_never_waits() -> None:
    board, _ = _board(2, 4)
    assert board.arrive("stranger") == ["stranger"]


def test_a_routes_board_lives_while_its_sessions_hold_lanes() -> None:
    """Admission keeps one board a route (made on its first opening) and drops it with its last lane."""
    from dgr.api.openai import parse_request
    from dgr.fsm.route import Hop, RouteSession
    from dgr.tracker.routing import RouteChoice

    gw = Gateway(Registry())
    hops = (Hop("n0", "http://n0", 0, 15), Hop("n1", "http://n1", 15, 30))
    req = parse_request({"model": "stub", "prompt": "hi"}, "completion")
    openings = [gw.admission.opening(req, RouteSession(sid, "stub", 0.0), RouteChoice(hops, (), "digest"), None)
                for sid in ("s0", "s1", "s2")]
    board = openings[0].board
    assert all(o.board is board for o in openings) and [o.lane for o in openings] == [0, 1, 2]
    gw.admission.leave(board, "s1")
    assert board.join("s3") == 1 and ("n0", "n1") in gw.admission.phases  # s1's lane came back
    for sid in ("s0", "s2", "s3"):
        gw.admission.leave(board, sid)
    assert gw.admission.phases == {}  # a board with no lanes goes


def test_a_ring_tail_holds_each_step_for_its_group_and_sends_it_alone_after_the_bound() -> None:
    """The tail of a ring keeps the same groups on the same board (dgr.node.links): a step waits
    for its group, goes alone after its bound, and a session that stops or ends frees its group."""
    from trio.testing import MockClock

    from dgr.fsm.node import NodeSession
    from dgr.node.links import NodeSessionRecord, RingPhases
    from dgr.fsm.phases import FIRST_HOLD_S

    sent: list[tuple[str, bytes]] = []

    class Loop:  # a session's loop relay, to the head
        def __init__(self, sid: str) -> None:
            self.sid = sid

        def put(self, item) -> None:
            sent.append((self.sid, item.frame))

    # each session's record, on a node, in the lane the gateway gave it
    recs = {f"s{i}": NodeSessionRecord(NodeSession(f"s{i}", 64, last_active=0.0), lane=i, loop=Loop(f"s{i}"))
            for i in range(4)}
    ring = RingPhases(recs.get)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                ring.join(recs[f"s{i}"], "a,b", 2)
            ring.boards["a,b"].decoding.update(f"s{i}" for i in range(4))  # every one decoding: groups s0-s1, s2-s3
            ring.go(recs["s1"], b"1", nursery)
            assert sent == []  # waits for s0
            ring.go(recs["s0"], b"0", nursery)
            assert sorted(sent) == [("s0", b"0"), ("s1", b"1")] and ring.released == 2
            ring.go(recs["s2"], b"2", nursery)  # s3 does not come
            await trio.sleep(FIRST_HOLD_S - 0.01)
            assert len(sent) == 2
            await trio.sleep(0.02)
            assert sent[-1] == ("s2", b"2") and ring.alone == 1
            ring.go(recs["s2"], b"2b", nursery)  # held again, for twice the time since its last step
            ring.leave(recs["s3"])  # s3 ended here: s2's group is s2 alone now
            assert sent[-1] == ("s2", b"2b") and ring.released == 3
            ring.go(recs["s0"], b"0b", nursery)
            assert sent[-1] == ("s2", b"2b")  # s0 waits for s1
            ring.go(recs["s1"], None, nursery)  # s1 sent its last step
            assert sent[-1] == ("s0", b"0b")
            ring.leave(recs["s0"]), ring.leave(recs["s1"]), ring.leave(recs["s2"])
            assert ring.boards == {} and all(r.hold.step is None and r.hold.wake is None for r in recs.values())

    trio.run(main, clock=MockClock(autojump_threshold=0))
