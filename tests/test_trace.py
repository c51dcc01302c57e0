"""python -m dgr.bench.trace: one chat completion followed through dgr's code, on the in-process ring."""

from __future__ import annotations

from dgr.bench.trace import main, trace_one_request


def test_the_trace_follows_a_request_through_the_gateway_and_both_nodes_of_the_ring(capsys) -> None:
    result = trace_one_request()
    assert result["request"]["completion_tokens"] == 2
    # bounded at the figures of the tree that set the bound (docs/perf/archive/trace-structure): a change that
    # puts more of dgr on a request's path must say why here, lowering is always welcome. 249 + 3: the stub
    # backend's own batch (forward_batch, _rows, forward_rows: one array op per layer for a batch's one-position
    # steps, issue 58), the fake model's compute, not the runtime's path. + 2 stops and 1 module: the tracker
    # checks each answer against its token id (Deliveries._check_token, and Pieces.forged in dgr.tracker.pieces,
    # which holds the models' vocabularies: issue 55, only the tail speaks for the route). + 6 stops and 1 module,
    # issue 55 too: a session's one budget of deadline extensions and the slow hop's standing (Patience.allowance,
    # Wait.refund, Patience._keep_waiting in place of keep_waiting, NodeEntry.load, Standing.banned in
    # dgr.tracker.blame), and the operator's speculation grants (GatewayConfig.spec_allowed, .prompt_to_tail).
    # + 4 (issue 55): a step is refused from its frame's header before its payload is read (NodeReplies.check_head,
    # with decode_head and _step_of, the header's and the shard's checks that decode_frame and check_frame now
    # share with it), and seam_headers (a stream's and a failure report's session and capability, read by one
    # function). + 9 stops and 1 module, issue 55's claims and spread: the tracker's own record of where prefixes
    # are kept and of what nodes claim (dgr.tracker.affinity: Affinity.kept, .candidates, ._usable, .check,
    # .may_hold, which the head no longer judges, PrefixCache.may_hold gone; _continues, _mark_key, _remember), and
    # routes compared on what differs with a random last tie (routing._settle, draw). + 1 net: a session's end
    # drops the capabilities verified for it (NodeSessions._forget, NodeTrust.forget; a node kept the tokens of its
    # last 2,048 sessions), and issue 58's cuts took one stop off. + 2 (issue 54, a stream survives a node loss):
    # the driver runs one route at a time (Gateway._run), so that a repaired route runs in the same loop, and a
    # route's snapshot rows are made by one function for its first route and a repaired one (route._route_json).
    # + 1 module, no stop (issue 54's spares): NodeEntry moved to dgr.tracker.entry, registry.py being at its
    # 400-line bound, so the entry's methods on the path (limit, load, routable, full, served) count under it
    # + 4 stops and 1 module (issue 54, the survivors' KV kept): each non-tail node journals the frames it sends on
    # for a repair's spare (dgr.node.journal: JournalBook.open, .add, .release), and an open's sample_from is read
    # as a count (dgr.seam.opening._natural). + 1 (issue 54, the storm with kills): an open that a node refuses
    # for room the gateway counted free waits and is tried again, so `Admission.open` is the loop over its tries
    # (Admission._open). + 1 (issue 58, a prompt's pipeline): a session's prefill chunk is chosen once from its
    # prompt and route (LiveSession.chunk_size; pipeline_chunk is its arithmetic)
    assert result["stops"] <= 282 and result["modules"] <= 55, (result["stops"], result["modules"])
    assert result["stops"] > 0 and result["calls"] >= result["stops"] and result["modules"] > 0
    modules = result["per_module"]
    # the gateway drives it, and each node's relay carries it on: the ring's path, not a star's
    assert modules["dgr.tracker.gateway"]["entries"] >= 1
    assert "dgr.tracker.gateway:Gateway.open" in result["functions"]
    assert "dgr.node.relay:Relay.run" in result["functions"]
    # the harness is not the path, and its counts add up
    assert not any(m.startswith(("dgr.testing", "dgr.bench")) for m in modules)
    assert sum(row["functions"] for row in modules.values()) == result["stops"] == len(result["functions"])
    assert sum(row["entries"] for row in modules.values()) == result["entries"]
    assert main(["--json"]) == 0 and '"stops"' in capsys.readouterr().out
