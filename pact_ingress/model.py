"""The configuration model: frozen dataclasses every other module reads, no YAML.

They are immutable so a reload swaps one object atomically. `normalize_hostname` is the
one spelling of a host name used everywhere (config, routing). The strict YAML loader and
its validators, which build these objects, live in `pact_ingress/config/`.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Mode = Literal["passthrough", "terminate"]
SealPosture = Literal["required", "optional"]
ClientCertPosture = Literal["none", "optional", "required"]


@dataclass(frozen=True)
class Limits:
    """Limits; top-level defaults, each route's copy has its overrides merged in."""

    clienthello_timeout: float = 10.0  # seconds
    idle_timeout: float = 300.0  # seconds
    max_connections: int = 20000
    max_connections_per_ip: int = 200
    calls_per_hour_per_ip_key: int = 600
    calls_per_hour_per_ip: int = 3000
    max_body_bytes: int = 6 * 1024 * 1024
    # Terminate routes: requests one client (IP, IPv6 /64) may have in flight toward the
    # route's node at once; the upstream pool holds 100 connections per route, so one
    # address can hold at most a sixth of it.
    max_requests_in_flight_per_ip: int = 16
    # Terminate routes: each write of an answer must be taken by the client within this
    # (a client that stops reading, or holds its HTTP/2 window shut, is dropped).
    client_write_timeout: float = 30.0  # seconds


@dataclass(frozen=True)
class Address:
    """A TCP address from config: IP literal or hostname, and port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Backend:
    """Where a route's traffic goes: a configured address, or the tenant's tunnel."""

    address: Address | None  # None means "tunnel"

    @property
    def is_tunnel(self) -> bool:
        return self.address is None

    def __str__(self) -> str:
        return "tunnel" if self.address is None else str(self.address)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


CertSource = Literal["acme"] | CertFiles


@dataclass(frozen=True)
class Route:
    host: str  # lower-case; exact name or "*.suffix"
    tenant: str
    mode: Mode
    backend: Backend
    proxy_protocol: Literal["off", "v2"] = "off"
    seal: SealPosture = "required"
    mcp_path: str = "/mcp"
    cert: Literal["acme"] | CertFiles | None = None  # terminate routes only
    limits: Limits = field(default_factory=Limits)
    # Set by the loader: the home node's client-certificate posture (spec §13.4).
    client_cert: ClientCertPosture = "none"


@dataclass(frozen=True)
class Tenant:
    name: str
    pins: tuple[str, ...]
    routes: tuple[Route, ...]
    # Added by the loader: the file that defined this tenant (main file or an include).
    source: Path | None = field(default=None, compare=False)
    #: Whether the relay queues calls for this tenant's pins (they become served recipients).
    relay: bool = False


@dataclass(frozen=True)
class Listen:
    tls: tuple[Address, ...]
    http: tuple[Address, ...] = ()
    admin: Address | Path | None = None  # Path = unix socket
    #: With a token file the admin endpoint may bind a non-loopback address; every request
    #: then needs `Authorization: Bearer <token>` (the file's content, ≥ 32 characters).
    admin_token_file: Path | None = None


@dataclass(frozen=True)
class Dns01:
    server: Address
    zone: str
    tsig_key_file: Path


@dataclass(frozen=True)
class Acme:
    directory: str
    email: str | None
    agree_tos: bool
    challenges: tuple[str, ...] = ("tls-alpn-01", "http-01")
    ca_bundle: Path | None = None
    dns01: Dns01 | None = None


class Secret:
    """A value read from a secret file (a Redis password): compared and used, never shown.

    Config objects end up in reprs, log lines and test failure messages; this wrapper is
    what keeps the password out of all of them."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(
            self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(Secret)  # equal secrets must hash alike; the value itself stays out


