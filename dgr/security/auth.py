"""Signed control messages and Route Session capabilities, with no I/O.

Two mechanisms, one secret (the cluster secret, shared by the tracker and
its nodes):

1. Signed requests (registration, heartbeats): the sender puts a timestamp,
   a random nonce and an HMAC-SHA256 over (method, path, timestamp, nonce,
   body) in headers. The receiver checks the MAC, refuses a timestamp more
   than `MAX_SKEW_S` away from its clock, and refuses a nonce it has already
   seen inside that window, so a captured registration cannot be replayed.

2. Capabilities: for each Route Session the tracker issues, per hop, a token
   binding session id, node id, layer range and expiry, MACed with a key
   derived from the cluster secret (domain-separated from request signing).
   A node checks it on every seam call against the frame's session and its
   own id and layers. Without one nobody can open a session on a node, inject
   a frame into another session, or read its output.

Keys derive from the secret with HMAC(secret, purpose) so one leaked MAC
cannot be reused in the other role. Comparisons are constant-time.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import secrets
from typing import Any

import attrs

from dgr.errors import CallerError, Reason

__all__ = [
    "MAX_SKEW_S",
    "Signer",
    "Verifier",
    "Capability",
    "CapabilityAuthority",
    "SIG_HEADERS",
]

MAX_SKEW_S = 30.0
CAPABILITY_TTL_S = 3600.0
SIG_HEADERS = ("x-dgr-timestamp", "x-dgr-nonce", "x-dgr-signature")


def _key(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"dgr/v1/" + purpose, hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> str:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.hexdigest()


@attrs.frozen
class Signer:
    secret: bytes

    def headers(self, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
        ts = f"{now:.3f}"
        nonce = secrets.token_hex(16)
        sig = _mac(_key(self.secret, b"request"), method.upper().encode(), path.encode(), ts.encode(),
                   nonce.encode(), body)
        return {"X-Dgr-Timestamp": ts, "X-Dgr-Nonce": nonce, "X-Dgr-Signature": sig}


@attrs.define
class Verifier:
    """Checks signed requests; remembers nonces for the skew window to refuse replays."""

    secret: bytes
    _seen: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # nonce -> timestamp

    def check(self, method: str, path: str, body: bytes, headers: dict[str, str], now: float) -> None:
        """Raises: CallerError(UNAUTHENTICATED | REPLAYED). Records the nonce only on success."""
        ts, nonce, sig = (headers.get(h, "") for h in SIG_HEADERS)
        if not (ts and nonce and sig):
            raise CallerError(Reason.UNAUTHENTICATED, "this request must be signed with the cluster secret")
        try:
            when = float(ts)
        except ValueError:
            raise CallerError(Reason.UNAUTHENTICATED, "bad signature timestamp") from None
        want = _mac(_key(self.secret, b"request"), method.upper().encode(), path.encode(), ts.encode(),
                    nonce.encode(), body)
        if not hmac.compare_digest(want, sig):
            raise CallerError(Reason.UNAUTHENTICATED, "bad signature: wrong cluster secret or altered request")
        if abs(now - when) > MAX_SKEW_S:
            raise CallerError(Reason.REPLAYED, f"signature timestamp is {now - when:+.0f}s off; clocks or a replay")
        self._forget(now)
        if nonce in self._seen:
            raise CallerError(Reason.REPLAYED, "this signed request was already used (replay)")
        self._seen[nonce] = when

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, when = next(iter(self._seen.items()))
            if now - when <= 2 * MAX_SKEW_S:
                break
            self._seen.popitem(last=False)


@attrs.frozen
class Capability:
    session: str
    node: str
    start: int
    stop: int
    expires: float

    def payload(self) -> bytes:
        return json.dumps({"s": self.session, "n": self.node, "l": [self.start, self.stop], "e": self.expires},
                          sort_keys=True, separators=(",", ":")).encode()


@attrs.frozen
class CapabilityAuthority:
    """Issues (tracker) and checks (node) capability tokens."""

    secret: bytes

    def issue(self, session: str, node: str, start: int, stop: int, now: float,
              ttl_s: float = CAPABILITY_TTL_S) -> str:
        cap = Capability(session, node, start, stop, round(now + ttl_s, 3))
        payload = cap.payload()
        mac = _mac(_key(self.secret, b"capability"), payload)
        return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + mac

    def check(self, token: str | None, *, session: str, node: str, start: int, stop: int, now: float) -> Capability:
        """Raises: CallerError(FORBIDDEN) naming what does not match."""
        if not token:
            raise CallerError(Reason.FORBIDDEN, "a Route Session capability is required")
        body, _, mac = token.partition(".")
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            data: dict[str, Any] = json.loads(payload)
            cap = Capability(str(data["s"]), str(data["n"]), int(data["l"][0]), int(data["l"][1]), float(data["e"]))
        except (ValueError, KeyError, TypeError, IndexError):
            raise CallerError(Reason.FORBIDDEN, "malformed capability") from None
        if not hmac.compare_digest(_mac(_key(self.secret, b"capability"), payload), mac):
            raise CallerError(Reason.FORBIDDEN, "capability signature does not verify (forged or altered)")
        if cap.expires < now:
            raise CallerError(Reason.FORBIDDEN, "capability expired")
        if cap.session != session:
            raise CallerError(Reason.FORBIDDEN, "capability is for another Route Session")
        if cap.node != node or (cap.start, cap.stop) != (start, stop):
            raise CallerError(Reason.FORBIDDEN, "capability is for another node or layer range")
        return cap
