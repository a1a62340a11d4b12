"""PACT identities (spec §2): keys, SPKI fingerprints, self-signed certs, pinned TLS.

A PACT identity is one keypair; its public identity is
``"sha256:" + base64url_nopad(SHA-256(SubjectPublicKeyInfo DER))``. Certificates are only
carriers for the key: chains and names are irrelevant, the pinned fingerprint is the
identity. So our TLS contexts never verify chains; they compare the peer's SPKI
fingerprint against a pin set after the handshake (stdlib `ssl` with `CERT_NONE` still
exposes the peer certificate's DER).

Key files are written atomically with mode 0600 and never logged.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import contextlib
import datetime
import hashlib
import os
import re
import ssl
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from pact_ingress.errors import IdentityError
from pact_ingress.files import read_small

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey

#: A pin is "sha256:" + 43 unpadded base64url characters (32 bytes of SHA-256).
PIN_RE = re.compile(r"sha256:[A-Za-z0-9_-]{43}")

#: Self-signed identity certs are long-lived on purpose: the key is the identity, and
#: rotation happens by re-pinning (spec §2), not by certificate expiry.
CERT_LIFETIME = datetime.timedelta(days=3650)


def b64url(data: bytes) -> str:
    """Unpadded base64url, the encoding of every PACT wire member."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*")
#: base64url's two letters to the standard alphabet's (what `binascii` decodes)
_TO_STANDARD = bytes.maketrans(b"-_", b"+/")
_PADDING = ("", "", "==", "=")


def b64url_decode(text: str) -> bytes:
    """Strict unpadded base64url decode; raises ValueError on padding or bad chars."""
    if not isinstance(text, str) or _B64URL_RE.fullmatch(text) is None:
        raise ValueError("not unpadded base64url")
    if len(text) % 4 == 1:
        raise ValueError("impossible base64url length")
    # every character is one of the alphabet's (checked above): what
    # `base64.urlsafe_b64decode` does, without its argument coercion and re-checks
    return binascii.a2b_base64((text + _PADDING[len(text) % 4]).encode("ascii")
                               .translate(_TO_STANDARD))


def is_pin(text: object) -> bool:
    """True when `text` is a PACT fingerprint in its one canonical spelling."""
    return pin_problem(text) is None


def pin_problem(text: object) -> str | None:
    """Why `text` is not a PACT fingerprint (to follow the quoted text), or None.

    43 base64url characters carry 258 bits for a 256-bit digest: the last character's
    two low bits are padding. A pin with them set decodes to the same digest as the
    canonical one, but fingerprints are compared as strings, so it could never match.
    """
    if not isinstance(text, str) or PIN_RE.fullmatch(text) is None:
        return "is not 'sha256:' + 43 base64url characters"
    canonical = "sha256:" + b64url(b64url_decode(text[7:]))
    if canonical != text:
        return (f"is not canonical base64url: its last character {text[-1]!r} sets padding "
                f"bits, so it can never equal a computed fingerprint (the same digest is "
                f"spelled with {canonical[-1]!r}; check the whole pin was copied intact)")
    return None


