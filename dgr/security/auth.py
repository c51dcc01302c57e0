"""Signed control messages, admission, and Route Session capabilities, with no I/O.

Every party has its own Ed25519 key (dgr.security.identity). Mechanisms:

1. Signed requests (a node's registration, heartbeats and layer request; the
   tracker's layer-possession challenges): the sender puts its public key, a
   timestamp, a random nonce, the SHA-256 of the body and an Ed25519
   signature over (method, path, timestamp, nonce, body digest) in headers.
   So the receiver checks the signature from the headers alone, before it
   reads a byte of the body (`Verifier.check_head`), then the body's digest
   once its bytes are in, before they are parsed (`Verifier.check_body`).
   It refuses a timestamp more than `MAX_SKEW_S` away from its clock, and a
   nonce it has already seen inside that window, so a captured request
   cannot be replayed. A valid signature proves only who sent it; whether
   that key may join is `Admission`'s question (also from the headers), and
   which node id it may speak for is the registry's (an id is bound to one
   key for the tracker's life).

2. Admission: a tracker admits a new key if it is listed (`--allow-node`),
   or if the registration proves knowledge of the join token: `X-Dgr-Join =
   HMAC(K_join, key || request signature)`, `K_join = HMAC(token,
   "dgr/v1/join")`. The token itself never crosses the wire, and the proof
   is bound to one signed request, so it cannot be lifted onto another.
   The tracker answers with its own key and, when it has a token,
   `HMAC(K_join, "tracker" || tracker key || request signature)`, so a node
   with the token knows it pinned the key of a tracker that has it too.

3. Capabilities: for each Route Session the tracker issues, per hop, a token
   binding session id, node id, layer range, expiry and what it allows
   (`Scope`), signed with the tracker's private key. A node checks it on
   every seam call with the tracker key it pinned at join, against the
   frame's session and its own id and layers. A node holds no key that can
   make one. The gateway's own capability for a hop is `CONTROL` (open,
   close with keep, status, tokenize and steps); the one a node is handed
   for its neighbour (the next hop, a ring's head) is `STEP`: it lets the
   holder send that session's steps there and nothing else, so a route
   member cannot open, re-open, close or plant KV on the nodes it feeds.
   A token that names no scope allows steps only. What a node sends the
   tracker is scoped too, and bound to the node that sends it: the tail
   alone holds `DELIVER` (the session's answers, and failure reports),
   every other hop `REPORT` (failure reports only), each naming its own id
   and layers, so the tracker knows who sent an answer or a report from the
   token, not from what the sender says. Neither allows a call on a node.

4. Boots: a node makes a random nonce each time it starts (`new_boot`) and
   reports it in its signed registration and heartbeats; the tracker binds
   every capability and open ticket for a node to the nonce it last heard
   from it, and the node refuses one with another. So a capability or open
   captured before a node restarted is refused by the restarted process,
   whose memory of used tickets and replayed frames starts empty. The
   tracker's own delivery capabilities name no boot: a restarted tracker
   knows none of the sessions they were for.

Signatures are domain-separated (`identity.Identity.sign`), so a signature
made in one role is never valid in another.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import json
import math
import secrets
from typing import Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.security.identity import Identity, b64d, b64e, key_from_text, key_text, verify

__all__ = [
    "MAX_SKEW_S",
    "Signer",
    "SignedHead",
    "Verifier",
    "Admission",
    "Scope",
    "Capability",
    "CapabilityAuthority",
    "SIG_HEADERS",
    "JOIN_HEADER",
    "join_proof",
    "tracker_join_proof",
    "sign_json",
    "verify_json",
    "ANSWER_DOMAIN",
    "new_boot",
]

MAX_SKEW_S = 30.0
CAPABILITY_TTL_S = 3600.0
SIG_HEADERS = ("x-dgr-key", "x-dgr-timestamp", "x-dgr-nonce", "x-dgr-signature", "x-dgr-body-sha256")
JOIN_HEADER = "X-Dgr-Join"
_REQUEST = b"dgr/v2/request"  # v2: over the body's digest, not its bytes
_CAPABILITY = b"dgr/v1/capability"
_DIGEST_HEX = 64
ANSWER_DOMAIN = b"dgr/v1/proof-answer"  # a node signs its answer together with the challenge it answers


def new_boot() -> str:
    """A process's boot nonce: 128 random bits, fresh at every start (see 4. above)."""
    return secrets.token_hex(16)


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed parts, so no two different part lists encode the same bytes."""
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _join_key(token: bytes) -> bytes:
    return hmac.new(token, b"dgr/v1/join", hashlib.sha256).digest()


def join_proof(token: bytes, public: bytes, signature: str) -> str:
    """What a node sends in `X-Dgr-Join`: its knowledge of the token, bound to one signed request."""
    return hmac.new(_join_key(token), _framed(public, signature.encode()), hashlib.sha256).hexdigest()


def tracker_join_proof(token: bytes, tracker_public: bytes, signature: str) -> str:
    """What a tracker with the token answers a registration with: its key, vouched for by the token."""
    return hmac.new(_join_key(token), _framed(b"tracker", tracker_public, signature.encode()),
                    hashlib.sha256).hexdigest()


def _canonical(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def sign_json(identity: Identity, domain: bytes, data: dict[str, Any]) -> str:
    """A signature over a JSON object's canonical form (sorted keys, no spaces)."""
    return b64e(identity.sign(domain, _canonical(data)))


