"""Fault-injection harness: real `dgr up` routes on loopback, and ways to break them.

`LocalRoute` starts `dgr up` as a real process (a tracker and N node
processes; forked by the test process's launcher, dgr.testing.launcher, with
its imports already done), learns each node's pid and URL from the tracker's registry, and
can then, at a chosen phase and step of a Route Session:
- kill a node (SIGKILL), stop it (SIGSTOP) or slow it (a SIGSTOP/SIGCONT
  duty cycle), and restart it as a new process;
- cut a connection to a node mid-frame (send half a seam frame, then close);
- send malformed seam frames and malformed OpenAI requests.

Everything is bounded in time, uses 127.0.0.1 only, and stops every process
it started, even when a test fails.

The route's join token is made here and handed to `dgr up` in the
environment, and its keys live in a folder made here (`dgr up
--identity-dir`), so tests can mint capabilities with the tracker's key and
sign membership messages with a key of their own (`capability`, `signed`)
the way the tracker and nodes do, and forge bad ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse
from typing import Any, Callable

import attrs
import httpx

from dgr.errors import PeerError
from dgr.procs import WatchedChild, dgr_command
from dgr.security.auth import JOIN_HEADER, CapabilityAuthority, Scope, Signer, join_proof
from dgr.security.identity import Identity
from dgr.security.secrets import API_KEYS_ENV, JOIN_ENV, new_secret
from dgr.security.tls import TlsTrust
from dgr.security.tickets import TICKET_TTL_S, issue_ticket
from dgr.seam.stream import encode_record
from dgr.seam.wire import CAPABILITY_HEADER, CONTENT_TYPE, ROUTE_SESSION_HEADER, STATUS_SCOPE, STREAM_PATH, TICKET_HEADER
from dgr.testing.launcher import LaunchedProcess, launch

__all__ = ["LOSS_BOUND_S", "LocalRoute", "RouteTimeout", "Slowdown", "free_port", "cut_mid_frame", "stream_steps", "sse_events", "first_error", "first_text"]


# Node loss must end a Route Session promptly: at once for a reset socket, within the heartbeat
# threshold for a hung node (about 1 s on an idle machine). Tests bound it generously, so that a loaded
# machine does not fail the suite, yet below the step deadline, so a loss that waits for that deadline
# (or is never seen) still fails. `dgr bench` reports the figure itself.
LOSS_BOUND_S = 8.0

# `dgr up`'s last line once every node is ready; with --port 0 it names the real port
_SERVING = re.compile(r"serving the OpenAI API at (https?)://127\.0\.0\.1:(\d+)/v1")


def _serving_port(line: str) -> dict[str, Any] | None:
    """`dgr up`'s ready line is its last: the API's address."""
    served = _SERVING.search(line)
    return None if served is None else {"scheme": served.group(1), "port": int(served.group(2))}


class RouteTimeout(Exception):
    """A harness wait ran out of time (test code only)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_steps(url: str, sid: str, frames: list[bytes], headers: dict[str, str]) -> httpx.Response:
    """A stream of session `sid`'s steps to the node at `url` (one record a frame, as its previous hop sends
    them), ended: 200 once every frame was applied, or the first refusal's error."""
    body = b"".join(encode_record((), f) for f in frames)
    return httpx.post(f"{url}{STREAM_PATH}", content=body, timeout=30,
                      headers={"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid, **headers})


def cut_mid_frame(url: str, sid: str, frame: bytes, headers: dict[str, str], fraction: float = 0.5) -> None:
    """Stream a seam frame of `sid` but close the connection after `fraction` of its record's bytes."""
    u = urlparse(url)
    record = encode_record((), frame)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid,
                                                  **headers}.items())
    head = (f"POST {STREAM_PATH} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n{head}"
            f"Content-Length: {len(record)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=5) as s:
        s.sendall(head + record[: int(len(record) * fraction)])
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        try:
            s.recv(4096)
        except OSError:
            pass


@attrs.define
class LocalRoute:
    backend: str = "stub"
    nodes: int = 3
    extra: tuple[str, ...] = ()
    ready_timeout_s: float = 120.0
    port: int = 0  # 0: the tracker binds an ephemeral port, learned from `dgr up`'s ready line
    proc: LaunchedProcess | None = None
    log_lines: list[str] = attrs.field(factory=list)
    restarted: list[LaunchedProcess] = attrs.field(factory=list)
    join_token: str = attrs.field(factory=new_secret)  # admits the route's nodes (and the harness's guest key)
    keys: Path | None = None  # the route's key folder (tracker.key, nodeN.key); made by `start`
    guest: Identity = attrs.field(factory=Identity.generate)  # a key of the harness's own, for test registrations
    api_key: str | None = None  # when set, the tracker requires it (DGR_API_KEYS) and the harness sends it
    # Each node's --busy-poll-ms; None: the product's default (dgr.cli.busy_poll_ms). 0 by default here, because
    # `make test` runs a second test beside every route: a node polling while the other computes takes a core that
    # test wants. In three paired rounds of the sharded llama_shard tests beside one CPU-bound process, the tests
    # took 62 to 65 s without polling and 71 to 76 s with it, and the other process ran 9 to 13% slower too.
    busy_poll_ms: float | None = 0.0
    scheme: str = "http"  # https once `extra` has `--tls`, learned from the ready line
    _threads: list[threading.Thread] = attrs.field(factory=list)
    _http: httpx.Client | None = attrs.field(default=None, init=False)

    @property
    def http(self) -> httpx.Client:
        """A keep-alive client for the calls of this route's test (main thread; a watcher thread makes its own).

        `httpx.get` makes a new client per call, which loads the system's CA certificates: about 60 ms of CPU,
        so a poll every 50 ms kept a core busy that the route under test needed.
        """
        if self._http is None:
            self._http = httpx.Client(verify=self.trust)  # httpx's default timeout (5 s), as httpx.get had
        return self._http

    @property
    def trust(self) -> ssl.SSLContext | bool:
        """What a client of the tracker verifies it with: over https, its certificate (beside its key) alone."""
        if self.scheme != "https" or self.keys is None:
            return True
        return TlsTrust().context((self.keys / "tracker.crt").read_text())

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        """What an API client of this route sends: the API key, if the route has one."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def env(self) -> dict[str, str]:
        env = {**os.environ, JOIN_ENV: self.join_token}
        if self.api_key is not None:
            env[API_KEYS_ENV] = self.api_key
        else:
            env.pop(API_KEYS_ENV, None)
        return env

    # -- credentials, as the tracker and nodes make them ---------------------------
    @property
    def tracker_identity(self) -> Identity:
        """The tracker's key, read from the route's key folder."""
        if self.keys is None:
            raise RouteTimeout("the route has not started")
        return Identity.load(self.keys / "tracker.key", create=False)

    def capability(self, sid: str, name: str, *, ttl_s: float = 60.0, layers: tuple[int, int] | None = None,
                   identity: Identity | None = None, node: str | None = None,
                   scope: Scope = Scope.CONTROL, boot: str | None = None) -> dict[str, str]:
        """The X-Dgr-Capability header for session `sid` on node `name`, signed with the tracker's key, as the
        gateway's own (CONTROL; STEP: as a neighbour holds it), bound to the boot `name` registered last. Override
        parts, or sign with another `identity`, to forge one."""
        layers = layers or self._layers(name)
        authority = CapabilityAuthority.issuer(identity or self.tracker_identity)
        token = authority.issue(sid, node or name, layers[0], layers[1], time.time(), ttl_s=ttl_s, scope=scope,
                                boot=self.boot(name) if boot is None else boot)
        return {CAPABILITY_HEADER: token}

    def boot(self, name: str) -> str:
        """The boot nonce node `name` registered last, as the tracker lists it ("" for a name it does not list)."""
        try:
            return self.node(name).get("boot", "")
        except KeyError:
            return ""

    def opening(self, sid: str, name: str, body: dict[str, Any], *, ttl_s: float = TICKET_TTL_S
                ) -> tuple[bytes, dict[str, str]]:
        """An open of `sid` on node `name` as the gateway sends it: the body's bytes, and headers with the
        gateway's capability and the tracker's single-use ticket for exactly those bytes, both bound to the
        node's boot as the tracker lists it."""
        raw = json.dumps({"session": sid, **body}).encode()
        start, stop = self._layers(name)
        ticket = issue_ticket(self.tracker_identity, sid, name, start, stop, raw, time.time(), ttl_s=ttl_s,
                              boot=self.boot(name))
        return raw, {"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid, TICKET_HEADER: ticket,
                     **self.capability(sid, name)}

    def relay(self, sid: str, name: str) -> dict[str, Any]:
        """The relay plan the gateway gives node `name` ("nodeK") of this ring for `sid`: the next node, or,
        on the tail, its loop back to the head, each with the capability the gateway would hand it."""
        k = int(name.removeprefix("node"))
        hop = f"node{(k + 1) % self.nodes}"
        nxt = {"node": hop, "url": self.node(hop)["url"],
               "capability": self.capability(sid, hop, scope=Scope.STEP)[CAPABILITY_HEADER]}
        if k + 1 < self.nodes:
            return {"next": nxt}
        return {"next": None, "loop": {"head": nxt}}

    def _layers(self, name: str) -> tuple[int, int]:
        a, b = self.node(name)["layers"].split(":")
        return int(a), int(b)

    def signed(self, path: str, body: bytes, *, identity: Identity | None = None, now: float | None = None,
               join_token: str | None = None, join: bool = True) -> dict[str, str]:
        """Headers of a membership message signed with the harness's guest key (or `identity`), carrying
        the proof of the route's join token (or `join_token`; none when not `join`)."""
        signer = Signer(identity or self.guest)
        headers = {"Content-Type": "application/json",
                   **signer.headers("POST", path, body, time.time() if now is None else now)}
        if join:
            token = (join_token or self.join_token).encode()
            headers[JOIN_HEADER] = join_proof(token, signer.identity.public, headers["X-Dgr-Signature"])
        return headers

    # -- lifecycle --------------------------------------------------------------
    def __enter__(self) -> "LocalRoute":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.keys is None:
            self.keys = Path(tempfile.mkdtemp(prefix="dgr-route-keys-"))
        cmd = dgr_command("up", "--backend", self.backend, "--nodes", str(self.nodes), "--port", str(self.port),
                          "--identity-dir", str(self.keys), *self.extra, *self._busy_poll())
        up = launch(cmd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child = WatchedChild.watch("dgr up", up, is_ready=_serving_port)
        self.proc, self.log_lines = child.popen, child.lines  # the reader keeps filling log_lines
        try:
            served = child.wait_ready(self.ready_timeout_s)
            self.port, self.scheme = served["port"], served["scheme"]
        except PeerError:
            self.close()
            raise RouteTimeout("dgr up did not become ready:\n" + "\n".join(self.log_lines[-40:])) from None

    def close(self) -> None:
        for p in self.restarted:
            _stop(p)
        if self.proc is not None:
            for n in self._registry_pids():
                _signal(n, signal.SIGCONT)  # a stopped child cannot handle SIGTERM
            _stop(self.proc)
            self.proc = None
        if self.keys is not None:
            shutil.rmtree(self.keys, ignore_errors=True)
            self.keys = None
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- registry ---------------------------------------------------------------
    def node_table(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.url}/v1/nodes", timeout=5, headers=self.headers).json()["nodes"]

    def node(self, name: str) -> dict[str, Any]:
        for n in self.node_table():
            if n["node"] == name:
                return n
        raise KeyError(name)

    def _registry_pids(self) -> list[int]:
        try:
            return [n["pid"] for n in self.node_table() if n.get("pid")]
        except (httpx.HTTPError, ValueError):
            return []

    def node_status(self, name: str) -> dict[str, Any]:
        """A node's whole status, counters included: asked with the tracker's capability for them."""
        node = self.node(name)
        a, b = node["layers"].split(":")
        headers = self.capability(STATUS_SCOPE, name, layers=(int(a), int(b)), boot=node.get("boot", "")
                                  ) if self.keys is not None else {}
        return self.http.get(f"{node['url']}/v1/node/status", timeout=5, headers=headers).json()

    def wait_nodes_alive(self, names: list[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = {n["node"] for n in self.node_table() if n["alive"]}
            if set(names) <= alive:
                return
            time.sleep(0.1)
        raise RouteTimeout(f"nodes {names} not alive after {timeout_s}s")

    # -- faults -----------------------------------------------------------------
    def kill(self, name: str) -> float:
        """SIGKILL a node; returns the time it happened (monotonic)."""
        os.kill(self.node(name)["pid"], signal.SIGKILL)
        return time.monotonic()

    def stop(self, name: str) -> float:
        os.kill(self.node(name)["pid"], signal.SIGSTOP)
        return time.monotonic()

    def cont(self, name: str) -> None:
        os.kill(self.node(name)["pid"], signal.SIGCONT)

    def slow(self, name: str, duty: float = 0.5, period_s: float = 0.05) -> "Slowdown":
        """Run a node at `duty` of its speed (a SIGSTOP/SIGCONT cycle) until the returned handle is stopped."""
        slowdown = Slowdown(self.node(name)["pid"], duty, period_s)
        slowdown.thread.start()
        self._threads.append(slowdown.thread)
        return slowdown

    def restart_node(self, name: str, layers: str, timeout_s: float = 120.0,
                     extra: tuple[str, ...] = ()) -> LaunchedProcess:
        """Start a fresh `dgr node` with the same name and layers (and `extra` options); wait until it is alive."""
        key = self.keys / f"{name}.key" if self.keys is not None else None
        cmd = dgr_command("node", *self.node_args(name, layers, key), *extra)
        p = launch(cmd, env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.restarted.append(p)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                n = self.node(name)
                if n["alive"] and n["pid"] == p.pid:
                    return p
            except (KeyError, httpx.HTTPError):
                pass
            time.sleep(0.1)
        raise RouteTimeout(f"restarted {name} did not register")

    def node_args(self, name: str, layers: str, key: Path | None) -> list[str]:
        """`dgr node`'s options for one more node of this route: its tracker, backend and model options, one
        thread, any port, and `key` as its identity (None: the node's default)."""
        return ["--tracker", self.url, "--layers", layers, "--backend", self.backend, "--name", name, "--threads",
                "1", "--port", "0", *self._node_extra(), *self._busy_poll(),
                *(["--identity", str(key)] if key is not None else [])]

    def _busy_poll(self) -> list[str]:
        if self.busy_poll_ms is None or "--busy-poll-ms" in self.extra:
            return []
        return ["--busy-poll-ms", str(self.busy_poll_ms)]

    def _node_extra(self) -> list[str]:
        keep = {"--model", "--stub-delay", "--stub-model", "--ctx", "--max-sessions", "--idle-timeout",
                "--busy-poll-ms", "--iteration-target-ms"}
        out, it = [], iter(self.extra)
        for a in it:
            if a in keep:
                out += [a, next(it)]
        return out

    def when(self, sid: str, predicate: Callable[[dict[str, Any]], bool], action: Callable[[], Any],
             timeout_s: float = 30.0) -> threading.Thread:
        """Run `action` once the session's telemetry satisfies `predicate` (polled every 5 ms)."""

        def watch() -> None:
            deadline = time.monotonic() + timeout_s
            with httpx.Client(timeout=5, headers=self.headers) as client:
                while time.monotonic() < deadline:
                    snap = client.get(f"{self.api}/route-sessions/{sid}").json()
                    if predicate(snap):
                        action()
                        return
                    if snap.get("phase") in ("done", "failed"):
                        return
                    time.sleep(0.005)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def wait_sessions_freed(self, names: list[str], timeout_s: float = 30.0) -> None:
        """Wait until every named node holds no session and no KV bytes."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = {n: self.node_status(n) for n in names}
            held = {n: (s["sessions"], s["kv_bytes"]) for n, s in status.items() if s["sessions"] or s["kv_bytes"]}
            if not held:
                return
            if time.monotonic() > deadline:
                raise RouteTimeout(f"nodes still hold (sessions, kv_bytes): {held}")
            time.sleep(0.05)

    def session(self, sid: str) -> dict[str, Any]:
        return self.http.get(f"{self.api}/route-sessions/{sid}", timeout=5, headers=self.headers).json()

    def wait_session_ended(self, sid: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The Route Session's telemetry once it is done or failed (its nodes may be freed a moment before)."""
        deadline = time.monotonic() + timeout_s
        while (snap := self.session(sid)).get("phase") not in ("done", "failed"):
            if time.monotonic() > deadline:
                raise RouteTimeout(f"session {sid} still {snap.get('phase')} after {timeout_s}s")
            time.sleep(0.05)
        return snap


@attrs.define(eq=False)
class Slowdown:
    """A node held at `duty` of its speed; `stops` counts the SIGSTOPs it has taken so far."""

    pid: int
    duty: float
    period_s: float
    stops: int = 0
    _done: threading.Event = attrs.field(factory=threading.Event)
    thread: threading.Thread = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        try:
            while not self._done.wait(self.period_s * self.duty):
                _signal(self.pid, signal.SIGSTOP)
                self.stops += 1
                time.sleep(self.period_s * (1 - self.duty))  # the stopped part of the duty cycle
                _signal(self.pid, signal.SIGCONT)
        finally:
            _signal(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        self.thread.join(10)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(p: LaunchedProcess) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def sse_events(response: httpx.Response):
    """Yield ('comment', text) and ('data', json-or-str) items of an SSE stream."""
    for line in response.iter_lines():
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("data: "):
            payload = line[6:]
            try:
                yield "data", json.loads(payload)
            except ValueError:
                yield "data", payload


def first_text(events) -> None:
    """Consume SSE events up to the first chunk that carries generated text."""
    for kind, data in events:
        if kind == "data" and isinstance(data, dict) and data.get("choices"):
            choice = data["choices"][0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                return
    raise RouteTimeout("the stream ended before any text")


def first_error(events) -> tuple[dict[str, Any], float]:
    """Consume SSE events up to the error object; return it and when it was seen."""
    for kind, data in events:
        if kind == "data" and isinstance(data, dict) and "error" in data:
            return data["error"], time.monotonic()
    raise RouteTimeout("the stream ended without an error")
