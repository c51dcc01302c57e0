"""The low findings of issue 40 (spec/security.md, trust v2): each attack, as it was run, now refused.

Registry and model-list attacks run against a real route (`dgr up` with a join
token, the harness acting as an admitted node or a stranger); the tracker's
reads of node replies run against fake nodes, real HTTP servers on loopback
that lie; the phase-group hold is a pure function, driven as a stalled session
would drive it.
"""

from __future__ import annotations

import functools
import gzip
import json

import httpx
import pytest
import trio

from dgr.errors import CallerError, Reason
from dgr.fsm.phases import FIRST_HOLD_S, MAX_HOLD_S, RoutePhases, hold_for
from dgr.seam.wire import NODE_HEADER
from dgr.seam.opening import RelayOrder
from dgr.security.identity import Identity, node_id_for
from dgr.testing.harness import LocalRoute
from dgr.tracker.registry import Registry


@pytest.fixture(scope="module")
def route():
    with LocalRoute(nodes=2) as r:
        yield r


def _registration(name: str, describe: object = None, model: str = "ghost-model") -> bytes:
    info = {"name": model, "architecture": "stub", "n_layers": 30, "hidden_size": 576, "seam_width": 576,
            "vocab_size": 300, "context_length": 4096, "digest": "0" * 64}
    return json.dumps({"node": name, "url": "http://127.0.0.1:9", "pid": None, "layers": [0, 30], "backend": "stub",
                       "model": info, "capacity": 4, "describe": {} if describe is None else describe}).encode()


def _register(route: LocalRoute, body: bytes, identity: Identity) -> httpx.Response:
    return httpx.post(f"{route.url}/v1/nodes/register", content=body,
                      headers=route.signed("/v1/nodes/register", body, identity=identity))


# -- describe cannot stand in for /v1/models fields --------------------------------------------------------------

def test_a_nodes_describe_cannot_override_model_list_fields(route) -> None:
    """A member registers a describe carrying the list's own keys; they stay nested under `describe`."""
    hostile = {"node": "node0", "layers": "0:30", "max_positions": 10 ** 9, "id": "gpt-4", "object": "evil",
               "owned_by": "attacker"}
    liar = Identity.generate()
    r = _register(route, _registration(liar.node_id, hostile, model="lows-describe"), liar)
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in route.http.get(f"{route.api}/models", timeout=5).json()["data"]}
    assert "gpt-4" not in models
    listed = models["lows-describe"]
    assert (listed["object"], listed["owned_by"]) == ("model", "dgr")
    [node] = listed["dgr"]["nodes"]
    assert node["node"] == liar.node_id and node["layers"] == "0:30" and node["max_positions"] == 4096
    assert node["describe"] == hostile
    # a describe that is not an object is a malformed registration
    r = _register(route, _registration(liar.node_id, ["node", "x"]), liar)
    assert r.status_code == 400 and "describe must be an object" in r.json()["error"]["message"]


# -- node ids: the reserved name, pruned owners, no oracle ---------------------------------------------------------

def test_the_gateways_own_id_cannot_be_registered(route) -> None:
    """Delivery capabilities name the node `gateway`: an admitted member may not register under it."""
    r = _register(route, _registration("gateway"), Identity.generate())
    assert r.status_code == 409 and r.json()["error"]["code"] == "identity_taken", r.text
    assert "gateway" not in {n["node"] for n in route.node_table()}


def test_a_heartbeat_under_another_keys_id_reads_as_an_unknown_id(route) -> None:
    """Heartbeats need no join token: a stranger's key must not learn which ids exist from the refusal."""
    stranger = Identity.generate()

    def beat(name: str) -> httpx.Response:
        body = json.dumps({"node": name, "sessions": 99, "kv_bytes": 1, "session_ids": []}).encode()
        return httpx.post(f"{route.url}/v1/nodes/heartbeat", content=body,
                          headers={**route.signed("/v1/nodes/heartbeat", body, identity=stranger, join=False),
                                   NODE_HEADER: name})

    # "node1" is live under another key; "nodeX" was never registered: the names are as long, so are the answers
    taken, unknown = beat("node1"), beat("nodeX")
    assert (taken.status_code, unknown.status_code) == (404, 404), (taken.text, unknown.text)
    assert taken.content.replace(b"node1", b"nodeX") == unknown.content
    assert route.node("node1")["sessions"] != 99


