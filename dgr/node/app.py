"""The node's HTTP face: seam sessions (a head's open tokenizing its prompt) and steps, status, artifact proofs.

Every session is on a ring: its open names its relay (the tail's with its loop back to the head), and its
steps come on `POST /v1/seam/stream` (from the previous hop, one long-lived request), served by a bare
ASGI handler in front of Quart: it runs once per token per hop, and Quart's request and response objects
cost more than the step's own bookkeeping. Everything else goes through Quart.

Every call that names a Route Session carries its capability in
`X-Dgr-Capability`; `NodeTrust.authorize` checks it with the tracker key
pinned at join (a node that has not joined refuses them; one with no
tracker, on loopback, asks for none) before the session is touched. The
session is named in the path or in `X-Dgr-Route-Session`, never only in a
body, so the check comes before any body byte is read: a caller without a
capability is answered 403 having sent a head and nothing else (and its
connection is closed, dgr.api.http). Steps take any capability for the
session; open, close, status and naming a prefix take the gateway's own (CONTROL),
and an open also the tracker's single-use ticket for its exact body
(`X-Dgr-Ticket`, dgr.security.tickets), whose digest is checked before the
body is parsed.

`/healthz` answers anyone with the node's id; asked about a session
(`?session=`, the tracker's probe of a late step) it needs the gateway's
capability for it, and adds how far the node got with it (NodeService.health).

Layer-possession challenges are answered only when signed by the pinned
tracker key (checked from the request's headers, before its body is read)
and addressed to this node, and each answer is signed with this node's key
over the challenge (nonce included): a node without the weights can neither
get an honest node to answer its challenges nor pass off that node's answers
as its own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import trio
from quart import Response, request
from quart_trio import QuartTrio

from dgr.metrics import CONTENT_TYPE as METRICS_TYPE, render
from dgr.api.http import install_error_handlers, json_response, parse_json, read_body, read_json, serve_seam_stream
from dgr.api.openapi import node_openapi_document
from dgr.api.server import authenticated
from dgr.errors import CallerError, Failure, Reason
from dgr.seam.keys import BLOCK_TOKENS, KEY_HEX, decode_marks, valid_chain
from dgr.seam.opening import AdoptRequest, OpenAnswer, OpenRequest, RelayOrder, SpecPlan
from dgr.node.service import NodeService
from dgr.node.relay import RelayPlan
from dgr.security.auth import Scope
from dgr.seam.wire import (
    CAPABILITY_HEADER,
    MAX_CONTROL_BYTES,
    MAX_TOKENIZE_BYTES,
    ROUTE_SESSION_HEADER,
    STREAM_PATH,
    TICKET_HEADER,
)

if TYPE_CHECKING:
    from dgr.node.artifact import NodeArtifact

__all__ = ["make_node_app", "seam_fast_path", "CAPABILITY_HEADER"]

_JSON_LIMIT = MAX_CONTROL_BYTES
_JOIN_WAIT_S = 5.0  # a challenge may overtake the registration reply that carries the tracker's key


def make_node_app(service: NodeService, *, artifact: NodeArtifact | None = None) -> QuartTrio:
    """The node's app; with an artifact it also answers the tracker's layer-possession challenges."""
    app = QuartTrio("dgr.node")
    # Seam frames (up to max_frame_bytes) never reach Quart: `seam_fast_path` reads them.
    # Everything else is small JSON; only an open may be larger (a head's carries the prompt).
    app.config["MAX_CONTENT_LENGTH"] = MAX_TOKENIZE_BYTES
    install_error_handlers(app)

    @app.before_request
    async def _body_limit():
        """1 MiB for every route but an open (it may carry the prompt); refused by its announced size before
        anything is read."""
        limit = MAX_TOKENIZE_BYTES if request.path == "/v1/seam/sessions" else MAX_CONTROL_BYTES
        request.max_content_length = limit
        if request.content_length is not None and request.content_length > limit:
            raise CallerError(Reason.BODY_TOO_LARGE, f"body of {request.content_length} bytes exceeds {limit}")

    @app.post("/v1/seam/sessions")
    async def open_session():
        headers = request.headers
        named = headers.get(ROUTE_SESSION_HEADER)
        ticket = service.trust.admit_open(headers.get(CAPABILITY_HEADER), headers.get(TICKET_HEADER), named or "")
        authenticated(request.scope)  # the gateway's capability and the tracker's ticket held, as in `_authorize`
        raw = await read_body(MAX_TOKENIZE_BYTES)  # only now: the caller is the gateway, with the tracker's ticket
        service.trust.redeem_open(ticket, raw)  # the bytes the tracker signed, or nothing is parsed
        req = OpenRequest.from_json(parse_json(raw), named=named, max_positions=service.table.max_positions,
                                    vocab_size=service.backend.info.vocab_size)
        opened = await service.open_session(req.session, req.max_positions, req.sampling,
                                            relay=_relay_plan(service, req.relay), prefix=list(req.reuse.prefix),
                                            lane=req.lane, marks=req.reuse.marks,
                                            spec=None if req.spec is None else _spec_plan(service, req.spec),
                                            prompt=req.prompt, max_new=req.max_new, resume=req.resume,
                                            sample_from=req.sample_from)
        return json_response(OpenAnswer(req.session, service.node_id, opened.reused, opened.tokens, opened.steps,
                                        opened.journal_from).to_json(), 201)

    @app.post("/v1/seam/sessions/<sid>/prefix")
    async def adopt_prefix(sid: str):
        _authorize(service, request.scope, request.headers.get(CAPABILITY_HEADER), sid, Scope.CONTROL)
        named = AdoptRequest.from_json(await read_json(_JSON_LIMIT), service.table.max_positions)
        reused = await service.lifecycle.adopt(sid, list(named.prefix), named.marks)
        return json_response(OpenAnswer(sid, service.node_id, reused).to_json())

    @app.delete("/v1/seam/sessions/<sid>")
    async def close_session(sid: str):
        _authorize(service, request.scope, request.headers.get(CAPABILITY_HEADER), sid, Scope.CONTROL)
        reason = request.args.get("reason")
        if reason:
            try:
                why = Reason(reason)
            except ValueError:
                raise CallerError(Reason.INVALID_REQUEST, f"unknown reason {reason!r}") from None
            await service.fail_session(sid, Failure(why, request.args.get("message", ""), node=service.node_id))
        else:
            keep = [k for k in request.args.get("keep", "").split(".") if k]
            if not valid_chain(keep, service.table.max_positions // BLOCK_TOKENS + 1):
                raise CallerError(Reason.INVALID_REQUEST, f"keep must be {KEY_HEX}-digit hex block keys joined by '.'")
            tail = decode_marks(request.args.get("tail", ""), BLOCK_TOKENS - 1)
            if tail is None:
                raise CallerError(Reason.INVALID_REQUEST, f"tail must be the base64 marks of under {BLOCK_TOKENS} "
                                                          "positions")
            await service.lifecycle.close(sid, keep, tail)
        return json_response({"session": sid, "closed": True})

    @app.get("/v1/seam/sessions/<sid>")
    async def session_status(sid: str):
        _authorize(service, request.scope, request.headers.get(CAPABILITY_HEADER), sid, Scope.CONTROL)
        return json_response(await service.session_json(sid))

    def _artifact() -> NodeArtifact:
        if artifact is None:
            raise CallerError(Reason.NOT_FOUND, f"{service.node_id} claims no Model Artifact (no --manifest)")
        return artifact

    @app.post("/v1/artifact/challenge")
    async def artifact_challenge():
        await service.wait_joined(_JOIN_WAIT_S)
        head = service.trust.admit_challenge(request.method, request.path, request.headers)  # nothing read yet
        body = service.trust.accept_challenge(head, await read_body(_JSON_LIMIT), parse_json)  # its nonce spent
        art = _artifact()
        # Reading and hashing a piece blocks; the limiter keeps a flood of
        # challenges from taking every worker thread.
        answer = await trio.to_thread.run_sync(art.answer, body, limiter=art.limiter)
        return json_response(service.sign_answer(body, answer))

    @app.get("/v1/artifact")
    async def artifact_status():
        return json_response(_artifact().status())

    @app.get("/v1/node/status")
    async def status():
        # aggregates for anyone; the per-kind counters (which time each request) for the tracker's key only
        return json_response(service.status(detail=service.status_detail(request.headers.get(CAPABILITY_HEADER))))

    @app.get("/metrics")
    async def metrics():
        return Response(render(service.metrics.registry), 200, content_type=METRICS_TYPE)

    @app.get("/healthz")
    async def healthz():
        # with ?session=, the tracker's probe of a late step: the session's progress, for its CONTROL capability
        sid = request.args.get("session")
        if sid is not None:
            _authorize(service, request.scope, request.headers.get(CAPABILITY_HEADER), sid, Scope.CONTROL)
        return json_response(service.health(sid))

    @app.get("/openapi.json")
    async def openapi():
        return json_response(node_openapi_document())

    return seam_fast_path(service, app)


def _spec_plan(service: NodeService, spec: SpecPlan) -> SpecPlan:
    """An open's speculation, where this node can give it (its shape is dgr.seam.opening's to check).

    Raises: CallerError(INVALID_REQUEST): drafts from a draft model this tail lacks, or memory that cannot
    drop the refused drafts.
    """
    if spec.source == "draft" and service.backend.is_tail and service.links.draft is None:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id} has no draft model (--draft-model)",
                          param="spec.source")
    if not service.backend.info.drops_positions:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id}'s memory cannot drop positions: it cannot "
                                                  "speculate", param="spec")
    return spec


def _relay_plan(service: NodeService, order: RelayOrder) -> RelayPlan:
    """A ring session's relay plan from an open's `relay` (which every open has: dgr.seam.opening), where this
    node can follow it. Answers always go to this node's own tracker, never to an address the caller names.

    Raises:
        CallerError(INVALID_REQUEST): no tracker to deliver to, a next hop where this node is the tail (or
            none where it is not), a loop on a node that is not the tail (or none on the tail);
        CallerError(FORBIDDEN): an http:// url under --require-tls.
    """
    if service.tracker_url is None:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id} has no tracker to deliver a ring's answers to",
                          param="relay")
    if order.next is not None:
        service.tls.check(order.next.url, "relay.next")
    if (order.next is None) != service.backend.is_tail:
        raise CallerError(Reason.INVALID_REQUEST, "a ring's tail delivers to the gateway; every other node forwards",
                          param="relay.next")
    if (order.loop is None) == service.backend.is_tail:
        raise CallerError(Reason.INVALID_REQUEST, "a ring's tail, and it only, loops back to the head (relay.loop)",
                          param="relay.loop")
    if order.loop is not None:
        service.tls.check(order.loop.head.url, "relay.loop.head")
    return RelayPlan(order.next, service.tracker_url, order.deliver_capability, order.loop, order.route, order.nodes)


def _authorize(service: NodeService, scope, capability: str | None, sid: str, need: Scope = Scope.STEP) -> None:
    """`NodeTrust.authorize`, and once a capability holds, the connection leaves the server's guest limits
    (dgr.api.server `authenticated`): the one place the node's routes mark it."""
    service.trust.authorize(capability, sid, need)
    authenticated(scope)


def seam_fast_path(service: NodeService, app):
    """Wrap `app` so that POST /v1/seam/stream skips the framework."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == STREAM_PATH:
            # a ring session's steps from the previous hop, checked against this node's capability for it
            await serve_seam_stream(scope, receive, send, limit=service.replies.max_frame_bytes, what="stream",
                                    authorize=functools.partial(_authorize, service, scope),
                                    apply=service.replies.accept_streamed, check_head=service.replies.check_head)
        else:
            await app(scope, receive, send)

    return asgi

