"""TLS for dgr's own connections: when links are encrypted, what a client trusts, what a server demands.

Encrypted by default: a tracker or node bound off loopback serves https with
no flag (`TlsTrust.serves`), from `--tls-cert`/`--tls-key` if given, else
from a certificate made of its own identity key (dgr.security.certs). A link
off loopback that is still plain http (a `--tracker`, an `--advertise` URL,
a registration, a relay's next hop or loop head) is refused
(`TlsTrust.check`) unless the process runs with `--insecure`. Loopback
stays plain unless `--tls` asks for https there too (tests, benchmarks).
`--require-tls` (tracker and node: `TlsTrust.required`) goes further and
refuses plain http on loopback too. A seed address stays plain: BitTorrent
has no TLS, and every piece is checked against the manifest's hashes
(dgr.artifact), so a peer on the path can slow a fetch, not alter it.

Clients honour `https://` everywhere (seam, membership, proofs, ring relays
and deliveries, artifact peers) and trust, in this order:
1. the certificate a node registered (its PEM arrives inside the node's
   signed registration, so it is as trustworthy as the node's key): the
   tracker, and a ring's previous node, pin exactly that certificate, self-
   signed or not, and skip the host name check (the pin is stronger);
2. for the tracker: the identity certificate it serves, once its key is the
   tracker key this node pins (`trust_tracker`; `--tracker-key`, the pin
   file, or on first use the key the registration reply then proves);
3. otherwise `--tls-ca FILE` (a CA bundle, or a self-signed certificate used
   as its own anchor), which also skips step 2;
4. otherwise the system's CAs.

Mutual: every client context presents `TlsTrust.client` when it has one
(the tracker its own identity certificate, a node the member certificate
its tracker issued it at registration). A node's server, once it knows its
tracker's certificate, refuses a client without a certificate that chains to
it (`admit_members`); a tracker's server checks one when offered (API
clients have none).

Left out: certificate reloading, and telling the app which member called (a
capability says that).
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import trio

from dgr.api.hosts import is_loopback
from dgr.errors import CallerError, Reason
from dgr.security.certs import LinkCert, cert_key
from dgr.security.pins import TrackerPin

__all__ = ["TlsTrust", "cert_pem", "check_registered_url", "check_server_files", "server_context", "admit_members", "served_cert",
           "trust_tracker", "learn_tracker", "httpx_default_trust"]

_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


def check_registered_url(url: str, *, required: bool, encrypt: bool) -> None:
    """A node's registered URL, which the tracker hands out as a next hop, against the links' rules.

    Raises:
        CallerError(FORBIDDEN): plain http:// where TLS is required (`required`, --require-tls), or off loopback
            where links are encrypted (`encrypt`, the default; off with --insecure).
    """
    if url.startswith("https://"):
        return
    if required:
        raise CallerError(Reason.FORBIDDEN, f"this tracker requires TLS (--require-tls): register an https:// URL, not "
                                            f"{url[:100]!r} (--tls-cert and --tls-key, or --advertise https://...)",
                          field="url")
    if encrypt and not is_loopback(urlsplit(url).hostname or ""):
        raise CallerError(Reason.FORBIDDEN, f"plain http:// off loopback: links off loopback are encrypted here; "
                                            f"register an https:// URL, not {url[:100]!r} (the node serves https off "
                                            "loopback unless --insecure; or start the tracker with --insecure)",
                          field="url")


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


def server_context(files: tuple[str, str] | None = None, own: LinkCert | None = None) -> ssl.SSLContext:
    """What a dgr server speaks TLS with: the operator's certificate `files` (TLS 1.2 or later), else its
    identity certificate `own` (TLS 1.3: see dgr.security.certs); HTTP/1.1 by ALPN, no client certificate
    asked until `admit_members`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2 if files is not None else ssl.TLSVersion.TLSv1_3
    ctx.options |= ssl.OP_NO_COMPRESSION
    if files is not None:
        ctx.load_cert_chain(*files)
    elif own is not None:
        own.load_into(ctx)
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.num_tickets = 0  # no client resumes a session: tickets would only sit unread on idle connections
    return ctx


def admit_members(ctx: ssl.SSLContext, anchor_pem: str, *, required: bool) -> None:
    """Make the server context `ctx` check client certificates against the tracker certificate `anchor_pem`
    (its member certificates, and itself); `required`: refuse a client without one.

    Connections accepted before keep what they had: a node calls this before it registers, so before the
    tracker, or any member, has reason to call it.
    """
    ctx.load_verify_locations(cadata=anchor_pem)
    ctx.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL


@attrs.frozen
class TlsTrust:
    """Which links must be encrypted, how this process's clients check the servers they call, and the
    certificate they present."""

    ca_file: str | None = None
    required: bool = False  # --require-tls: no http:// peer at all
    encrypt: bool = False  # links off loopback must be https: the command line's default, off with --insecure
    force: bool = False  # --tls: serve https on loopback too
    client: LinkCert | None = None  # presented to every https server this process calls
    tracker_pem: str | None = None  # the tracker's identity certificate, pinned for calls to it

    def check(self, url: str, what: str) -> None:
        """Refuse an http:// `url` (`what` names it) when TLS is required, or when it is off loopback and
        links must be encrypted.

        Raises:
            CallerError(FORBIDDEN): the link would be plain http where it may not be.
        """
        if url.startswith("https://"):
            return
        if self.required:
            raise CallerError(Reason.FORBIDDEN, f"{what} {url[:200]!r} is not https://, and TLS is required here "
                                                "(--require-tls)", field="url")
        host = urlsplit(url).hostname or ""
        if self.encrypt and not is_loopback(host):
            raise CallerError(Reason.FORBIDDEN, f"{what} {url[:200]!r} is plain http:// off loopback: links off "
                                                "loopback are encrypted (https://); --insecure allows plain http",
                              field="url")

    def serves(self, host: str, files: tuple[str, str] | None = None) -> bool:
        """Whether a server bound to `host` speaks TLS: with the operator's certificate `files`, with --tls,
        and off loopback unless --insecure."""
        return files is not None or self.force or (self.encrypt and not is_loopback(host))

    def context(self, pinned_pem: str | None = None) -> ssl.SSLContext:
        """A client context: pinned to one certificate, or trusting `ca_file`, or the system's CAs; presenting
        `client` when there is one.

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
            if self.client is not None:
                self.client.load_into(ctx)
        except (OSError, ssl.SSLError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"cannot load TLS trust: {exc}") from None
        # a leaf (a self-signed certificate, or a pinned one) may be the trust anchor itself
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return ctx

    def httpx_verify(self, url: str, pinned_pem: str | None = None) -> ssl.SSLContext:
        """What to give httpx as `verify` for `url`: a context for https, httpx's default (unused) for http."""
        return self.context(pinned_pem) if url.startswith("https://") else httpx_default_trust()

    def tracker_verify(self, url: str) -> ssl.SSLContext:
        """`httpx_verify` for the tracker at `url`: its identity certificate pinned, once learned."""
        return self.httpx_verify(url, self.tracker_pem)


async def served_cert(url: str) -> str:
    """The certificate (PEM) the https server at `url` presents, checking nothing: the caller checks the key
    in it, and the caller's scope bounds the wait.

    Raises:
        OSError, trio.BrokenResourceError: no TLS server answered there.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # nothing is sent over it: only the certificate is read, then checked
    stream = trio.SSLStream(await trio.open_tcp_stream(host, parts.port or 443), ctx, server_hostname=host)
    try:
        await stream.do_handshake()
        der = stream.getpeercert(binary_form=True)
    finally:
        await trio.aclose_forcefully(stream)
    if not der:
        raise trio.BrokenResourceError(f"{url} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der)


def trust_tracker(tls: TlsTrust, pem: str, pin: TrackerPin) -> TlsTrust:
    """`tls` with the tracker's certificate `pem` pinned, when it is an identity certificate (an Ed25519 key);
    `tls` unchanged for any other, which `--tls-ca` or the system's CAs must vouch for.

    Raises:
        CallerError(FORBIDDEN): the certificate's key is not the tracker key `pin` expects.
    """
    key = cert_key(pem)
    if key is None:
        return tls
    pin.check(key)
    return attrs.evolve(tls, tracker_pem=pem)


async def learn_tracker(tls: TlsTrust, url: str, pin: TrackerPin) -> TlsTrust:
    """`trust_tracker` with the certificate served at `url`, when it is https and nothing else decides whom
    to trust there (`--tls-ca`, or a certificate learned already).

    Raises:
        CallerError(FORBIDDEN): as `trust_tracker`. OSError, trio.BrokenResourceError: as `served_cert`.
    """
    if not url.startswith("https://") or tls.ca_file is not None or tls.tracker_pem is not None:
        return tls
    return trust_tracker(tls, await served_cert(url), pin)


@functools.cache
def httpx_default_trust() -> ssl.SSLContext:
    """httpx's own default (`verify=True`: certifi's CAs), built once per process.

    httpx builds it for every client, even one that only calls http:// URLs, and loading the CAs costs
    about 60 ms of CPU: a tracker makes a client per node.
    """
    import httpx

    return httpx.create_ssl_context()