def test_forgotten_ids_lose_their_owner_but_derived_ids_stay_bound() -> None:
    registry = Registry(forget_after_s=10.0)
    a, b = Identity.generate(), Identity.generate()
    data = json.loads(_registration("chosen"))
    registry.register(data, 0.0, key=a.public)
    registry.register({**data, "node": a.node_id}, 0.0, key=a.public)
    assert set(registry.owners) == {"chosen", a.node_id}
    registry.sweep(100.0)
    assert {e.node_id for e in registry.forget(200.0)} == {"chosen", a.node_id}
    assert registry.owners == {}  # before: every id ever registered stayed here for the tracker's life
    registry.register(data, 201.0, key=b.public)  # a chosen name is first come, first served once forgotten
    assert registry.owners["chosen"] == b.public
    with pytest.raises(CallerError) as err:  # a derived id is its key's without an owner recorded
        registry.register({**data, "node": node_id_for(a.public)}, 201.0, key=b.public)
    assert err.value.reason is Reason.IDENTITY_TAKEN


# -- phase-group holds are bounded when a member of the group stalls -----------------------------------------------

def _holds(rule, steps: int, compute_s: float = 0.05) -> list[float]:
    """The holds of a session whose group partner stalled: it arrives, waits its whole hold, goes alone.

    `rule(ready, last_ready, last_sent)` is a driver's call of the hold rule; each step's token comes
    `compute_s` after the step went out.
    """
    board = RoutePhases(1)
    board.join("a"), board.join("stalled")
    board.decoding.update(("a", "stalled"))
    assert board.arrive("stalled") == [] and board.arrive("a") == ["a", "stalled"]  # one pass together, then
    holds, ready, last_ready, last_sent = [], 0.0, None, None
    for _ in range(steps):
        assert board.arrive("a") == []  # "stalled" never has its token again
        hold = rule(ready, last_ready, last_sent)
        board.withdraw("a")  # waited the whole bound: goes alone
        holds.append(hold)
        last_ready, last_sent = ready, ready + hold
        ready = last_sent + compute_s
    return holds


def test_a_stalled_group_member_makes_holds_neither_grow_nor_exceed_the_cap() -> None:
    # before: the drivers measured from when the last step was ready, so each hold fed the next
    doubling = _holds(lambda ready, last_ready, _: 2.0 * (ready - last_ready) if last_ready is not None else 0.25, 8)
    assert doubling[1:4] == pytest.approx([0.6, 1.3, 2.7]) and doubling[-1] > 40  # 2^n: a minute by step 8
    # now: from when it went out (its own round trip), so the hold stays twice its compute
    holds = _holds(lambda ready, _, last_sent: hold_for(ready, last_sent), 50)
    assert holds[0] == FIRST_HOLD_S and holds[1:] == pytest.approx([0.1] * 49)
    # and however a driver measures, no hold passes the cap
    capped = _holds(lambda ready, last_ready, _: hold_for(ready, last_ready), 50)
    assert max(capped) == MAX_HOLD_S and capped[-1] == MAX_HOLD_S


def test_a_ring_tails_holds_stay_bounded_while_a_group_member_stalls() -> None:
    """The ring tail's driver (dgr.node.links) on trio's MockClock: s1 stalls, s0 steps on alone."""
    from trio.testing import MockClock

    from dgr.fsm.node import NodeSession
    from dgr.node.links import NodeSessionRecord, RingPhases

    went: list[float] = []
    holds: list[float] = []

    class Loop:  # s0's loop relay, to the head (s1's steps go nowhere)
        def __init__(self, sid: str) -> None:
            self.sid = sid

        def put(self, item) -> None:
            if self.sid == "s0":
                went.append(trio.current_time())

    # each session's record, on a node, in the lane the gateway gave it
    h = {sid: NodeSessionRecord(NodeSession(sid, 64, last_active=0.0), lane=i, loop=Loop(sid))
         for i, sid in enumerate(("s0", "s1"))}
    ring = RingPhases(h.get)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ring.join(h["s0"], "a,b", 1), ring.join(h["s1"], "a,b", 1)
            ring.boards["a,b"].decoding.update(("s0", "s1"))
            ring.go(h["s1"], b"1", nursery)
            ring.go(h["s0"], b"0", nursery)  # one pass together; s1 stalls from here
            for _ in range(12):
                await trio.sleep(0.05)  # s0's round trip: its next step is ready
                ready = trio.current_time()
                n = len(went)
                ring.go(h["s0"], b"0", nursery)
                while len(went) == n:
                    await trio.sleep(0.001)
                holds.append(went[-1] - ready)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=MockClock(autojump_threshold=0))
    # twice its round trip (0.05 s and the poll above), each time; before: 0.1, 0.3, 0.7 ... (2^n) to 400 s
    assert holds == pytest.approx([0.1] * 12, abs=0.01), holds


