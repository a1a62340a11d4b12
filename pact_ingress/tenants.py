"""Tenant files: the library behind `pact-ingress tenant add | list | remove`.

A tenant added from the command line lives in its own file, ``tenants.d/NAME.yaml``
beside the main config, which the main config's ``include`` glob must cover (no
``include`` → a clear error: we never rewrite the operator's main file).

Adding is validate-then-write. The whole config is loaded with the new file present
*in memory* (`config.load_config_with` and its overlay), so a file that would make the
config invalid is never written, and a running ingress reloading on SIGHUP can never
pick up a half-checked file. Only then is the file written: to a temp file in
``tenants.d`` (a dot-name the ``*.yaml`` glob does not match), then hard-linked to its
final name, which is atomic and refuses to clobber a file that appeared meanwhile. Adds
hold an exclusive lock on the main file from loading to writing, so two adds at once
cannot each validate without the other's file and route one host twice.

A tenant needs a pin: without the home node's fingerprint the edge can neither
authenticate the node's tunnel nor pin the node when re-originating, so `add_tenant`
refuses to guess (``pin=None`` is a UsageError naming the command that prints it).

Removing deletes the tenant's own file, only under ``tenants.d/`` (each such file holds
exactly one tenant); a tenant written inline in the main file, or in a file some other
include glob pulled in, is refused with a message saying where to edit by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import ipaddress
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from pact_ingress.config import (
    MAX_TENANT_NAME,
    TENANT_NAME_RE,
    Address,
    Config,
    Tenant,
    load_config,
    load_config_with,
    normalize_hostname,
    parse_address,
)
from pact_ingress.errors import PactIngressError, UsageError
from pact_ingress.identity import key_fingerprint, make_dirs, pin_problem

TENANTS_DIR = "tenants.d"
RELOAD_COMMANDS = (
    "systemctl reload pact-ingress",
    "kill -HUP <pid of `pact-ingress serve`>",
)
#: Where the connector config we print expects things on the home node (edit as needed).
NODE_KEY_PLACEHOLDER = "/var/lib/pact/node.key"
NODE_FORWARD_PLACEHOLDER = "127.0.0.1:8443"
PUBLIC_V4_PLACEHOLDER = "<public IPv4 of the ingress>"
PUBLIC_V6_PLACEHOLDER = "<public IPv6 of the ingress>"
#: Self-signed certs for terminate routes when the config has no ACME (state_dir-relative).
SELFSIGNED_DIR = "selfsigned"
CONNECTOR_HEADING = (
    "connector config for the home node (save as connector.yaml there, then run "
    "`pact-ingress connect -c connector.yaml`):"
)


@dataclass(frozen=True)
class DnsRecord:
    name: str  # fully qualified, with trailing dot
    type: str  # "A" or "AAAA"
    value: str  # an address, or a placeholder in <angle brackets>
    note: str = ""

    def __str__(self) -> str:
        note = f"   ; {self.note}" if self.note else ""
        return f"{self.name} {self.type} {self.value}{note}"


@dataclass(frozen=True)
class TenantAdded:
    """What `add_tenant` did and what the operator must do next (for the CLI to print)."""

    tenant: Tenant
    path: Path  # the tenants.d file written
    ingress_pin: str  # the ingress's own fingerprint (goes into the connector config)
    dns_records: tuple[DnsRecord, ...]
    connector_config: str | None  # YAML for the home node; None when no tunnel is used
    reload_commands: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        """Human-readable summary: file written, DNS records, connector config, reload."""
        lines = [f"wrote {self.path} (tenant {self.tenant.name!r})", "", "DNS records to create:"]
        lines += [f"  {r}" for r in self.dns_records]
        if self.connector_config is not None:
            lines += ["", CONNECTOR_HEADING, ""]
            lines += [f"  {x}" if x else "" for x in self.connector_config.splitlines()]
        lines += [""] + [f"note: {n}" for n in self.notes]
        lines += ["reload the ingress: " + "   or   ".join(self.reload_commands)]
        return "\n".join(lines).replace("\n\n\n", "\n\n")


def list_tenants(config_path: Path) -> list[Tenant]:
    """Every tenant of a (valid) config, inline and included, in load order."""
    return list(load_config(config_path).tenants)


def remove_tenant(config_path: Path, name: str) -> Path:
    """Delete the file that defines tenant `name`; return its path. Reload afterwards."""
    config = load_config(config_path)
    tenant = config.tenant(name)
    if tenant is None:
        known = ", ".join(t.name for t in config.tenants) or "none"
        raise UsageError(f"no tenant named {name!r} in {config_path} (tenants: {known})")
    if tenant.source is None or tenant.source == config.path:
        raise UsageError(
            f"tenant {name!r} is defined inline in {config_path}: edit that file by hand "
            f"(tenant remove only deletes files under {TENANTS_DIR}/)"
        )
    if tenant.source.parent != config.path.parent / TENANTS_DIR:
        raise UsageError(
            f"tenant {name!r} is defined in {tenant.source}, outside {TENANTS_DIR}/: "
            "remove that file by hand"
        )
    try:
        os.unlink(tenant.source)
    except OSError as exc:  # the command was right, the file system refused: exit 1
        raise PactIngressError(f"{tenant.source}: cannot remove: "
                               f"{exc.strerror or exc}") from None
    return tenant.source


def add_tenant(
    config_path: Path,
    name: str,
    host: str,
    mode: str = "passthrough",
    pin: str | None = None,
    backend: str = "tunnel",
) -> TenantAdded:
    """Write ``tenants.d/NAME.yaml`` for a new tenant with one route, validated first.

    Raises UsageError for bad arguments (missing/invalid pin, taken name or host, no
    include), ConfigError when the existing config or the result would be invalid.
    """
    with _adding(config_path):
        config = load_config(config_path)
        host = _check_args(config, name, host, mode, pin, backend)
        target = Path(os.path.dirname(config.path)) / TENANTS_DIR / f"{name}.yaml"
        _check_target(config, config_path, name, target)
        text = tenant_yaml(config, name, host, mode, pin, backend)  # type: ignore[arg-type]
        new_config = load_config_with(config_path, {target: text})
        tenant = new_config.tenant(name)
        if tenant is None or tenant.source != target:  # pragma: no cover - include checked
            raise UsageError(f"{target} would not be loaded by the include globs of "
                             f"{config_path}")
        try:
            ingress_pin = key_fingerprint(config.identity_key, create=True)
        except OSError as exc:
            raise PactIngressError(f"{config.identity_key}: cannot create the ingress key: "
                                   f"{exc.strerror or exc}") from None
        _write_new(target, text)
    return TenantAdded(
        tenant=tenant,
        path=target,
        ingress_pin=ingress_pin,
        dns_records=dns_records(config, tenant),
        connector_config=connector_yaml(config, tenant, ingress_pin),
        reload_commands=RELOAD_COMMANDS,
        notes=_notes(config, tenant),
    )


def _check_args(
    config: Config, name: str, host: str, mode: str, pin: str | None, backend: str
) -> str:
    """Refuse bad arguments with one-line messages; return the normalized host."""
    if not TENANT_NAME_RE.fullmatch(name) or len(name) > MAX_TENANT_NAME:
        raise UsageError(f"tenant name {name!r} must match [a-z0-9][a-z0-9-]* (at most "
                         f"{MAX_TENANT_NAME} characters)")
    if (existing := config.tenant(name)) is not None:
        raise UsageError(f"tenant {name!r} already exists (in {existing.source})")
    if pin is None:
        raise UsageError(
            "tenant add needs --pin sha256:…, the home node's fingerprint: run "
            "`pact-ingress fingerprint NODE_KEY` on the home node"
        )
    if (why := pin_problem(pin)) is not None:
        raise UsageError(f"--pin {pin!r} {why}")
    if mode not in ("passthrough", "terminate"):
        raise UsageError(f"--mode must be passthrough or terminate, got {mode!r}")
    if backend != "tunnel":
        try:
            parse_address(backend)
        except ValueError as exc:
            raise UsageError(f"--backend must be 'tunnel' or HOST:PORT: {exc}") from None
    try:
        host = normalize_hostname(host, wildcard=True)
    except ValueError as exc:
        raise UsageError(f"--host: {exc}") from None
    owner = next((r.tenant for r in config.routes() if r.host == host), None)
    if owner is not None:
        raise UsageError(f"host {host!r} already belongs to tenant {owner!r}")
    return host


def _check_target(config: Config, config_path: Path, name: str, target: Path) -> None:
    if not config.includes:
        raise UsageError(
            f"{config_path} has no include: add `include: {TENANTS_DIR}/*.yaml` to it so "
            "tenant files are loaded"
        )
    if target.exists():
        raise UsageError(f"{target} already exists")
    if not any(fnmatch.fnmatch(str(target), p) for p in config.includes):
        raise UsageError(
            f"the include globs of {config_path} ({', '.join(config.includes)}) do not "
            f"cover {target}"
        )


def tenant_yaml(config: Config, name: str, host: str, mode: str, pin: str, backend: str) -> str:
    """The text of ``tenants.d/NAME.yaml`` for one tenant with one route."""
    route: dict[str, object] = {"host": host, "mode": mode, "backend": backend}
    if mode == "terminate":
        route["seal"] = "required"
        route["cert"] = "acme" if config.acme is not None else _selfsigned_paths(config, host)
    body = yaml.safe_dump(
        {"name": name, "pins": [pin], "routes": [route]}, sort_keys=False, default_flow_style=False
    )
    return f"# tenant {name!r}, written by `pact-ingress tenant add`; edit freely.\n{body}"


def _selfsigned_paths(config: Config, host: str) -> dict[str, str]:
    stem = host.replace("*", "_wildcard")
    folder = config.state_dir / SELFSIGNED_DIR
    return {"cert": _config_relative(config, folder / f"{stem}.crt"),
            "key": _config_relative(config, folder / f"{stem}.key")}  # fmt: skip


def _config_relative(config: Config, path: Path) -> str:
    """`path` as written in a config file: relative to the main file's dir when near it."""
    rel = os.path.relpath(path, os.path.dirname(config.path))
    return str(path) if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