def verify_json(public: bytes, domain: bytes, data: dict[str, Any], signature: Any) -> bool:
    """True if `signature` is `public`'s over `data`'s canonical form; False for anything malformed."""
    try:
        raw = b64d(signature)
        message = _canonical(data)
    except (ValueError, TypeError):
        return False
    return verify(public, domain, message, raw)


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@attrs.frozen
class Signer:
    identity: Identity

    def headers(self, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
        ts = f"{now:.3f}"
        nonce = secrets.token_hex(16)
        digest = _digest(body)
        sig = self.identity.sign(_REQUEST, _framed(method.upper().encode(), path.encode(), ts.encode(),
                                                   nonce.encode(), digest.encode()))
        return {"X-Dgr-Key": self.identity.public_text, "X-Dgr-Timestamp": ts, "X-Dgr-Nonce": nonce,
                "X-Dgr-Body-Sha256": digest, "X-Dgr-Signature": b64e(sig)}


@attrs.frozen
class SignedHead:
    """A signed request's headers, once their signature holds: its body is still to be checked."""

    key: bytes  # the signer's public key
    nonce: str
    when: float
    digest: str  # SHA-256 (hex) of the body it signed


@attrs.define
class Verifier:
    """Checks signed requests; remembers nonces for the skew window to refuse replays."""

    _seen: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # nonce -> timestamp

    def check(self, method: str, path: str, body: bytes, headers: dict[str, str], now: float) -> bytes:
        """The signer's public key, once the signature and the body hold (`check_head`, then `check_body`).

        Raises: CallerError(UNAUTHENTICATED | REPLAYED).
        """
        return self.check_body(self.check_head(method, path, headers, now), body, now)

    def check_head(self, method: str, path: str, headers: dict[str, str], now: float) -> SignedHead:
        """The request's signature, from its headers alone (lower-case names): nothing is recorded yet.

        Raises: CallerError(UNAUTHENTICATED | REPLAYED).
        """
        key, ts, nonce, sig, digest = (headers.get(h, "") for h in SIG_HEADERS)
        if not (key and ts and nonce and sig and digest):
            raise CallerError(Reason.UNAUTHENTICATED, "this request must be signed with the sender's key")
        try:
            when = float(ts)
            public, raw = key_from_text(key), b64d(sig)
        except ValueError:
            raise CallerError(Reason.UNAUTHENTICATED, "bad signature: malformed key, timestamp or signature") from None
        message = _framed(method.upper().encode(), path.encode(), ts.encode(), nonce.encode(), digest.encode())
        if len(digest) != _DIGEST_HEX or not verify(public, _REQUEST, message, raw):
            raise CallerError(Reason.UNAUTHENTICATED, "bad signature: not this key's, or the request was altered")
        if not math.isfinite(when):  # nan would pass the window below, and stay replayable
            raise CallerError(Reason.REPLAYED, f"signature timestamp {ts[:32]!r} is not a time")
        if abs(now - when) > MAX_SKEW_S:
            raise CallerError(Reason.REPLAYED, f"signature timestamp is {now - when:+.0f}s off; clocks or a replay")
        self._refuse_seen(nonce, now)
        return SignedHead(public, nonce, when, digest)

    def check_body(self, head: SignedHead, body: bytes, now: float) -> bytes:
        """The signer's key, once `body` is the one `head` signed; records its nonce (a replay is refused from now).

        Raises: CallerError(UNAUTHENTICATED): another body. CallerError(REPLAYED): its nonce was used meanwhile.
        """
        if not hmac.compare_digest(_digest(body), head.digest):
            raise CallerError(Reason.UNAUTHENTICATED, "bad signature: the body is not the one signed (altered)")
        self._refuse_seen(head.nonce, now)
        self._seen[head.nonce] = head.when
        return head.key

    def _refuse_seen(self, nonce: str, now: float) -> None:
        self._forget(now)
        if nonce in self._seen:
            raise CallerError(Reason.REPLAYED, "this signed request was already used (replay)")

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, when = next(iter(self._seen.items()))
            if now - when <= 2 * MAX_SKEW_S:
                break
            self._seen.popitem(last=False)


@attrs.frozen
class Admission:
    """Which keys a tracker lets join: holders of the join token, and listed keys.

    With neither, every key is admitted (a loopback tracker only: see dgr.tracker.run).
    """

    token: bytes | None = None
    allowed: frozenset[bytes] = frozenset()

    @property
    def open(self) -> bool:
        return self.token is None and not self.allowed

    def admit(self, public: bytes, signature: str, proof: str | None) -> None:
        """Raises: CallerError(UNAUTHENTICATED): neither listed nor holding the join token."""
        if self.open or public in self.allowed:
            return
        if not proof:
            raise CallerError(Reason.UNAUTHENTICATED,
                              f"key {key_text(public)} is not admitted: this tracker needs the join token "
                              "(--join-token-file or DGR_JOIN_TOKEN) or --allow-node for the key")
        if self.token is None or not hmac.compare_digest(join_proof(self.token, public, signature), proof):
            raise CallerError(Reason.UNAUTHENTICATED, "bad join proof: the node's join token is not this tracker's")


class Scope(enum.Enum):
    """What a capability lets its holder do with its session: on the node it names, or at the tracker."""

    STEP = "step"  # send the session's steps on its stream: what a neighbour holds
    CONTROL = "control"  # steps, and open, close (with keep), status and tokenize: the gateway's own
    DELIVER = "deliver"  # the tail's, for the tracker: the session's answers, and failure reports
    REPORT = "report"  # every other hop's, for the tracker: failure reports only

    def allows(self, need: Scope) -> bool:
        return need in _ALLOWS[self]


# What each scope allows: a node's calls (STEP, CONTROL) and the tracker's (DELIVER, REPORT) never mix,
# so a capability that names a node's own id and layers for the tracker is no step on that node.
_ALLOWS: dict[Scope, frozenset[Scope]] = {
    Scope.STEP: frozenset({Scope.STEP}),
    Scope.CONTROL: frozenset({Scope.CONTROL, Scope.STEP}),
    Scope.DELIVER: frozenset({Scope.DELIVER, Scope.REPORT}),
    Scope.REPORT: frozenset({Scope.REPORT}),
}


@attrs.frozen
class Capability:
    session: str
    node: str
    start: int
    stop: int
    expires: float
    scope: Scope = Scope.STEP
    boot: str = ""  # the node's boot nonce when it was issued; "": the tracker's own (deliveries)

    def payload(self) -> bytes:
        return json.dumps({"s": self.session, "n": self.node, "l": [self.start, self.stop], "e": self.expires,
                           "a": self.scope.value, "i": self.boot}, sort_keys=True, separators=(",", ":")).encode()


# Verified tokens remembered per authority (a few hundred bytes each): the bound for tokens no session end
# drops (`forget`): a refused open's, a late frame's after its session ended, the STATUS_SCOPE ones.
_VERIFIED_KEPT = 4096


@attrs.frozen
class CapabilityAuthority:
    """Checks capability tokens with the tracker's public key; issues them only with its private key.

    A node's authority is `verifier(pinned tracker key)`: it can check but never issue.
    """

    public: bytes
    identity: Identity | None = None
    # Tokens whose signature verified, by their exact text, oldest first: a session's every step carries
    # the same token, and an Ed25519 verify per step cost about 3% of a stub node's decode loop.
    # Expiry and the session, node and layer match are still checked on every call.
    _verified: dict[str, Capability] = attrs.field(factory=dict, eq=False, repr=False)
    # session -> its tokens in `_verified`, so that its end drops them (`forget`). Kept until the count cap
    # pushed them out, a node held the 2 tokens of each of its last 2,048 sessions, about 1.5 KB a session.
    _tokens: dict[str, list[str]] = attrs.field(factory=dict, eq=False, repr=False)

    @classmethod
    def issuer(cls, identity: Identity) -> CapabilityAuthority:
        return cls(identity.public, identity)

    @classmethod
    def verifier(cls, public: bytes) -> CapabilityAuthority:
        return cls(public)

    def issue(self, session: str, node: str, start: int, stop: int, now: float,
              ttl_s: float = CAPABILITY_TTL_S, scope: Scope = Scope.CONTROL, boot: str = "") -> str:
        """A capability for `session` on `node`'s layers [start, stop) allowing `scope`, for `node`'s boot `boot`.

        Raises: CallerError(FORBIDDEN): this authority holds no private key (it is a node's).
        """
        if self.identity is None:
            raise CallerError(Reason.FORBIDDEN, "only the tracker can issue capabilities")
        payload = Capability(session, node, start, stop, round(now + ttl_s, 3), scope, boot).payload()
        return b64e(payload) + "." + b64e(self.identity.sign(_CAPABILITY, payload))

    def check(self, token: str | None, *, session: str, node: str, start: int, stop: int, now: float,
              need: Scope = Scope.STEP, boot: str = "") -> Capability:
        """The capability, once it is the tracker's, unexpired, for this session, node and layers, allows `need`,
        and was issued for this boot of the node (`boot`).

        Raises: CallerError(FORBIDDEN) naming what does not match.
        """
        cap = self._current(token, session, now)
        if cap.node != node or (cap.start, cap.stop) != (start, stop):
            raise CallerError(Reason.FORBIDDEN, "capability is for another node or layer range")
        _allowed(cap, need)
        if cap.boot != boot:  # not a secret: a plain comparison
            raise CallerError(Reason.FORBIDDEN, "capability was issued for another boot of this node: it restarted "
                                                "since (a replay), or the tracker has not heard its new boot yet")
        return cap

    def holder(self, token: str | None, *, session: str, now: float, need: Scope) -> Capability:
        """The capability, once it is the tracker's, unexpired, for this session, and allows `need`: what the
        tracker asks of one a node sends it, whose holder (node and layers) it then matches to the route.

        Raises: CallerError(FORBIDDEN) naming what does not match.
        """
        cap = self._current(token, session, now)
        _allowed(cap, need)
        return cap

    def _current(self, token: str | None, session: str, now: float) -> Capability:
        """Raises: CallerError(FORBIDDEN): none, malformed, not the tracker's, expired or another session's."""
        if not token:
            raise CallerError(Reason.FORBIDDEN, "a Route Session capability is required")
        cap = self._verified.get(token)
        if cap is None:
            cap = self._verify(token)
            if len(self._verified) >= _VERIFIED_KEPT:
                self._drop(next(iter(self._verified)))  # the oldest
            self._verified[token] = cap
            self._tokens.setdefault(cap.session, []).append(token)
        if cap.expires < now:
            raise CallerError(Reason.FORBIDDEN, "capability expired")
        if cap.session != session:
            raise CallerError(Reason.FORBIDDEN, "capability is for another Route Session")
        return cap

    def forget(self, session: str) -> None:
        """Drop the verified tokens of `session`, which has ended: a late call with one is verified again."""
        for token in self._tokens.pop(session, ()):
            del self._verified[token]

    def kept(self) -> int:
        """How many verified tokens are remembered."""
        return len(self._verified)

    def _drop(self, token: str) -> None:
        session = self._verified.pop(token).session
        tokens = self._tokens[session]
        tokens.remove(token)
        if not tokens:
            del self._tokens[session]

    def _verify(self, token: str) -> Capability:
        """Raises: CallerError(FORBIDDEN): malformed, or not signed by the tracker's key."""
        body, _, sig = token.partition(".")
        try:
            payload = b64d(body)
            data: dict[str, Any] = json.loads(payload)
            cap = Capability(str(data["s"]), str(data["n"]), int(data["l"][0]), int(data["l"][1]), float(data["e"]),
                             Scope(data.get("a", Scope.STEP.value)), str(data.get("i", "")))
            raw = b64d(sig)
        except (ValueError, KeyError, TypeError, IndexError):
            raise CallerError(Reason.FORBIDDEN, "malformed capability") from None
        if not math.isfinite(cap.expires):  # nan or inf would never expire
            raise CallerError(Reason.FORBIDDEN, "malformed capability: its expiry is not a time")
        if not verify(self.public, _CAPABILITY, payload, raw):
            raise CallerError(Reason.FORBIDDEN,
                              "capability signature does not verify with the tracker's key (forged or altered)")
        return cap


def _allowed(cap: Capability, need: Scope) -> None:
    """Raises: CallerError(FORBIDDEN): `cap`'s scope does not allow `need`, in words that say which side it is for."""
    if cap.scope.allows(need):
        return
    for_tracker = (Scope.DELIVER, Scope.REPORT)
    if cap.scope is Scope.REPORT and need is Scope.DELIVER:
        why = (f"this capability only lets node {cap.node} report session {cap.session}'s failures: only the "
               "route's tail delivers its answers")
    elif cap.scope in for_tracker:
        why = (f"a {cap.scope.value} capability is for what a node sends the tracker, not for {need.value} calls "
               "on a node")
    elif need in for_tracker:
        why = f"a {cap.scope.value} capability is for calls on a node, not for what a node sends the tracker"
    else:
        why = (f"this capability only lets its holder send session {cap.session}'s steps here (a neighbour's); "
               f"{need.value} calls (open, close, status, tokenize) need the tracker's own")
    raise CallerError(Reason.FORBIDDEN, why)