# -- node replies the tracker reads are capped; the head's token ids are checked -----------------------------------

_HUGE = 48 * 1024 * 1024  # what the lying node sends, unless cut first
_TAIL = RelayOrder(None)  # an open's relay: a tail's, delivering to its tracker


class _FakeNode:
    """A real HTTP server on loopback that answers every request with `answer(path)`: (headers, body chunks)."""

    def __init__(self, answer, status: bytes = b"200 OK") -> None:
        self.answer, self.sent, self.url, self.status = answer, 0, "", status

    async def serve(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        headers, chunks = self.answer(head.split(b" ")[1].decode())
        try:
            await stream.send_all(b"HTTP/1.1 " + self.status + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n")
            for c in chunks:
                await stream.send_all(c)
                self.sent += len(c)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client cut the reply
        finally:
            await stream.aclose()

    async def start(self, nursery: trio.Nursery) -> str:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, self.serve, 0, host="127.0.0.1"))
        self.url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        return self.url


def _chunked(total: int, size: int = 1 << 16):
    """`total` bytes of JSON-ish filler as HTTP/1.1 chunks (no Content-Length to refuse up front)."""
    piece = b"%x\r\n" % size + b" " * size + b"\r\n"
    for _ in range(total // size):
        yield piece
    yield b"0\r\n\r\n"


def _json_reply(obj) -> tuple[list[bytes], list[bytes]]:
    body = json.dumps(obj).encode()
    return [b"Content-Type: application/json", b"Content-Length: %d" % len(body)], [body]


def test_an_oversize_node_reply_is_cut_at_its_cap_with_memory_bounded() -> None:
    """A node answers status, an open and a head's open of a prompt with 48 MiB: the tracker stops at the cap
    and names the node."""
    import tracemalloc

    from dgr.errors import PeerError
    from dgr.seam.opening import OpenRequest, PromptPlan
    from dgr.seam.wire import MAX_CONTROL_BYTES
    from dgr.tracker.seam_client import NodeClient

    announced = [b"Content-Type: application/json", b"Content-Length: %d" % _HUGE]
    chunked = [b"Content-Type: application/json", b"Transfer-Encoding: chunked"]
    announce = [False]
    fake = _FakeNode(lambda path: (announced if announce[0] else chunked, _chunked(_HUGE)))

    async def main() -> list[tuple[str, str, int, int]]:
        out = []
        async with trio.open_nursery() as nursery:
            client = NodeClient("liar", await fake.start(nursery))
            calls = {"status": client.status,
                     "prompt": lambda: client.open(OpenRequest("a" * 32, 64, _TAIL, prompt=PromptPlan.of(
                         {"prompt": "hi"}, max_new=1, max_prompt=None)), vocab_size=300),
                     "open": lambda: client.open(OpenRequest("a" * 32, 64, _TAIL))}
            for name, call in calls.items():
                fake.sent, announce[0] = 0, name == "open"
                tracemalloc.start()
                with trio.fail_after(30):
                    try:
                        await call()
                        outcome = "answered"
                    except PeerError as exc:  # before the cap: a JSON error, once all 48 MiB were held
                        outcome = f"{exc.reason.value}: {exc.message}"
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                await trio.sleep(0.05)  # the server notices the cut
                out.append((name, outcome, peak, fake.sent))
            await client.aclose()
            nursery.cancel_scope.cancel()
        return out

    for name, outcome, peak, sent in trio.run(main):
        print(f"{name}: {outcome[:90]} peak {peak / 2**20:.1f} MiB, node sent {sent / 2**20:.1f} MiB")
        assert outcome.startswith("node_error: liar sent a reply"), (name, outcome)
        assert peak < 4 * MAX_CONTROL_BYTES, (name, peak)  # before: the whole 48 MiB, buffered
        assert sent < _HUGE // 2, (name, sent)


def test_an_encoded_node_reply_is_refused_as_its_fault_by_either_capped_reader() -> None:
    """Replies are asked for unencoded, as an encoded one could expand past its cap: a node that sends a gzip
    body anyway fails the gateway's control call (NodeClient, on the seam's pool) and the tracker's proof
    (read_capped, on httpx) as node_error, naming it."""
    from dgr.artifact.proof import Challenge
    from dgr.backends.base import LayerRange
    from dgr.errors import PeerError
    from dgr.seam.types import ModelInfo
    from dgr.tracker.proofs import Prover
    from dgr.tracker.registry import NodeEntry
    from dgr.tracker.seam_client import NodeClient

    body = gzip.compress(json.dumps({"node": "x"}).encode())
    fake = _FakeNode(lambda path: ([b"Content-Type: application/json", b"Content-Encoding: gzip",
                                    b"Content-Length: %d" % len(body)], [body]))
    info = ModelInfo(name="m", architecture="llama", n_layers=30, hidden_size=8, seam_width=8, vocab_size=10,
                     context_length=64, digest="d" * 64)

    async def main() -> tuple[str, str | None]:
        async with trio.open_nursery() as nursery:
            url = await fake.start(nursery)
            client = NodeClient("zipper", url)
            try:
                await client.status()
                control = "answered"
            except PeerError as exc:
                control = f"{exc.reason.value}: {exc.message}"
            await client.aclose()
            prover = Prover(deadline_s=20.0)
            await nursery.start(prover.run)
            entry = NodeEntry(node_id="zipper", url=url, start=0, stop=30, backend="stub", model=info, capacity=4,
                              describe={}, registered_at=0.0, last_seen=0.0)
            _, why = await prover._ask(entry, None, Challenge("m", LayerRange(0, 30), 0, 0))  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()
        return control, why

    control, why = trio.run(main)
    assert control == "node_error: zipper sent a reply encoded 'gzip', unasked", control
    assert why == "zipper sent a reply encoded 'gzip', unasked", why


@pytest.mark.parametrize("tokens, words", [
    ([1, 2, -1], "token id '-1'"),
    ([1, 300], "token id '300'"),  # the vocabulary is 300: ids 0..299
    ([1, "7"], "token id '7'"),
    ([True, 1], "token id 'True'"),
    ([1.0], "token id '1.0'"),
    (list(range(5)) * 1000, "into 5000 tokens"),  # "hi" cannot make 5,000 tokens
    ("1 2 3", "into str"),
    (None, "into NoneType"),
])
def test_a_lying_heads_token_ids_are_refused_as_its_fault(tokens, words) -> None:
    from dgr.errors import PeerError
    from dgr.seam.opening import OpenRequest, PromptPlan
    from dgr.tracker.seam_client import NodeClient

    opened = {"session": "a" * 32, "node": "n", "prefix_positions": 0}
    fake = _FakeNode(lambda path: _json_reply({**opened, "tokens": tokens}), b"201 Created")
    honest = _FakeNode(lambda path: _json_reply({**opened, "tokens": [1, 299]}), b"201 Created")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            liar, ok = NodeClient("liar", await fake.start(nursery)), NodeClient("ok", await honest.start(nursery))
            req = OpenRequest("a" * 32, 64, _TAIL, prompt=PromptPlan.of({"prompt": "hi"}, max_new=1,
                                                                 max_prompt=None))
            with pytest.raises(PeerError) as err:
                await liar.open(req, vocab_size=300)
            assert err.value.reason is Reason.NODE_ERROR and err.value.details.get("node") == "liar"
            assert err.value.message.startswith("liar ") and words in err.value.message, err.value.message
            assert (await ok.open(req, vocab_size=300)).tokens == [1, 299]
            await liar.aclose(), await ok.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_an_oversize_proof_answer_fails_the_challenge_unread() -> None:
    """A node answers its layer-possession challenge with 48 MiB: the tracker reads 1 MiB and fails the claim."""
    from dgr.artifact.proof import Challenge
    from dgr.backends.base import LayerRange
    from dgr.seam.types import ModelInfo
    from dgr.tracker.proofs import Prover
    from dgr.tracker.registry import NodeEntry

    fake = _FakeNode(lambda path: ([b"Content-Type: application/json", b"Transfer-Encoding: chunked"],
                                   _chunked(_HUGE)))
    info = ModelInfo(name="m", architecture="llama", n_layers=30, hidden_size=8, seam_width=8, vocab_size=10,
                     context_length=64, digest="d" * 64)

    async def main() -> tuple[str | None, str | None]:
        async with trio.open_nursery() as nursery:
            url = await fake.start(nursery)
            prover = Prover(deadline_s=20.0)
            await nursery.start(prover.run)
            entry = NodeEntry(node_id="liar", url=url, start=0, stop=30, backend="stub", model=info, capacity=4,
                              describe={}, registered_at=0.0, last_seen=0.0)
            got = await prover._ask(entry, None, Challenge("m", LayerRange(0, 30), 0, 0))  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()
        return got

    verdict, why = trio.run(main)
    assert verdict is None and why == "liar sent a reply over 1048576 bytes", why
    assert fake.sent < _HUGE // 2


def test_an_oversize_seam_answer_breaks_the_connection_at_its_cap() -> None:
    """The seam's own client (a step's answer, a stream's refusal) reads no more than `max_answer` either."""
    from dgr.seam.transport import ConnectionPool, TransportError

    fake = _FakeNode(lambda path: ([b"Content-Type: application/x-dgr-seam", b"Transfer-Encoding: chunked"],
                                   _chunked(_HUGE)))

    async def main() -> str:
        async with trio.open_nursery() as nursery:
            pool = ConnectionPool(await fake.start(nursery), max_answer=1 << 20)
            with pytest.raises(TransportError) as err, trio.fail_after(30):
                await pool.request("POST", "/v1/seam/deliver", b"x")
            await pool.aclose()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return str(err.value)

    assert trio.run(main) == "the answer exceeds 1048576 bytes"
    assert fake.sent < _HUGE // 2


# -- the open node status shows aggregates only -------------------------------------------------------------------

_COUNTERS = {"seam", "scheduler", "prefix", "snapshots", "ring_phases"}


def test_the_open_node_status_does_not_time_each_request(route) -> None:
    """Polled by anyone, the per-kind counters gave each request's prompt (prefill bytes) and output (decode
    frames); now they need the tracker's capability for them, and the open answer is aggregates only."""
    import uuid

    from dgr.seam.wire import STATUS_SCOPE

    url = route.node("node1")["url"]
    before = route.node_status("node1")["seam"]
    r = httpx.post(f"{route.api}/completions", json={"model": "stub", "prompt": "a" * 50, "max_tokens": 7},
                   timeout=30)
    assert r.status_code == 200, r.text
    full = route.node_status("node1")  # the tracker's view (and the harness's, which holds its key)
    assert full["seam"]["frames_in"]["DECODE"] - before["frames_in"].get("DECODE", 0) == 6  # the output, counted
    member = route.capability(uuid.uuid4().hex, "node1")  # a route member's capability for its own session
    forged = route.capability(STATUS_SCOPE, "node1", identity=Identity.generate())
    for headers in ({}, member, forged):
        seen = httpx.get(f"{url}/v1/node/status", headers=headers).json()
        assert not _COUNTERS & set(seen), (headers, sorted(seen))
        assert {"sessions", "capacity", "kv_bytes", "layers", "node"} <= set(seen)
    # asking is no refused seam call: the forbidden count is what it was
    assert route.node_status("node1")["seam"]["refused"] == full["seam"]["refused"]


def test_a_node_without_a_tracker_shows_its_counters_on_loopback() -> None:
    """A development node (no tracker, loopback) has no key to ask with: `dgr up`-less tools read it whole."""
    from dgr.backends.base import LayerRange
    from dgr.backends.stub import StubBackend, StubSpec
    from dgr.node.service import NodeService

    free = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="dev")
    assert free.status_detail(None)
    guarded = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0", joining=True)
    assert not guarded.status_detail(None)
