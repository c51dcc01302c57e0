"""The node's HTTP face: seam sessions (a head's open tokenizing its prompt) and steps, status, artifact proofs.

Every session is on a ring: its open names its relay (the tail's with its loop back to the head), and its
steps come on `POST /v1/seam/stream` (from the previous hop, one long-lived request), served by a bare
ASGI handler in front of Quart: it runs once per token per hop, and Quart's request and response objects
cost more than the step's own bookkeeping. Everything else goes through Quart.

Every call that names a Route Session carries its capability in
`X-Dgr-Capability`; `NodeService.authorize` checks it with the tracker key
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

Layer-possession challenges are answered only when signed by the pinned
tracker key and addressed to this node, and each answer is signed with this
node's key over the challenge (nonce included): a node without the weights
can neither get an honest node to answer its challenges nor pass off that
node's answers as its own.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from dgr.metrics import CONTENT_TYPE as METRICS_TYPE, render
from dgr.api.http import install_error_handlers, json_response, parse_json, read_body, read_json, serve_seam_stream
from dgr.api.openai import are_token_ids
from dgr.api.openapi import node_openapi_document
from dgr.api.server import authenticated
from dgr.errors import CallerError, Failure, Reason
from dgr.seam.keys import BLOCK_TOKENS, KEY_HEX, MAX_MARKS, decode_marks, valid_chain
from dgr.node.prompt import PromptPlan, count_field
from dgr.node.service import NodeService
from dgr.sampling import SamplingParams
from dgr.node.speculation import DRAFT_SOURCES, SpecPlan
from dgr.node.relay import Loop, NextHop, RelayPlan
from dgr.security.auth import Scope
from dgr.spec.ngram import WINDOW
from dgr.seam.wire import (
    CAPABILITY_HEADER,
    MAX_CONTROL_BYTES,
    MAX_DRAFTS,
    MAX_TOKENIZE_BYTES,
    ROUTE_SESSION_HEADER,
    STREAM_PATH,
    TICKET_HEADER,
)

if TYPE_CHECKING:
    from dgr.node.artifact import NodeArtifact
    from dgr.security.tls import TlsTrust

__all__ = ["make_node_app", "seam_fast_path", "CAPABILITY_HEADER"]

_JSON_LIMIT = MAX_CONTROL_BYTES
_SID = re.compile(r"[0-9a-f]{32}")
_JOIN_WAIT_S = 5.0  # a challenge may overtake the registration reply that carries the tracker's key
_MAX_LANE = 1 << 16  # a phase lane (dgr.fsm.phases) is a small sequence slot number
_MAX_ROUTE = 8192  # a ring's route key: its node ids, comma-separated


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

    def _authorize(sid: str, need: Scope = Scope.CONTROL) -> None:
        _checked(service, request.scope)(request.headers.get(CAPABILITY_HEADER), sid, need)

    @app.post("/v1/seam/sessions")
    async def open_session():
        headers = request.headers
        named = headers.get(ROUTE_SESSION_HEADER)
        ticket = service.admit_open(headers.get(CAPABILITY_HEADER), headers.get(TICKET_HEADER), named or "")
        raw = await read_body(MAX_TOKENIZE_BYTES)  # only now: the caller is the gateway, with the tracker's ticket
        service.redeem_open(ticket, raw)  # the bytes the tracker signed, or nothing is parsed
        body = parse_json(raw)
        sid, max_positions, params, prefix, lane, marks = _open_args(service, body, named)
        relay = _relay_plan(service, body.get("relay"))
        spec = _spec_plan(service, body.get("spec"))
        prompt = None if "prompt" not in body else PromptPlan.from_json(
            body["prompt"], root=body.get("root"), max_new=body.get("max_new"), max_prompt=body.get("max_prompt"),
            vocab_size=service.backend.info.vocab_size)
        # a later hop opened with the head: the prompt's length is not known, only what the answer may add
        max_new = None if prompt is not None or body.get("max_new") is None else count_field(body["max_new"],
                                                                                             "max_new")
        opened = await service.open_session(sid, max_positions, params, relay=relay, prefix=prefix, lane=lane,
                                            marks=marks, spec=spec, prompt=prompt, max_new=max_new)
        answer = {"session": sid, "node": service.node_id, "prefix_positions": opened.reused}
        if opened.tokens is not None:
            answer |= {"tokens": opened.tokens, "reusable": opened.reusable}
        return json_response(answer, 201)

    @app.post("/v1/seam/sessions/<sid>/prefix")
    async def adopt_prefix(sid: str):
        _authorize(sid)
        prefix, marks = _prefix_args(service, await read_json(_JSON_LIMIT))
        reused = await service.adopt_prefix(sid, prefix, marks)
        return json_response({"session": sid, "node": service.node_id, "prefix_positions": reused})

    @app.delete("/v1/seam/sessions/<sid>")
    async def close_session(sid: str):
        _authorize(sid)
        reason = request.args.get("reason")
        if reason:
            try:
                why = Reason(reason)
            except ValueError:
                raise CallerError(Reason.INVALID_REQUEST, f"unknown reason {reason!r}") from None
            await service.fail_session(sid, Failure(why, request.args.get("message", ""), node=service.node_id))
        else:
            keep = [k for k in request.args.get("keep", "").split(".") if k]
            if not valid_chain(keep, service.max_positions // BLOCK_TOKENS + 1):
                raise CallerError(Reason.INVALID_REQUEST, f"keep must be {KEY_HEX}-digit hex block keys joined by '.'")
            tail = decode_marks(request.args.get("tail", ""), BLOCK_TOKENS - 1)
            if tail is None:
                raise CallerError(Reason.INVALID_REQUEST, f"tail must be the base64 marks of under {BLOCK_TOKENS} "
                                                          "positions")
            await service.close_session(sid, keep, tail)
        return json_response({"session": sid, "closed": True})

    @app.get("/v1/seam/sessions/<sid>")
    async def session_status(sid: str):
        _authorize(sid)
        return json_response(await service.session_json(sid))

    def _artifact() -> NodeArtifact:
        if artifact is None:
            raise CallerError(Reason.NOT_FOUND, f"{service.node_id} claims no Model Artifact (no --manifest)")
        return artifact

    @app.post("/v1/artifact/challenge")
    async def artifact_challenge():
        art = _artifact()
        body = await read_json(_JSON_LIMIT)
        await service.wait_joined(_JOIN_WAIT_S)
        service.accept_challenge(body)
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
        return json_response({"ok": True, "node": service.node_id})

    @app.get("/openapi.json")
    async def openapi():
        return json_response(node_openapi_document())

    return seam_fast_path(service, app)


def _open_args(service: NodeService, body: dict[str, Any], named: str | None
               ) -> tuple[str, int, SamplingParams, list[str], int | None, bytes]:
    """An open body's (session, max_positions, sampling, prefix, lane, marks); the session must be the one named in
    the header, where there is one (a node without a tracker also takes an open that names it in the body only).

    Raises: CallerError(BAD_FRAME | INVALID_REQUEST).
    """
    sid = body.get("session")
    if named is not None and sid != named:
        raise CallerError(Reason.INVALID_REQUEST, f"the body opens another session than {ROUTE_SESSION_HEADER} names")
    if not isinstance(sid, str) or not _SID.fullmatch(sid):
        raise CallerError(Reason.BAD_FRAME, "session must be 32 lowercase hex digits")
    max_positions = body.get("max_positions")
    if not isinstance(max_positions, int) or isinstance(max_positions, bool):
        raise CallerError(Reason.INVALID_REQUEST, "max_positions must be an integer")
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise CallerError(Reason.INVALID_REQUEST, "sampling must be an object")
    params = SamplingParams.from_json(sampling)
    prefix, marks = _prefix_args(service, body)
    lane = body.get("lane")
    if lane is not None and (not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < _MAX_LANE):
        raise CallerError(Reason.INVALID_REQUEST, f"lane must be an integer in [0, {_MAX_LANE})")
    return sid, max_positions, params, prefix, lane, marks


def _prefix_args(service: NodeService, body: dict[str, Any]) -> tuple[list[str], bytes]:
    """An open's or an adopt's (prefix, marks): the block keys and position marks it offers to reuse.

    Raises: CallerError(INVALID_REQUEST).
    """
    prefix = body.get("prefix") or []
    if not valid_chain(prefix, service.max_positions // BLOCK_TOKENS + 1):
        raise CallerError(Reason.INVALID_REQUEST, f"prefix must be a list of {KEY_HEX}-digit hex block keys")
    marks = decode_marks(body.get("marks", ""), min(service.max_positions, MAX_MARKS))
    if marks is None:
        raise CallerError(Reason.INVALID_REQUEST, "marks must be base64 position marks, at most one a position")
    return prefix, marks


def _spec_plan(service: NodeService, data: Any) -> SpecPlan | None:
    """An open body's "spec" object (issue 42): {k_max, exact, fixed_k?, history?, source?}; None: no speculation.

    Raises:
        CallerError(INVALID_REQUEST): malformed, or this node's memory cannot drop the refused drafts.
    """
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - {"k_max", "exact", "fixed_k", "history", "source"}:
        raise CallerError(Reason.INVALID_REQUEST, "spec must be an object of k_max, exact, fixed_k, history and "
                                                  "source")
    k_max, exact, fixed, history = data.get("k_max"), data.get("exact", False), data.get("fixed_k"), data.get("history", [])
    source = data.get("source", "ngram")
    if source not in DRAFT_SOURCES:
        raise CallerError(Reason.INVALID_REQUEST, f"spec.source must be one of {', '.join(DRAFT_SOURCES)}")
    if source == "draft" and service.backend.is_tail and service.links.draft is None:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id} has no draft model (--draft-model)")
    if not isinstance(k_max, int) or isinstance(k_max, bool) or not 1 <= k_max <= MAX_DRAFTS:
        raise CallerError(Reason.INVALID_REQUEST, f"spec.k_max must be an integer in [1, {MAX_DRAFTS}]")
    if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool) or not 0 <= fixed <= k_max):
        raise CallerError(Reason.INVALID_REQUEST, "spec.fixed_k must be an integer in [0, k_max]")
    vocab = service.backend.info.vocab_size
    if not isinstance(exact, bool) or not are_token_ids(history, vocab) or len(history) > WINDOW:
        raise CallerError(Reason.INVALID_REQUEST, f"spec.exact must be a boolean and spec.history at most "
                                                  f"{WINDOW} token ids of this vocabulary")
    if not service.backend.info.drops_positions:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id}'s memory cannot drop positions: it cannot "
                                                  "speculate")
    return SpecPlan(k_max=k_max, fixed_k=fixed, exact=exact, history=tuple(history), source=source)


def _relay_plan(service: NodeService, data: Any) -> RelayPlan:
    """A ring session's relay plan from an open body's "relay" object: every session is on a ring, so an
    open without one is refused.

    Answers always go to this node's own tracker, never to an address the caller names.

    Raises:
        CallerError(INVALID_REQUEST): missing or malformed (a tail's without its loop to the head), or this
            node has no tracker to deliver to.
    """
    if not isinstance(data, dict):
        raise CallerError(Reason.INVALID_REQUEST, "relay must be an object: every session is on a ring")
    if service.tracker_url is None:
        raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id} has no tracker to deliver a ring's answers to")
    nxt, cap = data.get("next"), data.get("deliver_capability")
    if cap is not None and not isinstance(cap, str):
        raise CallerError(Reason.INVALID_REQUEST, "relay.deliver_capability must be a string")
    hop = None if nxt is None else _next_hop(nxt, "relay.next", service.tls)
    route, nodes = data.get("route", ""), data.get("nodes", 1)
    if (not isinstance(route, str) or len(route) > _MAX_ROUTE
            or not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= _MAX_LANE):
        raise CallerError(Reason.INVALID_REQUEST, "relay.route is the route's node ids, relay.nodes their count")
    if (hop is None) != service.backend.is_tail:
        raise CallerError(Reason.INVALID_REQUEST, "a ring's tail delivers to the gateway; every other node forwards")
    loop = data.get("loop")
    if (loop is None) == service.backend.is_tail:
        raise CallerError(Reason.INVALID_REQUEST, "a ring's tail, and it only, loops back to the head (relay.loop)")
    if loop is not None:
        if not isinstance(loop, dict) or not isinstance(loop.get("ignore_eos", False), bool):
            raise CallerError(Reason.INVALID_REQUEST, "relay.loop is a ring tail's {head, ignore_eos}")
        loop = Loop(_next_hop(loop.get("head"), "relay.loop.head", service.tls), loop.get("ignore_eos", False))
    return RelayPlan(hop, service.tracker_url, cap, loop, route, nodes)


def _next_hop(data: Any, what: str, tls: TlsTrust) -> NextHop:
    """A node to send steps on to, from {node, url, capability, tls_cert}.

    Raises: CallerError(INVALID_REQUEST) if malformed; (FORBIDDEN) an http:// url under --require-tls.
    """
    if (not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("node", "url"))
            or not data["url"].startswith(("http://", "https://"))
            or any(data.get(k) is not None and not isinstance(data[k], str) for k in ("capability", "tls_cert"))):
        raise CallerError(Reason.INVALID_REQUEST, f"{what} needs a node id and an http(s):// url")
    tls.check(data["url"], what)
    return NextHop(data["node"], data["url"], data.get("capability"), data.get("tls_cert"))


def _checked(service: NodeService, scope):
    """`service.authorize`, and once a capability holds, the connection leaves the server's guest limits
    (dgr.api.server `authenticated`): the one place the node's routes mark it."""

    def authorize(capability: str | None, sid: str, need: Scope = Scope.STEP) -> None:
        service.authorize(capability, sid, need)
        authenticated(scope)

    return authorize


def seam_fast_path(service: NodeService, app):
    """Wrap `app` so that POST /v1/seam/stream skips the framework."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == STREAM_PATH:
            await _stream(service, scope, receive, send)
        else:
            await app(scope, receive, send)

    return asgi


async def _stream(service: NodeService, scope, receive, send) -> None:
    """A ring session's steps from the previous hop, checked against this node's capability for it."""
    await serve_seam_stream(scope, receive, send, limit=service.max_frame_bytes, what="stream",
                            authorize=_checked(service, scope), apply=service.accept_streamed)
