"""The certificate store: ACME accounts and issued certificates under `state_dir`.

Layout (everything below `state_dir/acme/`):

    accounts/<directory-slug>/account.key        account key, PEM, 0600
    accounts/<directory-slug>/registration.json  the CA's registration resource
    certs/<host-dir>/<serial>.pem                full chain (leaf first)
    certs/<host-dir>/<serial>.key                the certificate's key, PEM, 0600
    certs/<host-dir>/meta.json                   which serial is current + bookkeeping

A certificate and its key are two files, and no rename replaces two files at once. So the
files of one issuance are named by the certificate's serial and never rewritten; `meta.json`
is the commit point: it is replaced atomically (temp file + rename) *after* both files are
on disk, and names the serial a reader must load. A crash between the steps leaves an
orphan pair that the next successful save removes; readers never see a half pair. A
crash inside one write leaves that write's temp file (`.NAME.xxxxxxxx`), which
`remove_leftovers` takes away once it is `LEFTOVER_AGE` old: the certificate manager
calls it when it starts and every `LEFTOVER_SWEEP` after.

Hosts are validated before they become directory names (no path traversal); a wildcard
`*.x` lives in `_wildcard_.x`. Nothing here touches the network or reads the clock: times
come in as arguments, so `list_store` works offline against a stopped instance.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cryptography import x509

from pact_ingress.errors import AcmeError
from pact_ingress.identity import atomic_write, remove_write_leftovers

#: A DNS name (optionally with one leading "*." label), lower case, as config.py stores it.
HOST_RE = re.compile(r"(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*"
                     r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")

#: How old a write's temp file must be before it counts as left behind (a write takes
#: milliseconds; the age keeps a sweep away from a write still under way in another
#: process).
LEFTOVER_AGE = 60.0
#: How often a running manager looks for them again (a crash leaves them at most once
#: per restart; the first look after a quick restart is too early for that crash's).
LEFTOVER_SWEEP = 3600.0

#: Largest certificate chain file we load back (a real chain is a few KiB).
MAX_CHAIN_BYTES = 64 * 1024

CertSource = Literal["acme", "file"]


class OrderElsewhere(AcmeError):
    """Another instance of the cluster holds this name's order lock: it orders, we wait."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="elsewhere")


class SharedStateUnavailable(AcmeError):
    """The shared state (Redis) does not answer: no new order may start until it does."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="state_unavailable")


@dataclass(frozen=True)
class CertInfo:
    """One row of `certs list`: what is (or is not yet) served for a host."""

    host: str
    source: CertSource
    issuer: str | None = None
    not_before: float | None = None  # wall-clock seconds
    not_after: float | None = None
    next_renewal: float | None = None
    last_error: str | None = None
    directory: str | None = None  # the ACME CA that issued it


@dataclass(frozen=True)
class StoredCert:
    """The current certificate of one host, as files on disk plus parsed facts."""

    host: str
    chain_path: Path
    key_path: Path
    chain_pem: bytes
    not_before: float
    not_after: float
    issuer: str
    directory: str | None

    @property
    def serial(self) -> str:
        """The serial in hex: the files of one issuance are named by it."""
        return self.chain_path.stem


def host_dir_name(host: str) -> str:
    """The directory name of a host's certificates; raises on anything not a DNS name."""
    if not HOST_RE.fullmatch(host) or len(host) > 253:
        raise AcmeError(f"not a certificate host name: {host!r}", reason="bad_host")
    return "_wildcard_" + host[1:] if host.startswith("*.") else host


def directory_slug(directory_url: str) -> str:
    """A stable, path-safe name for one ACME directory URL (one account per CA)."""
    readable = re.sub(r"[^a-zA-Z0-9.-]+", "_", directory_url.split("://", 1)[-1])[:60]
    return readable + "-" + hashlib.sha256(directory_url.encode()).hexdigest()[:12]


def parse_chain(chain_pem: bytes) -> x509.Certificate:
    """The leaf of a PEM chain; raises AcmeError when there is none."""
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as exc:
        raise AcmeError("certificate chain is not PEM", reason="bad_chain") from exc
    if not certs:
        raise AcmeError("certificate chain is empty", reason="bad_chain")
    return certs[0]


def issuer_name(cert: x509.Certificate) -> str:
    cn = cert.issuer.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    return str(cn[0].value) if cn else cert.issuer.rfc4514_string()