@dataclass(frozen=True)
class RedisTLS:
    """TLS toward Redis: the CA that signed its certificate (None: the system's CAs) and,
    when Redis asks for client certificates, ours."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


@dataclass(frozen=True)
class RedisSettings:
    """Where the shared state lives when `state.backend` is redis."""

    host: str
    port: int
    db: int
    #: 32 random bytes (base64) every instance holds: what shared secrets stored in
    #: Redis (certificate keys) are encrypted with, so Redis never holds them in clear.
    encryption_key_file: Path
    username: str | None = None
    password: Secret | None = None
    password_file: Path | None = None
    #: Every key this ingress writes starts with this, so one Redis can serve several
    #: clusters (or other applications) without collisions.
    key_prefix: str = "pact-ingress:"
    tls: RedisTLS | None = None
    #: A decision waits at most this long for Redis before this instance decides alone.
    deadline: float = 0.05
    #: Fingerprints of the other instances: the only keys a forward link is opened to
    #: or accepted from (see `net/forward.py` for why the registry is not enough).
    peers: tuple[str, ...] = ()

    def __str__(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{host}:{self.port}/{self.db}"


@dataclass(frozen=True)
class State:
    """Where state that several instances must agree on is kept: in this process
    (`local`, one instance) or in Redis (several instances acting as one edge)."""

    backend: Literal["local", "redis"] = "local"
    redis: RedisSettings | None = None  # set exactly when backend is redis
#: Per-recipient relay queue bounds when the config names none: ten thousand calls or
#: 256 MiB, whichever comes first — weeks of a busy person's mail, a small slice of a VPS disk.
RELAY_MAX_ITEMS = 10_000
RELAY_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Relay:
    """The relay gateway host: served at SNI `host` with its own certificate; its durable
    queue lives in the SQLite file `store` (default STATE_DIR/relay.sqlite)."""

    host: str
    cert: Literal["acme"] | CertFiles
    store: Path
    max_items: int = RELAY_MAX_ITEMS
    max_bytes: int = RELAY_MAX_BYTES


@dataclass(frozen=True)
class Config:
    path: Path
    identity_key: Path
    state_dir: Path
    listen: Listen
    tunnel_hostname: str | None
    acme: Acme | None
    limits: Limits
    tenants: tuple[Tenant, ...]
    # Added by the loader: the include globs, absolute (resolved against path's directory).
    includes: tuple[str, ...] = ()
    state: State = field(default_factory=State)
    relay: Relay | None = None

    def routes(self) -> tuple[Route, ...]:
        return tuple(r for t in self.tenants for r in t.routes)

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def relay_recipients(self) -> dict[str, str]:
        """Served relay recipients: each pin of a `relay: true` tenant → that tenant."""
        out: dict[str, str] = {}
        for t in self.tenants:
            if t.relay:
                for pin in t.pins:
                    out.setdefault(pin, t.name)
        return out


@dataclass(frozen=True)
class ConnectorConfig:
    path: Path
    identity_key: Path
    ingress: Address
    tunnel_hostname: str
    pin: str
    forward: Address
    connections: int = 2
    #: How tunnel data connections are made: raw token-authenticated TCP (fast, spliced),
    #: TLS (for networks that pass only TLS on 443), or auto (raw, falling back to TLS).
    data_transport: Literal["auto", "raw", "tls"] = "auto"
    #: What the connector does when the ingress says mail is queued at the relay.
    on_mail: OnMail | None = None
    #: Every configured ingress address when there are several (`ingress` is the first):
    #: empty means just `ingress`. A name among them stands for all its A/AAAA records.
    ingresses: tuple[Address, ...] = ()
    #: Every ingress key accepted (`pin` is the first); empty means just `pin`. One list
    #: for all addresses: which instance answers behind an address is not known ahead.
    pins: tuple[str, ...] = ()

    @property
    def ingress_addresses(self) -> tuple[Address, ...]:
        return self.ingresses or (self.ingress,)

    @property
    def ingress_pins(self) -> tuple[str, ...]:
        return self.pins or (self.pin,)


@dataclass(frozen=True)
class OnMail:
    """A local hook for relay wakes: POST `{"queued": 1}` to `url`, and/or run `command`
    (an argv list, no shell). Either or both."""

    url: str | None = None
    command: tuple[str, ...] | None = None


_LABEL_RE = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?")
#: A part of a numeric IPv4 spelling as the C library's inet_aton reads it.
_NUMBER_PART_RE = re.compile(r"0x[0-9a-f]*|[0-9]+", re.ASCII | re.IGNORECASE)


def is_numeric_name(host: str) -> bool:
    """Whether `host` is made of numbers only (decimal, octal or 0x hex parts): no host
    name, as the resolver reads such a name as an IPv4 address in one of inet_aton's old
    forms (`127.1`, `0x7f000001`, `2130706433`, `0177.0.0.1`) or fails on it."""
    return all(_NUMBER_PART_RE.fullmatch(part) for part in host.removesuffix(".").split("."))


def legacy_ipv4(host: str) -> str | None:
    """The dotted quad an inet_aton spelling stands for (`127.1` → `127.0.0.1`), or None
    when `host` is no such spelling (a name, a canonical address, an impossible number).
    Up to four parts; the last fills the bytes the others leave."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not is_numeric_name(host):
        return None
    values = []
    for part in parts:
        try:
            if part[:2].lower() == "0x":
                values.append(int(part, 16))  # takes the 0x; a bare 0x is refused
            else:
                values.append(int(part, 8 if len(part) > 1 and part[0] == "0" else 10))
        except ValueError:  # 08: no octal digit
            return None
    *leading, last = values
    if any(v > 255 for v in leading) or last >= 256 ** (4 - len(leading)):
        return None
    number = last
    for i, value in enumerate(leading):
        number += value << (24 - 8 * i)
    return str(ipaddress.IPv4Address(number))


def normalize_hostname(text: str, *, wildcard: bool = False, validate: bool = True) -> str:
    """Lower-case, strip one trailing dot, check LDH labels; ``*.suffix`` if `wildcard`.

    With ``validate=False`` only the spelling is made canonical, nothing is checked and
    nothing raises: for names already validated (a configured route host, a parsed SNI)
    and for lookups, where a bad name simply matches nothing.
    """
    host = text.strip().lower()
    host = host.removesuffix(".")
    if not validate:
        return host
    if not host.isascii():
        raise ValueError(f"{text!r} is not ASCII: use its punycode (xn--) form")
    if (is_ip_address(host.strip("[]")) or host.rsplit(".", 1)[-1].isdigit()
            or is_numeric_name(host)):
        raise ValueError(f"{text!r} is an IP address, not a host name")
    labels = host.split(".")
    if wildcard and labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
        if len(labels) == 1 and labels[0]:
            # `*.com` would take every unrouted name of a whole top-level domain (ACME
            # validations of them included): a slip for `*.x.com`, not a wish
            raise ValueError(f"{text!r}: a wildcard must name a domain of at least two "
                             "labels, e.g. *.example.com")
    if len(host) > 253 or not all(len(x) <= 63 and _LABEL_RE.fullmatch(x) for x in labels):
        hint = " ('*' only as the whole first label)" if "*" in host else ""
        raise ValueError(f"{text!r} is not a valid host name{hint}")
    return host


def is_ip_address(text: str) -> bool:
    """Whether `text` is an IPv4 or IPv6 address literal (no brackets)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
