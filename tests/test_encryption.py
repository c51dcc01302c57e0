"""Issue 55, item 7: every link off loopback is encrypted and mutually authenticated by default.

Real processes over loopback, where `--tls` makes a link what it is off loopback by default:
- a route whose tracker and nodes run with `--tls` and nothing else (no certificate files, no CA) runs
  over https on every link; each serves the certificate of its own identity key, and the tracker issues
  each node a member certificate at registration;
- a node's server refuses every caller that shows no certificate issued by its tracker (none, a
  self-made one, one issued by another tracker key), and the tracker's own is let in; a client that pins
  one node's certificate refuses another node answering at its address;
- a tap that records every byte between the tracker and the route's head, and between the nodes and the
  tracker, sees no prompt text on that route, and sees it on the same route run plain;
- a node pinning a tracker key refuses a tracker whose certificate holds another one, having sent it
  nothing but a handshake; at its first join (no pin), it refuses a TLS relay that passes the real
  tracker's reply through a certificate of another key;
- plain http off loopback is refused unless `--insecure`: a node's `--tracker` and `--advertise`, a
  tracker's registrations, a node's next hop; a tracker bound off loopback serves https unasked.

Each fails on the tree before: it had no `--tls` or `--insecure`, made no certificate of its own, and took
plain http anywhere.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import attrs
import httpx
import pytest
import trio

from dgr.backends.base import LayerRange
from dgr.backends.stub import StubBackend, StubSpec
from dgr.errors import CallerError, Reason
from dgr.node.app import make_node_app
from dgr.node.drain import HEAR_S
from dgr.node.membership import registration
from dgr.node.run import check_transport
from dgr.node.service import NodeService
from dgr.procs import WatchedChild, dgr_command, die_with_parent
from dgr.security.certs import LinkCert, cert_key, identity_cert, member_cert, pin_text
from dgr.security.identity import Identity
from dgr.security.pins import TrackerPin
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret
from dgr.security.tls import TlsTrust, learn_tracker, server_context
from dgr.serve import READY_PREFIX
from dgr.testing.inproc import InProcRoute, asgi_client
from dgr.tracker.app import make_tracker_app

READY_S = 60.0  # a bound on a loaded machine's start-up, not a timing claim
SECRET = "the vault code is 7319-QX-kestrel"  # in the prompt: never on an encrypted wire


def _start(args: list[str], env: dict[str, str]) -> WatchedChild:
    """`dgr ARGS` as a child whose stdout a thread keeps (its ready line in `ready`, the rest in `lines`)."""
    return WatchedChild.spawn(args[0], dgr_command(*args), env=env)


def _until(child: WatchedChild, predicate, what: str, timeout_s: float = READY_S) -> None:
    """Wait for `predicate()`, failing with the child's last words if it exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if child.popen.poll() is not None and not predicate():
            raise AssertionError(f"exited before {what}:\n" + child.output_tail())
        assert time.monotonic() < deadline, f"no {what}:\n" + child.output_tail()
        time.sleep(0.05)


@attrs.define(eq=False)
class Tap:
    """A TCP relay on loopback that keeps every byte it passes, both ways: a packet capture of one link.

    It forwards to `target`, which may be set after it starts listening (a node's port is known once it
    has registered at the tap's address); a connection made before waits for it.
    """

    server: socket.socket
    captured: bytearray = attrs.field(factory=bytearray)
    target: int | None = None
    _set: threading.Event = attrs.field(factory=threading.Event)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @classmethod
    def open(cls) -> "Tap":
        server = socket.create_server(("127.0.0.1", 0))
        tap = cls(server)
        threading.Thread(target=tap._accept, daemon=True).start()
        return tap

    @property
    def port(self) -> int:
        return self.server.getsockname()[1]

    def forward_to(self, port: int) -> None:
        self.target = port
        self._set.set()

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self.captured)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        if not self._set.wait(READY_S):
            conn.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=READY_S)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.captured += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (JOIN_ENV, API_KEYS_ENV)}
    return {**env, **extra}


@attrs.define
class Route:
    """A tracker and its nodes, started as processes, with a tap before the tracker and one before the head."""

    folder: Path
    tracker: WatchedChild
    nodes: list[WatchedChild]
    tracker_tap: Tap
    head_tap: Tap

    @property
    def url(self) -> str:
        return self.tracker.ready["url"]

    def identity(self, name: str) -> Identity:
        return Identity.load(self.folder / f"{name}.key", create=False)


