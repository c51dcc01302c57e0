"""Attacks on a real route (spec/security.md): each is refused with its reason code and changes nothing.

The route is `dgr up` with the join token and key folder the harness made, so
the test can act as the tracker (mint capabilities with its key), as a node
that joins (sign registrations with a key of its own), and as an attacker
(forge, replay, reuse them out of place, sign with a node's key or with the
old shared cluster secret).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from dgr.procs import dgr_command
from dgr.serve import READY_PREFIX
from dgr.security.identity import Identity, node_id_for
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret
from dgr.seam.frame import encode_frame
from dgr.seam.wire import NODE_HEADER, FrameKind
from dgr.testing.harness import LocalRoute, stream_steps

W = 576  # the default stub's seam width


@pytest.fixture(scope="module")
def route():
    with LocalRoute(nodes=2) as r:
        yield r


def _frame(sid: str, seq: int, pos0: int, n: int) -> bytes:
    """A PREFILL frame for node1 (not the head: hidden states only)."""
    return encode_frame(FrameKind.PREFILL, sid, seq, pos0, n, W, hidden=np.full((n, W), 0.25, np.float32))


def _state(route: LocalRoute, url: str, sid: str) -> tuple[int, int, int, int]:
    """(sessions, kv_bytes, positions, next_seq) on a node, read with a valid capability."""
    status = route.http.get(f"{url}/v1/node/status", timeout=5).json()
    s = route.http.get(f"{url}/v1/seam/sessions/{sid}", headers=route.capability(sid, "node1"), timeout=5).json()
    return status["sessions"], status["kv_bytes"], s["positions"], s["next_seq"]


def _refused(r: httpx.Response, status: int, code: str, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and words in err["message"], err


@pytest.fixture
def victim(route: LocalRoute):
    """A live session on node1, opened and prefilled (4 positions) the way the gateway does it."""
    url = route.node("node1")["url"]
    sid = uuid.uuid4().hex
    cap = route.capability(sid, "node1")
    raw, headers = route.opening(sid, "node1", {"max_positions": 64, "relay": route.relay(sid, "node1")})
    assert httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers).status_code == 201
    first = _frame(sid, 0, 0, 4)
    assert stream_steps(url, sid, [first], cap).status_code == 200
    # a stream is answered once its frames are admitted, not computed; a session's status call queues behind
    # its steps, so this returns once the prefill holds its KV (the tests compare state before and after)
    s = httpx.get(f"{url}/v1/seam/sessions/{sid}", headers=cap, timeout=10).json()
    assert s["positions_computed"] == 4, s
    yield url, sid, first
    httpx.delete(f"{url}/v1/seam/sessions/{sid}", headers=cap)


def test_seam_calls_without_a_valid_capability_are_forbidden_and_change_nothing(route, victim) -> None:
    url, sid, _ = victim
    before = _state(route, url, sid)
    assert before[2:] == (4, 1)
    refused_before = route.node_status("node1")["seam"]["refused"].get("forbidden", 0)
    good = route.capability(sid, "node1")["X-Dgr-Capability"]
    body, _, sig = good.partition(".")
    other_sid = uuid.uuid4().hex
    a_node = Identity.load(route.keys / "node0.key", create=False)  # a member of the route, not its tracker
    attacks = {
        "no capability": ({}, "capability is required"),
        "forged: signed by a node's own key": (route.capability(sid, "node1", identity=a_node), "does not verify"),
        "forged: signed by the node that checks it": (
            route.capability(sid, "node1", identity=Identity.load(route.keys / "node1.key", create=False)),
            "does not verify"),
        "forged: the old shared cluster secret's MAC": (
            {"X-Dgr-Capability": _shared_secret_capability(new_secret().encode(), sid, "node1", 15, 30)},
            "does not verify"),
        "altered: payload swapped under the signature": (
            {"X-Dgr-Capability": route.capability(other_sid, "node1")["X-Dgr-Capability"].partition(".")[0]
             + "." + sig}, "does not verify"),
        "malformed": ({"X-Dgr-Capability": "!!!." + sig}, "malformed"),
        "expired": (route.capability(sid, "node1", ttl_s=-5), "expired"),
        "another session": (route.capability(other_sid, "node1"), "another Route Session"),
        "another layer range": (route.capability(sid, "node1", layers=(0, 15)), "another node or layer range"),
        "another node": (route.capability(sid, "node1", node="node0"), "another node or layer range"),
    }
    nxt = _frame(sid, 1, 4, 2)
    for name, (headers, words) in attacks.items():
        _refused(stream_steps(url, sid, [nxt], headers), 403, "forbidden", words)
        _refused(httpx.get(f"{url}/v1/seam/sessions/{sid}", headers=headers), 403, "forbidden", words)
        _refused(httpx.delete(f"{url}/v1/seam/sessions/{sid}", params={"reason": "cancelled"}, headers=headers),
                 403, "forbidden", words)
        assert _state(route, url, sid) == before, name
    # opening a session needs one too (and the tracker's ticket, tests/test_tickets.py), and a refused open
    # leaves no trace: the id stays usable
    fresh = uuid.uuid4().hex
    raw, ok = route.opening(fresh, "node1", {"max_positions": 8, "relay": route.relay(fresh, "node1")})
    for cap_headers, words in [({}, "required"), (route.capability(sid, "node1"), "another Route Session"),
                               (route.capability(fresh, "node1", ttl_s=-1), "expired")]:
        headers = {k: v for k, v in ok.items() if k != "X-Dgr-Capability"} | cap_headers
        _refused(httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=headers), 403, "forbidden", words)
    assert _state(route, url, sid) == before
    assert httpx.post(f"{url}/v1/seam/sessions", content=raw, headers=ok).status_code == 201
    assert httpx.delete(f"{url}/v1/seam/sessions/{fresh}", headers=ok).status_code == 200
    # tokenizing at the head is work for a session: it happens inside an open, guarded the same way
    head, prompted = route.node("node0")["url"], uuid.uuid4().hex
    raw, ok = route.opening(prompted, "node0", {"max_positions": 64, "prompt": {"prompt": "x"}, "max_new": 1,
                                                 "relay": route.relay(prompted, "node0")})
    no_cap = {k: v for k, v in ok.items() if k != "X-Dgr-Capability"}
    _refused(httpx.post(f"{head}/v1/seam/sessions", content=raw, headers=no_cap), 403, "forbidden", "required")
    r = httpx.post(f"{head}/v1/seam/sessions", content=raw, headers=ok)
    assert r.status_code == 201 and r.json()["tokens"]
    assert httpx.delete(f"{head}/v1/seam/sessions/{prompted}", headers=ok).status_code == 200
    refused = route.node_status("node1")["seam"]["refused"]["forbidden"]
    assert refused - refused_before == 3 * len(attacks) + 3
    # and the session still works for its rightful holder
    assert stream_steps(url, sid, [nxt], route.capability(sid, "node1")).status_code == 200
    assert _state(route, url, sid)[2:] == (6, 2)


def _shared_secret_capability(secret: bytes, sid: str, node: str, start: int, stop: int) -> str:
    """A capability as the old cluster-secret model made them (any node holding the secret could)."""
    key = hmac.new(secret, b"dgr/v1/capability", hashlib.sha256).digest()
    payload = json.dumps({"s": sid, "n": node, "l": [start, stop], "e": time.time() + 60},
                         sort_keys=True, separators=(",", ":")).encode()
    mac = hmac.new(key, len(payload).to_bytes(8, "big") + payload, hashlib.sha256).hexdigest()
    return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + mac


def test_replayed_frame_is_refused_and_changes_nothing(route, victim) -> None:
    url, sid, first = victim
    before = _state(route, url, sid)
    # a captured frame sent again, even with a valid capability, is a replay of step 0
    _refused(stream_steps(url, sid, [first], route.capability(sid, "node1")), 409, "step_out_of_order", "replayed")
    assert _state(route, url, sid) == before


def _registration(name: str, model: str = "ghost-model") -> bytes:
    info = {"name": model, "architecture": "stub", "n_layers": 30, "hidden_size": 576, "seam_width": 576,
            "vocab_size": 300, "context_length": 4096, "digest": "0" * 64}
    return json.dumps({"node": name, "url": "http://127.0.0.1:9", "pid": None, "layers": [0, 30], "backend": "stub",
                       "model": info, "capacity": 4, "describe": {}}).encode()


def _registry(route: LocalRoute) -> dict[str, tuple]:
    return {n["node"]: (n["url"], n["layers"], n["alive"], n["model"]) for n in route.node_table()}


def test_registration_needs_a_signature_and_admission(route) -> None:
    path = "/v1/nodes/register"
    before = _registry(route)
    body = _registration("intruder", model="stub")  # would take over every stub route if accepted
    cases = [
        ({"Content-Type": "application/json"}, "unauthenticated", "must be signed"),
        (route.signed(path, body, join=False), "unauthenticated", "not admitted"),  # a valid key, no join token
        (route.signed(path, body, join_token=new_secret()), "unauthenticated", "join token"),  # another cluster's
        ({**route.signed(path, body), "X-Dgr-Nonce": "0" * 32}, "unauthenticated", "bad signature"),  # nonce swapped
        ({**route.signed(path, body), "X-Dgr-Key": Identity.generate().public_text},  # key swapped under it
         "unauthenticated", "bad signature"),
        (route.signed(path, body.replace(b"127.0.0.1:9", b"127.0.0.1:8")), "unauthenticated", "bad signature"),
        (route.signed("/v1/nodes/heartbeat", body), "unauthenticated", "bad signature"),  # signed for another path
    ]
    for headers, code, words in cases:
        _refused(httpx.post(f"{route.url}{path}", content=body, headers=headers), 401, code, words)
    beat = json.dumps({"node": "node0", "sessions": 99, "kv_bytes": 1}).encode()
    _refused(httpx.post(f"{route.url}/v1/nodes/heartbeat", content=beat,
                        headers={"Content-Type": "application/json", NODE_HEADER: "node0"}),
             401, "unauthenticated", "must be signed")
    assert _registry(route) == before
    assert route.node("node0")["sessions"] != 99
    r = httpx.post(f"{route.api}/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and [h["node"] for h in r.json()["dgr"]["telemetry"]["route"]] == ["node0", "node1"]


def test_a_node_id_is_never_taken_over(route) -> None:
    """An admitted key (it holds the join token) still cannot speak for another node's id."""
    before = _registry(route)
    owner = route.node("node1")["key"]
    intruder = Identity.generate()
    assert owner and owner != intruder.public_text
    for name in ("node1", node_id_for(Identity.generate().public)):  # a chosen name; an id derived from another key
        body = _registration(name, model="stub")
        r = httpx.post(f"{route.url}/v1/nodes/register", content=body,
                       headers=route.signed("/v1/nodes/register", body, identity=intruder))
        _refused(r, 409, "identity_taken", "belongs to another key")
    beat = json.dumps({"node": "node1", "sessions": 99, "kv_bytes": 1, "session_ids": []}).encode()
    r = httpx.post(f"{route.url}/v1/nodes/heartbeat", content=beat,
                   headers={**route.signed("/v1/nodes/heartbeat", beat, identity=intruder, join=False),
                            NODE_HEADER: "node1"})
    _refused(r, 404, "not_found", "is not registered")  # as for an unknown id: no oracle (tests/test_trust_lows.py)
    assert _registry(route) == before and route.node("node1")["key"] == owner
    assert route.node("node1")["sessions"] != 99
    # the same key registering its own id is fine: that is a restart
    mine = _registration(intruder.node_id)
    r = httpx.post(f"{route.url}/v1/nodes/register", content=mine,
                   headers=route.signed("/v1/nodes/register", mine, identity=intruder))
    assert r.status_code == 200 and r.json()["node"] == intruder.node_id, r.text
    assert r.json()["tracker_key"] == route.tracker_identity.public_text


