"""The attacks of issue 40, each a trio task of one `Attacker`, and the `Tally` of how each was answered.

One job: the attacks themselves; dgr.bench.attacker is the `dgr attack` process that runs them
(its time limit, signals, command line) beside `dgr soak --attacker`.

The attacker is a member node's operator gone bad: it holds the route's join token (JOIN_ENV, as every
node operator does) and knows the tracker's and the nodes' URLs. Until SIGTERM or `--time-limit` it runs,
each as its own trio task, a bounded number of requests at a time:
- `report_*`: route_node_lost failure reports on the tracker's delivery path for the live sessions it can
  see (or made-up ones), naming node0/node1, with no capability, one signed by its own key, or an
  expired one: the tracker must refuse each (2xx means a stranger's report was taken).
- `capture_*`: it registers under its own key as a node claiming every layer of the model with capacity
  1,000,000 and a `describe` that tries to override /v1/models fields, at the URL of a trap it serves
  that accepts TCP and never answers, and it heartbeats to stay alive. Any call the trap receives is an
  honest session routed to the attacker: `trap_calls` counts them (0 is the only good figure).
- `hijack_*`, `id_probe_*`, `gateway_id`: heartbeats and registrations for the route's node ids under its
  own key (want 409), heartbeats for ids that exist and ids that do not (a 404/409 difference is an oracle
  of node ids), a registration with the id `gateway`.
- `seam_*`: open (and a head's open of a prompt), close with `keep=` and step on each node with no,
  self-signed, expired and other-session capabilities; `replay_register`: an old signed registration sent again (want 401).
- `idle_conns`, `big_prompt`, `half_bodies`: ~300 idle TCP connections to the tracker and to each node,
  4 MiB opens of a prompt with no capability, 40 connections holding half-sent 4 MiB bodies; a connection the
  server closes is opened again.
- `browser`: text/plain and JSON POSTs with a foreign Origin and Host to the tracker (want 403 or 415).
- `status_poll`: the open /v1/node/status of each node.

Every attack is tallied by how it was answered: the HTTP status, `closed` (the server dropped the
connection), `timeout`, or `refused` (connect failed); for held connections also how many the servers
never closed (`held_open_at_exit`) and the longest one was let stay before being closed. `accepted` counts the answers that mean the attack
got through (a 2xx where a refusal is due); the JSON summary is the last line on stdout at exit.

Its connections leave from `--source` (127.0.0.2 by default, loopback too), so that a server's per-peer
caps can tell it from the honest clients on 127.0.0.1; `--hold-source` sends the held connections from
another address, as an attacker with two addresses would. Left out: attacks that need a session the attacker
carries (with `--trusted-head` it is never routed, which is what `trap_calls` checks).
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections import Counter, defaultdict
from typing import Any, Awaitable, Callable
from urllib.parse import urlparse

import attrs
import httpx
import numpy as np
import trio

from dgr.security.auth import JOIN_HEADER, CapabilityAuthority, Signer, join_proof
from dgr.security.identity import Identity
from dgr.seam.frame import FrameKind, encode_frame
from dgr.seam.stream import encode_record
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, DELIVER_PATH, NODE_HEADER, ROUTE_SESSION_HEADER,
                           STREAM_PATH)

__all__ = ["AttackConfig", "Attacker", "Tally"]

_BIG = 4 * 1024 * 1024
_TIMEOUT_S = 5.0
_LURE = "SECURITY NOTICE: re-enter your API key at http://attacker.example/login"
_HOSTILE_DESCRIBE = {"id": "attacker-model", "object": "attacker", "owned_by": "attacker.example",
                     "created": 1, "dgr": {"nodes": []}, "digest": "0" * 64}


@attrs.frozen
class AttackConfig:
    tracker: str
    nodes: dict[str, str]  # node id -> URL, as the tracker lists them
    time_limit_s: float = 300.0
    concurrency: int = 8  # requests in flight per request attack
    idle_conns: int = 300  # per server
    half_bodies: int = 40
    source: str = "127.0.0.2"
    hold_source: str | None = None  # where held connections leave from (None: `source`); another address
    # tests a server's per-process cap, not only its per-peer one
    interval_s: float = 0.05  # pause between one attack's rounds


@attrs.define
class Tally:
    """What each attack got back."""

    answers: dict[str, Counter] = attrs.field(factory=lambda: defaultdict(Counter))
    accepted: Counter = attrs.field(factory=Counter)
    trap_calls: int = 0
    oracle: dict[str, set] = attrs.field(factory=lambda: defaultdict(set))
    notes: dict[str, Any] = attrs.field(factory=dict)
    open_now: Counter = attrs.field(factory=Counter)  # held connections the servers have not closed
    held_s: dict[str, float] = attrs.field(factory=dict)  # the longest a server let one stay before closing it
    started: float = attrs.field(factory=time.monotonic)

    def note(self, attack: str, answer: str | int, *, refused_if_ok: bool = True) -> None:
        self.answers[attack][str(answer)] += 1
        if refused_if_ok and isinstance(answer, int) and 200 <= answer < 300:
            self.accepted[attack] += 1

    def to_json(self) -> dict[str, Any]:
        probe = {k: sorted(v) for k, v in self.oracle.items()}
        return {"elapsed_s": round(time.monotonic() - self.started, 1),
                "attacks": {k: dict(sorted(v.items())) for k, v in sorted(self.answers.items())},
                "total": sum(sum(v.values()) for v in self.answers.values()),
                "accepted": dict(sorted(self.accepted.items())),
                "trap_calls": self.trap_calls,
                "id_oracle": bool(probe.get("real")) and probe.get("real") != probe.get("made_up"),
                "id_probe_answers": probe,
                "held_open_at_exit": dict(self.open_now),
                "longest_held_before_close_s": {k: round(v, 1) for k, v in self.held_s.items()},
                **self.notes}


def _answer(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "refused"
    return "closed"


@attrs.define
class Attacker:
    cfg: AttackConfig
    tally: Tally
    client: httpx.AsyncClient
    token: bytes
    me: Identity = attrs.field(factory=Identity.generate)
    model: dict[str, Any] = attrs.field(factory=dict)
    trap_url: str = ""
    my_id: str = ""
    sessions: list[str] = attrs.field(factory=list)  # live session ids the tracker shows
    seen: set[str] = attrs.field(factory=set)
    urls: dict[str, str] = attrs.field(factory=dict)  # "tracker" and each node id -> its URL now (nodes restart)
    # Set once every held connection has been opened once (and begins to send): the floods are at full
    # strength, and what they cost a server is in its memory from here on (`dgr soak` takes RSS baselines after)
    holding: trio.Event = attrs.field(factory=trio.Event)
    _to_hold: int = 0

    def __attrs_post_init__(self) -> None:
        self.urls = {"tracker": self.cfg.tracker, **self.cfg.nodes}

    def _held_one(self) -> None:
        self._to_hold -= 1
        if self._to_hold <= 0:
            self.holding.set()

    @property
    def nodes(self) -> dict[str, str]:
        return {n: u for n, u in self.urls.items() if n != "tracker"}

    async def follow_nodes(self) -> None:
        """A restarted node listens on a new port: follow the route's node ids in the tracker's table."""
        while True:
            try:
                table = (await self.client.get(self.cfg.tracker + "/v1/nodes", timeout=_TIMEOUT_S)).json()["nodes"]
                for n in table:
                    if n.get("node") in self.cfg.nodes and n.get("alive") and isinstance(n.get("url"), str):
                        self.urls[n["node"]] = n["url"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                pass
            await trio.sleep(1.0)
    old_registration: tuple[bytes, dict[str, str]] | None = None

    # -- helpers -------------------------------------------------------------------------------
    async def call(self, attack: str, method: str, url: str, *, refused_if_ok: bool = True, **kw: Any) -> int | str:
        try:
            r = await self.client.request(method, url, timeout=_TIMEOUT_S, **kw)
        except (httpx.HTTPError, OSError) as exc:
            answer: int | str = _answer(exc)
        else:
            answer = r.status_code
        self.tally.note(attack, answer, refused_if_ok=refused_if_ok)
        return answer

    def signed(self, path: str, body: bytes, *, join: bool = True) -> dict[str, str]:
        signer = Signer(self.me)
        headers = {"Content-Type": "application/json", **signer.headers("POST", path, body, time.time())}
        if join:
            headers[JOIN_HEADER] = join_proof(self.token, self.me.public, headers["X-Dgr-Signature"])
        return headers

    def forged(self, sid: str, node: str, kind: str) -> dict[str, str]:
        """A capability header the tracker never issued: none, self-signed, expired or for another session."""
        if kind == "none":
            return {}
        if kind == "garbage":
            return {CAPABILITY_HEADER: secrets.token_urlsafe(48)}
        authority = CapabilityAuthority.issuer(self.me)
        n = int(self.model.get("n_layers", 1))
        if kind == "expired":
            token = authority.issue(sid, node, 0, n, time.time() - 3600, ttl_s=60)
        elif kind == "other_session":
            token = authority.issue(secrets.token_hex(16), node, 0, n, time.time())
        else:  # self-signed
            token = authority.issue(sid, node, 0, n, time.time())
        return {CAPABILITY_HEADER: token}

    def sid(self) -> str:
        return random.choice(self.sessions) if self.sessions and random.random() < 0.7 else secrets.token_hex(16)

    async def rounds(self, fn: Callable[[], Awaitable[None]], width: int | None = None) -> None:
        """Run `fn` `width` at a time, forever (the caller's cancel scope ends it)."""

        async def worker() -> None:
            while True:
                await fn()
                await trio.sleep(self.cfg.interval_s * random.random())

        async with trio.open_nursery() as nursery:
            for _ in range(width or self.cfg.concurrency):
                nursery.start_soon(worker)

    # -- what it learns ------------------------------------------------------------------------
    async def learn(self) -> None:
        """The model a node serves (its open status), else what /v1/models says."""
        for url in self.cfg.nodes.values():
            try:
                self.model = (await self.client.get(url + "/v1/node/status", timeout=_TIMEOUT_S)).json()["model"]
                self.tally.notes["learned_model_from"] = "node status"
                return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        data = (await self.client.get(self.cfg.tracker + "/v1/models", timeout=_TIMEOUT_S)).json()["data"][0]
        d = data["dgr"]
        self.model = {"name": data["id"], "architecture": d["architecture"], "n_layers": d["n_layers"],
                      "hidden_size": d["hidden_size"], "seam_width": d["seam_width"],
                      "vocab_size": d.get("vocab_size", 1), "context_length": d["context_length"],
                      "digest": d["digest"], "needs_token_ids": False, "metadata": {}}
        self.tally.notes["learned_model_from"] = "/v1/models"

    async def watch_sessions(self) -> None:
        while True:
            try:
                r = await self.client.get(self.cfg.tracker + "/v1/route-sessions", timeout=_TIMEOUT_S)
                self.sessions = [s["id"] for s in r.json().get("active", []) if isinstance(s, dict)
                                 and isinstance(s.get("id"), str)] if r.status_code == 200 else []
                self.seen.update(self.sessions)
                self.tally.notes["live_sessions_seen"] = len(self.seen)
                self.tally.note("session_list", r.status_code, refused_if_ok=False)
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                self.tally.note("session_list", _answer(exc))
            await trio.sleep(0.2)

    # -- capture -------------------------------------------------------------------------------
    async def trap(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A node URL that accepts and then stalls every call until the peer gives up."""
        listeners = await trio.open_tcp_listeners(0, host=self.cfg.source)
        port = listeners[0].socket.getsockname()[1]
        self.trap_url = f"http://{self.cfg.source}:{port}"
        task_status.started()

        async def stall(stream: trio.SocketStream) -> None:
            async with stream:
                try:
                    if await stream.receive_some(65536):
                        self.tally.trap_calls += 1
                    while await stream.receive_some(65536):
                        pass
                except trio.BrokenResourceError:
                    pass

        await trio.serve_listeners(stall, listeners)

    def registration(self, node: str, *, capacity: int = 1_000_000) -> dict[str, Any]:
        return {"node": node, "url": self.trap_url, "layers": [0, int(self.model["n_layers"])],
                "backend": "stub" if self.model.get("architecture") == "stub" else "llama_shard",
                "model": self.model, "capacity": capacity, "max_positions": int(self.model["context_length"]),
                "describe": _HOSTILE_DESCRIBE}

    async def capture(self) -> None:
        """Register as the whole model, heartbeat to stay alive, register again whenever told to."""
        self.my_id = "edge-" + secrets.token_hex(4)
        while True:
            body = json.dumps(self.registration(self.my_id)).encode()
            headers = self.signed("/v1/nodes/register", body)
            answer = await self.call("capture_register", "POST", self.cfg.tracker + "/v1/nodes/register",
                                     content=body, headers=headers, refused_if_ok=False)
            if self.old_registration is None:
                self.old_registration = (body, headers)
            while answer == 200:
                await trio.sleep(0.25)
                hb = json.dumps({"node": self.my_id, "sessions": 0, "kv_bytes": 0, "session_ids": []}).encode()
                answer = await self.call("capture_heartbeat", "POST", self.cfg.tracker + "/v1/nodes/heartbeat",
                                         content=hb, headers={**self.signed("/v1/nodes/heartbeat", hb, join=False),
                                                              NODE_HEADER: self.my_id}, refused_if_ok=False)
            await trio.sleep(1.0)

    async def describe_leak(self) -> None:
        """Does /v1/models show the attacker's `describe` (anywhere), and does it override a model's own fields?"""
        notes = self.tally.notes
        notes.setdefault("describe_in_models", False)
        notes.setdefault("describe_overrides_models", False)
        while True:
            try:
                r = await self.client.get(self.cfg.tracker + "/v1/models", timeout=_TIMEOUT_S)
                notes["describe_in_models"] |= "attacker" in r.text
                for model in r.json().get("data", []):
                    notes["describe_overrides_models"] |= any(
                        model.get(k) == v for k, v in _HOSTILE_DESCRIBE.items() if k not in ("dgr", "digest"))
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            await trio.sleep(1.0)

    # -- identities ----------------------------------------------------------------------------
    async def identities(self) -> None:
        victim = random.choice(list(self.nodes))
        hb = json.dumps({"node": victim, "sessions": 0, "kv_bytes": 0, "session_ids": []}).encode()
        await self.call("hijack_heartbeat", "POST", self.cfg.tracker + "/v1/nodes/heartbeat", content=hb,
                        headers={**self.signed("/v1/nodes/heartbeat", hb, join=False), NODE_HEADER: victim})
        body = json.dumps(self.registration(victim, capacity=8)).encode()
        await self.call("hijack_register", "POST", self.cfg.tracker + "/v1/nodes/register", content=body,
                        headers=self.signed("/v1/nodes/register", body))
        body = json.dumps(self.registration("gateway", capacity=8)).encode()
        await self.call("gateway_id", "POST", self.cfg.tracker + "/v1/nodes/register", content=body,
                        headers=self.signed("/v1/nodes/register", body))
        for kind, node in (("real", victim), ("made_up", "node" + str(random.randint(2, 99)))):
            other = Identity.generate()  # a fresh key: what the answer says is about the id alone
            hb = json.dumps({"node": node, "sessions": 0}).encode()
            signer = Signer(other)
            headers = {"Content-Type": "application/json", NODE_HEADER: node,
                       **signer.headers("POST", "/v1/nodes/heartbeat", hb, time.time())}
            answer = await self.call(f"id_probe_{kind}", "POST", self.cfg.tracker + "/v1/nodes/heartbeat",
                                     content=hb, headers=headers)
            self.tally.oracle[kind].add(str(answer))
        if self.old_registration is not None:
            body, headers = self.old_registration
            await self.call("replay_register", "POST", self.cfg.tracker + "/v1/nodes/register", content=body,
                            headers=headers)

    # -- reports -------------------------------------------------------------------------------
    async def report(self) -> None:
        sid = self.sid()
        reporter, named = random.sample(list(self.nodes), 2) if len(self.nodes) > 1 else (list(self.nodes)[0],) * 2
        kind = random.choice(("none", "self_signed", "expired", "garbage"))
        data = {"session": sid, "reporter": reporter, "code": "route_node_lost", "message": _LURE, "node": named}
        await self.call(f"report_{kind}", "POST", self.cfg.tracker + DELIVER_PATH, content=json.dumps(data).encode(),
                        headers={"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid,
                                 **self.forged(sid, "gateway", kind)})

    # -- seam calls ----------------------------------------------------------------------------
    async def seam(self) -> None:
        node, url = random.choice(list(self.nodes.items()))
        sid = secrets.token_hex(16)
        kind = random.choice(("none", "self_signed", "expired", "other_session", "garbage"))
        cap = self.forged(sid, node, kind)
        which = random.choice(("open", "close_keep", "prompt", "stream"))
        if which == "open":
            body = {"session": sid, "max_positions": 64, "sampling": {},
                    "relay": {"next": {"node": "x", "url": self.trap_url}, "loop": {"head": {"url": self.trap_url}}}}
            await self.call(f"seam_open_{kind}", "POST", url + "/v1/seam/sessions", json=body, headers=cap)
        elif which == "close_keep":
            keep = ".".join(secrets.token_hex(16) for _ in range(2))
            await self.call(f"seam_close_keep_{kind}", "DELETE", f"{url}/v1/seam/sessions/{sid}?keep={keep}",
                            headers=cap)
        elif which == "prompt":  # a head's open tokenizes: work no one may buy without the tracker's ticket
            await self.call(f"seam_prompt_{kind}", "POST", url + "/v1/seam/sessions",
                            json={"session": sid, "max_positions": 64, "sampling": {}, "prompt": {"prompt": "hello"},
                                  "max_new": 1}, headers={ROUTE_SESSION_HEADER: sid, **cap})
        else:
            width = int(self.model.get("seam_width", 1))
            frame = encode_frame(FrameKind.DECODE, sid, 1, 0, 1, width, hidden=np.zeros((1, width), np.float32))
            # a session's steps come only on its stream, which names the session for its capability
            await self.call(f"seam_stream_{kind}", "POST", url + STREAM_PATH, content=encode_record((), frame),
                            headers={"Content-Type": CONTENT_TYPE, ROUTE_SESSION_HEADER: sid, **cap})

    # -- starving ------------------------------------------------------------------------------
    async def big_prompt(self) -> None:
        node, url = random.choice(list(self.nodes.items()))
        sid = secrets.token_hex(16)
        body = json.dumps({"session": sid, "max_positions": 64, "sampling": {}, "max_new": 1,
                           "prompt": {"prompt": "x" * (_BIG - 256)}}).encode()
        await self.call("big_prompt", "POST", url + "/v1/seam/sessions", content=body,
                        headers={"Content-Type": "application/json", ROUTE_SESSION_HEADER: sid})

    async def spec_modes(self) -> None:
        """Speculation the operator did not grant (`--spec-allow`): every node's CPU, or the tail's, at a client's
        word; refused (403) before any node opens."""
        mode = random.choice(("ngram-exact", "draft", "draft-exact"))
        body = {"model": self.model.get("name", "stub"), "prompt": "hi", "max_tokens": 1, "speculation": mode}
        await self.call(f"spec_{mode}", "POST", self.cfg.tracker + "/v1/completions", json=body)

    async def _connect(self, url: str) -> trio.SocketStream:
        u = urlparse(url)
        return await trio.open_tcp_stream(u.hostname, u.port, local_address=self.cfg.hold_source or self.cfg.source)

    async def hold(self, attack: str, server: str, count: int, first: Callable[[str], bytes]) -> None:
        """Keep `count` connections to `server` ("tracker" or a node id) open, each having sent `first(its url)`;
        reopen those the server closes."""

        async def one() -> None:
            first_time = True
            while True:
                url = self.urls[server]
                try:
                    stream = await self._connect(url)
                except OSError:
                    self.tally.note(attack, "refused")
                    await trio.sleep(0.5)
                    continue
                self.tally.note(attack, "opened", refused_if_ok=False)
                opened = trio.current_time()
                self.tally.open_now[attack] += 1
                async with stream:
                    try:
                        data = first(url)
                        if first_time:  # counted as it starts sending: a server may never read a half body whole
                            first_time = False
                            self._held_one()
                        if data:
                            await stream.send_all(data)
                        while True:  # until the server closes it (an answer, if any, then end of file)
                            got = await stream.receive_some(65536)
                            if not got:
                                break
                            if got.startswith(b"HTTP/1.1 "):
                                self.tally.note(attack, int(got[9:12]))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
                        pass
                self.tally.open_now[attack] -= 1  # closed by the server (not when the attacker stops)
                held = trio.current_time() - opened
                self.tally.held_s[attack] = max(self.tally.held_s.get(attack, 0.0), held)
                self.tally.note(attack, "closed")
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
                await trio.sleep(0.002)

    def _half_body(self, url: str) -> bytes:
        u = urlparse(url)
        # a body each server would read to its end (within its limit), never finished
        path = "/v1/seam/sessions" if url != self.cfg.tracker else "/v1/completions"
        size = _BIG - 1024
        head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\n\r\n").encode()
        return head + b'{"prompt": "' + b"x" * (size // 2)

    # -- browsers ------------------------------------------------------------------------------
    async def browser(self) -> None:
        body = json.dumps({"model": self.model.get("name", "stub"), "prompt": "hi", "max_tokens": 1})
        ctype = random.choice(("text/plain", "application/json"))
        await self.call(f"browser_{ctype.split('/')[1]}", "POST", self.cfg.tracker + "/v1/completions", content=body,
                        headers={"Content-Type": ctype, "Origin": "http://attacker.example",
                                 "Host": "attacker.example"})

    async def status_poll(self) -> None:
        for node, url in self.nodes.items():
            await self.call("status_poll", "GET", url + "/v1/node/status", refused_if_ok=False)
        await trio.sleep(0.5)

    # -- all of it -----------------------------------------------------------------------------
    async def run(self) -> None:
        await self.learn()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.trap)
            nursery.start_soon(self.watch_sessions)
            nursery.start_soon(self.capture)
            nursery.start_soon(self.describe_leak)
            nursery.start_soon(self.rounds, self.identities, 1)
            nursery.start_soon(self.rounds, self.report)
            nursery.start_soon(self.rounds, self.seam)
            nursery.start_soon(self.rounds, self.big_prompt, 2)
            nursery.start_soon(self.rounds, self.browser, 1)
            nursery.start_soon(self.rounds, self.status_poll, 1)
            nursery.start_soon(self.rounds, self.spec_modes, 1)
            nursery.start_soon(self.follow_nodes)
            servers = list(self.urls)
            self._to_hold = self.cfg.idle_conns * len(servers) + self.cfg.half_bodies
            for server in servers:
                nursery.start_soon(self.hold, "idle_conns", server, self.cfg.idle_conns, lambda u: b"")
            for i in range(self.cfg.half_bodies):
                nursery.start_soon(self.hold, "half_bodies", servers[i % len(servers)], 1, self._half_body)