def _start_route(folder: Path, procs: list, *, tls: bool, layers: tuple[str, ...]) -> Route:
    env = _env(**{JOIN_ENV: new_secret()})
    mode = ["--tls"] if tls else []
    scheme = "https" if tls else "http"
    tracker = _start(["tracker", "--port", "0", "--identity", str(folder / "tracker.key"), *mode], env)
    procs.append(tracker)
    tracker.wait_ready(READY_S)
    tracker_tap, head_tap = Tap.open(), Tap.open()
    procs += [tracker_tap, head_tap]
    tracker_tap.forward_to(int(tracker.ready["url"].rpartition(":")[2]))
    nodes = []
    for i, span in enumerate(layers):
        args = ["node", "--tracker", f"{scheme}://127.0.0.1:{tracker_tap.port}", "--backend", "stub",
                "--layers", span, "--threads", "1", "--name", f"node{i}",
                "--identity", str(folder / f"node{i}.key"), *mode]
        if i == 0:  # the head: reached through the tap
            args += ["--advertise", f"{scheme}://127.0.0.1:{head_tap.port}"]
        nodes.append(_start(args, env))
        procs.append(nodes[-1])
    for node in nodes:
        node.wait_ready(READY_S)
    head_tap.forward_to(int(nodes[0].ready["bound"].rpartition(":")[2]))
    return Route(folder, tracker, nodes, tracker_tap, head_tap)


@pytest.fixture
def procs() -> Iterator[list]:
    started: list = []
    yield started
    for p in reversed(started):
        p.stop() if isinstance(p, WatchedChild) else p.close()


@pytest.fixture(scope="module")
def tls_route(tmp_path_factory) -> Iterator[Route]:
    started: list = []
    try:
        yield _start_route(tmp_path_factory.mktemp("tls-route"), started, tls=True, layers=("0:15", "15:30"))
    finally:
        for p in reversed(started):
            p.stop() if isinstance(p, WatchedChild) else p.close()


def _tracker_trust(route: Route) -> ssl.SSLContext:
    return TlsTrust().context(identity_cert(route.identity("tracker"), "tracker"))