def test_replayed_signed_registration_is_refused(route) -> None:
    path = "/v1/nodes/register"
    body = _registration("ghost")
    captured = route.signed(path, body)
    assert httpx.post(f"{route.url}{path}", content=body, headers=captured).status_code == 200
    # no heartbeats follow, so the tracker declares it dead; a replay would bring it back
    deadline = time.monotonic() + 60  # a bound on waiting, not a timing claim
    while route.node("ghost")["alive"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    before = _registry(route)
    _refused(httpx.post(f"{route.url}{path}", content=body, headers=captured), 401, "replayed", "already used")
    # an old signature that was never used is refused too: past the skew window it counts as a replay
    stale = route.signed(path, body, now=time.time() - 120)
    _refused(httpx.post(f"{route.url}{path}", content=body, headers=stale), 401, "replayed", "off")
    assert _registry(route) == before and not route.node("ghost")["alive"]


def test_node_with_the_wrong_join_token_says_why_and_keeps_retrying(route, tmp_path) -> None:
    """A 401 is not final (the tracker may come back with the node's token): it is logged and retried."""
    env = {**os.environ, JOIN_ENV: new_secret()}
    p = subprocess.Popen(dgr_command("node", "--tracker", route.url, "--layers", "0:15", "--backend", "stub",
                                     "--name", "impostor", "--threads", "1", "--identity", str(tmp_path / "k")),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in p.stderr:  # wait for the second refusal: the node retried after the first
            if "refused this node" in line:
                said.append(line)
                if len(said) == 2:
                    break
        assert p.poll() is None, "the node stopped"
        assert "refused this node (unauthenticated)" in said[0] and "bad join proof" in said[0]
        assert "retrying in" in said[0] and "retrying in" in said[1]
        assert "impostor" not in _registry(route)
    finally:
        p.terminate()
        p.wait(timeout=15)


def _start(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess | None:
    """Run a process that should refuse to start; None if it became ready instead (then stopped).

    Waits for the event itself, its exit or its ready line, however long a loaded machine takes to
    get there (bounded by the whole test's patience, not by a guess at start-up time).
    """
    p = subprocess.Popen(dgr_command(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    timer = threading.Timer(120, p.kill)  # a hung start fails the test below instead of hanging it
    timer.start()
    try:
        for line in p.stdout:  # ends at EOF: the process refused and exited
            out.append(line)
            if line.startswith(READY_PREFIX):
                p.terminate()
                p.communicate(timeout=30)
                return None
        err = p.stderr.read()
        p.wait(timeout=30)
    finally:
        timer.cancel()
    return subprocess.CompletedProcess(p.args, p.returncode, "".join(out), err)


def test_exposed_tracker_and_node_refuse_to_run_open(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k not in (JOIN_ENV, API_KEYS_ENV)}
    tracker = ["tracker", "--host", "0.0.0.0", "--port", "0", "--identity", str(tmp_path / "tracker.key")]
    for env, missing in [(base, "a join token"), ({**base, JOIN_ENV: new_secret()}, "API keys"),
                         ({**base, API_KEYS_ENV: "k1"}, "a join token")]:
        done = _start(tracker, env)
        assert done is not None and done.returncode == 2 and missing in done.stderr, done
    assert _start(tracker, {**base, JOIN_ENV: new_secret(), API_KEYS_ENV: "k1"}) is None  # both: it serves
    listed = ["--allow-node", Identity.generate().public_text]
    assert _start(tracker + listed, {**base, API_KEYS_ENV: "k1"}) is None  # listed keys are an admission rule too
    done = _start(["node", "--host", "0.0.0.0", "--backend", "stub", "--layers", "0:1",
                   "--identity", str(tmp_path / "node.key")], base)
    assert done is not None and done.returncode == 2 and "needs a tracker" in done.stderr
    # secrets and keys come from files only when nobody else can read them
    loose = tmp_path / "token"
    loose.write_text(new_secret())
    loose.chmod(0o644)
    done = _start(["tracker", "--port", "0", "--join-token-file", str(loose),
                   "--identity", str(tmp_path / "tracker.key")], base)
    assert done is not None and done.returncode == 2 and "chmod 600" in done.stderr
    (tmp_path / "tracker.key").chmod(0o644)
    done = _start(["tracker", "--port", "0", "--identity", str(tmp_path / "tracker.key")], base)
    assert done is not None and done.returncode == 2 and "chmod 600" in done.stderr and "identity" in done.stderr


KEY = "sk-dgr-test-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# one key per line\nsk-other\n{KEY}\n")
    keys.chmod(0o600)
    with LocalRoute(nodes=1, extra=("--api-key-file", str(keys))) as r:
        r.api_key = KEY  # `dgr up --api-key-file` is the only source; from now on the harness sends it
        yield r


def test_api_keys_guard_the_openai_and_telemetry_endpoints(keyed) -> None:
    body = {"model": "stub", "prompt": "hi", "max_tokens": 2}
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/route-sessions"), ("GET", f"/v1/route-sessions/{'0' * 32}"),
                         ("GET", "/v1/stats"), ("GET", "/v1/nodes"), ("GET", "/metrics")]:
        for headers, words in [({}, "needs a key"), ({"Authorization": "Bearer sk-wrong"}, "incorrect API key"),
                               ({"Authorization": KEY}, "needs a key")]:
            r = httpx.request(method, f"{keyed.url}{path}", json=body if method == "POST" else None, headers=headers)
            assert r.status_code == 401, (path, r.text)
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("unauthenticated", "authentication_error") and words in err["message"]
            assert err["param"] is None and r.headers["www-authenticate"].startswith("Bearer")
    for path in ("/healthz", "/openapi.json"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200
    r = httpx.post(f"{keyed.api}/completions", json=body, headers=keyed.headers, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    ok = openai.OpenAI(base_url=keyed.api, api_key=KEY, max_retries=0)
    assert ok.completions.create(model="stub", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=keyed.api, api_key="sk-wrong", max_retries=0).models.list()
    assert info.value.code == "unauthenticated"


def test_a_keyless_tracker_answers_no_web_page(route) -> None:
    """Issue 40, browsers: a page elsewhere can POST text/plain to 127.0.0.1 without a CORS preflight, and a
    DNS-rebinding name can point at it. A keyless (loopback) tracker refuses a foreign Host or Origin and a POST
    that is not JSON, before the body is read; the OpenAI client, curl with a JSON body and the tracker's own
    dashboard (a loopback Origin) are served."""
    body = {"model": "stub", "prompt": "hi", "max_tokens": 2}
    url = f"{route.url}/v1/completions"
    for headers, code in (({"Host": "attacker.example"}, "forbidden"),
                          ({"Host": "127.0.0.1.nip.io:8000"}, "forbidden"),
                          ({"Origin": "http://attacker.example"}, "forbidden"),
                          ({"Origin": "null"}, "forbidden")):
        r = httpx.post(url, json=body, headers=headers, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == code, (headers, r.text)
    r = httpx.post(url, content=json.dumps(body), headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{route.url}/v1/models", headers={"Host": "evil.example"}, timeout=10).status_code == 403
    for headers in ({}, {"Origin": route.url}, {"Host": "localhost"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)


def test_weak_tokens_odd_timestamps_and_retry_afters_are_refused(monkeypatch) -> None:
    """Issue 40, lows and item 7: a join token of fewer than 32 random bytes (judged from its alphabet and
    length), or a repetitive one, is refused at start; a signature stamped `nan` is not
    inside the replay window (it would stay replayable forever), nor is a capability that never expires; a
    node's non-numeric Retry-After reads as 1 s, not a 500."""
    from dgr.errors import CallerError, Reason
    from dgr.security.auth import CapabilityAuthority, Signer, Verifier
    from dgr.security.secrets import load_join_token
    from dgr.tracker.seam_client import _retry_after

    import secrets

    # 16 random bytes in 32 hex digits, and 24 in 32 base64url characters, passed the old 32-character rule
    for weak in ("short-token", "a" * 64, "12" * 32, secrets.token_hex(16), secrets.token_urlsafe(24),
                 "0123456789abcdef" * 4, secrets.token_hex(8) * 4):
        monkeypatch.setenv(JOIN_ENV, weak)
        with pytest.raises(CallerError, match=r"at least 32 random bytes .*secrets.token_hex\(32\)"):
            load_join_token(None)
    for strong in (new_secret(), secrets.token_urlsafe(32)):  # dgr up's, and docs/deploy.md's
        monkeypatch.setenv(JOIN_ENV, strong)
        assert load_join_token(None) == strong.encode()

    me = Identity.generate()
    body = b"{}"
    for ts in ("nan", "inf", "-inf"):
        headers = Signer(me).headers("POST", "/v1/nodes/heartbeat", body, time.time())
        headers["X-Dgr-Timestamp"] = ts  # the signature covers it: re-sign as an attacker with its own key would
        from dgr.security import auth
        headers["X-Dgr-Signature"] = auth.b64e(me.sign(auth._REQUEST, auth._framed(
            b"POST", b"/v1/nodes/heartbeat", ts.encode(), headers["X-Dgr-Nonce"].encode(),
            headers["X-Dgr-Body-Sha256"].encode())))
        with pytest.raises(CallerError) as err:
            Verifier().check("POST", "/v1/nodes/heartbeat", body, {k.lower(): v for k, v in headers.items()}, time.time())
        assert err.value.reason is Reason.REPLAYED, ts

    issuer = CapabilityAuthority.issuer(me)
    token = issuer.issue("a" * 32, "node0", 0, 1, time.time(), ttl_s=float("nan"))
    with pytest.raises(CallerError, match="expiry"):
        issuer.check(token, session="a" * 32, node="node0", start=0, stop=1, now=time.time())

    assert [_retry_after(v) for v in ("2", "Wed, 21 Oct 2026 07:28:00 GMT", "-1", "", None, "99999")] == [2, 1, 1, 1, 1, 3600]
