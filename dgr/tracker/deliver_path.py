"""The deliveries' fast path: a tail's answers and nodes' failure reports, served beside the framework.

One job: wrap the tracker's app so that POST DELIVER_STREAM_PATH (a record
per token, for one session) and POST DELIVER_PATH (a JSON failure report)
skip Quart. Rules: both are read up to one frame's size limit; each is
authorized by the session's delivery capability (`Gateway.authorize_delivery`,
`Gateway.report`) before its connection is marked authenticated; a ring's
answers never come as JSON on DELIVER_PATH (BAD_FRAME). Every other request
goes to the app untouched. What a delivery means is dgr.tracker.deliveries'.
"""

from __future__ import annotations

from dgr.api.http import read_raw_seam, respond_raw_error, serve_seam_stream
from dgr.api.server import authenticated
from dgr.errors import CallerError, DgrError, Reason
from dgr.seam.wire import DELIVER_PATH, DELIVER_STREAM_PATH
from dgr.tracker.gateway import Gateway

__all__ = ["deliver_fast_path"]

_DELIVER_LIMIT = 1024 * 1024  # a TOKEN or ACK frame, or a failure report: small


def deliver_fast_path(gateway: Gateway, app):
    """Wrap `app` so that a route's answers (POST DELIVER_STREAM_PATH, a record per token) skip the framework.

    Its nodes' failure reports (POST DELIVER_PATH, JSON) are served here too, read up to one frame's
    size limit and authorized by the session's delivery capability in `Gateway.report`.
    """

    async def asgi(scope, receive, send):
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in (DELIVER_PATH, DELIVER_STREAM_PATH)):
            await app(scope, receive, send)
            return
        if scope["path"] == DELIVER_STREAM_PATH:  # a tail's answers for one session

            def authorize(capability: str | None, sid: str) -> None:
                gateway.authorize_delivery(capability, sid)
                authenticated(scope)

            await serve_seam_stream(scope, receive, send, limit=_DELIVER_LIMIT, what="delivery stream",
                                    authorize=authorize, apply=gateway.deliver_frame)
            return
        try:
            req = await read_raw_seam(scope, receive, _DELIVER_LIMIT, "a delivery")
            if req is None:
                return
            if not req.is_json:
                raise CallerError(Reason.BAD_FRAME, f"a route's answers come on {DELIVER_STREAM_PATH}; "
                                                    f"{DELIVER_PATH} takes JSON failure reports")
            gateway.report(req.body, req.capability)
            authenticated(scope)  # the report held the session's delivery capability
        except (DgrError, ValueError) as exc:
            await respond_raw_error(send, exc, "delivery")
            return
        await send({"type": "http.response.start", "status": 204, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    return asgi