def _complete(route: Route, prompt: str, verify: ssl.SSLContext | bool) -> dict[str, Any]:
    r = httpx.post(f"{route.url}/v1/completions", verify=verify, timeout=30,
                   json={"model": "stub", "prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()


def _healthz(url: str, pinned: str, client: LinkCert | None) -> int | str:
    """GET /healthz over TLS trusting only `pinned`, showing `client`: the status, or how the link failed."""
    try:
        return httpx.get(f"{url}/healthz", verify=TlsTrust(client=client).context(pinned), timeout=5).status_code
    except httpx.TransportError as exc:
        return type(exc).__name__


def test_a_route_runs_over_tls_on_every_link_with_certificates_made_from_its_keys(tls_route: Route) -> None:
    route = tls_route
    tracker_id = route.identity("tracker")
    tracker_pem = identity_cert(tracker_id, "tracker")
    # the tracker serves the certificate of its own key, kept beside the key for API clients to pin
    assert route.url.startswith("https://127.0.0.1:")
    assert Path(route.tracker.ready["tls_cert"]).read_text() == tracker_pem
    assert route.tracker.ready["tls_pin"] == pin_text(tracker_pem)
    assert cert_key(tracker_pem) == tracker_id.public
    body = _complete(route, "over tls", _tracker_trust(route))
    assert [h["node"] for h in body["dgr"]["telemetry"]["route"]] == ["node0", "node1"]
    assert body["usage"]["completion_tokens"] == 8
    nodes = {n["node"]: n for n in httpx.get(f"{route.url}/v1/nodes", verify=_tracker_trust(route),
                                              timeout=5).json()["nodes"]}
    for i in (0, 1):
        assert nodes[f"node{i}"]["url"].startswith("https://127.0.0.1:") and nodes[f"node{i}"]["tls"]
        assert route.nodes[i].ready["bound"].startswith("https://127.0.0.1:")
    # plain http to a node gets nothing: it speaks TLS only
    with pytest.raises(httpx.HTTPError):
        httpx.get(route.nodes[1].ready["bound"].replace("https://", "http://") + "/healthz", timeout=5)
    # a client that reads its whole answer and hangs up costs the server no error (it once logged one for
    # each: the empty end of the answer was written to a TLS stream the client had closed)
    for _ in range(5):
        httpx.get(f"{route.url}/healthz", verify=_tracker_trust(route), timeout=5)
    time.sleep(0.5)
    assert not [line for line in route.tracker.lines if "unhandled error" in line], route.tracker.lines[-20:]


def test_a_node_lets_in_only_callers_with_a_certificate_its_tracker_issued(tls_route: Route) -> None:
    route = tls_route
    tracker_id, node0, node1 = route.identity("tracker"), route.identity("node0"), route.identity("node1")
    url = route.nodes[1].ready["bound"]
    pinned = identity_cert(node1, "node")  # what node1 registered: the certificate of its own key
    stranger, rogue = Identity.generate(), Identity.generate()
    as_tracker = LinkCert(identity_cert(tracker_id, "tracker"), tracker_id.private)
    as_member = LinkCert(member_cert(tracker_id, node0.public), node0.private)  # what node0 presents
    assert _healthz(url, pinned, as_tracker) == 200
    assert _healthz(url, pinned, as_member) == 200
    refused = {
        "no certificate": _healthz(url, pinned, None),
        "a self-made one": _healthz(url, pinned, LinkCert(identity_cert(stranger, "node"), stranger.private)),
        "another tracker's member": _healthz(url, pinned, LinkCert(member_cert(rogue, stranger.public),
                                                                  stranger.private)),
        "a member's key, self-signed": _healthz(url, pinned, LinkCert(identity_cert(node0, "node"), node0.private)),
    }
    assert all(isinstance(outcome, str) for outcome in refused.values()), refused
    # the other way: a client pinning node1 refuses node0 answering where node1 should be
    assert isinstance(_healthz(route.nodes[0].ready["bound"], pinned, as_tracker), str)
    # the registered certificates are those of the nodes' own keys, and the route still answers
    assert cert_key(pinned) == node1.public
    assert _complete(route, "still answering", _tracker_trust(route))["usage"]["completion_tokens"] == 8


def test_a_capture_between_hops_shows_the_prompt_only_on_a_plain_route(tls_route: Route, tmp_path: Path,
                                                                         procs) -> None:
    prompt = f"Please keep this safe: {SECRET}."
    plain = _start_route(tmp_path, procs, tls=False, layers=("0:30",))
    assert plain.url.startswith("http://")
    _complete(plain, prompt, True)
    on_plain = plain.head_tap.seen() + plain.tracker_tap.seen()
    assert SECRET.encode() in on_plain  # the control: a tap on a plain route reads the prompt
    before = (len(tls_route.head_tap.seen()), len(tls_route.tracker_tap.seen()))
    _complete(tls_route, prompt, _tracker_trust(tls_route))
    head, tracker = tls_route.head_tap.seen(), tls_route.tracker_tap.seen()
    assert len(head) > before[0] and len(tracker) > before[1]  # the session crossed both taps
    for wire in (head, tracker):
        assert SECRET.encode() not in wire and b"vault" not in wire and b"POST /v1" not in wire


class _Impostor:
    """A TLS server on loopback presenting the identity certificate of `key`: each connection goes to `_handle`."""

    def __init__(self, key: Identity) -> None:
        self.ctx = server_context(own=LinkCert(identity_cert(key, "tracker"), key.private))
        self.server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.server.close()


class _FakeTracker(_Impostor):
    """An impostor at the tracker's address, counting handshakes and bytes read."""

    def __init__(self, key: Identity) -> None:
        self.handshakes, self.received = 0, 0
        super().__init__(key)

    def _handle(self, conn: socket.socket) -> None:
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                self.handshakes += 1
                tls.settimeout(5)
                while data := tls.recv(4096):
                    self.received += len(data)
        except (OSError, ssl.SSLError):
            pass


def test_a_node_refuses_a_tracker_whose_certificate_holds_another_key(tmp_path: Path, procs) -> None:
    """An impostor at the tracker's address (or on the path) with a certificate of its own key: a node that
    pins the real tracker's key reads the certificate, refuses it, says why, and sends it nothing."""
    real, impostor = Identity.generate(), Identity.generate()
    fake = _FakeTracker(impostor)
    procs.append(fake)
    node = _start(["node", "--tracker", fake.url, "--tracker-key", real.public_text, "--backend", "stub",
                   "--layers", "0:30", "--threads", "1", "--identity", str(tmp_path / "node.key")],
                  _env(**{JOIN_ENV: new_secret()}))
    procs.append(node)
    _until(node, lambda: any("TLS certificate" in line and "answered with key" in line for line in node.lines),
           "the refusal of the tracker's certificate")
    said = next(line for line in node.lines if "answered with key" in line)
    assert impostor.public_text in said and real.public_text in said
    assert fake.handshakes >= 1 and fake.received == 0 and node.ready is None
    # never admitted, it has nothing routed to it: on SIGTERM it waits for no tracker to hear of its drain (it
    # waited HEAR_S, then QUIET_S, before 27b3bfa); the figure is the node's own clock, not this process's
    node.stop()
    drained = next(line for line in node.lines if "drained in" in line)
    assert float(drained.split("drained in ")[1].split("s")[0]) < HEAR_S, drained


class _TlsRelay(_Impostor):
    """An on-path attacker at a node's first join: terminates TLS with a certificate of its own key and relays
    what it reads, in clear to itself, to the real tracker over TLS."""

    def __init__(self, key: Identity, target: int) -> None:
        self.upstream = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.upstream.check_hostname, self.upstream.verify_mode = False, ssl.CERT_NONE
        self.target, self.read = target, bytearray()
        super().__init__(key)

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        try:
            near = self.ctx.wrap_socket(conn, server_side=True)
            far = self.upstream.wrap_socket(socket.create_connection(("127.0.0.1", self.target)))
        except (OSError, ssl.SSLError):
            return
        def pump(src: ssl.SSLSocket, dst: ssl.SSLSocket, keep: bool) -> None:
            try:
                while data := src.recv(65536):
                    if keep:
                        self.read += data
                    dst.sendall(data)
            except (OSError, ssl.SSLError):
                pass
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
        threading.Thread(target=pump, args=(far, near, False), daemon=True).start()
        pump(near, far, True)


def test_an_on_path_relay_at_a_first_join_is_refused(tmp_path: Path, procs) -> None:
    """A node with the join token and no pin yet (its first join) reads whatever certificate answers at the
    tracker's address. An attacker there terminates TLS with its own key and relays the registration to the
    real tracker, whose reply (and join-token proof) comes back: the reply's key is not the certificate's, so
    the node pins neither and does not join."""
    token = new_secret()
    tracker = _start(["tracker", "--port", "0", "--tls", "--identity", str(tmp_path / "tracker.key")],
                     _env(**{JOIN_ENV: token}))
    procs.append(tracker)
    tracker.wait_ready(READY_S)
    relay = _TlsRelay(Identity.generate(), int(tracker.ready["url"].rpartition(":")[2]))
    procs.append(relay)
    node = _start(["node", "--tracker", relay.url, "--tls", "--backend", "stub", "--layers", "0:30",
                   "--threads", "1", "--identity", str(tmp_path / "node.key")], _env(**{JOIN_ENV: token}))
    procs.append(node)
    _until(node, lambda: any("holds another key than its reply" in line for line in node.lines),
           "the refusal of a reply that came through another key's certificate")
    assert b"/v1/nodes/register" in relay.read  # the attacker read the registration (signed, and not secret)
    assert node.ready is None and not (tmp_path / "node.tracker").exists()  # nothing pinned


async def test_learning_the_tracker_pins_its_certificate_only_for_the_key_expected() -> None:
    """In process, the same rule on both sides of trust on first use: the key pinned is checked; with none
    pinned yet the certificate is kept, and the registration reply must then prove that key."""
    real, impostor = Identity.generate(), Identity.generate()
    for server_key, expected, ok in [(real, real.public, True), (impostor, real.public, False), (impostor, None, True)]:
        ctx = server_context(own=LinkCert(identity_cert(server_key, "tracker"), server_key.private))
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        url = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

        async def handshake_only(stream: trio.abc.Stream) -> None:
            tls = trio.SSLStream(stream, ctx, server_side=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError:
                pass
            await trio.aclose_forcefully(tls)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, handshake_only, listeners)
            pin = TrackerPin(tracker=url, key=expected)
            with trio.fail_after(10):
                if ok:
                    learned = await learn_tracker(TlsTrust(), url, pin)
                    assert learned.tracker_pem == identity_cert(server_key, "tracker")
                else:
                    with pytest.raises(CallerError) as err:
                        await learn_tracker(TlsTrust(), url, pin)
                    assert err.value.reason is Reason.FORBIDDEN and impostor.public_text in err.value.message
            nursery.cancel_scope.cancel()
    # --tls-ca names whom to trust: nothing is read; and a plain tracker has no certificate to read
    assert await learn_tracker(TlsTrust(ca_file="ca.pem"), "https://t.test:1", TrackerPin()) == TlsTrust("ca.pem")
    assert await learn_tracker(TlsTrust(), "http://127.0.0.1:1", TrackerPin()) == TlsTrust()


def test_plain_http_off_loopback_needs_insecure() -> None:
    encrypted, insecure = TlsTrust(encrypt=True), TlsTrust(encrypt=False)
    for tracker, advertise in [("http://10.9.8.7:8000", None), ("https://10.9.8.7:8000", "http://10.9.8.6:9000"),
                               ("http://0.0.0.0:8000", None)]:
        with pytest.raises(CallerError, match="--insecure") as err:
            check_transport(encrypted, tracker, None, advertise, "0.0.0.0")
        assert err.value.reason is Reason.FORBIDDEN
        check_transport(insecure, tracker, None, advertise, "0.0.0.0")
    check_transport(encrypted, "http://127.0.0.1:8000", None, "http://localhost:9000", "127.0.0.1")  # loopback
    assert encrypted.serves("0.0.0.0") and encrypted.serves("10.9.8.7") and not encrypted.serves("127.0.0.1")
    assert not insecure.serves("0.0.0.0") and TlsTrust(force=True).serves("127.0.0.1")
    assert insecure.serves("127.0.0.1", ("cert.pem", "key.pem"))


async def test_a_tracker_refuses_a_plain_registration_off_loopback_unless_insecure() -> None:
    """Before, any http:// URL registered and was handed out as a next hop: activations and capabilities in
    clear between machines. Now a plain URL off loopback is refused (403, nothing recorded) unless the tracker
    runs --insecure; loopback and https register."""
    for encrypt in (True, False):
        route = InProcRoute.stub()
        route.registry.encrypt = encrypt
        tracker_id = Identity.generate()
        app = make_tracker_app(route.gateway, identity=tracker_id)
        async with asgi_client(app, "http://127.0.0.1:8000") as http:
            body, headers = route.signed(0, "/v1/nodes/register", registration(route.services[0], "http://10.9.8.7:9000"))
            r = await http.post("/v1/nodes/register", content=body, headers=headers)
            if encrypt:
                assert r.status_code == 403 and "--insecure" in r.json()["error"]["message"], r.text
                assert route.registry.nodes == {}
            else:
                assert r.status_code == 200, r.text
            for url in ("http://127.0.0.1:9000", "https://10.9.8.7:9000"):
                body, headers = route.signed(0, "/v1/nodes/register", registration(route.services[0], url))
                r = await http.post("/v1/nodes/register", content=body, headers=headers)
                assert r.status_code == 200 and route.registry.nodes["n0"].url == url, r.text
            # the reply hands the node the tracker's certificate and a member certificate for its own key
            reply = r.json()
            assert reply["tls_ca"] == identity_cert(tracker_id, "tracker")
            assert reply["tls_member_cert"] == member_cert(tracker_id, route.services[0].identity.public)


async def test_a_node_refuses_a_plain_next_hop_off_loopback_unless_insecure(nursery) -> None:
    sid = "cd" * 16
    for url, encrypt, opens in [("http://10.9.8.7:9001", True, False), ("http://10.9.8.7:9001", False, True),
                                ("http://127.0.0.1:9001", True, True)]:
        service = NodeService(backend=StubBackend(spec=StubSpec(), layers=LayerRange(0, 15)), node_id="n0",
                              tracker_url="https://tracker.test", tls=TlsTrust(encrypt=encrypt))
        await nursery.start(service.run)
        body = {"session": sid, "max_positions": 64,
                "relay": {"route": "n0,n1", "nodes": 2, "next": {"node": "n1", "url": url}}}
        async with asgi_client(make_node_app(service), "https://n0.test:9000") as http:
            r = await http.post("/v1/seam/sessions", json=body)
        if opens:
            assert r.status_code == 201, r.text
            await service.lifecycle.close(sid, [])
        else:
            assert r.status_code == 403 and "relay.next" in r.text and "--insecure" in r.text, r.text
            assert service.sessions == {} and service.backend.session_count() == 0


def _run(args: list[str], env: dict[str, str], until_ready: bool) -> tuple[int | None, str]:
    """Run `dgr ARGS`: (its exit code, its output) once it exits, or (None, output) once it says it is ready."""
    p = subprocess.Popen(dgr_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         preexec_fn=die_with_parent)
    out: list[str] = []
    try:
        for line in p.stdout:
            out.append(line)
            if until_ready and line.startswith(READY_PREFIX):
                return None, "".join(out)
        return p.wait(timeout=30), "".join(out)
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=15)


def test_off_loopback_a_tracker_serves_https_and_a_node_refuses_a_plain_tracker_unasked(tmp_path: Path) -> None:
    env = _env(**{JOIN_ENV: new_secret(), API_KEYS_ENV: "sk-test-" + new_secret()[:16]})
    base = ["tracker", "--host", "0.0.0.0", "--port", "0", "--identity", str(tmp_path / "tracker.key")]
    code, out = _run(base, env, until_ready=True)
    assert code is None and '"url": "https://0.0.0.0:' in out, out
    code, out = _run([*base, "--insecure"], env, until_ready=True)
    assert code is None and '"url": "http://0.0.0.0:' in out, out
    node = ["node", "--tracker", "http://192.0.2.1:8000", "--backend", "stub", "--layers", "0:30",
            "--identity", str(tmp_path / "node.key")]
    code, out = _run(node, env, until_ready=False)
    assert code == 2 and "plain http:// off loopback" in out and "--insecure" in out, out
    code, out = _run([*node[:3], "--insecure", "--require-tls", *node[3:]], env, until_ready=False)
    assert code == 2 and "give one" in out, out


async def test_socket_tls_reads_like_a_socket_and_fails_like_a_trio_stream() -> None:
    """dgr.seam.tlsstream, both ends in process: a receive cancelled while it waits loses nothing (the
    server reads it as it reads a plain socket), an end without close_notify reads as an end, a stream
    closed here raises ClosedResourceError, and a handshake with a certificate other than the pinned one
    is a BrokenResourceError at both ends."""
    from dgr.seam.tlsstream import SocketTLS, TlsListener

    key, other = Identity.generate(), Identity.generate()
    own = LinkCert(identity_cert(key, "node"), key.private)
    listener = TlsListener((await trio.open_tcp_listeners(0, host="127.0.0.1"))[0], server_context(own=own))
    port = listener.listener.socket.getsockname()[1]

    async def pair(pinned: str) -> tuple[SocketTLS | BaseException, SocketTLS | BaseException]:
        """A client pinning `pinned` and the server's end, their handshakes made at once: each end, or why
        its handshake failed."""
        ends: dict[str, SocketTLS | BaseException] = {}

        async def shake(name: str, stream: SocketTLS) -> None:
            try:
                await stream.do_handshake()
                ends[name] = stream
            except trio.BrokenResourceError as exc:
                ends[name] = exc

        async def dial() -> None:
            raw = await trio.open_tcp_stream("127.0.0.1", port)
            await shake("client", SocketTLS.wrap(raw, TlsTrust().context(pinned), server_side=False,
                                                 server_hostname="dgr"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dial)
            await shake("server", await listener.accept())
        return ends["client"], ends["server"]

    with trio.fail_after(10):
        client, server = await pair(own.chain)
        with trio.move_on_after(0.05):  # nothing sent yet: cancelled while it waits
            await server.receive_some()
        await client.send_all(b"x" * 70_000)  # more than one TLS record, and more than one read
        got = b""
        while len(got) < 70_000:
            got += await server.receive_some()
        assert got == b"x" * 70_000
        await server.send_all(b"pong")
        assert await client.receive_some() == b"pong"
        await client.aclose()  # no close_notify
        assert await server.receive_some() == b""
        with pytest.raises(trio.ClosedResourceError):
            await client.receive_some()
        await server.aclose()
        refused = await pair(identity_cert(other, "node"))  # it serves key's certificate, not other's
        assert all(isinstance(end, trio.BrokenResourceError) for end in refused), refused
    await listener.aclose()
