"""The low findings of issue 40 (spec/security.md, trust v2): each attack, as it was run, now refused.

Registry and model-list attacks run against a real route (`dgr up` with a join
token, the harness acting as an admitted node or a stranger); the tracker's
reads of node replies run against fake nodes, real HTTP servers on loopback
that lie; the phase-group hold is a pure function, driven as a stalled session
would drive it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from dgr.errors import CallerError, Reason
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
                          headers=route.signed("/v1/nodes/heartbeat", body, identity=stranger, join=False))

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