@contextlib.contextmanager
def _adding(config_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the main config file while one add validates and writes.

    Validation reads the tenants that exist and the write adds one; two adds running at
    once would each validate without the other's file and could both route one host, an
    invalid config the next reload refuses. Adds queue on this lock; `serve` never takes
    it. A main file that cannot be opened is left to `load_config` to report.
    """
    try:
        fd = os.open(config_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_new(target: Path, text: str) -> None:
    """Atomically create `target` with `text`; refuse if it exists (no clobbering)."""
    try:
        make_dirs(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    except OSError as exc:
        raise PactIngressError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, target)
    except FileExistsError:
        raise UsageError(f"{target} already exists") from None
    except OSError as exc:
        raise PactIngressError(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        os.unlink(tmp)


# --- what the operator must do next ---------------------------------------------------------


def _public_addresses(config: Config) -> tuple[str | None, str | None]:
    """(IPv4, IPv6) values for DNS records: a concrete listen IP, a placeholder, or None."""
    v4: str | None = None
    v6: str | None = None
    for address in config.listen.tls:
        try:
            ip = ipaddress.ip_address(address.host)
        except ValueError:  # a host name: we cannot tell, offer an A record placeholder
            v4 = v4 or PUBLIC_V4_PLACEHOLDER
            continue
        if ip.version == 4:
            v4 = v4 or (PUBLIC_V4_PLACEHOLDER if ip.is_unspecified else str(ip))
        else:
            v6 = v6 or (PUBLIC_V6_PLACEHOLDER if ip.is_unspecified else str(ip))
    return v4, v6


def dns_records(config: Config, tenant: Tenant) -> tuple[DnsRecord, ...]:
    """A/AAAA records pointing the tenant's hosts (and the tunnel name) at the ingress."""
    v4, v6 = _public_addresses(config)
    names = [(r.host, "") for r in tenant.routes]
    if config.tunnel_hostname and any(r.backend.is_tunnel for r in tenant.routes):
        names.append((config.tunnel_hostname, "once for all tenants; skip if present"))
    records = []
    for host, note in names:
        records += [DnsRecord(host + ".", "A", v4, note)] if v4 else []
        records += [DnsRecord(host + ".", "AAAA", v6, note)] if v6 else []
    return tuple(records)


def _dial_address(config: Config) -> Address:
    """Where a connector dials: a concrete listen IP if there is one (e.g. loopback in a
    local setup, where *.localhost may not resolve), else the tunnel hostname."""
    first = config.listen.tls[0]
    try:
        if not ipaddress.ip_address(first.host).is_unspecified:
            return first
    except ValueError:
        pass
    return Address(config.tunnel_hostname or first.host, first.port)


def connector_yaml(config: Config, tenant: Tenant, ingress_pin: str) -> str | None:
    """A ready connector config for the tenant's home node; None when it uses no tunnel."""
    if not config.tunnel_hostname or not any(r.backend.is_tunnel for r in tenant.routes):
        return None
    address = _dial_address(config)
    return (
        f"# pact-ingress connector for tenant {tenant.name!r}: run on the home node with\n"
        f"#   pact-ingress connect -c connector.yaml\n"
        f"identity:\n"
        f"  key: {NODE_KEY_PLACEHOLDER}   # the node's PACT key; fingerprint {tenant.pins[0]}\n"
        f"ingress:\n"
        f'  address: "{address}"\n'
        f"  tunnel_hostname: {config.tunnel_hostname}\n"
        f'  pin: "{ingress_pin}"   # the ingress\'s fingerprint\n'
        f'forward: "{NODE_FORWARD_PLACEHOLDER}"   # the home node\'s TLS endpoint\n'
        f"connections: 2\n"
    )


def _notes(config: Config, tenant: Tenant) -> tuple[str, ...]:
    notes = []
    for route in tenant.routes:
        if route.mode == "terminate" and route.cert not in ("acme", None):
            notes.append(
                f"{route.host} is a terminate route without ACME: put a certificate and key at "
                f"{route.cert.cert} and {route.cert.key}"  # type: ignore[union-attr]
            )
    return tuple(notes)
