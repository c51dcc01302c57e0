"""The gateway's client for one node: one pooled HTTP/1.1 connection set per node.

Every call maps transport trouble to `PeerError(ROUTE_NODE_LOST)` naming the
node, and a node's refusal to `PeerError(NODE_ERROR)` (or capacity to
`CallerError(NODE_AT_CAPACITY)`), so the driver has one kind of failure to
handle. Deadlines are the caller's cancel scopes.

Every call for a Route Session carries that session's capability for this
node (`X-Dgr-Capability`, issued by the gateway); `None` sends none, for a
caller that issues none (an in-process test). Opens name their session in
`X-Dgr-Route-Session`, so the node checks it before reading the body, and
carry the tracker's ticket for the exact bytes they send (`X-Dgr-Ticket`). An `https://` node is called
over TLS with `ssl_context` (the node's registered certificate pinned, see
dgr.security.tls), on both of its pools (control calls, and the seam's).

A node's replies are read with a cap, chunk by chunk, never more than the cap
held (ConnectionPool's `limit`; `read_capped` for an httpx caller, the
tracker's proofs): MAX_CONTROL_BYTES for open, close and status, and for a
head's open of a prompt what the prompt can yield besides (`token_bound`: one
token per byte of the request at most, each a short JSON number). Replies come
unencoded (`Accept-Encoding: identity`, `check_unencoded`), so no compressed
reply expands past the cap. A reply over its cap, or one
that is not the JSON it should be, is `PeerError(NODE_ERROR)` naming the
node. The head's token ids are checked too: integers in [0, vocab_size),
no more of them than the bound; a head that lies fails the session as a
node error, never as the client's (`context_length_exceeded`) or a crash.
"""

from __future__ import annotations

import json
import ssl
from typing import Any, Callable
from urllib.parse import urlencode

import attrs
import httpx

from dgr.errors import CallerError, Failure, PeerError, Reason, parse_error_body
from dgr.seam.opening import AdoptRequest, OpenAnswer, OpenRequest, token_bound
from dgr.seam.transport import AnswerTooLarge, ConnectionPool, HttpResponse, OutStream, TransportError
from dgr.seam.wire import (CAPABILITY_HEADER, CONTENT_TYPE, MAX_CONTROL_BYTES, ROUTE_SESSION_HEADER,
                           STREAM_PATH, TICKET_HEADER)

__all__ = ["NodeClient", "Reply", "CAPABILITY_HEADER", "read_capped"]

# A head's open reply per byte of its prompt: a token id (at most 7 digits, a comma and a space).
_TOKENIZE_REPLY_PER_BYTE = 16


@attrs.frozen
class Reply:
    """A node's whole reply, read within its cap by `read_capped` (an httpx caller's; NodeClient's calls answer
    HttpResponse)."""

    status_code: int
    headers: httpx.Headers
    content: bytes


def check_unencoded(encoding: str | None, node: str) -> None:
    """Refuse a reply that came encoded (its Content-Encoding header; None: absent): it was asked for unencoded,
    and an encoded one could expand past its cap.

    Raises: PeerError(NODE_ERROR).
    """
    encoding = (encoding or "identity").strip().lower()
    if encoding != "identity":
        raise PeerError(Reason.NODE_ERROR, f"{node} sent a reply encoded {encoding[:40]!r}, unasked", node=node)


async def read_capped(client: httpx.AsyncClient, method: str, url: str, *, limit: int, node: str,
                      **kw: Any) -> Reply:
    """One request whose reply is read up to `limit` bytes, chunk by chunk: an oversize one is cut there.

    Raises:
        PeerError(NODE_ERROR): the reply (announced or read) exceeds `limit`, or comes encoded.
        httpx.TransportError: as the client raises it.
    """
    headers = {**kw.pop("headers", {}), "Accept-Encoding": "identity"}
    async with client.stream(method, url, headers=headers, **kw) as r:
        check_unencoded(r.headers.get("content-encoding"), node)
        announced = r.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > limit:
            raise PeerError(Reason.NODE_ERROR, f"{node} sent a reply of {announced} bytes, over {limit}", node=node)
        body, size = [], 0
        async for chunk in r.aiter_bytes():  # as sent: an encoded reply was refused above
            size += len(chunk)
            if size > limit:
                raise PeerError(Reason.NODE_ERROR, f"{node} sent a reply over {limit} bytes", node=node)
            body.append(chunk)
        return Reply(r.status_code, r.headers, b"".join(body))


