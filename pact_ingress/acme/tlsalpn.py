"""TLS-ALPN-01 (RFC 8737): the challenge certificate and the acme library glue.

The CA opens TLS to the host on port 443 with SNI = the host and ALPN offering only
`acme-tls/1`. We must complete the handshake with a self-signed certificate whose only
identifier is that host (subjectAltName dNSName) and which carries the *critical*
extension id-pe-acmeIdentifier (1.3.6.1.5.5.7.1.31) whose extnValue is the DER encoding
of an OCTET STRING holding SHA-256(key authorization). The router sees the ALPN in the
ClientHello and hands such connections to `CertManager.challenge_context(sni)`.

The `acme` library (5.x) no longer ships TLS-ALPN-01 classes, so without them the challenge
parses as `UnrecognizedChallenge` and cannot be answered. The two small classes below
register the type with the library's JSON registries: answering is the generic
key-authorization response (an empty JSON object on the wire, RFC 8555 §7.5.1).
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
import tempfile
from pathlib import Path
from typing import Any

import josepy as jose
from acme import challenges
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID, ObjectIdentifier

#: id-pe-acmeIdentifier (RFC 8737 §6.1).
ACME_IDENTIFIER_OID = ObjectIdentifier("1.3.6.1.5.5.7.1.31")
#: The ALPN protocol name of the challenge (RFC 8737 §6.2).
ALPN_ACME_TLS = "acme-tls/1"
#: The challenge cert only has to live through one validation; a day covers clock skew.
CHALLENGE_CERT_LIFETIME = datetime.timedelta(days=1)


@challenges.ChallengeResponse.register
class TLSALPN01Response(challenges.KeyAuthorizationChallengeResponse):
    """Answer to a TLS-ALPN-01 challenge (serialises as `{}`)."""

    typ = "tls-alpn-01"


@challenges.Challenge.register
class TLSALPN01(challenges.KeyAuthorizationChallenge):
    """The TLS-ALPN-01 challenge; `validation` is the acmeIdentifier digest."""

    response_cls = TLSALPN01Response
    typ = response_cls.typ

    def validation(self, account_key: jose.JWK, **unused: Any) -> bytes:
        return hashlib.sha256(self.key_authorization(account_key).encode()).digest()


def acme_identifier_value(key_authorization: str) -> bytes:
    """DER OCTET STRING of SHA-256(key authorization): the extension's extnValue."""
    digest = hashlib.sha256(key_authorization.encode("ascii")).digest()
    return bytes([0x04, len(digest)]) + digest


def challenge_cert(host: str, key_authorization: str, *,
                   now: datetime.datetime) -> tuple[bytes, bytes]:
    """(cert PEM, key PEM) of the RFC 8737 self-signed challenge certificate for `host`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ACME challenge")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CHALLENGE_CERT_LIFETIME)
        .not_valid_after(now + CHALLENGE_CERT_LIFETIME)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(
            x509.UnrecognizedExtension(ACME_IDENTIFIER_OID,
                                       acme_identifier_value(key_authorization)),
            critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def challenge_context(host: str, key_authorization: str, *,
                      now: datetime.datetime) -> ssl.SSLContext:
    """A server context presenting the challenge certificate, ALPN `acme-tls/1` only."""
    cert_pem, key_pem = challenge_cert(host, key_authorization, now=now)
    return context_from_pem(cert_pem, key_pem, alpn=[ALPN_ACME_TLS])


def context_from_pem(chain_pem: bytes, key_pem: bytes, *, alpn: list[str]) -> ssl.SSLContext:
    """A server-side SSLContext from PEM bytes.

    The stdlib only loads certificates from paths, so the PEM goes through a private
    temporary directory (0700, removed at once). Used for throwaway challenge keys only;
    served certificates are loaded straight from the store's files.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.set_alpn_protocols(alpn)
    with tempfile.TemporaryDirectory(prefix="pact-acme-") as tmp:
        chain, key = Path(tmp) / "chain.pem", Path(tmp) / "key.pem"
        key.touch(0o600)
        key.write_bytes(key_pem)
        chain.write_bytes(chain_pem)
        ctx.load_cert_chain(chain, key)
    return ctx
