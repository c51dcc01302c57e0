"""The tracker's HTTP face: node registry, the OpenAI API, Route Session telemetry, artifact peers.

Who may call what (spec/security.md):
- registration and heartbeats must be signed with the node's own key
  (`unauthenticated` or `replayed`, 401, and the registry is untouched); a
  registration's key must be admitted (the join token's proof, or
  `--allow-node`), and a node id belongs to the first key that registered it
  (`identity_taken`, 409; a heartbeat under it reads as an unknown id, 404,
  so it tells no stranger which ids exist). The registration's reply carries the tracker's
  public key, which the node pins to check capabilities and challenges with,
  the tracker's identity certificate (`tls_ca`) and the member certificate
  issued to the registering key (`tls_member_cert`, dgr.security.certs): the
  node presents it on every TLS link, and demands one from its own callers.
  A heartbeat names its node in `X-Dgr-Node`: its signature and that key's
  ownership of the id are checked before its body is parsed (the body's
  `node` must then agree); one that says `draining` (a node stopping on
  SIGTERM) has its sessions handed over (dgr.tracker.drain);
- with API keys, the OpenAI endpoints and the telemetry views need
  `Authorization: Bearer KEY` (401 in OpenAI's error shape otherwise), and a
  key sees only the Route Sessions it made: another key's are left out of the
  listing and are `not_found` by id, as an unknown id is;
  `/healthz`, `/openapi.json`, the dashboard page and the artifact peer lists
  (which nodes fetching layers read) stay open;
- `POST /v1/assign` (which layers a joining node should serve) is for a node
  the tracker would admit: signed, by a listed key or with the join token's
  proof, checked from the headers before the body is read (open where
  admission is: a loopback tracker).

A route's deliveries skip the framework (dgr.tracker.deliveries `deliver_fast_path`), and a
streaming completion's body is dgr.tracker.sse.

A request that passed an API key, a node's signature or a delivery
capability marks its connection authenticated (dgr.api.server
`authenticated`): until then the connection lives under the server's guest
deadlines.
"""

from __future__ import annotations

import hashlib
import time
from importlib import resources
from typing import Any, AsyncIterator

import trio
from quart import Response, request
from quart_trio import QuartTrio

from dgr.metrics import CONTENT_TYPE as METRICS_TYPE, render
from dgr.api.http import (error_response, install_error_handlers, json_response, parse_json, read_body, read_json,
                          unread)
from dgr.api.openai import completion_body, parse_request
from dgr.api.openapi import openapi_document
from dgr.errors import CallerError, Failure, Reason
from dgr.api.server import authenticated
from dgr.seam.wire import NODE_HEADER, ROUTE_SESSION_HEADER
from dgr.fsm.route import RouteSession, RouteState
from dgr.tracker.gateway import Gateway
from dgr.security.api_keys import check_bearer
from dgr.security.browsers import loopback_only
from dgr.security.auth import JOIN_HEADER, SIG_HEADERS, Admission, Verifier, tracker_join_proof
from dgr.security.certs import identity_cert, member_cert
from dgr.security.identity import Identity
from dgr.tracker.deliveries import deliver_fast_path
from dgr.tracker.entry import Role
from dgr.tracker.proofs import Prover
from dgr.tracker.sse import completion_stream, sse

__all__ = ["make_tracker_app"]

_REGISTRY_LIMIT = 1024 * 1024
# Paths (and their subpaths) that need an API key when keys are configured.
_KEYED = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/route-sessions", "/v1/stats",
          "/v1/nodes", "/metrics")
_MEMBERSHIP = ("/v1/nodes/register", "/v1/nodes/heartbeat")  # node keys and admission guard these instead


