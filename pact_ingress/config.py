"""Configuration: YAML → frozen dataclasses, strictly validated (DESIGN §3).

(Loader to be written: see load_config.) The dataclasses below are the contract every
other module reads; they are immutable so a reload swaps one object atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Mode = Literal["passthrough", "terminate"]
SealPosture = Literal["required", "optional"]


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


@dataclass(frozen=True)
class Tenant:
    name: str
    pins: tuple[str, ...]
    routes: tuple[Route, ...]


@dataclass(frozen=True)
class Listen:
    tls: tuple[Address, ...]
    http: tuple[Address, ...] = ()
    admin: Address | Path | None = None  # Path = unix socket


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

    def routes(self) -> tuple[Route, ...]:
        return tuple(r for t in self.tenants for r in t.routes)

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)


@dataclass(frozen=True)
class ConnectorConfig:
    path: Path
    identity_key: Path
    ingress: Address
    tunnel_hostname: str
    pin: str
    forward: Address
    connections: int = 2