def spki_der(public_key: PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def fingerprint_of_spki(der: bytes) -> str:
    return "sha256:" + b64url(hashlib.sha256(der).digest())


def fingerprint(public_key: PublicKey) -> str:
    """The PACT fingerprint of a public key."""
    return fingerprint_of_spki(spki_der(public_key))


def fingerprint_of_cert_der(der: bytes) -> str:
    """Fingerprint of the key inside a DER certificate (what a TLS peer presented)."""
    cert = x509.load_der_x509_certificate(der)
    return fingerprint(cert.public_key())  # type: ignore[arg-type]


def generate_key(*, ed25519_key: bool = False) -> PrivateKey:
    """A new identity key: ECDSA P-256 by default (best TLS compatibility, spec §2)."""
    if ed25519_key:
        return ed25519.Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def self_signed_cert(key: PrivateKey, common_name: str = "pact") -> x509.Certificate:
    """A long-lived self-signed certificate carrying `key`; only the key matters."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + CERT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm)


def ensure_selfsigned_cert(host: str, cert_path: Path, key_path: Path) -> bool:
    """Create a self-signed cert (SAN = host) + 0600 key when neither file exists.

    For terminate routes on machines without ACME (the bundled local config, tests).
    Returns True when files were created. Existing files are never touched.
    """
    cert_path, key_path = Path(cert_path), Path(key_path)
    if cert_path.exists() or key_path.exists():
        return False
    key = generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host.replace("*", "wildcard"))])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    atomic_write(key_path, key_pem(key), 0o600)
    atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def make_dirs(directory: Path) -> None:
    """`mkdir -p` with 0755 at most for every directory it creates: under a lax umask
    (000 from a service manager or a container) a directory holding keys or tenant files
    would otherwise be writable by every user, who could then swap or add files in it."""
    missing = []
    directory = Path(directory)
    while not directory.is_dir() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for part in reversed(missing):
        part.mkdir(mode=0o755, exist_ok=True)  # the umask can only take more away


#: The name of `atomic_write`'s temp file for NAME: a dot, NAME, a dot and `mkstemp`'s
#: eight random characters.
WRITE_LEFTOVER = re.compile(r"\.(.+)\.[a-z0-9_]{8}")


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` via a temp file + rename, created with `mode` from the start.
    A process killed mid-write leaves the temp file behind (`remove_write_leftovers`)."""
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_write_leftovers(directory: Path, before: float) -> list[Path]:
    """Remove from `directory` the temp files `atomic_write` left there (a process killed
    between the temp file and the rename: a partial copy, perhaps of a private key) last
    modified before `before` (wall clock: a write still under way elsewhere is younger).
    Returns what was removed; a directory that is not there has none."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        if not WRITE_LEFTOVER.fullmatch(entry.name):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or entry.stat(
                    follow_symlinks=False).st_mtime >= before:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(Path(entry.path))
    return removed


def cert_path_for(key_path: Path) -> Path:
    """Where the self-signed cert of a key file lives: `X.key` → `X.crt`, else `X.crt` appended."""
    key_path = Path(key_path)
    if key_path.suffix == ".key":
        return key_path.with_suffix(".crt")
    return key_path.with_name(key_path.name + ".crt")


@dataclass(frozen=True)
class Identity:
    """A loaded identity: private key, its cert, and the fingerprint both share."""

    key_path: Path
    cert_path: Path
    key: PrivateKey
    cert: x509.Certificate
    fingerprint: str

    def __repr__(self) -> str:  # never show key material
        return f"Identity({self.fingerprint}, key=MASKED)"


def keygen(path: Path, *, ed25519_key: bool = False, common_name: str = "pact") -> Identity:
    """Create a key (0600) and its self-signed cert beside it."""
    path = Path(path)
    key = generate_key(ed25519_key=ed25519_key)
    cert = self_signed_cert(key, common_name)
    atomic_write(path, key_pem(key), 0o600)
    atomic_write(cert_path_for(path), cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Identity(path, cert_path_for(path), key, cert, fingerprint(key.public_key()))


#: Key and certificate files are a few KiB; a bigger one is no such file.
MAX_KEY_FILE_BYTES = 1024 * 1024


def _read_small_file(path: Path, what: str) -> bytes:
    """A regular file's bytes; a FIFO or device (which could block or never end) and an
    oversized file are refused instead of read."""
    try:
        return read_small(path, MAX_KEY_FILE_BYTES)[0]
    except OSError as exc:
        raise IdentityError(f"{path}: cannot read {what}: {exc.strerror}") from exc
    except ValueError as exc:  # NotAFile, TooLarge
        raise IdentityError(f"{path}: cannot read {what}: {exc}") from None


def load_private_key(path: Path) -> PrivateKey:
    data = _read_small_file(path, "key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{path}: not an unencrypted PEM private key") from exc
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)):
        raise IdentityError(f"{path}: only ECDSA P-256 and Ed25519 identities are supported")
    return key


def load_identity(key_path: Path, *, create: bool = False) -> Identity:
    """Load a key and the cert beside it; (re)make the cert when missing or not matching.

    With `create`, a missing key is generated (first start of a fresh install).
    """
    key_path = Path(key_path)
    if create and not key_path.exists():
        return keygen(key_path)
    key = load_private_key(key_path)
    fp = fingerprint(key.public_key())
    cert_path = cert_path_for(key_path)
    cert = None
    if cert_path.exists():
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError:
            cert = None
    if cert is None or fingerprint(cert.public_key()) != fp:  # type: ignore[arg-type]
        cert = self_signed_cert(key)
        cert_path = _write_cert_somewhere(cert_path, cert)
    return Identity(key_path, cert_path, key, cert, fp)


def identity_pems(identity: Identity) -> tuple[bytes, bytes]:
    """The key and certificate of a loaded identity, PEM (for `identity_in_memory`)."""
    return key_pem(identity.key), identity.cert.public_bytes(serialization.Encoding.PEM)


def identity_in_memory(key_data: bytes, cert_data: bytes) -> Identity:
    """An identity from PEM bytes that no file change can alter afterwards.

    The stdlib's ssl loads a key only from a path, so key and certificate go to one
    anonymous memory file (Linux memfd, kept open for the process's life) whose
    /proc/self/fd path serves as both `key_path` and `cert_path`.
    """
    key = serialization.load_pem_private_key(key_data, password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)):
        raise IdentityError("only ECDSA P-256 and Ed25519 identities are supported")
    cert = x509.load_pem_x509_certificate(cert_data)
    fp = fingerprint(key.public_key())
    if fingerprint(cert.public_key()) != fp:  # type: ignore[arg-type]
        raise IdentityError("the certificate is not the key's")
    fd = os.memfd_create("pact-identity", os.MFD_CLOEXEC)
    view = memoryview(cert_data + key_data)
    while view:
        view = view[os.write(fd, view):]
    path = Path(f"/proc/self/fd/{fd}")
    return Identity(path, path, key, cert, fp)


def _write_cert_somewhere(cert_path: Path, cert: x509.Certificate) -> Path:
    """Write the cert beside the key; when that directory is read-only (a systemd
    credential passed with LoadCredential=, a read-only mount) use a private runtime
    file instead: the cert is public and derived from the key, so nothing is lost."""
    pem = cert.public_bytes(serialization.Encoding.PEM)
    try:
        atomic_write(cert_path, pem, 0o644)
        return cert_path
    except OSError:
        runtime = Path(os.environ.get("RUNTIME_DIRECTORY", tempfile.gettempdir()))
        fd, tmp = tempfile.mkstemp(dir=runtime, prefix="pact-identity-", suffix=".crt")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
        except BaseException:
            _remove(tmp)
            raise
        # TLS contexts load it by path for as long as the process runs, and no longer:
        # each start would otherwise leave one more behind
        atexit.register(_remove, tmp)
        return Path(tmp)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def key_fingerprint(key_path: Path, *, create: bool = False) -> str:
    """The fingerprint of the key at `key_path` (with `create`, made first when missing),
    for a caller that needs the pin only: no certificate is made, so none is written."""
    key_path = Path(key_path)
    if create and not key_path.exists():
        return keygen(key_path).fingerprint
    return fingerprint(load_private_key(key_path).public_key())


def fingerprint_file(path: Path) -> str:
    """Fingerprint of a private key, public key (SPKI), or certificate file, PEM or DER."""
    data = _read_small_file(path, "file")
    loaders = (
        lambda d: serialization.load_pem_private_key(d, None).public_key(),
        lambda d: serialization.load_der_private_key(d, None).public_key(),
        lambda d: x509.load_pem_x509_certificate(d).public_key(),
        lambda d: x509.load_der_x509_certificate(d).public_key(),
        serialization.load_pem_public_key,
        serialization.load_der_public_key,
    )
    for load in loaders:
        try:
            return fingerprint(load(data))  # type: ignore[arg-type]
        except (ValueError, TypeError):
            continue
    raise IdentityError(f"{path}: not a key, certificate or SPKI file (PEM or DER)")


# --- pinned TLS (stdlib ssl) -------------------------------------------------------------


def pinned_client_context(identity: Identity | None, alpn: Iterable[str] = ()) -> ssl.SSLContext:
    """A client context that presents `identity` and verifies nothing by chain or name.

    The caller MUST check the peer with `check_pin` after the handshake: the pin is the
    whole of server authentication here (spec §2 (b)).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if identity is not None:
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
    alpn = list(alpn)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def peer_fingerprint(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> str | None:
    der = ssl_object.getpeercert(binary_form=True)
    return fingerprint_of_cert_der(der) if der else None


class PinMismatch(IdentityError):
    """The peer's key is not one of the pins. Carries both sides for the log line."""

    def __init__(self, expected: Iterable[str], seen: str | None) -> None:
        self.expected = tuple(expected)
        self.seen = seen
        super().__init__(f"pin mismatch: expected one of {list(self.expected)}, saw {seen}")


def check_pin(ssl_object: ssl.SSLObject | ssl.SSLSocket, pins: Iterable[str]) -> str:
    """Return the peer fingerprint if it is pinned, else raise PinMismatch."""
    pins = tuple(pins)
    seen = peer_fingerprint(ssl_object)
    if seen is None or seen not in pins:
        raise PinMismatch(pins, seen)
    return seen