@attrs.define
class NodeClient:
    node_id: str
    url: str
    ssl_context: ssl.SSLContext | None = None  # https nodes: what to trust (None: the system's CAs)
    # Control calls (open, prefix, close, status) on a pool of their own, as lean as the seam's: on httpx's
    # pool, which scans its connections for each idle one at every request (quadratic), they took 23% of the
    # tracker's busy time with 32 stub sessions of 128 tokens at once (a profile: 2.2 of 9.5 s)
    _control: ConnectionPool = attrs.field(init=False)
    _seam: ConnectionPool = attrs.field(init=False)  # the per-token hot path

    def __attrs_post_init__(self) -> None:
        self._control = ConnectionPool(self.url, self.ssl_context)
        self._seam = ConnectionPool(self.url, self.ssl_context)

    async def aclose(self) -> None:
        await self._control.aclose()
        await self._seam.aclose()

    def _lost(self, exc: Exception, phase: str | None = None) -> PeerError:
        return PeerError(
            Reason.ROUTE_NODE_LOST,
            f"lost node {self.node_id} ({self.url}): {type(exc).__name__}: {exc}".rstrip(": "),
            node=self.node_id,
            phase=phase,
        )

    def _refused(self, r: HttpResponse, param: str | None = None) -> Exception:
        """A node's refusal as the gateway raises it; `param`: the request's prompt parameter, where the node
        was given the prompt, so that a refusal of the prompt itself (dgr.seam.opening.PromptPlan.positions) is the client's."""
        body, status = r.body, r.status
        code, message = parse_error_body(body)
        if param is not None and code in (Reason.CONTEXT_LENGTH_EXCEEDED.value, Reason.INVALID_REQUEST.value) \
                and _error_param(body) == "prompt":
            return CallerError(Reason(code), message, param=param, node=self.node_id)
        if code == Reason.NODE_AT_CAPACITY.value:
            return CallerError(Reason.NODE_AT_CAPACITY, f"{self.node_id}: {message}", node=self.node_id,
                               retry_after=_retry_after(r.headers.get("retry-after")))
        if code == Reason.CONTEXT_LENGTH_EXCEEDED.value:
            return CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"{self.node_id}: {message}", node=self.node_id)
        return PeerError(Reason.NODE_ERROR, f"{self.node_id} refused ({status} {code}): {message}",
                         node=self.node_id, node_code=code)

    async def _request(self, method: str, path: str, capability: str | None = None, limit: int = MAX_CONTROL_BYTES,
                       *, headers: list[tuple[str, str]] = (), body: bytes = b"",
                       params: dict[str, str] | None = None) -> HttpResponse:
        """One control call, carrying the session's `capability` where given, its reply read up to `limit` bytes.

        Raises: PeerError (ROUTE_NODE_LOST, NODE_ERROR).
        """
        headers = [("Accept-Encoding", "identity"), *headers]
        if capability is not None:
            headers.append((CAPABILITY_HEADER, capability))
        target = path + ("?" + urlencode(params) if params else "")
        try:
            r = await self._control.request(method, target, body, headers, limit=limit)
        except AnswerTooLarge:
            raise PeerError(Reason.NODE_ERROR, f"{self.node_id} sent a reply over {limit} bytes",
                            node=self.node_id) from None
        except TransportError as exc:
            raise self._lost(exc) from None
        if "content-encoding" in r.headers:  # asked for none: most replies name none
            check_unencoded(r.headers["content-encoding"], self.node_id)
        return r

    def _json(self, r: HttpResponse) -> dict[str, Any]:
        """A reply's JSON object. Raises PeerError(NODE_ERROR) for anything else."""
        try:
            data = json.loads(r.body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise PeerError(Reason.NODE_ERROR, f"{self.node_id} sent a reply that is not a JSON object",
                            node=self.node_id)
        return data

    async def open(self, req: OpenRequest, capability: str | None = None,
                   ticket: Callable[[bytes], str | None] | None = None, vocab_size: int | None = None
                   ) -> OpenAnswer:
        """Open `req.session` on the node (dgr.seam.opening); a head given the prompt answers its ids, checked
        (`OpenAnswer.from_json`) against the model's `vocab_size` and what the prompt can yield (`token_bound`).

        `ticket(body bytes)` is the tracker's ticket for exactly the body sent (dgr.security.tickets); None
        sends none.
        """
        raw = req.encode()
        headers = [("Content-Type", "application/json"), (ROUTE_SESSION_HEADER, req.session)]
        signed = None if ticket is None else ticket(raw)
        if signed is not None:
            headers.append((TICKET_HEADER, signed))
        bound = None if req.prompt is None else token_bound(req.prompt)
        r = await self._request("POST", "/v1/seam/sessions", capability, headers=headers, body=raw,
                                limit=MAX_CONTROL_BYTES + _TOKENIZE_REPLY_PER_BYTE * (bound or 0))
        if r.status != 201:
            raise self._refused(r, None if req.prompt is None else req.prompt.param())
        return OpenAnswer.from_json(self._json(r), node=self.node_id, tokens_bound=bound, vocab_size=vocab_size)

    async def adopt_prefix(self, sid: str, named: AdoptRequest, capability: str | None = None) -> int:
        """Name the prefix of a session opened before its prompt's length was known (an open with `max_new`):
        the node opens its KV on the longest kept prefix of it; returns the positions it holds from there."""
        r = await self._request("POST", f"/v1/seam/sessions/{sid}/prefix", capability,
                                headers=[("Content-Type", "application/json")], body=json.dumps(named.to_json()).encode())
        if r.status != 200:
            raise self._refused(r)
        return OpenAnswer.from_json(self._json(r), node=self.node_id).positions

    async def close(self, sid: str, failure: Failure | None = None, capability: str | None = None,
                    keep: list[str] | None = None, tail: str = "") -> None:
        """Close `sid`; a normal close with `keep` (its KV's block hash chain) and `tail` (the marks of its
        positions after the last whole block, encoded) lets the node keep the KV."""
        params = {} if failure is None else {"reason": failure.reason.value, "message": failure.message[:200]}
        if failure is None and keep:
            params["keep"] = ".".join(keep)
        if failure is None and tail:
            params["tail"] = tail
        r = await self._request("DELETE", f"/v1/seam/sessions/{sid}", capability, params=params)
        if r.status not in (200, 404, 410):
            raise self._refused(r)

    async def open_stream(self, sid: str, capability: str | None = None) -> OutStream:
        """Open a session's stream of steps to this node (the head): one record a step, no answer each."""
        headers = [("Content-Type", CONTENT_TYPE), (ROUTE_SESSION_HEADER, sid)]
        if capability is not None:
            headers.append((CAPABILITY_HEADER, capability))
        try:
            return await self._seam.open_stream(STREAM_PATH, headers)
        except TransportError as exc:
            raise self._lost(exc) from None

    def stream_failure(self, answer: HttpResponse | TransportError, phase: str | None = None) -> Failure:
        """What an answer to a stream that should still be open means: the link broke, or the node refused."""
        if isinstance(answer, TransportError):
            return self._lost(answer).failure(phase=phase)
        if answer.status == 200:
            return Failure(Reason.NODE_ERROR, f"{self.node_id} ended a stream of steps early", node=self.node_id,
                           phase=phase)
        return self._refused(answer).failure(node=self.node_id, phase=phase)

    async def session_status(self, sid: str, capability: str | None = None) -> dict[str, Any]:
        r = await self._request("GET", f"/v1/seam/sessions/{sid}", capability)
        if r.status != 200:
            raise self._refused(r)
        return self._json(r)

    async def alive(self) -> None:
        """The node's /healthz answers (it is served on the node's loop, never behind compute).

        Raises:
            PeerError(ROUTE_NODE_LOST): no answer (transport failure).
        """
        await self._request("GET", "/healthz")

    async def probe(self, sid: str | None = None, capability: str | None = None) -> Any:
        """/healthz, and with `sid` (and the session's capability) the node's progress on that session: its
        JSON answer (dgr.tracker.blame `Progress` reads it), or None for one that is not JSON (it still answered).

        Raises:
            PeerError(ROUTE_NODE_LOST): no answer (transport failure).
        """
        r = await self._request("GET", "/healthz", capability, params={"session": sid} if sid else None)
        try:
            return json.loads(r.body) if r.status == 200 else None
        except ValueError:
            return None

    async def status(self) -> dict[str, Any]:
        r = await self._request("GET", "/v1/node/status")
        if r.status != 200:
            raise self._refused(r)
        return self._json(r)


def _error_param(body: bytes) -> str | None:
    try:
        param = json.loads(body)["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return param if isinstance(param, str) else None


def _retry_after(value: str | None) -> int:
    """A node's Retry-After in whole seconds, 1 to 3600; 1 where it is not a number of seconds (an HTTP date,
    or garbage from a faulty node, must not turn a capacity answer into a 500)."""
    return min(3600, max(1, int(value))) if value is not None and value.strip().isdigit() else 1