def make_tracker_app(gateway: Gateway, *, max_body_bytes: int = 4 * 1024 * 1024,
                     prover: Prover | None = None, identity: Identity | None = None,
                     admission: Admission = Admission(), api_keys: frozenset[str] = frozenset(),
                     tls_ca: str | None = None) -> QuartTrio:
    """The tracker's app. Without a prover, every Model Artifact claim fails (nothing can check it).

    `identity` is the tracker's key (its public half goes to every node that
    registers; the gateway's authority signs capabilities with it, and member
    certificates are issued under `tls_ca`, its identity certificate, made
    here when not given);
    `admission` says which node keys may register; `api_keys`, when not
    empty, guard the OpenAI and telemetry endpoints.
    """
    app = QuartTrio("dgr.tracker")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    install_error_handlers(app)
    registry = gateway.registry
    verifier = Verifier()
    if identity is not None and tls_ca is None:
        tls_ca = identity_cert(identity, "tracker")

    @app.before_request
    async def _api_key():
        path = request.path
        if not api_keys or path in _MEMBERSHIP:
            return
        if any(path == p or path.startswith(p + "/") for p in _KEYED):
            check_bearer(request.headers.get("Authorization"), api_keys)
            authenticated(request.scope)

    async def _membership(*, joining: bool = False, node_id: str | None = None) -> tuple[bytes, bytes, str]:
        """A membership message's raw body, signer key and signature, once the signature holds (and, `joining`,
        the key is admitted; given `node_id`, the key owns that id); nothing is parsed. Each check but the
        body's digest runs on the headers, before a byte of the body is read.

        Raises:
            CallerError(UNAUTHENTICATED | REPLAYED | BODY_TOO_LARGE); NOT_FOUND: `node_id` is not the key's
                (dgr.tracker.registry `beating`).
        """
        headers = {h: request.headers.get(h, "") for h in SIG_HEADERS}
        try:
            head = verifier.check_head(request.method, request.path, headers, time.time())
            if joining:
                admission.admit(head.key, headers["x-dgr-signature"], request.headers.get(JOIN_HEADER))
            if node_id is not None:
                registry.beating(node_id, head.key)
        except CallerError as exc:
            raise unread(exc)  # refused from the headers: the body is never read
        raw = await read_body(_REGISTRY_LIMIT)
        key = verifier.check_body(head, raw, time.time())
        authenticated(request.scope)
        return raw, key, headers["x-dgr-signature"]

    # -- node registry ----------------------------------------------------------
    @app.post("/v1/nodes/register")
    async def register():
        raw, key, signature = await _membership(joining=True)
        data = parse_json(raw)
        seen = request.remote_addr if isinstance(request.remote_addr, str) else None
        entry = registry.register(data, trio.current_time(), key=key, seen=seen)
        (prover or Prover()).submit(entry)  # challenges run in the prover's nursery; PENDING until then
        reply: dict[str, Any] = {"node": entry.node_id, "registered": True, "proof": entry.proof.to_json(),
                                 "url": entry.url, "seed": entry.seed, "seen": seen,
                                 "heartbeat_s": registry.heartbeat_s}
        if identity is not None:
            reply["tracker_key"] = identity.public_text
            reply["tls_ca"], reply["tls_member_cert"] = tls_ca, member_cert(identity, key)
            if admission.token is not None:
                reply["tracker_proof"] = tracker_join_proof(admission.token, identity.public, signature)
        return json_response(reply)

    @app.post("/v1/nodes/heartbeat")
    async def heartbeat():
        node_id = request.headers.get(NODE_HEADER)
        if not node_id:
            raise CallerError(Reason.INVALID_REQUEST, f"a heartbeat names its node in {NODE_HEADER}")
        raw, key, _ = await _membership(node_id=node_id)  # that key owns that id, before a byte of the body is read
        data = parse_json(raw)
        if data.get("node") != node_id:
            raise CallerError(Reason.INVALID_REQUEST, f"the heartbeat's node is not the one in {NODE_HEADER}")
        entry = registry.heartbeat(data, trio.current_time(), key=key)
        # The node learns its proof verdict here, to show it to its operator; a draining one, that it was heard
        # and how many of its sessions are being handed over (dgr.tracker.drain).
        drained = {"draining": True, "handed_over": gateway.drains.handover(node_id)} if (
            entry.role is Role.DRAINING) else {}
        return json_response({"ok": True, "proof": entry.proof.to_json(), **drained})

    @app.get("/v1/nodes")
    async def nodes():
        now = trio.current_time()  # the registry's clock
        return json_response({"nodes": [n.to_json(now) for n in registry.nodes.values()]})

    # -- Model Artifacts --------------------------------------------------------
    @app.get("/v1/artifacts")
    async def artifacts():
        known = [] if prover is None else sorted(prover.manifests.values(), key=lambda m: m.id)
        return json_response({"artifacts": [
            {"manifest_id": m.id, "file": m.file.name, "size": m.file.size, "architecture": m.model.architecture,
             "block_count": m.model.block_count, "info_hash_v2": m.torrent.info_hash_v2,
             "seeders": len(registry.seeders(m.id))}
            for m in known
        ]})

    @app.get("/v1/artifacts/<manifest_id>/peers")
    async def artifact_peers(manifest_id: str):
        if prover is None or manifest_id not in prover.manifests:
            raise CallerError(Reason.NOT_FOUND, f"this tracker does not know manifest {manifest_id[:12]}")
        return json_response({"manifest_id": manifest_id, "peers": [
            {"node": n.node_id, "seed": n.seed, "layers": f"{n.start}:{n.stop}"} for n in registry.seeders(manifest_id)
        ]})

    layouts: dict[str, Any] = {}  # manifest id -> its ModelLayout, priced once

    @app.post("/v1/assign")
    async def assign():
        """The layers a joining node should serve (dgr.tracker.assign): for a node this tracker would admit, as a
        registration is (signed, and a listed key or the join token's proof, from the headers before the body is
        read); open where every key is (a loopback tracker)."""
        if admission.open:
            body = await read_json(_REGISTRY_LIMIT)
        else:
            raw, _, _ = await _membership(joining=True)
            body = parse_json(raw)
        # imported here: the planner pulls in gguf, which a tracker without manifests never needs
        from dgr.plan import PlanParams
        from dgr.plan.sources import layout_from_manifest
        from dgr.tracker.assign import assign_layers, coverage

        manifest_id = body.get("manifest_id")
        manifest = prover.manifests.get(manifest_id) if prover is not None and isinstance(manifest_id, str) else None
        if manifest is None:
            raise CallerError(Reason.NOT_FOUND, f"this tracker does not know manifest {str(manifest_id)[:12]}: "
                                                "start it with --manifest for that file")
        numbers = {k: body.get(k, d) for k, d in (("memory_bytes", None), ("context", 4096), ("sessions", 1))}
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2 ** 62 for v in numbers.values()):
            raise CallerError(Reason.INVALID_REQUEST, "memory_bytes, context and sessions must be positive integers")
        gpu_bytes, cpu_moe = body.get("gpu_memory_bytes", 0), body.get("cpu_moe", False)
        if isinstance(gpu_bytes, bool) or not isinstance(gpu_bytes, int) or not 0 <= gpu_bytes < 2 ** 62:
            raise CallerError(Reason.INVALID_REQUEST, "gpu_memory_bytes must be a non-negative integer")
        if not isinstance(cpu_moe, bool) or (cpu_moe and not gpu_bytes):
            raise CallerError(Reason.INVALID_REQUEST, "cpu_moe is a boolean, for a node with gpu_memory_bytes")
        layout = layouts.get(manifest.id)
        if layout is None:
            layout = layouts[manifest.id] = layout_from_manifest(manifest.to_json())
        params = PlanParams(context=numbers["context"], sessions=numbers["sessions"], cpu_moe=cpu_moe)
        counts = coverage(registry.nodes.values(), manifest.id, layout.n_layers)
        chosen = await trio.to_thread.run_sync(assign_layers, layout, params, numbers["memory_bytes"], counts,
                                               gpu_bytes)
        return json_response({**chosen.to_json(), "manifest_id": manifest.id, "coverage": counts})

    # -- OpenAI API -------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        data = []
        for name, entries in sorted(gateway.models().items()):
            entries = [n for n in entries if n.routable]
            if not entries:
                continue
            first = entries[0]
            data.append({
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "dgr",
                "dgr": {
                    "backend": first.backend,
                    "architecture": first.model.architecture,
                    "n_layers": first.model.n_layers,
                    "hidden_size": first.model.hidden_size,
                    "seam_width": first.model.seam_width,
                    "context_length": first.model.context_length,  # trained; nodes serve max_positions
                    "max_positions": min(n.max_positions for n in entries),
                    "digest": first.model.digest,
                    "metadata": first.model.metadata,
                    # a node's own description is nested: what it declares never stands in for the tracker's fields
                    "nodes": [{"node": n.node_id, "layers": f"{n.start}:{n.stop}", "max_positions": n.max_positions,
                               "describe": n.describe} for n in entries],
                },
            })
        return json_response({"object": "list", "data": data})

    async def generate(kind: str):
        req = parse_request(await read_json(max_body_bytes), kind)  # type: ignore[arg-type]
        live = await gateway.open(req, scope=_prefix_scope(request.headers.get("Authorization")))
        headers = {ROUTE_SESSION_HEADER: live.rs.sid}
        if req.stream:
            live.unclaimed_since = trio.current_time()  # until the body starts: a client gone before it is noticed
            response = Response(completion_stream(gateway, live), 200, mimetype="text/event-stream",
                                headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            # Quart cuts every response at RESPONSE_TIMEOUT (60 s); a stream lives as long as its
            # Route Session, which the gateway bounds (max_session_s, slow_client_s).
            response.timeout = None
            return response
        try:
            text = []
            async for delta in live.recv:
                text.append(delta.text)
        finally:
            gateway.cancel(live.rs.sid, "the client went away")
        rs = live.rs
        snapshot = rs.snapshot(trio.current_time())
        if rs.state is not RouteState.DONE:
            failure = rs.failure or Failure(Reason.INTERNAL, "session ended without an answer")
            return error_response(failure, headers=headers, route_session=rs.sid)
        return json_response(
            completion_body(req, rs.sid, "".join(text), rs.finish_reason or "stop", live.usage(), snapshot),
            headers=headers,
        )

    # one view for both, the route giving its kind
    app.add_url_rule("/v1/chat/completions", "chat_completions", generate, methods=["POST"], defaults={"kind": "chat"})
    app.add_url_rule("/v1/completions", "completions", generate, methods=["POST"], defaults={"kind": "completion"})

    # -- Route Sessions ---------------------------------------------------------
    def _viewer() -> str | None:
        """Whose Route Sessions the caller sees: its API key's scope; None without API keys (every one)."""
        return _prefix_scope(request.headers.get("Authorization")) if api_keys else None

    def _session(sid: str) -> RouteSession:
        """Raises: CallerError(NOT_FOUND): no such session, or another key's (the same answer: no oracle)."""
        rs, viewer = gateway.lookup(sid), _viewer()
        if rs is None or viewer not in (None, rs.owner):
            raise CallerError(Reason.NOT_FOUND, f"no route session {sid[:64]}")
        return rs

    @app.get("/v1/route-sessions")
    async def route_sessions():
        now, viewer = trio.current_time(), _viewer()
        live = [l.rs.snapshot(now) for l in gateway.sessions.values() if viewer in (None, l.rs.owner)]
        ended = [rs for rs in gateway.ended.values() if viewer in (None, rs.owner)][-50:]
        return json_response({"active": live, "recent": [rs.snapshot(now) for rs in ended]})

    @app.get("/v1/route-sessions/<sid>")
    async def route_session(sid: str):
        return json_response(_session(sid).snapshot(trio.current_time()))

    @app.get("/v1/route-sessions/<sid>/events")
    async def route_session_events(sid: str):
        rs = _session(sid)
        hub = gateway.telemetry(sid)

        async def events() -> AsyncIterator[bytes]:
            if hub is None:  # already ended: its final state, once
                yield b"event: telemetry\n" + sse(rs.snapshot(trio.current_time()))
                return
            recv = hub.subscribe()
            async with recv:
                async for snapshot in recv:
                    yield b"event: telemetry\n" + sse(snapshot)

        response = Response(events(), 200, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
        response.timeout = None  # ends with the session, not at Quart's 60 s
        return response

    @app.get("/v1/stats")
    async def stats():
        return json_response(gateway.stats())

    @app.get("/metrics")
    async def metrics():
        return Response(render(gateway.metrics.registry), 200, content_type=METRICS_TYPE)

    @app.get("/healthz")
    async def healthz():
        return json_response({"ok": True, "nodes": len(registry.alive())})

    @app.get("/openapi.json")
    async def openapi():
        return json_response(openapi_document(sorted(gateway.models())))

    @app.get("/")
    async def dashboard():
        # Read per request: the page is small, and a missing file then fails only this route.
        page = resources.files("dgr.tracker").joinpath("dashboard.html").read_bytes()
        return Response(page, 200, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    served = deliver_fast_path(gateway.deliveries, app)
    # without API keys (a loopback tracker), no web page may drive it: the key would be the guard otherwise
    return served if api_keys else loopback_only(served)


def _prefix_scope(authorization: str | None) -> str:
    """A request's prefix isolation scope: a hash of its credential, so one key never reuses another's prefix.

    Without API keys every caller presenting the same header (or none) shares one scope.
    """
    if not authorization:
        return ""
    return hashlib.sha256(b"dgr-prefix-scope\0" + authorization.encode("utf-8", "replace")).hexdigest()
