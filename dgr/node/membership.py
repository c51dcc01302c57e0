"""Join a tracker and stay joined: register, then heartbeat.

A heartbeat the tracker does not recognise (it restarted, or declared us
dead) is answered 404, and the node registers again. One that does not
reach it is sent again soon (`HEARTBEAT_RETRY_S`, doubling to the period):
a tracker at its connection cap turns newcomers away for moments, and one
that hears nothing for 3 s fails every session through the node. The period is the tracker's to set: its
registration reply says `heartbeat_s`, a fraction of its death threshold
(--dead-after), so a tracker that declares nodes dead sooner hears from them
more often.

A node with a Model Artifact adds its claim (manifest id, seed address) to
each registration; the tracker answers with the proof's state, and every
heartbeat reply repeats it, so the node can say on stderr when its layers
are proven (or why not).

Every registration and heartbeat is signed with the node's own key over its
exact body bytes (dgr.security.auth.Signer), so the tracker can refuse
forged and replayed ones and knows which key speaks for which node id. A
registration also carries the join token's proof (when the node has a
token), bound to that one signature. The reply carries the tracker's public
key, which the node pins (`NodeService.join`): from then on it accepts only
capabilities and challenges signed with it. With a join token, the node
pins the key only if the reply proves the tracker holds the token too. The
pin outlives the process (dgr.security.pins): it is written beside the
node's identity, and a restarted node, or one given `--tracker-key`,
refuses a tracker that answers with another key, naming both. With
`--require-tls` the node refuses an http:// tracker outright, and off
loopback it refuses one unless `--insecure`.

Over https, before its first registration the node reads the certificate
the tracker serves: one made from the tracker's key (dgr.security.certs)
must carry the key the node pins, else the node sends nothing and retries as
for a refusal; once it passes, it is the only certificate the node's calls to
the tracker trust (dgr.security.tls `trust_tracker`). Its server then demands
from every caller a certificate that chains to it. The reply carries the
tracker's certificate (`tls_ca`, checked to hold the key just pinned: it
anchors the server on first use, once the reply has proved the key, and
when the tracker serves a CA-signed one; until then the server asks no
client certificate) and this node's member certificate (`tls_member_cert`,
checked to hold this node's key), which its clients present from then on.

The reply also says which URL and seed address the tracker recorded: a node
bound to a wildcard address without `--advertise` is recorded at the source
address the tracker saw, and the node shows that address. When that is a
loopback address (the node reached the tracker over 127.0.0.1), the node
warns on stderr: it bound every interface to serve other machines, which
cannot reach it there. `dgr up`'s nodes bind 127.0.0.1 and are not warned.

A refusal (401, 403, or 409 for an id that belongs to another key), or a
reply with a key this node does not trust, is not final:
the tracker may be restarting with a rotated token, a clock may be off for a
while, or a signature may collide with a nonce it saw. The node says why on
its log and retries with exponential backoff (`RETRY_MIN_S` doubling to
`RETRY_MAX_S`), serving its open sessions meanwhile.

A heartbeat names its node id in `X-Dgr-Node` as well as in its body, so
the tracker checks our key owns the id before it parses the body. Each
heartbeat lists the ids of the sessions the node holds, so the tracker
can close the ones it no longer runs (a node it declared lost, an open whose
reply it never got). Each registration advertises `max_positions`, the
positions per session this node really allocates (`--ctx`). A node whose
layers are on accelerators adds their memory to each heartbeat, as last read
(dgr.node.accounting); a CPU node's heartbeat is as it was.

A node that drains (SIGTERM, dgr.node.drain) says so in every heartbeat
from then on, the first sent at once; the reply says the tracker heard it.

Both name this process's boot nonce (dgr.node.trust `boot`), under the
node's signature: the tracker binds every capability and open ticket for
this node to it, so none issued to an earlier process of the node is
accepted by this one. A heartbeat with another boot than the registration
the tracker holds is answered 404, and the node registers again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from dgr.api.hosts import is_loopback, is_wildcard
from dgr.errors import CallerError, Reason, parse_error_body
from dgr.node.drain import Drain
from dgr.node.service import NodeService
from dgr.progress import say
from dgr.security.auth import JOIN_HEADER, Signer, join_proof, tracker_join_proof
from dgr.security.certs import LinkCert, cert_key
from dgr.security.identity import key_from_text
from dgr.security.pins import TrackerPin
from dgr.seam.wire import NODE_HEADER
from dgr.security.tls import TlsTrust, admit_members, learn_tracker

if TYPE_CHECKING:  # the artifact plane loads only for a node that serves one (cli: prepare_node_artifact)
    from dgr.node.artifact import NodeArtifact

__all__ = ["HEARTBEAT_S", "HEARTBEAT_RANGE_S", "RETRY_MIN_S", "RETRY_MAX_S", "stay_registered", "registration",
           "heartbeat_body", "wait_for_tracker_trust"]

log = logging.getLogger("dgr.node")
HEARTBEAT_S = 0.25  # until the tracker's registration reply says its own period (`heartbeat_s`)
HEARTBEAT_RANGE_S = (0.05, 10.0)  # a period a tracker may ask for
HEARTBEAT_TIMEOUT_S = 2.0
REGISTER_TIMEOUT_S = 15.0  # `dgr up` starts all at once: it waits in a starting tracker's backlog (sent twice, read twice)
HEARTBEAT_RETRY_S = 0.05  # a beat or registration that did not reach the tracker is tried again this soon
RETRY_MIN_S = 1.0  # first wait after the tracker refused this node's credentials
RETRY_MAX_S = 30.0


def registration(service: NodeService, url: str, artifact: NodeArtifact | None = None,
                 tls_cert: str | None = None, spare: bool = False) -> dict[str, Any]:
    backend = service.backend
    claim = {} if artifact is None else {"artifact": artifact.claim()}
    cert = {} if tls_cert is None else {"tls_cert": tls_cert}
    return {
        **claim,
        **cert,
        **({"spare": True} if spare else {}),
        "node": service.node_id,
        "boot": service.trust.boot,
        "url": url,
        "pid": os.getpid(),
        "layers": [backend.layers.start, backend.layers.stop],
        "backend": backend.name,
        "model": backend.info.to_json(),
        "capacity": service.capacity,
        "max_positions": service.max_positions,
        "describe": service.described,
        "prefixes": _advertised(service),
    }


def heartbeat_body(service: NodeService, draining: bool = False) -> dict[str, Any]:
    """Load, the sessions held (the tracker closes any it does not run), the prefixes kept (its gateway
    routes a prompt that extends one to this node, after a restart too), on a node with accelerators their
    memory as last read (a CPU node's heartbeat carries no `devices` at all), and whether it drains."""
    body: dict[str, Any] = {"node": service.node_id, "boot": service.trust.boot, "sessions": len(service.sessions),
                            "kv_bytes": service.scheduler.kv_bytes, "session_ids": sorted(service.sessions),
                            "prefixes": _advertised(service)}
    if service.devices:
        body["devices"] = [d.to_json() for d in service.devices]
    if draining:
        body["draining"] = True
    return body


def _advertised(service: NodeService) -> list[str]:
    # read on the loop while the scheduler's thread may add or drop entries: retried if they changed meanwhile
    for _ in range(3):
        try:
            return [] if service.prefix is None else service.prefix.advertised()
        except RuntimeError:  # the entries changed while being read
            continue
    return []


def _note_proof(artifact: NodeArtifact | None, reply: Any) -> None:
    """Keep the tracker's latest proof verdict and say it on stderr when it changes."""
    proof = reply.get("proof") if isinstance(reply, dict) else None
    if artifact is None or not isinstance(proof, dict) or proof == artifact.proof:
        return
    before = artifact.proof.get("state")
    artifact.proof = proof
    state = proof.get("state")
    if state == before:
        return
    if state == "passed":
        artifact.timings.setdefault("proved_after_s", artifact.age())
        say(f"layers {artifact.layers} proven to the tracker: {proof.get('message', '')}; routable")
    elif state == "failed":
        say(f"the tracker refused the layer proof ({proof.get('reason')}): {proof.get('message', '')}; not routed")
    elif state == "pending":
        say("registered; the tracker is challenging the layer claim")


def _decided(artifact: NodeArtifact | None) -> bool:
    return artifact is None or artifact.proof.get("state") in ("passed", "failed", "none")


async def _post(client: httpx.AsyncClient, signer: Signer, path: str, data: dict[str, Any],
                join_token: bytes | None = None, timeout_s: float = HEARTBEAT_TIMEOUT_S,
                extra: dict[str, str] | None = None) -> tuple[httpx.Response, str]:
    """POST `data` as JSON, signed over the exact bytes sent (with `extra` headers); the response and the
    signature sent.

    Raises:
        CallerError(UNAUTHENTICATED | REPLAYED | FORBIDDEN | IDENTITY_TAKEN): the tracker refused our key or
        signature, or our registration (an http:// URL to a tracker that requires TLS).
    """
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json", **(extra or {}), **signer.headers("POST", path, body, time.time())}
    if join_token is not None:
        headers[JOIN_HEADER] = join_proof(join_token, signer.identity.public, headers["X-Dgr-Signature"])
    r = await client.post(path, content=body, headers=headers, timeout=timeout_s)
    if r.status_code in (401, 403, 409):
        code, message = parse_error_body(r.content)
        try:
            reason = Reason(code)
        except ValueError:  # not an error body, or a code this node does not know
            reason = Reason.UNAUTHENTICATED
        raise CallerError(reason, f"the tracker refused this node ({reason.value}): {message}")
    return r, headers["X-Dgr-Signature"]


def _why(exc: BaseException) -> str:
    """An exception and its causes in one line: a TLS refusal hides under an empty transport error."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if text and text not in parts:
            parts.append(text)
        exc = exc.__cause__ or exc.__context__
    return "; ".join(parts) or "no detail"


def _pin(service: NodeService, reply: Any, signature: str, join_token: bytes | None, pin: TrackerPin) -> None:
    """Pin the tracker key a registration reply carries, in memory and in the pin file.

    Raises:
        CallerError(FORBIDDEN): no key, a key not vouched for by our join token, not the key this node
        trusts (--tracker-key, the pin file, or the one pinned at join), or not the key of the certificate
        the reply came through (an identity certificate kept on first use).
    """
    try:
        key = key_from_text(reply["tracker_key"])
    except (KeyError, TypeError, ValueError):
        raise CallerError(Reason.FORBIDDEN, "the tracker's reply carries no key to check capabilities with") from None
    if join_token is not None and reply.get("tracker_proof") != tracker_join_proof(join_token, key, signature):
        raise CallerError(Reason.FORBIDDEN, "the tracker did not prove it holds our join token: not pinning its key")
    through = service.tls.tracker_pem
    if through is not None and cert_key(through) != key:  # a TLS endpoint in front of the tracker: not joining
        raise CallerError(Reason.FORBIDDEN, "the tracker's TLS certificate holds another key than its reply: "
                                            "not pinning either")
    pin.check(key)
    service.join(key)
    try:
        pin.keep(key)
    except OSError as exc:  # pinned in memory all the same; a restart trusts on first use again
        log.warning("could not write the tracker pin %s: %s", pin.path, exc)


def _take_certs(service: NodeService, reply: Any, server_tls: ssl.SSLContext | None) -> None:
    """Keep the tracker's certificate and this node's member certificate from a registration reply whose key
    is pinned already (`_pin`); each is used only if it holds the key it must (a tracker that issues none
    changes nothing)."""
    key = service.trust.tracker_key
    anchor, member = reply.get("tls_ca"), reply.get("tls_member_cert")
    if (isinstance(anchor, str) and cert_key(anchor) == key and server_tls is not None
            and server_tls.verify_mode != ssl.CERT_REQUIRED):  # first use, or a CA-signed tracker certificate
        admit_members(server_tls, anchor, required=True)
    if (isinstance(member, str) and cert_key(member) == service.identity.public
            and (service.tls.client is None or service.tls.client.chain != member)):
        service.tls = attrs.evolve(service.tls, client=LinkCert(member, service.identity.private))


async def wait_for_tracker_trust(tls: TlsTrust, tracker: str, pin: TrackerPin, period: float = HEARTBEAT_S) -> TlsTrust:
    """`learn_tracker`, retried until the tracker answers with a certificate this node may trust: at the
    heartbeat period while it cannot be reached, with backoff while its certificate holds another key."""
    backoff = RETRY_MIN_S
    while True:
        try:
            with trio.fail_after(HEARTBEAT_TIMEOUT_S):
                return await learn_tracker(tls, tracker, pin)
        except CallerError as exc:
            log.warning("the tracker's TLS certificate: %s; retrying in %gs", exc.message, backoff)
            await trio.sleep(backoff)
            backoff = min(RETRY_MAX_S, backoff * 2)
        except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
            log.warning("tracker %s unreachable: %s", tracker, _why(exc))
            await trio.sleep(period)


def _heartbeat_period(reply: Any) -> float:
    """The period the tracker asks for (within HEARTBEAT_RANGE_S), else HEARTBEAT_S."""
    period = reply.get("heartbeat_s") if isinstance(reply, dict) else None
    if isinstance(period, (int, float)) and not isinstance(period, bool) and math.isfinite(period):
        return min(max(float(period), HEARTBEAT_RANGE_S[0]), HEARTBEAT_RANGE_S[1])
    return HEARTBEAT_S


def _note_address(service: NodeService, reply: Any, url: str) -> None:
    """Say where the tracker recorded us, when that is not where we bound (a wildcard address); warn when that is
    loopback, where no other machine reaches us."""
    recorded = reply.get("url") if isinstance(reply, dict) else None
    if isinstance(recorded, str) and recorded != url and recorded != service.advertised:
        say(f"the tracker reaches this node at {recorded} (it saw the registration come from {reply.get('seen')})")
        if is_wildcard(urlsplit(url).hostname or "") and is_loopback(urlsplit(recorded).hostname or ""):
            say(f"warning: bound to every interface, but registered over loopback, so the tracker routes to this "
                f"node (and peers fetch its pieces) at {recorded}, which no other machine reaches. Fine if the "
                f"whole route runs on this machine; otherwise give --tracker the tracker's LAN address, or "
                f"--advertise {urlsplit(url).scheme}://THIS-MACHINE:PORT")
    if isinstance(recorded, str):
        service.advertised = recorded


async def stay_registered(service: NodeService, tracker: str, url: str, *, artifact: NodeArtifact | None = None,
                          join_token: bytes | None = None, tls_cert: str | None = None,
                          tls: TlsTrust = TlsTrust(), pin: TrackerPin | None = None,
                          transport: httpx.AsyncBaseTransport | None = None,
                          server_tls: ssl.SSLContext | None = None, spare: bool = False,
                          drain: Drain | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Register with the tracker, report ready, then heartbeat forever.

    With an artifact, ready means the tracker has decided on the layer claim
    (passed or failed), so `dgr up` announces the API once nodes are routable.
    A refusal of this node's credentials (401) is logged with its reason and
    retried with backoff; so is a reply with a key `pin` does not admit (in memory only when None), and a
    tracker certificate that does not hold it. `transport` is for in-process tests; `server_tls` is this
    node's own server context, which learns whose client certificates to demand. `spare`: the registration
    asks to be kept as one; `drain`: once it drains, heartbeats say so, the first at once (dgr.node.drain).

    Raises:
        CallerError(INVALID_REQUEST): the node has no identity. CallerError(FORBIDDEN): an http:// tracker
        under --require-tls.
    """
    started = False
    if service.identity is None:
        raise CallerError(Reason.INVALID_REQUEST, "a node joins a tracker with its own key: it has no identity")
    tls.check(tracker, "the tracker")
    pin = pin if pin is not None else TrackerPin(tracker=tracker.rstrip("/"))
    signer = Signer(service.identity)
    backoff = RETRY_MIN_S
    period = HEARTBEAT_S
    soon = HEARTBEAT_RETRY_S  # the next try after one that did not reach the tracker, doubling to the period
    # an in-process test's transport has no certificate to read
    learned = tls if transport is not None else await wait_for_tracker_trust(tls, tracker, pin, period)
    if learned.tracker_pem is not None:
        service.tls = attrs.evolve(service.tls, tracker_pem=learned.tracker_pem)
        # before the tracker, or any member, has reason to call this node; on first use only once the
        # reply has proved the key (`_take_certs`), so that an impostor never becomes an anchor
        if server_tls is not None and pin.key is not None:
            admit_members(server_tls, learned.tracker_pem, required=True)
    verify = learned.tracker_verify(tracker)
    async with httpx.AsyncClient(base_url=tracker, transport=transport, verify=verify) as client:  # _post times each
        registered = False
        while True:
            try:
                if not registered:
                    r, signature = await _post(client, signer, "/v1/nodes/register",
                                               registration(service, url, artifact, tls_cert, spare), join_token,
                                               timeout_s=REGISTER_TIMEOUT_S)
                    r.raise_for_status()
                    reply = r.json()
                    _pin(service, reply, signature, join_token, pin)
                    _take_certs(service, reply, server_tls)
                    _note_address(service, reply, url)
                    _note_proof(artifact, reply)
                    period = _heartbeat_period(reply)
                    registered = True
                    log.info("registered with %s as %s", tracker, service.node_id)
                    if not started and _decided(artifact):
                        started = True
                        task_status.started()
                # the id in a header too: the tracker checks our key owns it before it parses the body
                draining = drain is not None and drain.draining
                r, _ = await _post(client, signer, "/v1/nodes/heartbeat", heartbeat_body(service, draining),
                                   extra={NODE_HEADER: service.node_id})
                if r.status_code == 404:
                    registered = False
                    continue
                if r.status_code == 200:
                    _note_proof(artifact, r.json())
                    if draining:
                        drain.heard(r.json())
                if not started and _decided(artifact):
                    started = True
                    task_status.started()
                backoff = RETRY_MIN_S
            except CallerError as exc:  # 401/403/409: our key or token, our clock, a replayed nonce; or an impostor
                registered = False
                log.warning("%s; retrying in %gs (check the join token, the node's identity and the clocks)",
                            exc.message, backoff)
                await trio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
                continue
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError) as exc:  # ValueError: a non-JSON reply
                if not (registered and isinstance(exc, httpx.TransportError)):
                    registered = False  # a refusal or a garbled reply: register again; not reached: beat again
                if soon == HEARTBEAT_RETRY_S:  # once a streak: sooner than the period (see the module)
                    log.warning("tracker %s unreachable or refused: %s", tracker, _why(exc))
                await trio.sleep(soon)
                soon = min(period, 2 * soon)
                continue
            soon = HEARTBEAT_RETRY_S
            with trio.move_on_after(period):
                if drain is not None and not drain.draining:
                    await drain.asked.wait()  # a drain's first heartbeat goes at once
                else:
                    await trio.sleep_forever()
