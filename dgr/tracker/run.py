"""`dgr tracker`: the registry, the gateway and the OpenAI API in one process.

Exposure rule: on loopback a tracker may run open (development: any node key
may join); bound to any other address it refuses to start unless it has an
admission rule (a join token, or `--allow-node` keys, so only chosen nodes
register) and API keys (so only key holders generate).

The tracker's own key (`--identity`, made on first start) signs every
capability and challenge; nodes pin its public half when they join.

Transport (dgr.security.tls): off loopback, or with `--tls`, it serves https
with `--tls-cert` if given, else with the certificate of its own key
(dgr.security.certs), written beside the identity file (`ID.crt`) for API
clients to pin; `--insecure` keeps plain http off loopback. Either way it
checks a client certificate when one is offered (its members'), presents
its own when it calls an https node, and issues member certificates at
registration (dgr.tracker.app).
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path

import attrs
import trio

from dgr.api.hosts import is_loopback
from dgr.errors import CallerError, Reason
from dgr.security.auth import Admission, CapabilityAuthority
from dgr.security.certs import LinkCert, identity_cert, pin_text
from dgr.security.identity import Identity
from dgr.security.private_files import write_private
from dgr.security.tls import TlsTrust, admit_members, server_context
from dgr.serve import print_ready, serve_app
from dgr.tracker.app import make_tracker_app
from dgr.tracker.blame import SlowPolicy
from dgr.tracker.gateway import Gateway, GatewayConfig
from dgr.tracker.pieces import Vocabularies
from dgr.tracker.proofs import Prover
from dgr.tracker.registry import DEAD_AFTER_S, MAX_NODE_SESSIONS, Registry

__all__ = ["run_tracker"]


async def run_tracker(*, host: str, port: int, config: GatewayConfig, identity: Identity,
                      dead_after_s: float = DEAD_AFTER_S, prover: Prover | None = None, require_proof: bool = False,
                      trusted_ends: frozenset[bytes] = frozenset(), max_node_sessions: int = MAX_NODE_SESSIONS,
                      spares: int = 0, admission: Admission = Admission(), api_keys: frozenset[str] = frozenset(),
                      max_body_bytes: int = 4 * 1024 * 1024, tls_files: tuple[str, str] | None = None,
                      tls: TlsTrust = TlsTrust(), listening: socket.socket | None = None,
                      slow: SlowPolicy = SlowPolicy(), vocabularies: Vocabularies | None = None) -> None:
    """Serve until cancelled. `prover` holds the manifests layer proofs are checked against; `slow` is what
    late steps cost a node (dgr.tracker.blame); `vocabularies` the models' token bytes the tails' answers are
    checked against (default: the stub models' only); `spares` the idle nodes kept per layer (dgr.tracker.spares).

    `listening` is a socket already bound and listening (`dgr up` hands one over): the tracker serves
    on it, and host is then only checked against the exposure rule.

    Raises:
        CallerError(INVALID_REQUEST): bound beyond loopback without an admission rule and API keys.
    """
    if not is_loopback(host):
        missing = [what for what, have in (
            ("a join token (--join-token-file or DGR_JOIN_TOKEN) or --allow-node keys", not admission.open),
            ("API keys (--api-key-file or DGR_API_KEYS)", api_keys)) if not have]
        if missing:
            raise CallerError(Reason.INVALID_REQUEST,
                              f"a tracker listening on {host} needs " + " and ".join(missing)
                              + "; only a loopback tracker may run without them")
    own = LinkCert(identity_cert(identity, "tracker"), identity.private)
    tls = attrs.evolve(tls, client=own)  # presented to every https node it calls
    gateway = Gateway(registry=Registry(dead_after_s=dead_after_s, require_proof=require_proof,
                                        trusted_ends=trusted_ends, max_node_sessions=max_node_sessions, spares=spares,
                                        require_tls=tls.required, encrypt=tls.encrypt, slow=slow), config=config,
                      authority=CapabilityAuthority.issuer(identity), tls=tls,
                      vocabularies=vocabularies or Vocabularies.builtin())
    gateway.admission.prefix_secret = identity.derive(b"prefix-root")  # the prefix roots' key lives with the identity
    prover = prover or Prover()
    prover.identity, prover.tls = identity, tls
    app = make_tracker_app(gateway, prover=prover, identity=identity, admission=admission, api_keys=api_keys,
                           max_body_bytes=max_body_bytes, tls_ca=own.chain)
    ctx, shown = None, {}
    if tls.serves(host, tls_files):
        ctx = server_context(tls_files, own)
        admit_members(ctx, own.chain, required=False)  # API clients have no certificate; members show theirs
        if tls_files is None:
            shown = {"tls_pin": pin_text(own.chain), **_kept_beside(identity, own.chain)}
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        await nursery.start(prover.run)
        url = await nursery.start(functools.partial(serve_app, app, host, port, ssl_context=ctx,
                                                     listening=listening))
        print_ready({"role": "tracker", "url": url, "api": f"{url}/v1", "key": identity.public_text,
                     "join_token": admission.token is not None, "allowed_nodes": len(admission.allowed),
                     "api_keys": len(api_keys), **shown})


def _kept_beside(identity: Identity, pem: str) -> dict[str, str]:
    """Write the tracker's certificate beside its identity file (`ID.crt`), for API clients to trust; where."""
    if identity.path is None:
        return {}
    path = Path(identity.path)
    path = path.with_suffix(".crt") if path.suffix == ".key" else path.with_name(path.name + ".crt")
    try:
        write_private(path, pem.encode("ascii"))
    except OSError:
        return {}  # the pin in the ready line says the same
    path.chmod(0o644)  # a certificate is public
    return {"tls_cert": str(path)}
