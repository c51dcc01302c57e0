"""Node identities at the trio level: proof answers bound to the challenger and the answerer, key binding in the
registry, admission by join token or listed key, pinning the tracker's key, wildcard addresses. The
real-process attacks are in tests/test_security.py.

Proofs: the tracker signs each challenge and addresses it to one node with a
fresh nonce; a node answers only challenges signed by the tracker it joined
and addressed to itself, and signs its answer over the challenge. So a node
without the weights that relays its challenges to an honest node gets a
refusal, and one that passes off an honest node's answer fails its proof.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.artifact.proof import make_challenge
from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.cli import build_parser
from dgr.errors import CallerError, Reason
from dgr.node.app import make_node_app
from dgr.node.artifact import NodeArtifact
from dgr.node.membership import registration, stay_registered
from dgr.node.service import NodeService
from dgr.security.auth import Admission, CapabilityAuthority, join_proof, tracker_join_proof
from dgr.security.identity import Identity, b64e, key_from_text, node_id_for, parse_public_key
from dgr.testing.inproc import asgi_client
from dgr.tracker.proofs import Prover
from dgr.tracker.registration import reachable
from dgr.tracker.registry import NodeEntry, Registry

CLAIM = LayerRange(1, 3)


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Manifest, Path]:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)
    return build_manifest(path, piece_length=65536), path


def _node(identity: Identity, tracker: Identity, manifest: Manifest, path: Path):
    """A joined node holding the file: (its service, its app)."""
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id=identity.node_id,
                          identity=identity, joining=True)
    service.join(tracker.public)
    artifact = NodeArtifact(manifest=manifest, path=path, layers=CLAIM, partial=False)
    return service, make_node_app(service, artifact=artifact)


def _entry(registry: Registry, service: NodeService, url: str, manifest: Manifest) -> NodeEntry:
    entry = registry.register(registration(service, url), 0.0, key=service.identity.public)
    entry.manifest_id, entry.start, entry.stop = manifest.id, CLAIM.start, CLAIM.stop
    return entry


async def test_a_relayed_proof_fails(tiny) -> None:
    manifest, path = tiny
    tracker, honest, relayer = Identity.generate(), Identity.generate(), Identity.generate()
    prover = Prover.from_manifests([manifest], identity=tracker)
    registry = Registry()
    honest_service, honest_app = _node(honest, tracker, manifest, path)
    relayer_service, _ = _node(relayer, tracker, manifest, path)
    honest_entry = _entry(registry, honest_service, "http://honest.test:1", manifest)
    relayer_entry = _entry(registry, relayer_service, "http://relayer.test:1", manifest)
    challenge = make_challenge(manifest, CLAIM, random.Random(3))

    # control: the honest node proves its own claim
    async with asgi_client(honest_app, honest_entry.url) as to_honest:
        assert await prover._ask(honest_entry, manifest, challenge, to_honest) == ("ok", None)

        # 1. the relayer forwards its challenge, byte for byte, to the honest node: refused there
        verdict, why = await prover._ask(relayer_entry, manifest, challenge, to_honest)
        assert verdict is None and "HTTP 403" in why and "addressed to" in why, why

        # 2. it rewrites the challenge to name the honest node, the tracker's signed headers kept: the
        #    signature no longer holds
        async def rewrite(request: httpx.Request) -> httpx.Response:
            body = {**json.loads(request.content), "node": honest.node_id}
            signed = {k: v for k, v in request.headers.items() if k.lower().startswith("x-dgr-")}
            r = await to_honest.post("/v1/artifact/challenge", json=body, headers=signed)
            return httpx.Response(r.status_code, content=r.content, headers={"Content-Type": "application/json"})

        async with httpx.AsyncClient(transport=httpx.MockTransport(rewrite)) as relay:
            verdict, why = await prover._ask(relayer_entry, manifest, challenge, relay)
        assert verdict is None and "HTTP 403" in why and "not signed by this node's tracker" in why, why

        # 3. it gets a genuine, tracker-signed challenge for the honest node answered (the same block) and
        #    hands in that answer as its own: the signature is the honest node's, over another challenge
        async def lift(request: httpx.Request) -> httpx.Response:
            raw, signed = prover.challenge_request(prover.challenge_body(honest_entry, challenge))
            r = await to_honest.post("/v1/artifact/challenge", content=raw, headers=signed)
            assert r.status_code == 200, r.text
            return httpx.Response(200, content=r.content, headers={"Content-Type": "application/json"})

        async with httpx.AsyncClient(transport=httpx.MockTransport(lift)) as relay:
            verdict, why = await prover._ask(relayer_entry, manifest, challenge, relay)
        assert verdict is None and f"not signed by {relayer.node_id}'s key" in why, why


async def test_nodes_answer_only_their_trackers_challenges(tiny) -> None:
    manifest, path = tiny
    tracker = Identity.generate()
    node = Identity.generate()
    service, app = _node(node, tracker, manifest, path)
    entry = _entry(Registry(), service, "http://node.test:1", manifest)
    challenge = make_challenge(manifest, CLAIM, random.Random(4))
    async with asgi_client(app, entry.url) as http:
        for prover, words in [(Prover.from_manifests([manifest]), "not signed by this node's tracker"),  # unsigned
                              (Prover.from_manifests([manifest], identity=node), "not signed by this node's tracker"),
                              (Prover.from_manifests([manifest], identity=Identity.generate()), "not signed")]:
            raw, signed = prover.challenge_request(prover.challenge_body(entry, challenge))
            r = await http.post("/v1/artifact/challenge", content=raw, headers=signed)
            assert r.status_code == 403 and words in r.json()["error"]["message"], r.text
    unjoined = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id=node.node_id,
                           identity=node, joining=True)
    prover = Prover(identity=tracker)
    _, signed = prover.challenge_request(prover.challenge_body(entry, challenge))
    with pytest.raises(CallerError, match="only from the tracker it joined") as err:
        unjoined.trust.admit_challenge("POST", "/v1/artifact/challenge", {k.lower(): v for k, v in signed.items()})
    assert err.value.reason is Reason.FORBIDDEN


def test_a_node_cannot_mint_capabilities_and_pins_one_tracker_key() -> None:
    tracker, node = Identity.generate(), Identity.generate()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                          identity=node, joining=True)
    with pytest.raises(CallerError, match="not joined") as err:  # before it joins, nothing is authorized
        service.trust.authorize(None, "a" * 32)
    assert err.value.reason is Reason.FORBIDDEN
    service.join(tracker.public)
    with pytest.raises(CallerError, match="only the tracker"):
        service.authority.issue("a" * 32, "n0", 0, 30, now=0.0)
    own = CapabilityAuthority.issuer(node).issue("a" * 32, "n0", 0, 30, now=1e12)  # signed with the node's key
    with pytest.raises(CallerError, match="does not verify"):
        service.trust.authorize(own, "a" * 32)
    # the tracker's, bound to this process's boot nonce (what the node registered)
    service.trust.authorize(CapabilityAuthority.issuer(tracker).issue("a" * 32, "n0", 0, 30, now=1e12,
                                                                      boot=service.trust.boot), "a" * 32)
    with pytest.raises(CallerError, match="another key") as err:  # an impostor tracker later on
        service.join(Identity.generate().public)
    assert err.value.reason is Reason.FORBIDDEN and service.tracker_key == tracker.public


def test_registry_binds_ids_to_keys() -> None:
    registry = Registry()
    a, b = Identity.generate(), Identity.generate()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0", identity=a)
    data = registration(service, "http://127.0.0.1:9")
    registry.register(data, 0.0, key=a.public)
    for node_id in ("n0", node_id_for(b.public)):  # taken; derived from another key (not yet registered)
        with pytest.raises(CallerError) as err:
            registry.register({**data, "node": node_id}, 1.0, key=a.public if node_id != "n0" else b.public)
        assert err.value.reason is Reason.IDENTITY_TAKEN
    with pytest.raises(CallerError) as err:
        registry.heartbeat({"node": "n0"}, 1.0, key=b.public)
    assert err.value.reason is Reason.NOT_FOUND  # as for an unknown id, so heartbeats are no oracle of ids
    assert registry.nodes["n0"].key == a.public and registry.nodes["n0"].registered_at == 0.0
    registry.register({**data, "node": node_id_for(b.public)}, 2.0, key=b.public)  # its own derived id
    registry.register(data, 3.0, key=a.public)  # a restart with the same key replaces the entry
    assert registry.nodes["n0"].registered_at == 3.0


def test_wildcard_addresses_become_the_address_the_tracker_saw() -> None:
    assert reachable("http://0.0.0.0:8001", "192.0.2.7") == "http://192.0.2.7:8001"
    assert reachable("https://[::]:8001", "2001:db8::5") == "https://[2001:db8::5]:8001"
    assert reachable("0.0.0.0:6881", "192.0.2.7") == "192.0.2.7:6881"  # a seed address
    assert reachable("http://10.0.0.2:8001", "192.0.2.7") == "http://10.0.0.2:8001"  # named: kept
    assert reachable("http://0.0.0.0:8001", None) == "http://0.0.0.0:8001"
    registry = Registry()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0")
    data = {**registration(service, "http://0.0.0.0:8001"), "artifact": {"manifest_id": "m", "seed": "0.0.0.0:6881"}}
    entry = registry.register(data, 0.0, seen="192.0.2.7")
    assert (entry.url, entry.seed) == ("http://192.0.2.7:8001", "192.0.2.7:6881")


def test_the_tracker_warns_of_a_wildcard_node_recorded_at_loopback(caplog) -> None:
    """Bound to every interface to serve other machines, registered over 127.0.0.1: recorded where only this
    machine reaches it. A node bound to loopback (`dgr up`'s) or seen from the LAN is not warned of."""
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0")
    with caplog.at_level(logging.WARNING, logger="dgr.registry"):
        for url, seen in [("http://127.0.0.1:8001", "127.0.0.1"), ("http://0.0.0.0:8001", "192.0.2.7"),
                          ("http://0.0.0.0:8001", None), ("http://192.0.2.7:8001", "127.0.0.1")]:
            Registry().register(registration(service, url), 0.0, seen=seen)
        assert caplog.records == []
        for url, seen in [("http://0.0.0.0:8001", "127.0.0.1"), ("http://[::]:8001", "::1")]:
            entry = Registry().register(registration(service, url), 0.0, seen=seen)
            said = caplog.records[-1].getMessage()
            assert f"node n0 bound every interface but registered over loopback: recorded at {entry.url}" in said
            assert "--advertise" in said
    assert len(caplog.records) == 2


@pytest.mark.parametrize("sent, recorded, warned", [
    ("http://0.0.0.0:8001", "http://127.0.0.1:8001", True),
    ("http://[::]:8001", "http://[::1]:8001", True),
    ("http://0.0.0.0:8001", "http://192.0.2.7:8001", False),  # seen from the LAN
    ("http://127.0.0.1:8001", "http://127.0.0.1:8001", False),  # dgr up: bound to loopback on purpose
])
async def test_a_wildcard_node_recorded_at_loopback_warns_on_stderr(sent, recorded, warned, autojump_clock,
                                                                     capsys) -> None:
    tracker = Identity.generate()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                          identity=Identity.generate(), joining=True)

    paths: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if paths == ["/v1/nodes/register", "/v1/nodes/heartbeat"]:
            return httpx.Response(404)  # the tracker forgot us: register again
        return httpx.Response(200, json={"node": "n0", "registered": True, "proof": {"state": "none"},
                                         "tracker_key": tracker.public_text, "url": recorded, "seen": "x"})

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(stay_registered, service, "http://127.0.0.1:8000", sent,
                                              transport=httpx.MockTransport(answer)))
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert paths.count("/v1/nodes/register") == 2 and service.advertised == recorded  # registered twice, said once
    err = capsys.readouterr().err
    assert err.count("warning: bound to every interface, but registered over loopback") == int(warned)
    if warned:
        assert f"at {recorded}, which no other machine reaches" in err and "--advertise" in err


