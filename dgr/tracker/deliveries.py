"""What a route's members send the tracker: the tail's answers, and failure reports.

A tail delivers a session's answers on one stream (dgr.api.http
`serve_seam_stream`), authorized by the session's DELIVER capability before
any of the body is read; each record's answer goes into the session's inbox
with every hop's compute, where the ring driver takes it (dgr.tracker.ring).

Both skip the framework (`deliver_fast_path`, wrapping the tracker's app):
POST DELIVER_STREAM_PATH (a record per token, for one session) and POST
DELIVER_PATH (a JSON failure report) name their session in
`X-Dgr-Route-Session` and are authorized by a capability the tracker
issued for the session, from their headers, before a byte of their body is read (a
refused caller is answered at once, its body unread, and its connection
closed); only then is the body read, up to one frame's size limit, and the
connection marked authenticated. A report's body must name the session its
header named. A ring's answers never come as JSON on DELIVER_PATH
(BAD_FRAME). Every other request goes to the app untouched.

Only the tail speaks for the route (trust v3). Each hop's capability for the
tracker names the hop (dgr.tracker.credentials): DELIVER on the tail, REPORT
elsewhere. An answer stream needs DELIVER, held by the live route's tail; a
member that opens one with its REPORT capability is refused before its body
is read and struck (`strike`, the standing a late step costs too: three
bans it from routing), and the session goes on with its tail's honest
answers: what the member forged never reaches it. Every TOKEN answer is checked against its token id with the
model's vocabulary (dgr.tracker.pieces): bytes or an end of generation that
are not the id's are refused, and the session fails naming the tail (which
is struck as well: its answer stream cannot go on), so not even the tail can make the client read text that is not its tokens.

A report is scoped to its session: its reporter is the node its capability
names, never what the body says (a body naming another is refused), the
reporter and the node it names must be hops of that session's route, only
that session fails, and no node is marked dead on a member's word. A node
reported lost is probed with the tracker's own request (`/healthz`), and only
its silence marks it dead. The client is told who reported what in the
tracker's words; the reporter's own text goes to the tracker's log only.

Without the tracker's key (in-process routes) there are no capabilities: a
report's reporter is then its body's, and any stream may deliver.
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
from dgr.seam.frame import Frame, TokenResult, decode_frame
from dgr.seam.stream import Record
from dgr.seam.wire import DELIVER_PATH, DELIVER_STREAM_PATH, ROUTE_SESSION_HEADER, FrameKind
from dgr.security.auth import Capability, CapabilityAuthority, Scope
from dgr.tracker.clients import NodeClients
from dgr.tracker.live import Answer, LiveSession
from dgr.tracker.patience import PROBE_S
from dgr.tracker.pieces import Vocabularies
from dgr.tracker.registry import NodeEntry

__all__ = ["Deliveries", "deliver_fast_path"]

log = logging.getLogger("dgr.gateway")

_DELIVER_LIMIT = 1024 * 1024  # a TOKEN or ACK frame, or a failure report: small
_HOLDER = "dgr.deliver_holder"  # the ASGI scope's key for who holds an answer stream's capability


@attrs.define
class Deliveries:
    sessions: dict[str, LiveSession]  # the gateway's live sessions by their node sessions' id (its `routes`, shared)
    clients: NodeClients
    node_lost: Callable[[str, str], None]  # (node id, why): mark it dead and fail its sessions
    strike: Callable[[str, str], None]  # (node id, why): a member caught sending what it may not pays in standing
    authority: CapabilityAuthority | None = None
    vocabularies: Vocabularies = attrs.field(factory=Vocabularies.builtin)  # what answers are checked against
    nursery: trio.Nursery | None = None  # where probes run
    _probing: set[str] = attrs.field(factory=set)  # nodes a member reported lost, which the tracker is checking
    _unchecked: set[str] = attrs.field(factory=set)  # model digests without a vocabulary here (logged once each)

    def authorize(self, capability: str | None, sid: str, connection: dict[str, Any] | None = None) -> str | None:
        """Check an answer stream's capability for session `sid`: DELIVER, and while the session lives, held by
        its route's tail. Once it holds, mark `connection` (the request's ASGI scope, where given)
        authenticated and note the holder there, which `deliver` then holds each answer to. Returns the
        holder's node id (None without an authority).

        Raises:
            CallerError(FORBIDDEN): refused. A hop of the live route that holds another capability (REPORT) has
            tried to speak for the route: it is struck, and the session goes on without what it sent.
        """
        holder = None
        if self.authority is not None:
            now = time.time()
            cap = self.authority.holder(capability, session=sid, now=now, need=Scope.REPORT)  # any a member holds
            live = self._member(sid, cap)
            try:
                self.authority.holder(capability, session=sid, now=now, need=Scope.DELIVER)
                if live is not None and cap.node != live.hops(sid)[-1].node_id:
                    raise CallerError(Reason.FORBIDDEN, f"node {cap.node} is not session {sid}'s tail: only the "
                                                        "route's tail delivers its answers")
            except CallerError:
                if live is not None:
                    self.strike(cap.node, f"tried to deliver session {sid}'s answers, which only its tail does")
                raise
            holder = cap.node
        if connection is not None:
            authenticated(connection)
            connection[_HOLDER] = holder
        return holder

    def deliver(self, sid: str, record: Record, connection: dict[str, Any] | None = None) -> None:
        """An answer from a delivery stream already authorized for `sid` (`connection`: its ASGI scope, which
        names who holds the stream's capability).

        Raises:
            CallerError(BAD_FRAME | FORBIDDEN | UNKNOWN_SESSION): refused; nothing changed but, for an answer
            that is not its token's (BAD_FRAME), the session, which fails naming the tail.
        """
        frame = decode_frame(record.frame)
        if frame.kind not in (FrameKind.TOKEN, FrameKind.ACK):
            raise CallerError(Reason.BAD_FRAME, f"a route delivers TOKEN or ACK frames, not {frame.kind.name}")
        if frame.session != sid:
            raise CallerError(Reason.FORBIDDEN, f"a delivery stream of session {sid} carried an answer of {frame.session}")
        live = self._live(sid)
        opening = live.opening_route  # LiveSession.hops, inline on the every-token path
        tail = (opening[1] if opening is not None and opening[0] == sid else live.rs.route)[-1].node_id
        holder = None if connection is None else connection.get(_HOLDER)
        if self.authority is not None and holder != tail:  # a stream authorized before the session lived
            raise CallerError(Reason.FORBIDDEN, f"node {holder} is not session {sid}'s tail: only the route's tail "
                                                "delivers its answers")
        if frame.kind is FrameKind.TOKEN:
            self._check_token(live, frame, tail)
        live.inbox[0].send_nowait(Answer(frame, record.compute_us))

    def _check_token(self, live: LiveSession, frame: Frame, tail: str) -> None:
        """Raises: CallerError(BAD_FRAME): not what its token id is (the session fails naming `tail`)."""
        model = live.nodes[-1].model
        try:
            token = TokenResult.from_frame(frame)
        except CallerError as exc:
            why: str | None = exc.message
        else:
            pieces = self.vocabularies.by_digest.get(model.digest)
            if pieces is not None:
                why = pieces.forged(token)
            else:
                if model.digest not in self._unchecked:
                    self._unchecked.add(model.digest)
                    log.warning("no vocabulary for model %s (digest %s): its tails' text is not checked against "
                                "their token ids; give the tracker --vocab with its GGUF", model.name, model.digest)
                why = (None if 0 <= token.token < model.vocab_size
                       else f"token id {token.token} is outside the vocabulary of {model.vocab_size}")
        if why is not None:
            self._forged(live, tail, f"answered step {frame.seq} with a forged token: {why}")
            raise CallerError(Reason.BAD_FRAME, f"session {live.rs.sid}'s answer to step {frame.seq} is refused: {why}")

    def _forged(self, live: LiveSession, node: str, what: str) -> None:
        """Fail `live` naming `node`, its tail, which sent what it may not (in the tracker's words), and strike it."""
        self.strike(node, f"in session {live.rs.sid} {what}")
        live.inbox[0].send_nowait(Failure(Reason.NODE_ERROR, f"node {node} {what}"[:300], node=node))

    def admit_report(self, capability: str | None, sid: str) -> None:
        """Check a failure report from its headers alone, before its body is read: `sid` is the session its
        `X-Dgr-Route-Session` names, `capability` the one it carries (any a member of the session holds).

        Raises:
            CallerError(FORBIDDEN): no session named, or no capability for it.
        """
        if not SESSION_ID.fullmatch(sid):
            raise CallerError(Reason.FORBIDDEN, f"a failure report names its session in {ROUTE_SESSION_HEADER} (32 hex "
                                                "digits): its capability is checked before its body is read")
        if self.authority is not None:
            self.authority.holder(capability, session=sid, now=time.time(), need=Scope.REPORT)

    def report(self, body: bytes, capability: str | None, named: str) -> None:
        """A session's node reports a failure (JSON: session, code, message, node; `reporter`, if given, must be
        the holder of the capability, which is who reported), admitted for the session `named`
        (`admit_report`), which its body must name too.

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
        sid = sid if isinstance(sid, str) else ""
        if self.authority is None:
            live, reporter = self._live(sid), data.get("reporter")
        else:
            cap = self.authority.holder(capability, session=sid, now=time.time(), need=Scope.REPORT)
            live, reporter = self._member(sid, cap), cap.node
            if live is None:
                raise CallerError(Reason.UNKNOWN_SESSION, f"no live Route Session {sid[:64]}")
            if data.get("reporter", reporter) != reporter:  # an honest node names itself (dgr.node.relay)
                self.strike(reporter, f"reported in node {str(data.get('reporter'))[:64]}'s name for session {sid}")
                raise CallerError(Reason.FORBIDDEN, f"this report comes from node {reporter}, whose capability it "
                                                    "holds: it cannot name another reporter")
        members = {h.node_id for h in live.hops(sid)}
        if reporter not in members or (failure.node is not None and failure.node not in members):
            raise CallerError(Reason.FORBIDDEN, "a report comes from a node of its session's route and names only one")
        log.warning("session %s: node %s reports %s for %s: %.200s", sid, reporter, failure.reason.value,
                    failure.node or "itself", failure.message)
        said = f"node {reporter} reported {failure.reason.value}" + (f" for node {failure.node}" if failure.node else "")
        live.inbox[0].send_nowait(Failure(failure.reason, said, node=failure.node, step=failure.step))
        if failure.reason is Reason.ROUTE_NODE_LOST and failure.node is not None:
            self._probe_soon(failure.node)

    def _member(self, sid: str, cap: Capability) -> LiveSession | None:
        """`sid`'s live session, where `cap`'s holder is one of its hops (its id and layers); None if not live.

        Raises: CallerError(FORBIDDEN): the holder is not a hop of the live route (one of a route it left).
        """
        live = self.sessions.get(sid)
        if live is None or live.rs.ended:
            self._gone(sid)
            return None
        if not any((h.node_id, h.start, h.stop) == (cap.node, cap.start, cap.stop) for h in live.hops(sid)):
            raise CallerError(Reason.FORBIDDEN, f"node {cap.node} is not a hop of session {sid}'s route")
        return live

    def _live(self, sid: Any) -> LiveSession:
        live = self.sessions.get(sid) if isinstance(sid, str) else None
        if live is None or live.rs.ended:
            if isinstance(sid, str):
                self._gone(sid)
            raise CallerError(Reason.UNKNOWN_SESSION, f"no live Route Session {str(sid)[:64]}")
        return live

    def _gone(self, sid: str) -> None:
        """`sid` is not live: forget the capability just verified for it (the gateway forgot the session's at its
        end, and a member's late answer or report would otherwise keep one until 4,096 later ones pushed it out).
        One that comes before its session lives is verified again when it next comes."""
        if self.authority is not None:
            self.authority.forget(sid)

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
                                    apply=functools.partial(deliveries.deliver, connection=scope))
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
            authenticated(scope)  # the report held a capability the tracker issued for the session
        except (DgrError, ValueError) as exc:
            await respond_raw_error(send, exc, "delivery")
            return
        await send({"type": "http.response.start", "status": 204, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    return asgi
