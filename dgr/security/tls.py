"""TLS for dgr's own connections: which certificates a client trusts, from files or from a registration.

Servers (tracker, node) take `--tls-cert`/`--tls-key` and serve https
(dgr.serve). Clients honour `https://` everywhere (seam, membership, proofs,
chain relays, artifact peers) and trust, in this order:
1. the certificate a node registered (its PEM arrives inside the node's
   signed registration, so it is as trustworthy as the node's key): the
   tracker, and a ring's previous node, pin exactly that certificate, self-
   signed or not, and skip the host name check (the pin is stronger);
2. otherwise `--tls-ca FILE` (a CA bundle, or a self-signed certificate used
   as its own anchor);
3. otherwise the system's CAs.

`--require-tls` (tracker and node: `TlsTrust.required`) makes plain http a
refusal instead of a choice. A tracker refuses a registration whose URL is
http:// (dgr.tracker.registry), so it never hands out an http next hop; a
node refuses to register with an http:// tracker, to advertise an http://
URL of its own, and to open a session whose relay next hop or ring loop head
is http:// (dgr.node.app). A seed address stays plain: BitTorrent has no
TLS, and every piece is checked against the manifest's hashes
(dgr.artifact), so a peer on the path can slow a fetch, not alter it. The
tracker's own listener is its operator's to secure: `--tls-cert`, or a TLS
terminator in front of it.

Left out: client certificates (callers are authenticated by signatures and
capabilities, not by TLS) and certificate reloading.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import attrs

from dgr.errors import CallerError, Reason

__all__ = ["TlsTrust", "cert_pem", "check_server_files"]

_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


def cert_pem(path: str | Path) -> str:
    """The first certificate of a PEM file (a server's own, before its chain).

    Raises:
        CallerError(INVALID_REQUEST): unreadable, or no certificate in it.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot read the TLS certificate {path}: {exc.strerror}") from None
    start, end = text.find(_BEGIN), text.find(_END)
    if start < 0 or end < start:
        raise CallerError(Reason.INVALID_REQUEST, f"{path} holds no PEM certificate")
    return text[start:end + len(_END)] + "\n"


def check_server_files(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """(cert, key) when both are given, None when neither.

    Raises:
        CallerError(INVALID_REQUEST): one without the other, or a pair that does not load.
    """
    if not cert and not key:
        return None
    if not (cert and key):
        raise CallerError(Reason.INVALID_REQUEST, "--tls-cert and --tls-key go together")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"cannot load the TLS certificate and key: {exc}") from None
    return cert, key


@attrs.frozen
class TlsTrust:
    """How this process's clients check the servers they call."""

    ca_file: str | None = None
    required: bool = False  # --require-tls: no http:// peer at all

    def check(self, url: str, what: str) -> None:
        """Refuse an http:// `url` (`what` names it) when TLS is required.

        Raises:
            CallerError(FORBIDDEN): TLS is required and `url` is not https://.
        """
        if self.required and not url.startswith("https://"):
            raise CallerError(Reason.FORBIDDEN, f"{what} {url[:200]!r} is not https://, and TLS is required here "
                                                "(--require-tls)", field="url")

    def context(self, pinned_pem: str | None = None) -> ssl.SSLContext:
        """A client context: pinned to one certificate, or trusting `ca_file`, or the system's CAs.

        Raises:
            CallerError(INVALID_REQUEST): the CA file or the pinned certificate does not load.
        """
        try:
            if pinned_pem is not None:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(cadata=pinned_pem)
                ctx.check_hostname = False  # the exact certificate is pinned: a name adds nothing
            else:
                ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"cannot load TLS trust: {exc}") from None
        # a leaf (a self-signed certificate, or a pinned one) may be the trust anchor itself
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return ctx

    def httpx_verify(self, url: str, pinned_pem: str | None = None) -> ssl.SSLContext:
        """What to give httpx as `verify` for `url`: a context for https, httpx's default (unused) for http."""
        return self.context(pinned_pem) if url.startswith("https://") else httpx_default_trust()


@functools.cache
def httpx_default_trust() -> ssl.SSLContext:
    """httpx's own default (`verify=True`: certifi's CAs), built once per process.

    httpx builds it for every client, even one that only calls http:// URLs, and loading the CAs costs
    about 60 ms of CPU: a tracker makes a client per node.
    """
    import httpx

    return httpx.create_ssl_context()
