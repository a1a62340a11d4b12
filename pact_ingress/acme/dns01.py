"""DNS-01 by RFC 2136 dynamic update with TSIG, then a propagation check.

DNS-01 is the only challenge a CA accepts for wildcard names (`*.x`). We publish
`_acme-challenge.<name> TXT <b64url(SHA-256(key authorization))>` by sending a signed
UPDATE to the configured server (normally the zone's primary), then poll that
authoritative server until the record is visible before telling the CA to look: answering
the challenge too early makes the CA's lookup fail and burns a failed validation.

Runs synchronously (dnspython's blocking API) inside the issuance worker thread; every
network call has a timeout and every wait loop a deadline, so the thread always ends.
The TSIG secret never leaves this module's `TsigKey` (its repr is masked).
"""

from __future__ import annotations

import base64
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype
import dns.tsig
import dns.tsigkeyring
import dns.update

from pact_ingress.errors import AcmeError
from pact_ingress.files import read_small
from pact_ingress.model import Dns01

#: TTL of the challenge record: short, it is deleted right after validation anyway.
CHALLENGE_TTL = 60
#: Per-query timeout to the DNS server (seconds).
QUERY_TIMEOUT = 5.0
#: How long we wait for the record to show on the authoritative server before giving up.
PROPAGATION_TIMEOUT = 60.0
#: Pause between propagation checks.
PROPAGATION_POLL = 0.25
#: Largest key file we read (a BIND key clause is ~150 bytes).
MAX_KEY_FILE = 4096

_KEY_RE = re.compile(
    r'key\s+"?(?P<name>[^"\s{]+)"?\s*\{\s*algorithm\s+"?(?P<alg>[a-z0-9-]+)"?\s*;'
    r'\s*secret\s+"(?P<secret>[A-Za-z0-9+/=]+)"\s*;\s*\}\s*;', re.DOTALL)


@dataclass(frozen=True)
class TsigKey:
    name: str
    algorithm: str
    secret: bytes = field(repr=False)

    def keyring(self) -> dict[dns.name.Name, dns.tsig.Key]:
        key = dns.tsig.Key(self.name, self.secret, self.algorithm)
        return {key.name: key}


def read_tsig_key(path: Path) -> TsigKey:
    """Parse a BIND `key "name" { algorithm ...; secret "..."; };` file (tsig-keygen output).

    Read as every operator-named file is (`files.read_small`): this runs in the event
    loop, where a pipe at the path would otherwise wait for a writer for ever."""
    try:
        text = read_small(path, MAX_KEY_FILE)[0].decode("ascii")
    except (OSError, ValueError) as exc:  # NotAFile, TooLarge, UnicodeDecodeError
        raise AcmeError(f"cannot read TSIG key file {path}: {exc}", reason="dns01_key") from exc
    return parse_tsig_key(text, path)


def parse_tsig_key(text: str, path: Path) -> TsigKey:
    m = _KEY_RE.search(text)
    if m is None:
        raise AcmeError(f"{path}: not a BIND key clause (tsig-keygen output)",
                        reason="dns01_key")
    try:
        secret = base64.b64decode(m["secret"], validate=True)
    except ValueError as exc:  # binascii.Error: bad padding
        raise AcmeError(f"{path}: the key's secret is not base64", reason="dns01_key") from exc
    return TsigKey(m["name"], m["alg"], secret)


def challenge_name(host: str) -> str:
    """`_acme-challenge.<host>` (a wildcard's challenge sits on its base name, RFC 8555 §8.4)."""
    base = host.removeprefix("*.")
    return "_acme-challenge." + base.rstrip(".") + "."


class Dns01Solver:
    """Publish and remove challenge TXT records in one zone."""

    def __init__(self, cfg: Dns01, *, propagation_timeout: float = PROPAGATION_TIMEOUT) -> None:
        self.zone = dns.name.from_text(cfg.zone)
        # A name is looked up when a record is sent, in the order's worker thread: the
        # solver is made on the event loop's thread (at start and at every reload), where
        # a lookup would hold every connection for as long as the resolver takes. Looked
        # up per order, a server that moved is followed too.
        self.server = cfg.server.host
        self.port = cfg.server.port
        self.shown = str(cfg.server)  # as the config writes it ([v6]:port) in messages
        self.key = read_tsig_key(cfg.tsig_key_file)
        self.propagation_timeout = propagation_timeout

    def present(self, host: str, value: str) -> None:
        """Add the TXT record and return once the authoritative server answers with it."""
        name = self._relative(host)
        upd = dns.update.UpdateMessage(self.zone, keyring=self.key.keyring())
        upd.add(name, CHALLENGE_TTL, "TXT", value)
        address = _resolve(self.server)
        self._send(address, upd, "add")
        self._wait_visible(address, name.derelativize(self.zone), value)

    def cleanup(self, host: str, value: str) -> None:
        """Remove exactly our TXT value (other concurrent challenges' values stay)."""
        upd = dns.update.UpdateMessage(self.zone, keyring=self.key.keyring())
        upd.delete(self._relative(host), "TXT", value)
        self._send(_resolve(self.server), upd, "delete")

    def _relative(self, host: str) -> dns.name.Name:
        name = dns.name.from_text(challenge_name(host))
        if not name.is_subdomain(self.zone):
            raise AcmeError(f"{host} is not inside the DNS-01 zone {self.zone}",
                            reason="dns01_zone")
        return name.relativize(self.zone)

    def _send(self, address: str, upd: dns.update.UpdateMessage, what: str) -> None:
        try:
            resp = dns.query.tcp(upd, address, port=self.port, timeout=QUERY_TIMEOUT)
        except (OSError, dns.exception.DNSException) as exc:
            raise AcmeError(f"DNS update ({what}) to {self.shown} failed: {exc}",
                            reason="dns01_update") from exc
        if resp.rcode() != dns.rcode.NOERROR:
            raise AcmeError(f"DNS update ({what}) refused: {dns.rcode.to_text(resp.rcode())}",
                            reason="dns01_update")

    def _wait_visible(self, address: str, name: dns.name.Name, value: str) -> None:
        deadline = time.monotonic() + self.propagation_timeout
        while True:
            if value in self._txt_values(address, name):
                return
            if time.monotonic() >= deadline:
                raise AcmeError(f"TXT {name} not visible on {self.shown} after "
                                f"{self.propagation_timeout:.0f}s", reason="dns01_propagation")
            time.sleep(PROPAGATION_POLL)

    def _txt_values(self, address: str, name: dns.name.Name) -> set[str]:
        q = dns.message.make_query(name, dns.rdatatype.TXT)
        try:
            resp, _ = dns.query.udp_with_fallback(q, address, port=self.port,
                                                  timeout=QUERY_TIMEOUT)
        except (OSError, dns.exception.DNSException):
            return set()
        out: set[str] = set()
        for rrset in resp.answer:
            if rrset.rdtype == dns.rdatatype.TXT:
                out.update(b"".join(r.strings).decode("ascii", "replace") for r in rrset)
        return out


def _resolve(host: str) -> str:
    """An IP literal for the configured server (dnspython's query functions want one).
    Blocks while a name is looked up: call it in the order's worker thread only."""
    try:
        return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError as exc:
        raise AcmeError(f"cannot resolve DNS-01 server {host}: {exc}",
                        reason="dns01_server") from exc