class Store:
    """Files under `state_dir/acme`. Synchronous and small: callers run it where they like.

    The async methods at the end are what a cluster shares (`pact_ingress.state.acme`);
    for one instance they are empty: its `_Host.busy` flags already make one order per
    name, and its challenge answers live in the manager's own tables."""

    #: Whether other instances see what this store holds.
    shared = False

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "acme"

    # -- accounts ---------------------------------------------------------------------------
    def account_dir(self, directory_url: str) -> Path:
        return self.root / "accounts" / directory_slug(directory_url)

    def read_account(self, directory_url: str) -> tuple[bytes | None, dict[str, Any] | None]:
        """(account key PEM, registration JSON), each None when not stored yet."""
        d = self.account_dir(directory_url)
        key = _read_optional(d / "account.key")
        reg = _read_optional(d / "registration.json")
        return key, (json.loads(reg) if reg else None)

    def write_account_key(self, directory_url: str, key_pem: bytes) -> None:
        atomic_write(self.account_dir(directory_url) / "account.key", key_pem, 0o600)

    def write_registration(self, directory_url: str, registration: dict[str, Any]) -> None:
        data = json.dumps(registration, indent=1, sort_keys=True).encode()
        atomic_write(self.account_dir(directory_url) / "registration.json", data, 0o600)

    # -- certificates -----------------------------------------------------------------------
    def host_dir(self, host: str) -> Path:
        return self.root / "certs" / host_dir_name(host)

    def read_meta(self, host: str) -> dict[str, Any]:
        return self.read_meta_dir(self.host_dir(host))

    def write_meta(self, host: str, **changes: Any) -> None:
        """Merge `changes` into the host's meta.json (atomic replace)."""
        meta = self.read_meta(host)
        meta.update(changes, host=host)
        data = json.dumps(meta, indent=1, sort_keys=True).encode()
        atomic_write(self.host_dir(host) / "meta.json", data, 0o644)

    def save_cert(self, host: str, chain_pem: bytes, key_pem: bytes, *, directory: str,
                  next_renewal: float | None) -> StoredCert:
        """Store a new certificate for `host` and make it current (see module docstring)."""
        leaf = parse_chain(chain_pem)
        serial = format(leaf.serial_number, "x")
        d = self.host_dir(host)
        atomic_write(d / f"{serial}.key", key_pem, 0o600)
        atomic_write(d / f"{serial}.pem", chain_pem, 0o644)
        self.write_meta(host, serial=serial, directory=directory, next_renewal=next_renewal,
                        last_error=None)
        self._remove_stale(d, keep=serial)
        stored = self.load_cert(host)
        assert stored is not None  # just written
        return stored

    def load_cert(self, host: str) -> StoredCert | None:
        """The current certificate of `host`, or None (never stored, or files damaged)."""
        meta = self.read_meta(host)
        serial = meta.get("serial")
        if not isinstance(serial, str) or not re.fullmatch(r"[0-9a-f]+", serial):
            return None
        d = self.host_dir(host)
        chain_path, key_path = d / f"{serial}.pem", d / f"{serial}.key"
        chain_pem = _read_optional(chain_path, MAX_CHAIN_BYTES)
        if chain_pem is None or not key_path.exists():
            return None
        try:
            leaf = parse_chain(chain_pem)
        except AcmeError:
            return None
        return StoredCert(
            host=host, chain_path=chain_path, key_path=key_path, chain_pem=chain_pem,
            not_before=leaf.not_valid_before_utc.timestamp(),
            not_after=leaf.not_valid_after_utc.timestamp(),
            issuer=issuer_name(leaf), directory=meta.get("directory"))

    def hosts(self) -> list[str]:
        """Every host that has a meta.json (certificate or recorded error)."""
        base = self.root / "certs"
        if not base.is_dir():
            return []
        out = []
        for d in sorted(base.iterdir()):
            meta = self.read_meta_dir(d)
            host = meta.get("host")
            if isinstance(host, str) and HOST_RE.fullmatch(host):
                out.append(host)
        return out

    def read_meta_dir(self, d: Path) -> dict[str, Any]:
        raw = _read_optional(d / "meta.json")
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return meta if isinstance(meta, dict) else {}

    def info(self, host: str) -> CertInfo:
        """The inventory row of one ACME host from disk alone."""
        meta = self.read_meta(host)
        stored = self.load_cert(host)
        return CertInfo(
            host=host, source="acme",
            issuer=stored.issuer if stored else None,
            not_before=stored.not_before if stored else None,
            not_after=stored.not_after if stored else None,
            next_renewal=meta.get("next_renewal") if stored else None,
            last_error=meta.get("last_error"),
            directory=meta.get("directory"))

    # -- the cluster: nothing to share for one instance -------------------------------------
    @contextlib.asynccontextmanager
    async def order_lock(self, host: str) -> AsyncIterator[None]:
        yield

    async def fetch_shared(self, host: str,
                           known_serial: str | None) -> tuple[StoredCert, float | None] | None:
        """A certificate another instance stored that is not `known_serial` (None here)."""
        return None

    async def publish_challenge(self, kind: str, host: str, token: str,
                                key_authorization: str) -> None:
        pass

    async def withdraw_challenge(self, kind: str, host: str, token: str) -> None:
        pass

    async def find_challenge(self, kind: str, host: str, token: str) -> str | None:
        return None

    async def watch(self, known: Callable[[], dict[str, str | None]],
                    changed: Callable[[str], Awaitable[None]]) -> None:
        """Call `changed(host)` whenever another instance stored a new certificate."""
        await _sleep_forever()

    def remove_leftovers(self, now: float) -> list[Path]:
        """The temp files of writes that never finished (a process killed mid-write),
        removed from every directory this store writes, once `LEFTOVER_AGE` old. `now`:
        the wall clock. Returns what was removed."""
        removed = []
        for kind in ("accounts", "certs"):
            try:
                dirs = [p for p in (self.root / kind).iterdir() if p.is_dir()]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for d in dirs:
                removed += remove_write_leftovers(d, now - LEFTOVER_AGE)
        return removed

    @staticmethod
    def _remove_stale(d: Path, keep: str) -> None:
        for p in d.iterdir():
            if p.suffix in (".pem", ".key") and p.stem != keep and not p.name.startswith("."):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass


def list_store(state_dir: Path) -> list[CertInfo]:
    """Offline inventory of ACME certificates (for `pact-ingress certs list`).

    Reads only files: works whether or not an instance is running. File-based certs from
    the config are not in the store; `CertManager.inventory()` adds them for a live view.
    """
    store = Store(state_dir)
    return [store.info(h) for h in store.hosts()]


async def _sleep_forever() -> None:
    import trio  # only the running ingress gets here; `certs list` never imports trio

    await trio.sleep_forever()


def _read_optional(path: Path, cap: int = MAX_CHAIN_BYTES) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(cap + 1)[:cap]
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AcmeError(f"cannot read {path}: {os.strerror(exc.errno or 0)}",
                        reason="store") from exc
