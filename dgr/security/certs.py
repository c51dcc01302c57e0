"""TLS certificates made from dgr identities: encrypted, mutually authenticated links with no CA to set up.

Every tracker and node already holds an Ed25519 key (dgr.security.identity)
that the others know: a node's key is in its signed registration, the
tracker's is pinned by every node (dgr.security.pins). So the certificate a
process serves is made from that key, and a peer checks a certificate by the
key inside it, which is the key it already trusts:

- `identity_cert`: self-signed, its public key the identity key itself. A
  node serves one and registers it (the tracker and the ring's previous node
  pin exactly that certificate); a tracker serves one, and a node checks
  that its key is the tracker key it pins before it sends a byte
  (dgr.security.tls `trust_tracker`). The tracker's is also a CA
  certificate (basic constraints CA, path length 0), whose only use is:
- `member_cert`: issued by the tracker, at registration, for the key the
  node registered with (an admitted key: a join token or `--allow-node`), for
  client authentication only. A node presents it whenever it calls a tracker
  or another node, and a node's server demands a client certificate that
  chains to its tracker's (the tracker presents its own): the links between
  members are mutually authenticated, and a stranger's TLS handshake fails
  before a byte of HTTP is read.

Every field is a function of the keys (the validity runs from 2024 to
"no well-defined expiration", RFC 5280 4.1.2.5; the serial is a hash of the
key), and Ed25519 signatures are deterministic: a restarted process serves
the same certificate, so a pin never goes stale.

Why the identity key itself and not a TLS key signed by it: a peer's check is
then one comparison, and nothing new is kept on disk. The key's other
signatures cannot be confused with these: dgr signs a domain tag (first byte
`d`), X.509 a DER sequence (0x30), and TLS 1.3, which identity servers
insist on, 64 spaces (0x20) and its context string.

Left out: revocation and expiry (a member certificate lasts as long as its
key is admitted: a capability still gates every session call), and names
(SANs): peers pin keys, not host names. Browsers do not take Ed25519
certificates: an API served to browsers off loopback takes `--tls-cert`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dgr.security.identity import Identity, node_id_for

__all__ = ["LinkCert", "identity_cert", "member_cert", "cert_key", "pin_text"]

_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)  # RFC 5280: no expiry


def _name(role: str, public: bytes) -> x509.Name:
    # the key's own id makes every subject distinct: a chain is looked up by its issuer's name
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "dgr"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"dgr {role} {node_id_for(public)}")])


def _serial(kind: bytes, public: bytes) -> int:
    return int.from_bytes(hashlib.sha256(b"dgr/v1/tls-serial\0" + kind + public).digest()[:19], "big") | 1


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def identity_cert(identity: Identity, role: str) -> str:
    """The self-signed certificate (PEM) of `identity`'s own key; a tracker's (`role` "tracker") may issue
    member certificates."""
    public = identity.public
    issuer = identity.private.public_key()
    ca = role == "tracker"
    builder = (x509.CertificateBuilder().subject_name(_name(role, public)).issuer_name(_name(role, public))
               .public_key(issuer).serial_number(_serial(b"self", public))
               .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(issuer), critical=False))
    return _pem(builder.sign(identity.private, None))


def member_cert(tracker: Identity, node_key: bytes) -> str:
    """The client certificate (PEM) the tracker issues to the admitted node key `node_key`.

    Raises:
        ValueError: `node_key` is not a raw Ed25519 public key.
    """
    subject = Ed25519PublicKey.from_public_bytes(node_key)
    issuer = tracker.private.public_key()
    builder = (x509.CertificateBuilder().subject_name(_name("member", node_key))
               .issuer_name(_name("tracker", tracker.public))
               .public_key(subject).serial_number(_serial(b"member", node_key))
               .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer), critical=False))
    return _pem(builder.sign(tracker.private, None))


def cert_key(pem: str) -> bytes | None:
    """The raw Ed25519 public key a PEM certificate carries; None for any other key, or no certificate."""
    try:
        key = x509.load_pem_x509_certificate(pem.encode("ascii")).public_key()
    except (ValueError, UnicodeEncodeError):
        return None
    if not isinstance(key, Ed25519PublicKey):
        return None
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def pin_text(pem: str) -> str:
    """The certificate's public key pin as curl's `--pinnedpubkey` takes it: `sha256//` and base64."""
    import base64

    spki = x509.load_pem_x509_certificate(pem.encode("ascii")).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode("ascii")


@attrs.frozen
class LinkCert:
    """A certificate chain (PEM) and its private key: what a TLS context presents."""

    chain: str
    key: Ed25519PrivateKey = attrs.field(repr=False)

    def load_into(self, ctx: ssl.SSLContext) -> None:
        """Give `ctx` this certificate and key (the ssl module reads them only from a file: one made 0600 in a
        private folder, and removed at once)."""
        key = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        with tempfile.TemporaryDirectory(prefix="dgr-tls-") as folder:  # 0700
            path = os.path.join(folder, "link.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key + self.chain.encode("ascii"))
            ctx.load_cert_chain(path)
