"""The node's HTTP face: seam sessions and steps, tokenizing, status."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from dgr.api.http import install_error_handlers, json_response, read_json
from dgr.errors import CallerError, Failure, Reason
from dgr.node.service import NodeService
from dgr.sampling import SamplingParams
from dgr.seam.wire import CONTENT_TYPE

__all__ = ["make_node_app"]

_JSON_LIMIT = 4 * 1024 * 1024


def make_node_app(service: NodeService) -> QuartTrio:
    app = QuartTrio("dgr.node")
    app.config["MAX_CONTENT_LENGTH"] = service.max_frame_bytes
    install_error_handlers(app)

    @app.post("/v1/seam/sessions")
    async def open_session():
        body = await read_json(_JSON_LIMIT)
        sid = body.get("session")
        max_positions = body.get("max_positions")
        sampling = body.get("sampling") or {}
        if not isinstance(sid, str) or len(sid) != 32:
            raise CallerError(Reason.BAD_FRAME, "session must be 32 hex digits")
        if not isinstance(max_positions, int) or isinstance(max_positions, bool):
            raise CallerError(Reason.INVALID_REQUEST, "max_positions must be an integer")
        if not isinstance(sampling, dict):
            raise CallerError(Reason.INVALID_REQUEST, "sampling must be an object")
        try:
            params = SamplingParams(**sampling)
        except TypeError as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"bad sampling parameters: {exc}") from None
        service.open_session(sid, max_positions, params)
        return json_response({"session": sid, "node": service.node_id}, 201)

    @app.post("/v1/seam/step")
    async def step():
        body = await request.get_data(cache=False)
        reply, compute_s = await service.step(body)
        return Response(reply, 200, content_type=CONTENT_TYPE, headers={"X-Dgr-Compute-Us": str(int(compute_s * 1e6))})

    @app.delete("/v1/seam/sessions/<sid>")
    async def close_session(sid: str):
        reason = request.args.get("reason")
        if reason:
            try:
                why = Reason(reason)
            except ValueError:
                raise CallerError(Reason.INVALID_REQUEST, f"unknown reason {reason!r}") from None
            service.fail_session(sid, Failure(why, request.args.get("message", ""), node=service.node_id))
        else:
            service.close_session(sid)
        return json_response({"session": sid, "closed": True})

    @app.get("/v1/seam/sessions/<sid>")
    async def session_status(sid: str):
        return json_response(service.session_json(sid))

    @app.post("/v1/node/tokenize")
    async def tokenize():
        body = await read_json(_JSON_LIMIT)
        backend = service.backend
        if not backend.is_head:
            raise CallerError(Reason.INVALID_REQUEST, f"{service.node_id} is not a head shard")
        if "messages" in body:
            text = backend.render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise CallerError(Reason.INVALID_REQUEST, "tokenize needs messages or a prompt string")
        tokens = backend.tokenize(text, add_special=True, parse_special=True)
        return json_response({"tokens": tokens, "text": text})

    @app.get("/v1/node/status")
    async def status():
        return json_response(service.status())

    @app.get("/healthz")
    async def healthz():
        return json_response({"ok": True, "node": service.node_id})

    return app