def test_admission_needs_the_token_bound_to_the_request_or_a_listed_key() -> None:
    token, member, listed = b"t" * 32, Identity.generate(), Identity.generate()
    admission = Admission(token, frozenset({listed.public}))
    signature = "sig-of-one-request"
    admission.admit(member.public, signature, join_proof(token, member.public, signature))
    admission.admit(listed.public, signature, None)  # listed: no token needed
    for public, proof, words in [
        (member.public, None, "not admitted"),
        (member.public, join_proof(b"x" * 32, member.public, signature), "bad join proof"),  # another token
        (member.public, join_proof(token, member.public, "another request"), "bad join proof"),  # lifted
        (member.public, join_proof(token, listed.public, signature), "bad join proof"),  # made for another key
    ]:
        with pytest.raises(CallerError, match=words) as err:
            admission.admit(public, signature, proof)
        assert err.value.reason is Reason.UNAUTHENTICATED
    Admission().admit(member.public, signature, None)  # an open (loopback) tracker admits every key


async def test_a_node_with_a_join_token_pins_only_a_tracker_that_holds_it(autojump_clock, caplog) -> None:
    token, tracker, node = b"t" * 32, Identity.generate(), Identity.generate()
    service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 30)), node_id="n0",
                          identity=node, joining=True)
    sent: list[tuple[str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/nodes/register":
            return httpx.Response(200, json={"ok": True, "proof": {"state": "none"}})
        signature = request.headers["x-dgr-signature"]
        sent.append((signature, request.headers["x-dgr-join"]))
        reply = {"node": "n0", "registered": True, "proof": {"state": "none"}, "tracker_key": tracker.public_text}
        vouching = [None, b"x" * 32, token][min(len(sent), 3) - 1]  # none; another token's; ours
        if vouching is not None:
            reply["tracker_proof"] = tracker_join_proof(vouching, tracker.public, signature)
        return httpx.Response(200, json=reply)

    with caplog.at_level(logging.WARNING, logger="dgr.node"):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(stay_registered, service, "http://tracker.test", "http://n.test:1",
                                                  join_token=token, transport=httpx.MockTransport(answer)))
            nursery.cancel_scope.cancel()
    assert len(sent) == 3 and service.tracker_key == tracker.public
    assert all(join == join_proof(token, node.public, sig) for sig, join in sent)
    said = [r.getMessage() for r in caplog.records if "not pinning" in r.getMessage()]
    assert len(said) == 2 and "did not prove it holds our join token" in said[0]


def test_every_public_key_text_survives_a_command_line() -> None:
    # Bare base64url starts with "-" for one key in 64, and argparse then took
    # `--allow-node -Xyz...` for an unknown option (a CI run failed that way).
    seed = 0
    while True:  # a deterministic key whose bare text starts with "-"
        dashed = Identity(Ed25519PrivateKey.from_private_bytes(seed.to_bytes(32, "big")))
        if b64e(dashed.public).startswith("-"):
            break
        seed += 1
    args = build_parser().parse_args(["tracker", "--allow-node", dashed.public_text])
    assert [parse_public_key(k) for k in args.allow_node] == [dashed.public]
    assert key_from_text(dashed.public_text) == dashed.public
    with pytest.raises(CallerError):
        parse_public_key(b64e(dashed.public))  # the bare form is refused: one spelling per key


def test_a_remembered_capability_is_still_checked_for_expiry_session_and_layers() -> None:
    tracker = Identity.generate()
    issuer, node = CapabilityAuthority.issuer(tracker), CapabilityAuthority.verifier(tracker.public)
    sid = "s" * 32
    token = issuer.issue(sid, "n0", 0, 15, now=1000.0, ttl_s=60)
    assert node.check(token, session=sid, node="n0", start=0, stop=15, now=1000.0).session == sid
    assert node.check(token, session=sid, node="n0", start=0, stop=15, now=1001.0).session == sid  # remembered
    for kwargs, says in [({"now": 1061.0}, "expired"), ({"session": "t" * 32}, "another Route Session"),
                         ({"stop": 16}, "another node or layer range"), ({"node": "n1"}, "another node")]:
        args = {"session": sid, "node": "n0", "start": 0, "stop": 15, "now": 1001.0, **kwargs}
        with pytest.raises(CallerError, match=says):
            node.check(token, **args)
    body, _, sig = token.partition(".")
    forged = body + "." + sig[:-2] + ("AA" if sig[-2:] != "AA" else "BB")
    for _ in range(2):  # a refused token is never remembered as verified
        with pytest.raises(CallerError, match="does not verify"):
            node.check(forged, session=sid, node="n0", start=0, stop=15, now=1000.0)
