"""`dgr node`: load a backend, serve it, join the tracker, expire idle sessions.

With a Model Artifact (dgr.node.artifact), the node also seeds its file and
claims its layers at registration; seeding starts first so that the claim
can carry the seed address, and the HTTP app before registration so that the
tracker's challenges find it answering.

A node with a tracker signs its membership messages with its own key, pins
the tracker's key when it joins, and demands a capability signed with that
key on every session call. A node without a tracker accepts any caller, so
it refuses to listen anywhere but loopback.

Where it is reached: `advertise` (`--advertise URL`; the bound port when
the URL names none) if given, else the bound address, except that a
wildcard bind (0.0.0.0, ::) is recorded by the tracker at the source address
it saw. The seed address follows the same rule.

Transport (dgr.security.tls): bound off loopback, or with `--tls`, it serves
https, with `--tls-cert`/`--tls-key` if given, else with the certificate of
its own key (dgr.security.certs), and registers that certificate, which the
tracker and its ring neighbours pin. Its server asks no client certificate
until it knows its tracker's (dgr.node.membership), then refuses every
caller without one that chains to it. `--insecure` keeps plain http off
loopback; a plain `--tracker` or `--advertise` off loopback needs it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio

from dgr.api.hosts import is_loopback
from dgr.backends.base import ShardBackend
from dgr.errors import CallerError, Reason
from dgr.node import steptrace
from dgr.node.draft import DraftModel
from dgr.node.drain import Drain, drain_on_signal
from dgr.node.app import make_node_app
from dgr.node.membership import stay_registered
from dgr.node.prefix import PrefixCache
from dgr.node.scheduler import DEFAULT_ITERATION_TARGET_S
from dgr.node.service import DEFAULT_JOURNAL_BYTES, NodeService
from dgr.node.snapshot import SNAPSHOT_MAX_MB, SnapshotDir
from dgr.security.identity import Identity
from dgr.security.pins import TrackerPin
from dgr.security.certs import LinkCert, identity_cert
from dgr.security.tls import TlsTrust, cert_pem, server_context
from dgr.serve import print_ready, serve_app

if TYPE_CHECKING:
    from dgr.node.artifact import NodeArtifact

__all__ = ["run_node", "advertised_url", "check_transport"]


def advertised_url(bound: str, advertise: str | None) -> str:
    """The URL to register: `advertise` (with the bound port if it names none), else the bound URL.

    Raises:
        CallerError(INVALID_REQUEST): `advertise` is not an http(s) URL.
    """
    if not advertise:
        return bound
    parts = urlsplit(advertise)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CallerError(Reason.INVALID_REQUEST, f"--advertise must look like https://HOST[:PORT], got {advertise!r}")
    try:
        port = parts.port or urlsplit(bound).port
    except ValueError:
        raise CallerError(Reason.INVALID_REQUEST, f"--advertise has a bad port: {advertise!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def check_transport(tls: TlsTrust, tracker: str | None, tls_files: tuple[str, str] | None,
                    advertise: str | None, host: str = "127.0.0.1") -> None:
    """A tracker and a URL of this node's own to register that may be plain http only on loopback (under
    --require-tls: not at all), unless --insecure.

    Raises:
        CallerError(FORBIDDEN): either would be plain http where it may not be.
    """
    if tracker:
        tls.check(tracker, "--tracker")
    if advertise:
        tls.check(advertise, "--advertise")
    elif tls.required and not tls.serves(host, tls_files):
        raise CallerError(Reason.FORBIDDEN, "--require-tls: this node would register a plain http:// URL; give it "
                                            "--tls (or --tls-cert and --tls-key, or --advertise https://... behind "
                                            "a TLS terminator)")


async def run_node(backend: ShardBackend, *, node_id: str, host: str, port: int, tracker: str | None,
                   identity: Identity, idle_timeout_s: float = 120.0, artifact: NodeArtifact | None = None,
                   seed_port: int = 0, join_token: bytes | None = None, advertise: str | None = None,
                   tls_files: tuple[str, str] | None = None, tls: TlsTrust = TlsTrust(),
                   pin: TrackerPin | None = None,
                   prefix_cache_mb: float | None = None, snapshot_dir: str | None = None,
                   snapshot_max_mb: float | None = None, busy_poll_s: float = 0.0,
                   iteration_target_s: float = DEFAULT_ITERATION_TARGET_S, draft: DraftModel | None = None,
                   spare: bool = False, drain_s: float = 0.0, journal_bytes: int = DEFAULT_JOURNAL_BYTES) -> None:
    """Serve until cancelled, or drained. `draft`: the tail's draft model (dgr.node.draft), unloaded with the
    backend. `spare`: ask the tracker to keep it as one. `drain_s` > 0: the first SIGTERM drains the node
    (dgr.node.drain), which the caller must then not catch itself. `journal_bytes`: its seam journals' bound
    (dgr.node.journal).

    Raises:
        CallerError(INVALID_REQUEST): bound beyond loopback without a tracker to take capabilities from.
        CallerError(FORBIDDEN): plain http where it may not be (see `check_transport`).
    """
    check_transport(tls, tracker, tls_files, advertise, host)
    if tracker is None and not is_loopback(host):
        raise CallerError(Reason.INVALID_REQUEST,
                          f"a node listening on {host} needs a tracker (--tracker): without one it has no key to "
                          "check capabilities with, and anyone who reaches it could open sessions")
    service = NodeService(backend=backend, node_id=node_id, idle_timeout_s=idle_timeout_s, joining=tracker is not None,
                          identity=identity, tls=tls, tracker_url=tracker.rstrip("/") if tracker else None,
                          prefix=_prefix_cache(prefix_cache_mb), snapshots=_snapshots(snapshot_dir, snapshot_max_mb, backend, artifact),
                          busy_poll_s=busy_poll_s, iteration_target_s=iteration_target_s, draft=draft,
                          journal_bytes=journal_bytes)
    app = make_node_app(service, artifact=artifact)
    steptrace.start_from_env()
    seed_host = urlsplit(advertise).hostname if advertise else None
    if seed_host and ":" in seed_host:
        seed_host = f"[{seed_host}]"  # an IPv6 literal in HOST:PORT
    try:
        async with trio.open_nursery() as nursery:
            if artifact is not None:
                from dgr.node.artifact import seed_artifact

                await nursery.start(seed_artifact, artifact, host, seed_port)
                if seed_host and artifact.seed:  # seeded on the bound address, announced at the advertised one
                    artifact.seed = f"{seed_host}:{artifact.seed.rpartition(':')[2]}"
            await nursery.start(service.run)  # the scheduler: the one owner of the backend
            drain = Drain(drain_s, node_id, joined=service.joined.is_set if tracker else lambda: False)
            if drain_s > 0:
                await nursery.start(drain_on_signal, drain, lambda: len(service.sessions), nursery.cancel_scope)
            ctx, cert = None, None
            if tls.serves(host, tls_files):
                own = None if tls_files else LinkCert(identity_cert(identity, "node"), identity.private)
                ctx = server_context(tls_files, own)
                cert = cert_pem(tls_files[0]) if tls_files else own.chain
            bound = await nursery.start(functools.partial(serve_app, app, host, port, ssl_context=ctx))
            url = advertised_url(bound, advertise)
            if tracker:
                await nursery.start(functools.partial(stay_registered, service, tracker, url, artifact=artifact,
                                                      join_token=join_token, tls_cert=cert, tls=tls,
                                                      pin=pin or TrackerPin.beside(identity.path, tracker),
                                                      server_tls=ctx, spare=spare, drain=drain))
            print_ready({"role": "node", "node": node_id, "url": service.advertised or url, "bound": bound,
                         "key": identity.public_text, "layers": str(backend.layers)})
    finally:
        steptrace.dump(node_id)
        backend.close()
        if draft is not None:
            draft.unload()


def _prefix_cache(mb: float | None) -> PrefixCache | None:
    """The node's prefix cache for `--prefix-cache-mb` (None: bounded by free slots only; 0: none)."""
    if mb is None:
        return PrefixCache()
    return PrefixCache(max_bytes=int(mb * 2**20)) if mb > 0 else None


def _snapshots(folder: str | None, max_mb: float | None, backend: ShardBackend,
               artifact: NodeArtifact | None) -> SnapshotDir | None:
    """`--snapshot-dir`: what a snapshot there must match to be loaded is this node's file, manifest and layers;
    `--snapshot-max-mb` its disk budget (SNAPSHOT_MAX_MB when not given)."""
    if folder is None:
        return None
    own = {"model_digest": backend.info.digest, "manifest_id": artifact.manifest.id if artifact else None,
           "backend": backend.name, "layers": str(backend.layers)}
    budget = int((SNAPSHOT_MAX_MB if max_mb is None else max(0.0, max_mb)) * 2**20)
    return SnapshotDir(folder, own, model=backend.info.name, max_bytes=budget)
