"""Joining from another machine, over loopback: reachable addresses and TLS, with real processes.

- A node bound to 0.0.0.0 is recorded at the address the tracker saw it come
  from (127.0.0.1 here), not at 0.0.0.0, and node and tracker warn that no
  other machine reaches it there; `--advertise` names the address outright
  (with the bound port when it gives none).
- With `--tls-cert/--tls-key` the tracker and nodes serve https: nodes trust
  the tracker through `--tls-ca`, the tracker (and a chain's nodes) pin the
  certificate each node registered, so every hop of a star or chain route,
  a chain's answers and the membership messages all go over TLS. A node that does not
  trust the tracker's certificate does not join. The certificates are
  self-signed, made here with `cryptography`.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dgr.procs import dgr_command, die_with_parent
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret
from dgr.serve import READY_PREFIX
from dgr.testing.harness import LocalRoute

READY_S = 120.0  # a bound on a loaded machine's start-up, not a timing claim


@attrs.define
class Proc:
    popen: subprocess.Popen
    lines: list[str] = attrs.field(factory=list)
    ready: dict[str, Any] | None = None
    _event: threading.Event = attrs.field(factory=threading.Event)

    @classmethod
    def start(cls, args: list[str], env: dict[str, str]) -> "Proc":
        popen = subprocess.Popen(dgr_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, preexec_fn=die_with_parent)
        proc = cls(popen)
        threading.Thread(target=proc._pump, daemon=True).start()
        return proc

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip())
            if self.ready is None and line.startswith(READY_PREFIX):
                self.ready = json.loads(line[len(READY_PREFIX):])
            self._event.set()

    def wait_for(self, predicate, what: str) -> None:
        deadline = time.monotonic() + READY_S
        while not predicate():
            self._event.wait(0.1)
            self._event.clear()
            if self.popen.poll() is not None and not predicate():
                raise AssertionError(f"exited before {what}:\n" + "\n".join(self.lines[-30:]))
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what}:\n" + "\n".join(self.lines[-30:]))

    def wait_ready(self) -> dict[str, Any]:
        self.wait_for(lambda: self.ready is not None, "ready line")
        return self.ready

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (JOIN_ENV, API_KEYS_ENV)}
    return {**env, **extra}


def test_a_wildcard_node_is_reached_at_the_address_the_tracker_saw(tmp_path: Path, procs) -> None:
    with LocalRoute(nodes=1) as route:
        env = _env(**{JOIN_ENV: route.join_token})
        # plain http, as before links off loopback were encrypted by default: this test is about addresses
        common = ["--tracker", route.url, "--backend", "stub", "--layers", "0:30", "--threads", "1", "--insecure"]
        wild = Proc.start(["node", *common, "--host", "0.0.0.0", "--name", "wild",
                           "--identity", str(tmp_path / "wild.key")], env)
        named = Proc.start(["node", *common, "--host", "0.0.0.0", "--name", "named", "--advertise", "http://localhost",
                            "--identity", str(tmp_path / "named.key")], env)
        procs += [wild, named]
        for p in (wild, named):
            p.wait_ready()
        port = int(wild.ready["bound"].rpartition(":")[2])
        assert wild.ready["bound"].startswith("http://0.0.0.0:")
        assert route.node("wild")["url"] == wild.ready["url"] == f"http://127.0.0.1:{port}"
        assert any("reaches this node at http://127.0.0.1" in line for line in wild.lines)
        # bound to every interface but registered over loopback: both ends warn that no other machine reaches it
        assert any("warning: bound to every interface, but registered over loopback" in line for line in wild.lines)
        assert not any("registered over loopback" in line for line in named.lines)  # named by --advertise
        deadline = time.monotonic() + 10
        while not any("node wild bound every interface but registered over loopback" in line
                      for line in route.log_lines):
            assert time.monotonic() < deadline, "\n".join(route.log_lines[-20:])
            time.sleep(0.1)
        # dgr up's own node binds 127.0.0.1 on purpose: no warning for it
        assert all("node wild " in line for line in route.log_lines if "registered over loopback" in line)
        named_port = int(named.ready["bound"].rpartition(":")[2])
        assert route.node("named")["url"] == named.ready["url"] == f"http://localhost:{named_port}"
        # and it really is reachable there
        assert httpx.get(f"{route.node('wild')['url']}/healthz", timeout=5).json()["node"] == "wild"


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files (key mode 600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def test_a_route_runs_over_tls(tmp_path: Path, procs) -> None:
    token = new_secret()
    env = _env(**{JOIN_ENV: token})
    t_cert, t_key = _self_signed(tmp_path, "tracker")
    tracker = Proc.start(["tracker", "--port", "0", "--tls-cert", str(t_cert),
                          "--tls-key", str(t_key), "--identity", str(tmp_path / "tracker.id")], env)
    procs.append(tracker)
    url = tracker.wait_ready()["url"]
    assert url.startswith("https://127.0.0.1:")
    # a node that does not trust the tracker's certificate does not join; it says why and keeps trying
    stranger = Proc.start(["node", "--tracker", url, "--backend", "stub", "--layers", "0:15", "--threads", "1",
                           "--name", "stranger", "--identity", str(tmp_path / "stranger.id")], env)
    procs.append(stranger)
    stranger.wait_for(lambda: any("CERTIFICATE_VERIFY_FAILED" in line for line in stranger.lines),
                      "a certificate refusal")
    for i, layers in enumerate(("0:15", "15:30")):
        cert, key = _self_signed(tmp_path, f"node{i}")
        node = Proc.start(["node", "--tracker", url, "--backend", "stub", "--layers", layers, "--threads", "1",
                           "--name", f"node{i}", "--tls-cert", str(cert), "--tls-key", str(key),
                           "--tls-ca", str(t_cert), "--identity", str(tmp_path / f"node{i}.id")], env)
        procs.append(node)
        assert node.wait_ready()["url"].startswith("https://127.0.0.1:")
    trust = ssl.create_default_context(cafile=str(t_cert))
    with httpx.Client(verify=trust, timeout=30) as client:
        table = {n["node"]: n for n in client.get(f"{url}/v1/nodes").json()["nodes"]}
        assert "stranger" not in table
        assert all(table[f"node{i}"]["url"].startswith("https://") and table[f"node{i}"]["tls"] for i in (0, 1))
        r = client.post(f"{url}/v1/completions", json={"model": "stub", "prompt": "over tls", "max_tokens": 6})
        assert r.status_code == 200, r.text
        assert [h["node"] for h in r.json()["dgr"]["telemetry"]["route"]] == ["node0", "node1"]
        assert r.json()["usage"]["completion_tokens"] == 6
    # a node serves TLS only: plain http to it gets no answer
    with pytest.raises(httpx.HTTPError):
        httpx.get(table["node1"]["url"].replace("https://", "http://") + "/healthz", timeout=5)


def test_require_tls_and_tracker_keys_between_real_processes(tmp_path: Path, procs) -> None:
    """Issue 40, item 7, with real processes: a --require-tls tracker refuses a node that registers an
    http:// URL; a node given --tracker-key refuses a tracker with another key, naming both; a node that
    joined pins the tracker's key beside its identity, and after both restart it refuses a tracker at the
    same address that answers with another key, saying how to reset the pin."""
    from dgr.security.identity import Identity

    env = _env(**{JOIN_ENV: new_secret()})
    t_cert, t_key = _self_signed(tmp_path, "tracker")
    n_cert, n_key = _self_signed(tmp_path, "node")

    def tracker(identity: str, port: int = 0) -> Proc:
        p = Proc.start(["tracker", "--port", str(port), "--require-tls", "--tls-cert", str(t_cert),
                        "--tls-key", str(t_key), "--identity", str(tmp_path / identity)], env)
        procs.append(p)
        p.wait_ready()
        return p

    def node(name: str, *extra: str, tls: bool = True) -> Proc:
        args = ["node", "--tracker", url, "--backend", "stub", "--layers", "0:30", "--threads", "1", "--name", name,
                "--tls-ca", str(t_cert), "--identity", str(tmp_path / f"{name}.key"), *extra]
        if tls:
            args += ["--tls-cert", str(n_cert), "--tls-key", str(n_key), "--require-tls"]
        p = Proc.start(args, env)
        procs.append(p)
        return p

    first = tracker("tracker.id")
    url, key = first.ready["url"], first.ready["key"]
    plain = node("plain", tls=False)  # serves http: the tracker must not hand it out as a next hop
    plain.wait_for(lambda: any("this tracker requires TLS (--require-tls)" in line for line in plain.lines),
                   "the tracker's refusal of an http:// registration")
    other = Identity.generate().public_text
    wary = node("wary", "--tracker-key", other)
    wary.wait_for(lambda: any("answered with key" in line for line in wary.lines), "a tracker key refusal")
    said = next(line for line in wary.lines if "answered with key" in line)
    assert key in said and other in said and wary.ready is None
    good = node("good")
    assert good.wait_ready()["url"].startswith("https://")
    pinned = json.loads((tmp_path / "good.tracker").read_text())
    assert pinned == {"trackers": {url: key}} and (tmp_path / "good.tracker").stat().st_mode & 0o777 == 0o600
    with httpx.Client(verify=ssl.create_default_context(cafile=str(t_cert)), timeout=10) as client:
        table = {n["node"]: n for n in client.get(f"{url}/v1/nodes").json()["nodes"]}
    assert set(table) >= {"good"} and "plain" not in table
    # both restart; the tracker with another key at the same address
    for p in (good, first):
        p.stop()
    second = tracker("tracker2.id", port=int(url.rpartition(":")[2]))
    assert second.ready["url"] == url and second.ready["key"] != key
    again = node("good")
    again.wait_for(lambda: any("answered with key" in line for line in again.lines), "a pinned key refusal")
    said = next(line for line in again.lines if "answered with key" in line)
    assert second.ready["key"] in said and key in said and f"delete {tmp_path / 'good.tracker'}" in said
    assert again.ready is None


@pytest.mark.llama
def test_a_node_given_only_its_memory_serves_the_layers_the_tracker_assigns(manifest, tmp_path: Path,
                                                                             procs) -> None:
    """`dgr node --manifest M --memory SIZE` with no --layers: the tracker prices the ranges with the planner's
    cost model and the node serves, proves and is routed on the range it was given. Over TLS, so the
    assignment, the layer-possession challenges (pinned to the node's registered certificate) and the
    route all go over https."""
    from dgr.plan import PlanParams
    from dgr.plan.sources import layout_from_manifest
    from dgr.tracker.assign import assign_layers

    path = tmp_path / "m.json"
    manifest.save(path)
    layout = layout_from_manifest(manifest.to_json())
    params = PlanParams(context=256, sessions=1)
    memory = 200 * 2**20
    want = assign_layers(layout, params, memory, [0] * layout.n_layers).layers
    assert 0 < len(want) < layout.n_layers  # the memory holds part of the model, not all of it
    env = _env()
    t_cert, t_key = _self_signed(tmp_path, "tracker")
    n_cert, n_key = _self_signed(tmp_path, "node")
    tracker = Proc.start(["tracker", "--port", "0", "--manifest", str(path), "--tls-cert", str(t_cert),
                          "--tls-key", str(t_key), "--identity", str(tmp_path / "tracker.id")], env)
    procs.append(tracker)
    url = tracker.wait_ready()["url"]
    node = Proc.start(["node", "--tracker", url, "--manifest", str(path), "--memory", str(memory),
                       "--backend", "llama_shard", "--ctx", "256", "--max-sessions", "1", "--threads", "1",
                       "--name", "sized", "--tls-cert", str(n_cert), "--tls-key", str(n_key), "--tls-ca", str(t_cert),
                       "--identity", str(tmp_path / "node.id")], env)
    procs.append(node)
    assert node.wait_ready()["layers"] == str(want)
    assert any(f"the tracker assigned layers {want}" in line for line in node.lines)
    table = httpx.get(f"{url}/v1/nodes", timeout=5, verify=ssl.create_default_context(cafile=str(t_cert))).json()
    entry = {n["node"]: n for n in table["nodes"]}["sized"]
    assert entry["url"].startswith("https://") and entry["layers"] == str(want)
    assert entry["proof"]["state"] == "passed" and entry["proof"]["challenges"] == 8


def test_http_clients_share_one_default_trust_and_https_gets_its_own() -> None:
    """httpx builds its CA bundle for every client (about 60 ms of CPU), even one that only calls http://."""
    from dgr.security.tls import TlsTrust, httpx_default_trust

    trust = TlsTrust()
    assert trust.httpx_verify("http://a:1") is trust.httpx_verify("http://b:2") is httpx_default_trust()
    assert trust.httpx_verify("https://a:1") is not httpx_default_trust()
