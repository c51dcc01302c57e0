"""What a route's members send the tracker: the tail's answers, and failure reports.

A tail delivers a session's answers on one stream (dgr.api.http
`serve_seam_stream`), authorized by the session's delivery capability before
any of the body is read; each record's answer goes into the session's inbox
with every hop's compute, where the ring driver takes it (dgr.tracker.ring).

Both skip the framework (`deliver_fast_path`, wrapping the tracker's app):
POST DELIVER_STREAM_PATH (a record per token, for one session) and POST
DELIVER_PATH (a JSON failure report) name their session in
`X-Dgr-Route-Session` and are authorized by the session's delivery
capability from their headers, before a byte of their body is read (a
refused caller is answered at once, its body unread, and its connection
closed); only then is the body read, up to one frame's size limit, and the
connection marked authenticated. A report's body must name the session its
header named. A ring's answers never come as JSON on DELIVER_PATH
(BAD_FRAME). Every other request goes to the app untouched.

A report is scoped to its session: the reporter and the node it names must be
hops of that session's route, only that session fails, and no node is marked
dead on a member's word. A node reported lost is probed with the tracker's
own request (`/healthz`), and only its silence marks it dead. The client is
told who reported what in the tracker's words; the reporter's own text goes
to the tracker's log only.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import attrs
import trio

from dgr.api.http import (SESSION_ID, parse_json, read_raw_seam, respond_raw_error, seam_headers,
                          serve_seam_stream)
from dgr.api.server import authenticated
from dgr.errors import CallerError, DgrError, Failure, PeerError, Reason
from dgr.seam.frame import decode_frame
from dgr.seam.stream import Record
from dgr.seam.wire import DELIVER_PATH, DELIVER_STREAM_PATH, ROUTE_SESSION_HEADER, FrameKind
from dgr.security.auth import CapabilityAuthority, Scope
from dgr.tracker.clients import NodeClients
from dgr.tracker.live import Answer, LiveSession
from dgr.tracker.patience import PROBE_S
from dgr.tracker.registry import GATEWAY_ID, NodeEntry

__all__ = ["Deliveries", "deliver_fast_path"]

log = logging.getLogger("dgr.gateway")

_DELIVER_LIMIT = 1024 * 1024  # a TOKEN or ACK frame, or a failure report: small


@attrs.define
class Deliveries:
    sessions: dict[str, LiveSession]  # the gateway's live sessions (shared, not copied)
    clients: NodeClients
    node_lost: Callable[[str, str], None]  # (node id, why): mark it dead and fail its sessions
    authority: CapabilityAuthority | None = None
    nursery: trio.Nursery | None = None  # where probes run
    _probing: set[str] = attrs.field(factory=set)  # nodes a member reported lost, which the tracker is checking

    def authorize(self, capability: str | None, sid: str, connection: dict[str, Any] | None = None) -> None:
        """Check a delivery capability for session `sid`; once it holds, mark `connection` (the request's ASGI
        scope, where given) authenticated. Raises CallerError(FORBIDDEN)."""
        if self.authority is not None:
            # a route's delivery capability names this "node" (layers 0:1): one for the whole route, since
            # any of its nodes may have to report
            self.authority.check(capability, session=sid, node=GATEWAY_ID, start=0, stop=1, now=time.time(),
                                 need=Scope.STEP)
        if connection is not None:
            authenticated(connection)

    def deliver(self, sid: str, record: Record) -> None:
        """An answer from a delivery stream already authorized for `sid`.

        Raises:
            CallerError(BAD_FRAME | FORBIDDEN | UNKNOWN_SESSION): refused; nothing changed.
        """
        frame = decode_frame(record.frame)
        if frame.kind not in (FrameKind.TOKEN, FrameKind.ACK):
            raise CallerError(Reason.BAD_FRAME, f"a route delivers TOKEN or ACK frames, not {frame.kind.name}")
        if frame.session != sid:
            raise CallerError(Reason.FORBIDDEN, f"a delivery stream of session {sid} carried an answer of {frame.session}")
        self._live(sid).inbox[0].send_nowait(Answer(frame, record.compute_us))

    def admit_report(self, capability: str | None, sid: str) -> None:
        """Check a failure report from its headers alone, before its body is read: `sid` is the session its
        `X-Dgr-Route-Session` names, `capability` the one it carries.

        Raises:
            CallerError(FORBIDDEN): no session named, or no capability for it.
        """
        if not SESSION_ID.fullmatch(sid):
            raise CallerError(Reason.FORBIDDEN, f"a failure report names its session in {ROUTE_SESSION_HEADER} (32 hex "
                                                "digits): its capability is checked before its body is read")
        self.authorize(capability, sid)

    def report(self, body: bytes, capability: str | None, named: str) -> None:
        """A session's node reports a failure (JSON: session, reporter, code, message, node), admitted for the
        session `named` (`admit_report`), which its body must name too.

        Raises:
            CallerError(BAD_FRAME | INVALID_REQUEST | UNKNOWN_SESSION | FORBIDDEN): refused; nothing changed.
        """
        data = parse_json(body)
        sid = data.get("session")
        if sid != named:
            raise CallerError(Reason.FORBIDDEN, f"the report's session is not the one in {ROUTE_SESSION_HEADER}")
        try:
            failure = Failure.from_json(data)
        except (ValueError, KeyError, TypeError):
            raise CallerError(Reason.INVALID_REQUEST, "a failure report needs a code and a message") from None
        self.authorize(capability, sid if isinstance(sid, str) else "")
        live = self._live(sid)
        members = {h.node_id for h in live.rs.route}
        reporter = data.get("reporter")
        if reporter not in members or (failure.node is not None and failure.node not in members):
            raise CallerError(Reason.FORBIDDEN, "a report comes from a node of its session's route and names only one")
        log.warning("session %s: node %s reports %s for %s: %.200s", sid, reporter, failure.reason.value,
                    failure.node or "itself", failure.message)
        said = f"node {reporter} reported {failure.reason.value}" + (f" for node {failure.node}" if failure.node else "")
        live.inbox[0].send_nowait(Failure(failure.reason, said, node=failure.node, step=failure.step))
        if failure.reason is Reason.ROUTE_NODE_LOST and failure.node is not None:
            self._probe_soon(failure.node)

    def _live(self, sid: Any) -> LiveSession:
        live = self.sessions.get(sid) if isinstance(sid, str) else None
        if live is None or live.rs.ended:
            raise CallerError(Reason.UNKNOWN_SESSION, f"no live Route Session {str(sid)[:64]}")
        return live

    def _probe_soon(self, node_id: str) -> None:
        entry = self.clients.registry.nodes.get(node_id)
        if entry is None or not entry.alive or self.nursery is None or node_id in self._probing:
            return
        self._probing.add(node_id)
        self.nursery.start_soon(self._probe, entry)

    async def _probe(self, entry: NodeEntry) -> None:
        try:
            with trio.move_on_after(PROBE_S) as scope:
                await self.clients.get(entry).alive()
            if scope.cancelled_caught:
                self.node_lost(entry.node_id, f"no answer to the tracker's probe within {PROBE_S:g}s")
        except PeerError:
            self.node_lost(entry.node_id, "the tracker's probe could not reach it")
        finally:
            self._probing.discard(entry.node_id)


def deliver_fast_path(deliveries: Deliveries, app):
    """Wrap `app` so that a route's answers (POST DELIVER_STREAM_PATH, a record per token) and its nodes'
    failure reports (POST DELIVER_PATH, JSON) skip the framework."""

    async def asgi(scope, receive, send):
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in (DELIVER_PATH, DELIVER_STREAM_PATH)):
            await app(scope, receive, send)
            return
        if scope["path"] == DELIVER_STREAM_PATH:  # a tail's answers for one session
            await serve_seam_stream(scope, receive, send, limit=_DELIVER_LIMIT, what="delivery stream",
                                    authorize=functools.partial(deliveries.authorize, connection=scope),
                                    apply=deliveries.deliver)
            return
        sid, capability = seam_headers(scope)
        try:
            deliveries.admit_report(capability, sid)  # from the headers: nothing read, nothing parsed before
        except DgrError as exc:
            await respond_raw_error(send, exc, "delivery", unread=True)
            return
        try:
            req = await read_raw_seam(scope, receive, _DELIVER_LIMIT, "a delivery")
            if req is None:
                return
            if not req.is_json:
                raise CallerError(Reason.BAD_FRAME, f"a route's answers come on {DELIVER_STREAM_PATH}; "
                                                    f"{DELIVER_PATH} takes JSON failure reports")
            deliveries.report(req.body, capability, sid)
            authenticated(scope)  # the report held the session's delivery capability
        except (DgrError, ValueError) as exc:
            await respond_raw_error(send, exc, "delivery")
            return
        await send({"type": "http.response.start", "status": 204, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    return asgi
