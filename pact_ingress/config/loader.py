"""Configuration: YAML → the frozen dataclasses of `pact_ingress.model`, strictly validated.

The dataclasses it builds (the contract every other module reads) live in
`pact_ingress.model`.

Theory of operation
-------------------
Every complaint must read ``FILE:LINE: message`` with the line of the offending key or
value, and *all* complaints of a file come out at once (an operator fixing a config
should not play whack-a-mole). So the loader never builds plain Python objects from the
YAML first: it asks PyYAML only for the composed node tree (``yaml.compose`` with the
SafeLoader: scalars with their resolved tags, and a ``start_mark`` on every node) and
walks that tree against the schema by hand. Each ``_section`` function takes a node,
appends errors to a shared `_Ctx` and returns a value or ``None``; nothing raises until
the end, where `ConfigError` carries every line. A schema library (pydantic, msgspec)
would give error *paths* that we would have to map back to node marks anyway, and the
messages we want are domain messages ("a terminate route cannot have seal: none,
because …"), so the walker is hand-written and small.

Decisions worth knowing:

* Durations: ``250ms``, ``10s``, ``5m``, ``1h``, or a plain number = seconds; > 0.
* Numbers are plain decimal. YAML 1.1 also reads ``010`` (octal 8), ``0x10``, ``0b101``,
  ``1_000`` and ``1:30`` (base 60, 90) as numbers; such a spelling of a count, size or
  duration is refused with the plain one to write (`_odd_number`), never reinterpreted.
* Sizes: a plain integer = bytes, or an integer with a unit: ``B``, binary ``KiB MiB GiB``
  (powers of 1024) or decimal ``kB MB GB`` (powers of 1000). Units are case-sensitive,
  so ``6mb`` (millibits?) is refused rather than guessed.
* Relative paths (identity key, state_dir, cert files, ca_bundle, tsig key file, a
  ``unix:`` admin socket) resolve against the directory of the *main* config file, also
  when they appear in an included tenant file: one base for the whole tree.
* ``include`` is a glob (or a list of globs) relative to the main file's directory; each
  matching file holds one tenant mapping. No match (e.g. a missing ``tenants.d``) means no
  extra tenants, not an error; but a directory the glob cannot list, or a match that
  cannot be read as a file, is one: either would otherwise drop tenants without a word.
* ``identity`` may be omitted: the key then lives at ``STATE_DIR/identity.key``.
* Route ``mode`` and ``backend`` are required (no silent default for where traffic goes).
* A terminate route without ``cert`` uses ``acme`` when an ``acme`` block exists;
  otherwise it must name ``{cert: FILE, key: FILE}``. Cert files need not exist yet
  (``serve`` may create self-signed demo files), but existing ones are read and checked
  (PEM certificate, its unencrypted key), so ``check-config`` catches what would
  otherwise only show as failed handshakes. A wildcard terminate host with
  ``cert: acme`` needs the ``dns-01`` challenge (CAs issue wildcards only over DNS-01).
* ``client_cert: none|optional|required`` (route, default ``none``) records the home
  node's transport client-certificate posture (spec §13.4). In passthrough the home node
  enforces it end to end; in terminate mode ``required`` is refused because such a node is
  unreachable through a terminating edge by construction.
* ``seal``, ``mcp_path`` and ``cert`` belong to terminate routes, ``proxy_protocol`` to
  passthrough routes; giving one to the other kind of route is an error, not a no-op.
* Hosts are lower-cased and lose a trailing dot; ``*.suffix`` is allowed when the suffix
  has two labels or more (``*.com`` would claim a whole top-level domain); IP literals
  and non-ASCII names (use the ``xn--`` form) are refused. In an address, a name of
  numbers only (``127.1``, ``0x7f000001``: old IPv4 spellings the resolver would dial)
  is refused with the dotted quad to write. A wildcard may cover only
  its own tenant's hosts, never another tenant's or the tunnel hostname.
* Connector config: ``ingress.address`` may omit the port (443). It is one address or a
  list of them (several ingress instances; a name stands for all its A/AAAA records), and
  ``ingress.pin`` is one pin or a list (any of them is accepted on every address).
* ``state`` picks where state shared by several instances lives: ``backend: local`` (the
  default: this process, as a single instance always was) or ``backend: redis`` with a
  ``url`` (``redis://HOST:PORT/DB``, ``rediss://`` for TLS). A password in the URL is
  refused — URLs end up in logs and status pages — so it comes from ``password_file``
  instead and is held as a `Secret`. ``encryption_key_file`` is required from the start,
  so a cluster never runs without the key its certificate keys will be sealed with.
  Secret files must not be readable by every user on the machine. ``peers`` lists the
  other instances' fingerprints: the only keys forward links are made to or taken from.
* ``relay:`` (top level) serves the relay gateway on its own ``host``, which must not be
  a route host or the tunnel hostname; its ``cert`` is chosen like a terminate route's.
  Tenants opt in with ``relay: true``. The connector's ``on_mail`` hook is ``{url: URL}``
  (http or https) and/or ``{command: [ARGV...]}`` (run without a shell).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import difflib
import errno
import fnmatch
import glob
import ipaddress
import math
import os
import re
import socket
import stat
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pact_ingress.errors import ConfigError
from pact_ingress.files import NotAFile, TooLarge, read_small
from pact_ingress.identity import pin_problem
from pact_ingress.model import (
    RELAY_MAX_BYTES,
    RELAY_MAX_ITEMS,
    Acme,
    Address,
    Backend,
    CertFiles,
    CertSource,
    Config,
    ConnectorConfig,
    Dns01,
    Limits,
    Listen,
    OnMail,
    RedisSettings,
    RedisTLS,
    Relay,
    Route,
    Secret,
    State,
    Tenant,
    is_ip_address,
    legacy_ipv4,
    normalize_hostname,
)
from pact_ingress.proto.http_request import BadRequest, normalise_path

# --- caps ---------------------------------------------------------------------------------

#: A config file larger than this is surely not hand-written; refuse instead of parsing.
MAX_CONFIG_BYTES = 1024 * 1024
#: Upper bound on files one include may pull in (one per tenant; far above any real VPS).
MAX_INCLUDED_FILES = 10_000
#: Mappings and lists walked per load. YAML aliases can make a small file a huge tree
#: (billion laughs); the schema is shallow, a route costs 1-3, so this is ~30k routes.
MAX_WALKED_NODES = 100_000
#: Nesting of YAML collections. The schema is six deep (top, tenants, tenant, routes,
#: route, limits); PyYAML composes nested nodes recursively, so without a bound a few KiB
#: of brackets reach the interpreter's recursion limit instead of a config error.
MAX_NESTING = 64
#: Errors collected before giving up: an operator reads the first screenful anyway.
MAX_ERRORS = 100
#: Pins per tenant: one normally, two during a key rotation (spec §2); a few spare.
MAX_PINS_PER_TENANT = 8
#: Tenant names become file names (tenants.d/NAME.yaml) and metric labels.
MAX_TENANT_NAME = 63
#: Parallel tunnel connections a connector may keep (redundancy, not throughput).
MAX_TUNNEL_CONNECTIONS = 16
#: Ingress addresses and ingress pins one connector config may list (a cluster of a few
#: instances; each address costs `connections` control links).
MAX_INGRESS_ADDRESSES = 16
MAX_INGRESS_PINS = 16
#: Durations above a day are a typo (e.g. "300" meant as ms) rather than a wish.
MAX_DURATION_SECONDS = 86_400.0
#: A password or key file is a line of text; anything larger is the wrong file.
MAX_SECRET_FILE_BYTES = 4096
#: The shared encryption key: 32 random bytes (AES-256), base64 in its file.
ENCRYPTION_KEY_BYTES = 32
#: Redis key prefixes are short printable names; the bound keeps every key small.
MAX_KEY_PREFIX = 64
#: Other instances one may name in state.peers: a cluster is a handful of VPSes; the cap
#: keeps a pasted list of something else from becoming a long per-connection scan.
MAX_PEERS = 64
#: state.deadline above this would let a sick Redis stall every request for longer than
#: a client waits; below the round trip to a distant Redis, it would never be shared.
MAX_STATE_DEADLINE = 1.0

TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
# re.ASCII: `\d` would take any script's digits, and float() and int() would read them
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?", re.ASCII)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE_RE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB|kB|MB|GB)?", re.ASCII)
_SIZE_UNITS = {
    None: 1, "B": 1,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
    "kB": 1000, "MB": 1000**2, "GB": 1000**3,
}  # fmt: skip
#: Integers in config (counts, bytes) have no useful upper bound; this one keeps them sane.
_NO_LIMIT = 2**62
ACME_CHALLENGES = ("tls-alpn-01", "http-01", "dns-01")

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ = _TAG + "map", _TAG + "seq"


# --- public value parsers (also used by the CLI and tenants.py) ---------------------------


def parse_duration(text: str) -> float:
    """``"250ms"``, ``"10s"``, ``"5m"``, ``"1h"`` or ``"30"`` → seconds; ValueError if not."""
    m = _DURATION_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad duration {text!r}: use e.g. 250ms, 10s, 5m, 1h")
    return _check_duration(float(m.group(1)) * _DURATION_UNITS[m.group(2)], text)


def _check_duration(seconds: float, text: object) -> float:
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"bad duration {text!r}: must be greater than zero")
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"bad duration {text!r}: more than a day")
    return seconds


def parse_size(text: str) -> int:
    """``"6MiB"``, ``"512KiB"``, ``"100kB"``, ``"4096"`` → bytes; ValueError if not."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(
            f"bad size {text!r}: use an integer with B, KiB, MiB, GiB (1024s) or kB, MB, GB (1000s)"
        )
    size = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if size <= 0:
        raise ValueError(f"bad size {text!r}: must be greater than zero")
    if size > _NO_LIMIT:  # the bound a plain integer has
        raise ValueError(f"bad size {text!r}: must be at most {_NO_LIMIT} bytes")
    return size


def parse_address(text: str, *, default_port: int | None = None) -> Address:
    """``"host:port"``, ``"[v6]:port"``, ``"1.2.3.4:port"`` → Address; ValueError if not."""
    text = text.strip()
    host, port = _split_host_port(text, default_port)
    if host.startswith("["):
        if not host.endswith("]") or not _is_ipv6(host[1:-1]):
            raise ValueError(f"{text!r}: brackets hold an IPv6 address only")
        host = host[1:-1]
        if "%" in host:
            _check_zone(host, text)
    elif not is_ip_address(host):
        if (address := legacy_ipv4(host)) is not None:
            # the resolver would dial that address, which nobody wrote down
            raise ValueError(f"{text!r}: {host!r} is an old spelling of the IPv4 address "
                             f"{address}: write {address}")
        try:
            host = normalize_hostname(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IP address or host name") from None
    return Address(host, port)


def _check_zone(host: str, text: str) -> None:
    """A zone (`fe80::1%eth0`) names the interface of a link-local address; anywhere else,
    or naming an interface this machine lacks, it would fail only at connect or bind."""
    address, zone = host.split("%", 1)
    if not ipaddress.IPv6Address(address).is_link_local:
        raise ValueError(f"{text!r}: a zone (%{zone}) applies to a link-local address "
                         "(fe80::/10) only")
    try:
        if zone.isascii() and zone.isdigit():
            socket.if_indextoname(int(zone))
        else:
            socket.if_nametoindex(zone)
    except (OSError, OverflowError):
        raise ValueError(f"{text!r}: no network interface {zone!r} on this machine") from None


def _split_host_port(text: str, default_port: int | None) -> tuple[str, int]:
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"{text!r}: '[' without ']'")
        host, rest = text[: close + 1], text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: want [IPv6]:PORT")
        port_text = rest[1:]
    elif text.count(":") > 1:
        raise ValueError(f"{text!r}: write IPv6 addresses in brackets, e.g. [2001:db8::1]:443")
    else:
        host, _, port_text = text.partition(":")
    if not host or host == "[]":
        raise ValueError(f"{text!r}: missing host (want HOST:PORT)")
    if not port_text:
        if default_port is None:
            raise ValueError(f"{text!r}: missing port (want HOST:PORT)")
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be 1..65535")
    return host, int(port_text)


def _is_ipv6(text: str) -> bool:
    return is_ip_address(text) and ":" in text


# --- the walker ---------------------------------------------------------------------------


class _Stop(Exception):
    """A cap was hit: stop walking; `str(exc)` is the last error line to report."""


@dataclass
class _Ctx:
    """Errors shared by every file of one load; `file` names the file being walked."""

    file: str
    base: Path  # directory that relative paths resolve against (the main file's)
    errors: list[str]
    budget: list[int]  # one shared, mutable counter

    def at(self, node: Node, message: str) -> None:
        self.errors.append(f"{self.where(node)}: {message}")
        if len(self.errors) >= MAX_ERRORS:
            raise _Stop(f"{self.where(node)}: stopped after {MAX_ERRORS} errors")

    def where(self, node: Node) -> str:
        return f"{self.file}:{node.start_mark.line + 1}"

    def spend(self, node: Node) -> None:
        self.budget[0] -= 1
        if self.budget[0] < 0:
            raise _Stop(f"{self.where(node)}: config too large (over {MAX_WALKED_NODES} "
                        "nodes)")

    def for_file(self, file: str) -> _Ctx:
        return _Ctx(file, self.base, self.errors, self.budget)


@dataclass
class _Fields:
    """A checked mapping node: its known keys, each with key and value node."""

    ctx: _Ctx
    node: MappingNode
    keys: dict[str, Node] = field(default_factory=dict)
    values: dict[str, Node] = field(default_factory=dict)

    def opt(self, name: str, parse: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """`parse(ctx, value_node, *args)` if `name` is set, else `default`."""
        node = self.get(name)
        return default if node is None else parse(self.ctx, node, *args)

    def get(self, name: str) -> Node | None:
        """The value node of `name`, or None when absent or YAML null."""
        node = self.values.get(name)
        return None if node is None or _is_null(node) else node

    def key(self, name: str) -> Node:
        return self.keys.get(name, self.node)


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == _NULL


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    names = {_STR: "a string", _INT: "an integer", _FLOAT: "a number", _BOOL: "a boolean"}
    return names.get(node.tag, "null" if node.tag == _NULL else f"a {node.tag.rsplit(':', 1)[-1]}")


def _unknown_key(key: str, what: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"
    return f"unknown key {key!r} in {what}{hint}"


def _mapping(
    ctx: _Ctx, node: Node, what: str, known: tuple[str, ...], required: tuple[str, ...] = ()
) -> _Fields | None:
    """Check `node` is a mapping with string keys drawn from `known`, `required` present."""
    ctx.spend(node)
    if not isinstance(node, MappingNode):
        ctx.at(node, f"{what} must be a mapping, got {_kind(node)}")
        return None
    if node.tag != _MAP:
        ctx.at(node, _tag_refused(what, node))
        return None
    fields = _Fields(ctx, node)
    for key_node, value_node in node.value:
        if key_node.tag == _TAG + "merge":
            ctx.at(key_node, f"merge keys (<<) are not supported in {what}")
        elif not isinstance(key_node, ScalarNode) or key_node.tag != _STR:
            ctx.at(key_node, f"keys in {what} must be strings, got {_kind(key_node)}")
        elif key_node.value in fields.keys:
            first = fields.keys[key_node.value].start_mark.line + 1
            ctx.at(key_node, f"duplicate key {key_node.value!r} in {what} (first on line {first})")
        elif key_node.value not in known:
            ctx.at(key_node, _unknown_key(key_node.value, what, known))
        else:
            fields.keys[key_node.value] = key_node
            fields.values[key_node.value] = value_node
    for name in required:
        if fields.get(name) is None:
            ctx.at(fields.key(name), f"{what} needs {name!r}")
    return fields


def _sequence(ctx: _Ctx, node: Node, what: str) -> list[Node]:
    ctx.spend(node)
    if not isinstance(node, SequenceNode):
        ctx.at(node, f"{what} must be a list, got {_kind(node)}")
        return []
    if node.tag != _SEQ:
        ctx.at(node, _tag_refused(what, node))
        return []
    return list(node.value)


def _tag_refused(what: str, node: Node) -> str:
    """A tag on a mapping or list (`!!python/object`, `!!set`, `!custom`) changes nothing
    here, as the tree is only walked, never constructed: refused rather than silently
    ignored, like an unknown key."""
    tag = node.tag.replace(_TAG, "!!")
    return f"{what}: the YAML tag {tag} is not supported (plain mappings and lists only)"


def _string(ctx: _Ctx, node: Node, what: str) -> str | None:
    if not isinstance(node, ScalarNode) or node.tag != _STR:
        ctx.at(node, f"{what} must be a string, got {_kind(node)}{_quote_hint(node)}")
        return None
    if not node.value.strip():
        ctx.at(node, f"{what} must not be empty")
        return None
    if "\0" in node.value:  # YAML's "\0" escape: no path, name or address holds one
        ctx.at(node, f"{what} must not contain a NUL character")
        return None
    return str(node.value)


def _quote_hint(node: Node) -> str:
    """Why a bare word is no string: YAML 1.1 reads on/off/yes/no as booleans, digits as
    numbers and dates as timestamps unless they are quoted."""
    if not isinstance(node, ScalarNode) or node.style is not None or node.tag == _NULL:
        return ""
    return f" (YAML reads a bare {node.value!r} as {_kind(node)}: quote it, \"{node.value}\")"


def _strings(ctx: _Ctx, node: Node, what: str) -> list[tuple[str, Node]]:
    """A list of strings, each with its node (for per-item line numbers)."""
    out = []
    for item in _sequence(ctx, node, what):
        text = _string(ctx, item, f"each item of {what}")
        if text is not None:
            out.append((text, item))
    return out


def _choice(ctx: _Ctx, node: Node, what: str, allowed: tuple[str, ...]) -> str | None:
    text = _string(ctx, node, what)
    if text is not None and text not in allowed:
        ctx.at(node, f"{what} must be one of {', '.join(allowed)}; got {text!r}")
        return None
    return text


#: How YAML 1.1 spells numbers that are not plain decimal (PyYAML's SafeLoader takes all
#: but 0o10, which YAML 1.2 added): the sign, then the digits.
_ODD_NUMBER_RES = (
    (re.compile(r"0x([0-9a-fA-F_]+)", re.ASCII), "hex"),
    (re.compile(r"0b([01_]+)", re.ASCII), "binary"),
    (re.compile(r"0o([0-7_]+)", re.ASCII), "octal"),
    (re.compile(r"([0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)", re.ASCII), "base 60"),
    (re.compile(r"(0[0-9_]+)", re.ASCII), "leading zero"),
    (re.compile(r"([0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?|[0-9]+\.[0-9]*_[0-9_]*)", re.ASCII),
     "underscore"),
)


def _odd_number(node: Node) -> str | None:
    """Why a bare number is not taken as written, or None when it is plain decimal (or
    no number at all). YAML 1.1 reads `010` as 8 and `1:30` as 90; `0x10`, `0b101` and
    `1_000` are no way to write a port, a count or a duration either. Whatever the reader
    meant, taking it silently is the wrong guess, so every such spelling is refused with
    the plain one to write instead; quoted, a value is a string and no number."""
    if not isinstance(node, ScalarNode) or node.style is not None:
        return None
    text = node.value
    sign = text[0] if text[:1] in ("-", "+") else ""
    for pattern, kind in _ODD_NUMBER_RES:
        m = pattern.fullmatch(text[len(sign):])
        if m is None:
            continue
        digits = m.group(1).replace("_", "")
        if not digits:  # PyYAML takes `0x_` for an integer it then cannot convert
            return f"{text!r} is no number"
        if kind == "base 60":
            whole, _, fraction = digits.partition(".")
            value = 0
            for part in whole.split(":"):
                value = value * 60 + int(part)
            plain = f"{value}.{fraction}".rstrip(".") if fraction else str(value)
            return f"write {sign}{plain}, not {text} (YAML 1.1 reads {text} in base 60)"
        if kind == "leading zero":
            plain = str(int(digits))
            if node.tag == _INT and int(digits, 8) != int(digits):
                return (f"write {sign}{plain}, not {text} (YAML 1.1 reads a leading 0 as "
                        f"octal: {text} would be {sign}{int(digits, 8)})")
            return f"write {sign}{plain}, not {text} (numbers here are plain decimal)"
        if kind == "underscore":
            return f"write {sign}{digits}, not {text} (numbers here are plain decimal)"
        plain = str(int(digits, {"hex": 16, "binary": 2, "octal": 8}[kind]))
        return f"write {sign}{plain}, not {text} (numbers here are plain decimal, not {kind})"
    return None


def _integer(ctx: _Ctx, node: Node, what: str, lo: int = 1, hi: int = _NO_LIMIT) -> int | None:
    if (odd := _odd_number(node)) is not None:
        ctx.at(node, f"{what}: {odd}")
        return None
    if not isinstance(node, ScalarNode) or node.tag != _INT:
        ctx.at(node, f"{what} must be an integer, got {_kind(node)}")
        return None
    value = int(SafeConstructor().construct_yaml_int(node))
    if not lo <= value <= hi:
        bound = (f"between {lo} and {hi}" if hi < _NO_LIMIT
                 else f"at least {lo}" if value < lo else f"at most {hi}")
        ctx.at(node, f"{what} must be {bound}, got {value}")
        return None
    return value


def _duration(ctx: _Ctx, node: Node, what: str) -> float | None:
    if (odd := _odd_number(node)) is not None:
        ctx.at(node, f"{what}: {odd}")
        return None
    try:
        if isinstance(node, ScalarNode) and node.tag in (_INT, _FLOAT):
            construct = (SafeConstructor().construct_yaml_int if node.tag == _INT
                         else SafeConstructor().construct_yaml_float)
            return _check_duration(float(construct(node)), node.value)
        if isinstance(node, ScalarNode) and node.tag == _STR:
            return parse_duration(node.value)
    except ValueError as exc:
        ctx.at(node, f"{what}: {exc}")
        return None
    ctx.at(node, f"{what} must be a duration (250ms, 10s, 5m, 1h), got {_kind(node)}")
    return None


def _size(ctx: _Ctx, node: Node, what: str) -> int | None:
    if isinstance(node, ScalarNode) and node.tag == _INT:
        return _integer(ctx, node, what)
    if isinstance(node, ScalarNode) and node.tag == _STR:
        if (odd := _odd_number(node)) is not None:
            ctx.at(node, f"{what}: {odd}")
            return None
        try:
            return parse_size(node.value)
        except ValueError as exc:
            ctx.at(node, f"{what}: {exc}")
            return None
    ctx.at(node, f"{what} must be a size (6MiB, 512KiB, or bytes), got {_kind(node)}")
    return None


def _path(ctx: _Ctx, node: Node, what: str) -> Path | None:
    text = _string(ctx, node, what)
    if text is None:
        return None
    return _resolve(ctx.base, text)


def _resolve(base: Path, text: str) -> Path:
    path = Path(os.path.expanduser(text))
    return Path(os.path.normpath(path if path.is_absolute() else base / path))


def _address(ctx: _Ctx, node: Node, what: str, default_port: int | None = None) -> Address | None:
    text = _string(ctx, node, what)
    if text is None:
        return None
    try:
        return parse_address(text, default_port=default_port)
    except ValueError as exc:
        ctx.at(node, f"{what}: {exc}")
        return None


def _hostname(ctx: _Ctx, node: Node, what: str, *, wildcard: bool = False) -> str | None:
    text = _string(ctx, node, what)
    if text is None:
        return None
    try:
        return normalize_hostname(text, wildcard=wildcard)
    except ValueError as exc:
        ctx.at(node, f"{what}: {exc}")
        return None


# --- reading files ------------------------------------------------------------------------


def _read_text(ctx: _Ctx, path: Path, overlay: Mapping[str, str]) -> str | None:
    if (text := overlay.get(os.path.abspath(path))) is not None:
        return text
    try:
        # a named pipe must not hold a reload (and with it the whole event loop) waiting
        # for a writer: `read_small` refuses it like any non-file
        data, mode = read_small(path, MAX_CONFIG_BYTES)
    except OSError as exc:  # line 1 too: every complaint reads FILE:LINE
        ctx.errors.append(f"{ctx.file}:1: cannot read: {exc.strerror or exc}")
        return None
    except NotAFile as exc:
        ctx.errors.append(f"{ctx.file}:1: cannot read: {os.strerror(errno.EISDIR)}"
                          if exc.is_dir else f"{ctx.file}:1: not a regular file")
        return None
    except TooLarge:
        ctx.errors.append(f"{ctx.file}:1: file larger than {MAX_CONFIG_BYTES} bytes")
        return None
    if mode & 0o002:
        ctx.errors.append(f"{ctx.file}:1: {_writable_by_all('the file')}")
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        ctx.errors.append(f"{ctx.file}:{line}: not UTF-8 text")
        return None


class _TooDeep(yaml.YAMLError):
    def __init__(self, mark: yaml.Mark) -> None:
        self.mark = mark


class _TooMany(yaml.YAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing collections nested deeper than MAX_NESTING, and giving
    each alias a copy of its anchor's nodes marked with the alias's own position: in
    PyYAML's tree an alias *is* the anchored node, so a tenant repeated through `*t`
    would be blamed at the anchor's line. Copies count against MAX_WALKED_NODES, so an
    alias bomb stops while it is composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._copied = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                raise _TooDeep(self.peek_event().start_mark)
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                return self._copy(super().compose_node(parent, index), mark)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def _copy(self, node: Node, mark: yaml.Mark) -> Node:
        self._copied += 1
        if self._copied > MAX_WALKED_NODES:
            raise _TooMany()
        if isinstance(node, ScalarNode):
            return ScalarNode(node.tag, node.value, mark, mark, node.style)
        if isinstance(node, SequenceNode):
            items = [self._copy(item, mark) for item in node.value]
            return SequenceNode(node.tag, items, mark, mark, node.flow_style)
        pairs = [(self._copy(k, mark), self._copy(v, mark)) for k, v in node.value]
        return MappingNode(node.tag, pairs, mark, mark, node.flow_style)


#: Characters YAML 1.1 takes for line breaks that editors and `grep -n` do not: one
#: pasted into a comment would end it early and shift every later line number.
_HIDDEN_BREAKS = {"\x85": "NEXT LINE", "\u2028": "LINE SEPARATOR",
                  "\u2029": "PARAGRAPH SEPARATOR"}
_HIDDEN_BREAK_RE = re.compile("[" + "".join(_HIDDEN_BREAKS) + "]")
_EDITOR_BREAK_RE = re.compile(r"\r\n|\r|\n")


def _writable_by_all(what: str) -> str:
    """Any local user could reroute traffic through it, or add a tenant, at the next
    reload (and a connector's on_mail.command would run what they wrote)."""
    return (f"{what} is writable by every user: chmod o-w (whoever may write it decides "
            "where traffic goes)")


def _compose(ctx: _Ctx, path: Path, overlay: Mapping[str, str]) -> Node | None:
    """The node tree of one YAML file, or None (with the error recorded)."""
    text = _read_text(ctx, path, overlay)
    if text is None:
        return None
    if (hidden := _HIDDEN_BREAK_RE.search(text)) is not None:
        line = len(_EDITOR_BREAK_RE.split(text[: hidden.start()]))
        char = hidden.group()
        ctx.errors.append(f"{ctx.file}:{line}: U+{ord(char):04X} {_HIDDEN_BREAKS[char]} is a "
                          "line break to YAML but not to an editor: remove it")
        return None
    try:
        node = yaml.compose(text, Loader=_Loader)
    except _TooDeep as exc:
        ctx.errors.append(f"{ctx.file}:{exc.mark.line + 1}: YAML nested more than "
                          f"{MAX_NESTING} levels deep")
        return None
    except _TooMany:
        ctx.errors.append(f"{ctx.file}:1: config too large (its aliases repeat over "
                          f"{MAX_WALKED_NODES} nodes)")
        return None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        why = "; ".join(p for p in (exc.context, exc.problem) if p)
        ctx.errors.append(f"{ctx.file}:{line}: YAML syntax error: {why}")
        return None
    except yaml.reader.ReaderError as exc:
        # a character YAML refuses (NULs left by a crash mid-write, an escape sequence):
        # its line, and one line of message (PyYAML's own text spans two)
        line = text[: exc.position].count("\n") + 1
        ctx.errors.append(f"{ctx.file}:{line}: YAML error: unacceptable character "
                          f"#x{exc.character:04x}: {exc.reason}")
        return None
    except yaml.YAMLError as exc:
        ctx.errors.append(f"{ctx.file}:1: YAML error: {' '.join(str(exc).split())}")
        return None
    if node is None:
        ctx.errors.append(f"{ctx.file}:1: empty file (no YAML document)")
    return node


def _start(path: Path, overlay: Mapping[str, str]) -> tuple[_Ctx, Node | None]:
    path = Path(path)
    ctx = _Ctx(str(path), Path(os.path.abspath(path)).parent, [], [MAX_WALKED_NODES])
    return ctx, _compose(ctx, path, overlay)


# --- ingress config -----------------------------------------------------------------------

_TOP_KEYS = (
    "identity", "state_dir", "listen", "tunnel", "acme", "limits", "include", "tenants", "state",
    "relay",
)  # fmt: skip
_STATE_KEYS = (
    "backend", "url", "password_file", "key_prefix", "encryption_key_file", "tls", "deadline",
    "peers",
)  # fmt: skip
_REDIS_TLS_KEYS = ("ca_file", "cert_file", "key_file")
_KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9._:/{}-]+")
_RELAY_KEYS = ("host", "cert", "store", "max_items", "max_bytes")
_LISTEN_KEYS = ("tls", "http", "admin", "admin_token_file")
_ACME_KEYS = ("directory", "email", "agree_tos", "challenges", "ca_bundle", "dns01")
_DNS01_KEYS = ("server", "zone", "tsig_key_file")
_LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(Limits))
_DURATION_LIMITS = ("clienthello_timeout", "idle_timeout", "client_write_timeout")
_SIZE_LIMITS = ("max_body_bytes",)
_TENANT_KEYS = ("name", "pins", "routes", "relay")
_ROUTE_KEYS = (
    "host", "mode", "backend", "proxy_protocol", "seal", "mcp_path", "cert", "limits",
    "client_cert",
)  # fmt: skip
_TERMINATE_ONLY = ("seal", "mcp_path", "cert")
_CLIENT_CERT = ("none", "optional", "required")


def load_config(path: Path) -> Config:
    """Load and validate an ingress config; raise ConfigError with every problem found."""
    return load_config_with(path, {})


def load_config_with(path: Path, overlay: Mapping[Path, str]) -> Config:
    """`load_config`, with files in `overlay` (path → text) read from memory, not disk.

    An overlay path that an include glob covers is included even if it does not exist
    on disk: `tenants.add_tenant` validates a new tenant file this way before writing it.
    """
    texts = {os.path.abspath(p): text for p, text in overlay.items()}
    ctx, root = _start(path, texts)
    config = None
    if root is not None:
        try:
            config = _config(ctx, Path(path), root, texts)
        except _Stop as stop:
            ctx.errors.append(str(stop))
    if ctx.errors or config is None:
        raise ConfigError(ctx.errors or [f"{path}:1: invalid config"])
    return config


@dataclass
class _Seen:
    """Cross-tenant state: names and hosts already claimed, and where."""

    tunnel_hostname: str | None
    acme: Acme | None
    limits: Limits
    broken: frozenset[str] = frozenset()  # top-level blocks present but invalid (no cascade)
    names: dict[str, str] = field(default_factory=dict)  # name -> "FILE:LINE"
    hosts: dict[str, tuple[str, str]] = field(default_factory=dict)  # host -> (tenant, where)
    #: pin -> (first tenant, where, whether any tenant with it needs a connector)
    pins: dict[str, tuple[str, str, bool]] = field(default_factory=dict)
    relay_host: tuple[str, str] | None = None  # (host, where) of the relay gateway


def _config(ctx: _Ctx, path: Path, root: Node, overlay: Mapping[str, str]) -> Config | None:
    top = _mapping(ctx, root, "the config file", _TOP_KEYS, required=("state_dir", "listen"))
    if top is None:
        return None
    state_dir = top.opt("state_dir", _state_dir)
    identity_key = _identity(ctx, top, state_dir)
    listen = top.opt("listen", _listen)
    tunnel = top.opt("tunnel", _tunnel)
    acme = top.opt("acme", _acme)
    limits = top.opt("limits", _limits, Limits(), "limits", default=Limits())
    state = top.opt("state", _state, default=State())
    broken = frozenset(k for k, v in (("tunnel", tunnel), ("acme", acme)) if top.get(k) and not v)
    seen = _Seen(tunnel, acme, limits or Limits(), broken)
    relay = top.opt("relay", _relay, seen, state_dir)
    tenants = [t for n in _items(ctx, top, "tenants") if (t := _tenant(ctx, n, seen, path))]
    patterns = top.opt("include", _include_patterns, default=[])
    for file in _expand_includes(ctx, patterns, path, overlay):
        tenant = _included_tenant(ctx.for_file(file), Path(file), seen, overlay)
        tenants += [tenant] if tenant else []
    if ctx.errors or None in (state_dir, identity_key, listen, limits, state):
        return None
    return Config(
        path=Path(os.path.abspath(path)),
        identity_key=identity_key,  # type: ignore[arg-type]
        state_dir=state_dir,
        listen=listen,
        tunnel_hostname=tunnel,
        acme=acme,
        limits=limits,
        tenants=tuple(tenants),
        includes=tuple(str(_resolve(ctx.base, p)) for p, _ in patterns),
        state=state,
        relay=relay,
    )


def _state_dir(ctx: _Ctx, node: Node) -> Path | None:
    """A directory, or one that serve can create (it does at start)."""
    path = _path(ctx, node, "state_dir")
    if path is None:
        return None
    if os.path.lexists(path) and not path.is_dir():
        ctx.at(node, f"state_dir {path} is not a directory")
        return None
    if (blocker := _not_a_directory(path)) is not None:
        ctx.at(node, f"state_dir {path} cannot be created: {blocker} is not a directory")
        return None
    return path


def _state(ctx: _Ctx, node: Node) -> State | None:
    fields = _mapping(ctx, node, "state", _STATE_KEYS, required=("backend",))
    if fields is None:
        return None
    backend = fields.opt("backend", _choice, "state.backend", ("local", "redis"))
    if backend == "local":
        extra = [name for name in fields.keys if name != "backend"]
        for name in extra:
            ctx.at(fields.keys[name], f"state.{name} applies to backend: redis only")
        return None if extra else State()
    if backend is None:
        return None
    for name in ("url", "encryption_key_file"):
        if fields.get(name) is None:
            ctx.at(fields.key(name), f"state with backend: redis needs {name!r}")
    url = fields.opt("url", _redis_url)
    password_file = fields.opt("password_file", _path, "state.password_file")
    password = _secret_file(ctx, fields.get("password_file"), password_file,
                            "state.password_file") if password_file else None
    key_file = fields.opt("encryption_key_file", _encryption_key_file)
    prefix = fields.opt("key_prefix", _key_prefix, default="pact-ingress:")
    tls = fields.opt("tls", _redis_tls)
    deadline = fields.opt("deadline", _state_deadline, default=RedisSettings.deadline)
    peers = fields.opt("peers", _peers, default=())
    if url is not None and url[4] and fields.get("tls") is not None and tls is False:
        ctx.at(fields.get("tls") or fields.node, "state.tls: false contradicts a rediss:// url")
        return None
    if None in (url, key_file, prefix, deadline, peers) or (password_file and password is None):
        return None
    host, port, db, username, tls_scheme = url  # type: ignore[misc]
    if tls is None or tls is False:
        tls = RedisTLS() if tls_scheme else None
    return State("redis", RedisSettings(host, port, db, key_file, username, password,
                                        password_file, prefix, tls, deadline,
                                        peers))  # type: ignore[arg-type]


def _peers(ctx: _Ctx, node: Node) -> tuple[str, ...] | None:
    """The fingerprints of the other instances this one forwards to and accepts forwards
    from (each is what `pact-ingress fingerprint` prints for that instance's key)."""
    items = _strings(ctx, node, "state.peers")
    bad = [(t, n, why) for t, n in items if (why := pin_problem(t)) is not None]
    for text, item, why in bad:
        ctx.at(item, f"state.peers: {text!r} {why} (get it with `pact-ingress fingerprint "
               "KEYFILE` on that instance)")  # fmt: skip
    peers = tuple(t for t, _ in items)
    if len(set(peers)) != len(peers):
        ctx.at(node, "state.peers lists the same fingerprint twice")
    if len(peers) > MAX_PEERS:
        ctx.at(node, f"state.peers: at most {MAX_PEERS} instances")
    ok = not bad and len(set(peers)) == len(peers) <= MAX_PEERS
    return peers if ok else None


def _state_deadline(ctx: _Ctx, node: Node) -> float | None:
    seconds = _duration(ctx, node, "state.deadline")
    if seconds is not None and seconds > MAX_STATE_DEADLINE:
        ctx.at(node, f"state.deadline must be at most {MAX_STATE_DEADLINE:g}s: every request "
               "waits this long while Redis is sick")  # fmt: skip
        return None
    return seconds


def _redis_url(ctx: _Ctx, node: Node) -> tuple[str, int, int, str | None, bool] | None:
    """(host, port, db, username, tls) from ``redis://[USER@]HOST[:PORT][/DB]``."""
    text = _string(ctx, node, "state.url")
    if text is None:
        return None
    try:
        parts = urllib.parse.urlsplit(text.strip())
        port = parts.port or 6379
    except ValueError:
        ctx.at(node, "state.url is not a URL like redis://HOST:PORT/DB")
        return None
    if parts.password is not None:
        # the URL is not repeated here: it holds the password
        ctx.at(node, "state.url must not hold a password (URLs end up in logs and status "
               "pages): put it in state.password_file")  # fmt: skip
        return None
    problem = None
    if parts.scheme not in ("redis", "rediss"):
        problem = "the scheme must be redis:// or rediss:// (TLS)"
    elif not parts.hostname:
        problem = "it names no host"
    elif parts.query or parts.fragment:
        problem = "query strings and fragments are not supported (use the state.* keys)"
    elif parts.path.strip("/") and not (parts.path.strip("/").isascii()
                                        and parts.path.strip("/").isdigit()):
        problem = "the path must be a database number, e.g. /0"
    if problem is None:
        try:
            host = parts.hostname if is_ip_address(parts.hostname) else normalize_hostname(
                parts.hostname)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        ctx.at(node, f"state.url {text!r}: {problem}")
        return None
    db = int(parts.path.strip("/") or 0)
    return host, port, db, parts.username or None, parts.scheme == "rediss"


def _secret_file(ctx: _Ctx, node: Node | None, path: Path, what: str) -> Secret | None:
    data = _read_secret(ctx, node, path, what)
    if data is None:
        return None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = ""
    if not text:
        ctx.at(node, f"{what} {path} holds no text")  # type: ignore[arg-type]
        return None
    return Secret(text)


def _read_secret(ctx: _Ctx, node: Node | None, path: Path, what: str) -> bytes | None:
    """A small regular file that not every local user can read (it guards every tenant)."""
    assert node is not None
    return _read_small_file(ctx, node, path, what, MAX_SECRET_FILE_BYTES, private=True)


def _readable_by_all(what: str, path: Path) -> str:
    return (f"{what} {path} is readable by every user: chmod o-rwx (e.g. 0600, "
            "or 0640 with the service's group)")


def _read_small_file(ctx: _Ctx, node: Node, path: Path, what: str, cap: int, *,
                     kind: str | None = None, private: bool = False) -> bytes | None:
    """The bytes of a regular file of at most `cap` bytes, or None with the reason recorded.
    `kind` names what the file should be (in the messages); `private` refuses a file every
    local user may read."""
    try:
        data, mode = read_small(path, cap)
    except OSError as exc:
        ctx.at(node, f"{what} {path}: cannot read: {exc.strerror or exc}")
        return None
    except NotAFile as exc:
        ctx.at(node, f"{what} {path} is a directory, not a {kind}" if kind and exc.is_dir
               else f"{what} {path} is not a regular file")
        return None
    except TooLarge:
        ctx.at(node, f"{what} {path} is larger than {cap} bytes"
               + (f": not a {kind}" if kind else ""))
        return None
    if private and mode & 0o007:
        ctx.at(node, _readable_by_all(what, path))
        return None
    return data


def _encryption_key_file(ctx: _Ctx, node: Node) -> Path | None:
    path = _path(ctx, node, "state.encryption_key_file")
    data = _read_secret(ctx, node, path, "state.encryption_key_file") if path else None
    if data is None:
        return None
    try:
        key = base64.b64decode(data.strip().replace(b"-", b"+").replace(b"_", b"/"),
                               validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != ENCRYPTION_KEY_BYTES:
        ctx.at(node, f"state.encryption_key_file {path} must hold {ENCRYPTION_KEY_BYTES} random "
               f"bytes in base64 (make one with: openssl rand -base64 {ENCRYPTION_KEY_BYTES})")
        return None
    return path


def _key_prefix(ctx: _Ctx, node: Node) -> str | None:
    prefix = _string(ctx, node, "state.key_prefix")
    if prefix is not None and (len(prefix) > MAX_KEY_PREFIX
                               or not _KEY_PREFIX_RE.fullmatch(prefix)):
        ctx.at(node, f"state.key_prefix {prefix!r} must be at most {MAX_KEY_PREFIX} of "
               "A-Z a-z 0-9 . _ : / { } -")  # fmt: skip
        return None
    return prefix


def _redis_tls(ctx: _Ctx, node: Node) -> RedisTLS | bool | None:
    """``true`` (the system's CAs), ``false``, or ``{ca_file, cert_file, key_file}``."""
    if isinstance(node, ScalarNode) and node.tag == _BOOL:
        return node.value.lower() in ("true", "yes", "on")
    fields = _mapping(ctx, node, "state.tls", _REDIS_TLS_KEYS)
    if fields is None:
        return None
    ca = fields.opt("ca_file", _path, "state.tls.ca_file")
    cert = fields.opt("cert_file", _path, "state.tls.cert_file")
    key = fields.opt("key_file", _path, "state.tls.key_file")
    if (cert is None) != (key is None):
        ctx.at(fields.node, "state.tls: cert_file and key_file go together")
        return None
    for path, name in ((ca, "ca_file"), (cert, "cert_file"), (key, "key_file")):
        if path is not None and not os.path.isfile(path):
            ctx.at(fields.get(name) or fields.node, f"state.tls.{name} {path} does not exist")
            return None
    return RedisTLS(ca, cert, key)


def _items(ctx: _Ctx, fields: _Fields, name: str) -> list[Node]:
    node = fields.get(name)
    return [] if node is None else _sequence(ctx, node, name)


def _identity(ctx: _Ctx, top: _Fields, state_dir: Path | None) -> Path | None:
    node = top.get("identity")
    if node is None:
        path = state_dir / "identity.key" if state_dir else None
        if path is not None:
            _key_not_public(ctx, top.key("state_dir"), path, "identity key")
        return path
    fields = _mapping(ctx, node, "identity", ("key",), required=("key",))
    key = fields.get("key") if fields else None
    path = _path(ctx, key, "identity.key") if key else None
    if path is not None and key is not None:
        _key_not_public(ctx, key, path, "identity.key")
    return path


def _key_not_public(ctx: _Ctx, node: Node, path: Path, what: str) -> None:
    """A private key (or the admin token) that exists must not be readable by every
    local user (a key that does not exist yet is written 0600), nor be a directory. Other
    problems with it are reported where it is read."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        ctx.at(node, f"{what} {path} is a directory")
    elif stat.S_ISREG(mode) and mode & 0o007:
        ctx.at(node, _readable_by_all(what, path))


def _listen(ctx: _Ctx, node: Node) -> Listen | None:
    fields = _mapping(ctx, node, "listen", _LISTEN_KEYS, required=("tls",))
    if fields is None:
        return None
    tls = _addresses(ctx, fields, "tls")
    if isinstance(node := fields.get("tls"), SequenceNode) and not node.value:
        ctx.at(node, "listen.tls needs at least one address")
    http = _addresses(ctx, fields, "http")
    token_node = fields.get("admin_token_file")
    token_file = _path(ctx, token_node, "listen.admin_token_file") if token_node else None
    if token_file is not None and token_node is not None:  # a secret like the state's
        _key_not_public(ctx, token_node, token_file, "listen.admin_token_file")
    admin = fields.opt("admin", _admin, token_file is not None)
    admin_node = fields.get("admin")
    extra = [(admin, admin_node)] if isinstance(admin, Address) and admin_node else []
    _check_overlaps(ctx, tls + http + extra)
    return Listen(tuple(a for a, _ in tls), tuple(a for a, _ in http), admin, token_file)


def _addresses(ctx: _Ctx, fields: _Fields, name: str) -> list[tuple[Address, Node]]:
    node = fields.get(name)
    if node is None:
        return []
    what = f"listen.{name}"
    found = [(_listen_address(ctx, n, what), n) for _, n in _strings(ctx, node, what)]
    return [(a, n) for a, n in found if a is not None]


def _listen_address(ctx: _Ctx, node: Node, what: str) -> Address | None:
    """A listen address; an IPv4-mapped one is refused here, as bind would refuse it:
    IPv6 listeners are v6-only, and the kernel binds no such socket to a mapped address."""
    address = _address(ctx, node, what)
    if address is None or ":" not in address.host:
        return address
    mapped = ipaddress.IPv6Address(address.host.partition("%")[0]).ipv4_mapped
    if mapped is None:
        return address
    ctx.at(node, f"{what}: {str(address)!r} is an IPv4-mapped address, which an IPv6 "
           f"listener (v6-only) cannot bind: write {mapped}:{address.port}")
    return None


def _check_overlaps(ctx: _Ctx, addresses: list[tuple[Address, Node]]) -> None:
    """Two listeners on one port fail at bind time: say so at check time, with lines."""
    for i, (address, node) in enumerate(addresses):
        for earlier, earlier_node in addresses[:i]:
            if earlier.port == address.port and _same_socket(earlier.host, address.host):
                line = earlier_node.start_mark.line + 1
                ctx.at(node, f"listen address {str(address)!r} overlaps {str(earlier)!r} "
                       f"(line {line}): both cannot bind")  # fmt: skip
                break


#: What a `localhost` listener binds: every address the name resolves to, 127.0.0.1 and,
#: on most systems, ::1. Taken as both, so that a config is judged the same on every
#: machine, and without a lookup (a reload must not wait for a resolver).
_LOCALHOST = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def _same_socket(a: str, b: str) -> bool:
    """Whether two listen hosts take one socket on a port: the same address (however it
    is spelled), or one is the wildcard of the other's family (0.0.0.0 covers 127.0.0.1).
    IPv6 listeners are v6-only, so [::] and 0.0.0.0 do not overlap; distinct loopback
    addresses (127.0.0.2, 127.0.0.3) do not either. Other names are known only after a
    lookup: only the same name is an overlap."""
    if a == b:
        return True
    ips_a, ips_b = _listen_ips(a), _listen_ips(b)
    return any(x == y or (x.version == y.version and (x.is_unspecified or y.is_unspecified))
               for x in ips_a for y in ips_b)


def _listen_ips(host: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    if host == "localhost":
        return _LOCALHOST
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        return ()


def _admin(ctx: _Ctx, node: Node, has_token: bool = False) -> Address | Path | None:
    text = _string(ctx, node, "listen.admin")
    if text is not None and text.startswith("unix:"):
        if not text[5:].strip():
            ctx.at(node, "listen.admin: 'unix:' needs a socket path, e.g. unix:/run/x.sock")
            return None
        return _admin_socket(ctx, node, _resolve(ctx.base, text[5:].strip()))
    address = _listen_address(ctx, node, "listen.admin") if text is not None else None
    if address is not None and not _is_loopback(address.host) and not has_token:
        ctx.at(node, f"listen.admin {str(address)!r} is not a loopback address: the admin "
               "endpoint can reload the ingress; use 127.0.0.1, [::1], localhost or "
               "unix:PATH, or set listen.admin_token_file to require a bearer token")  # fmt: skip
        return None
    return address


#: A unix socket address holds this many bytes of path (sun_path, less its NUL).
MAX_UNIX_PATH = 107


def _admin_socket(ctx: _Ctx, node: Node, path: Path) -> Path | None:
    """What binding it at start would refuse, said now: a path too long for a socket
    address, or one naming something other than a (stale) socket."""
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        ctx.at(node, f"listen.admin unix:{path} is longer than the {MAX_UNIX_PATH} bytes a "
               "unix socket path may have")  # fmt: skip
        return None
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return path
    if not stat.S_ISSOCK(mode):
        ctx.at(node, f"listen.admin unix:{path} exists and is not a socket")
        return None
    return path


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tunnel(ctx: _Ctx, node: Node) -> str | None:
    fields = _mapping(ctx, node, "tunnel", ("hostname",), required=("hostname",))
    host = fields.get("hostname") if fields else None
    return _hostname(ctx, host, "tunnel.hostname") if host else None


def _acme(ctx: _Ctx, node: Node) -> Acme | None:
    fields = _mapping(ctx, node, "acme", _ACME_KEYS, required=("directory",))
    if fields is None:
        return None
    directory = fields.opt("directory", _acme_directory)
    email = fields.opt("email", _acme_email)
    agreed = _agree_tos(ctx, fields)
    challenges = fields.opt("challenges", _challenges, default=Acme.challenges)
    ca_bundle = fields.opt("ca_bundle", _ca_bundle)
    dns01 = fields.opt("dns01", _dns01)
    if challenges and "dns-01" in challenges and fields.get("dns01") is None:
        where = fields.get("challenges") or fields.node
        ctx.at(where, "acme: the dns-01 challenge needs an acme.dns01 block "
               "{server, zone, tsig_key_file}")  # fmt: skip
    if directory is None or not agreed or challenges is None:
        return None
    return Acme(directory, email, True, challenges, ca_bundle, dns01)


def _ca_bundle(ctx: _Ctx, node: Node) -> Path | None:
    """Extra CAs to trust the ACME API with: when the file is there it is read now, so a
    wrong one is a line here rather than every order failing later (one not there yet,
    like a test CA's, is looked for when ordering)."""
    path = _path(ctx, node, "acme.ca_bundle")
    if path is None or not os.path.lexists(path):
        return path
    pem = _read_pem(ctx, node, path, "acme.ca_bundle")
    if pem is None:
        return None
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError:
        ctx.at(node, f"acme.ca_bundle {path} holds no PEM certificate")
        return None
    return path


def _acme_directory(ctx: _Ctx, node: Node) -> str | None:
    url = _string(ctx, node, "acme.directory")
    if url is not None and not re.match(r"^https://[^/\s]+", url):
        ctx.at(node, f"acme.directory must be an https:// URL, got {url!r}")
        return None
    return url


def _acme_email(ctx: _Ctx, node: Node) -> str | None:
    email = _string(ctx, node, "acme.email")
    if email is not None and not re.fullmatch(r"[^@\s]+@[^@\s]+", email):
        ctx.at(node, f"acme.email {email!r} is not an e-mail address")
        return None
    return email


def _agree_tos(ctx: _Ctx, fields: _Fields) -> bool:
    node = fields.get("agree_tos")
    if node is not None and node.tag == _BOOL and node.value.lower() in ("true", "yes", "on"):
        return True
    got = (f" (got the string {node.value!r}: write true without quotes)"
           if isinstance(node, ScalarNode) and node.tag == _STR else "")
    ctx.at(node or fields.node, "acme.agree_tos must be true: ordering certificates means "
           f"agreeing to the CA's terms of service, so say so explicitly{got}")  # fmt: skip
    return False


def _challenges(ctx: _Ctx, node: Node) -> tuple[str, ...] | None:
    items = _strings(ctx, node, "acme.challenges")
    bad = [(t, n) for t, n in items if t not in ACME_CHALLENGES]
    for text, item in bad:
        ctx.at(item, f"unknown ACME challenge {text!r} (known: {', '.join(ACME_CHALLENGES)})")
    names = [t for t, _ in items]
    if len(set(names)) != len(names):
        ctx.at(node, "acme.challenges lists a challenge twice")
    if not items and isinstance(node, SequenceNode):
        ctx.at(node, "acme.challenges needs at least one challenge")
    return None if bad or not items or len(set(names)) != len(names) else tuple(names)


def _dns01(ctx: _Ctx, node: Node) -> Dns01 | None:
    fields = _mapping(ctx, node, "acme.dns01", _DNS01_KEYS, required=_DNS01_KEYS)
    if fields is None:
        return None
    server = fields.opt("server", _address, "acme.dns01.server", 53)
    zone = fields.opt("zone", _hostname, "acme.dns01.zone")
    tsig = fields.opt("tsig_key_file", _tsig_key_file)
    if server is None or zone is None or tsig is None:
        return None
    return Dns01(server, zone + ".", tsig)


def _tsig_key_file(ctx: _Ctx, node: Node) -> Path | None:
    """The key that may change the zone (so obtain certificates for it): when it is there
    it is checked now, as the state's secrets are; one not there yet is fine (systemd's
    LoadCredential puts it in place only for the service)."""
    what = "acme.dns01.tsig_key_file"
    path = _path(ctx, node, what)
    if path is None or not os.path.lexists(path):
        return path
    data = _read_secret(ctx, node, path, what)
    if data is None:
        return None
    from pact_ingress.acme.dns01 import parse_tsig_key  # dnspython: only when used
    from pact_ingress.errors import AcmeError

    try:
        parse_tsig_key(data.decode("ascii"), path)
    except (UnicodeDecodeError, ValueError, AcmeError):
        ctx.at(node, f"{what} {path} holds no BIND key clause "
               '(key "NAME" { algorithm ...; secret "..."; }; as tsig-keygen writes)')
        return None
    return path


def _limits(ctx: _Ctx, node: Node, base: Limits, what: str) -> Limits | None:
    fields = _mapping(ctx, node, what, _LIMIT_KEYS)
    if fields is None:
        return None
    changes = {
        name: _limit_value(ctx, value_node, f"{what}.{name}", name)
        for name, value_node in fields.values.items()
        if not _is_null(value_node)
    }
    if None in changes.values():
        return None
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _limit_value(ctx: _Ctx, node: Node, what: str, name: str) -> float | int | None:
    if name in _DURATION_LIMITS:
        return _duration(ctx, node, what)
    if name in _SIZE_LIMITS:
        return _size(ctx, node, what)
    return _integer(ctx, node, what)


def _include_patterns(ctx: _Ctx, node: Node) -> list[tuple[str, Node]]:
    if isinstance(node, ScalarNode):
        text = _string(ctx, node, "include")
        return [(text, node)] if text else []
    return _strings(ctx, node, "include")


def _expand_includes(
    ctx: _Ctx, patterns: list[tuple[str, Node]], main: Path, overlay: Mapping[str, str]
) -> list[str]:
    """Files the include globs match (sorted, main file excluded), plus matching overlays."""
    base = os.path.dirname(str(main))
    found: dict[str, str] = {}  # abspath -> display path
    for pattern, node in patterns:
        full = os.path.join(base, os.path.expanduser(pattern))
        if (problem := _include_dir_problem(full)) is not None:
            ctx.at(node, f"include {pattern!r}: {problem}")
            continue
        for hit in sorted(glob.glob(full)):
            # only directories are passed over: anything else the glob names (a symlink
            # to nowhere, a pipe) is read, and refused there, rather than dropped unsaid
            if not os.path.isdir(hit):
                found.setdefault(os.path.abspath(hit), hit)
        for virtual in overlay:
            if fnmatch.fnmatch(virtual, os.path.abspath(full)):
                shown = os.path.relpath(virtual, os.path.abspath(base or os.curdir))
                found.setdefault(virtual, os.path.join(base, shown))
        if len(found) > MAX_INCLUDED_FILES:
            ctx.at(node, f"include matches more than {MAX_INCLUDED_FILES} files")
            return []
    found.pop(os.path.abspath(main), None)
    return [found[k] for k in sorted(found)]


def _include_dir_problem(pattern: str) -> str | None:
    """What is wrong with the directory an include glob searches (the part before its
    first wildcard): it exists but cannot be listed, or is a symlink to nowhere (glob
    then quietly finds nothing, which would read as "no tenants"), or every user may
    add files to it (each a tenant at the next reload; the sticky bit does not stop
    that). None when it is fine, or does not exist (no tenants.d yet is fine)."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
    if fixed is None:  # one file named: found without listing anything
        return None
    directory = os.path.join(*parts[:fixed]) if fixed else os.curdir
    try:
        os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError) as exc:
        if os.path.islink(directory):  # a symlink to nowhere is no missing directory
            return (f"cannot list {directory}: {exc.strerror or exc} (a symlink to "
                    f"{os.readlink(directory)})")
        return None
    except OSError as exc:
        return f"cannot list {directory}: {exc.strerror or exc}"
    try:
        mode = os.stat(directory).st_mode
    except OSError:  # gone since it was listed: the glob finds nothing, as it would
        return None
    if mode & 0o002:
        return _writable_by_all(f"directory {directory}")
    return None


def _included_tenant(
    ctx: _Ctx, path: Path, seen: _Seen, overlay: Mapping[str, str]
) -> Tenant | None:
    root = _compose(ctx, path, overlay)
    if root is None:
        return None
    if isinstance(root, SequenceNode):
        ctx.at(root, "an included file holds one tenant mapping, not a list")
        return None
    return _tenant(ctx, root, seen, path)


def _tenant(ctx: _Ctx, node: Node, seen: _Seen, source: Path) -> Tenant | None:
    fields = _mapping(ctx, node, "tenant", _TENANT_KEYS, required=("name", "pins"))
    if fields is None:
        return None
    name = fields.opt("name", _tenant_name, seen)
    pins = fields.opt("pins", _pins)
    nodes = _items(ctx, fields, "routes")
    routes = [r for n in nodes if (r := _route(ctx, n, seen, name or "?")) is not None]
    relay = fields.opt("relay", _boolean, "tenant relay", default=False)
    if name is None or not pins or len(routes) != len(nodes) or relay is None:
        return None
    connector = relay or any(r.backend.is_tunnel for r in routes)
    if not _pins_of_its_own(ctx, fields.get("pins"), pins, name, connector, seen):
        return None
    return Tenant(name, pins, tuple(routes), Path(os.path.abspath(source)), relay=relay)


def _pins_of_its_own(ctx: _Ctx, node: Node | None, pins: tuple[str, ...], tenant: str,
                     connector: bool, seen: _Seen) -> bool:
    """One node may sit behind two tenants while the edge only dials it. But a connector
    (backend: tunnel, or the relay's wake) whose key two tenants pin is refused by the
    tunnel server, which cannot tell whose traffic it may carry: a copied tenant file
    whose pin was left as it was would cut the first tenant's tunnels on reload."""
    assert isinstance(node, SequenceNode)  # `pins` parsed as a list of strings
    ok = True
    for pin, item in zip(pins, node.value):
        owner, where, needs = seen.pins.get(pin, (tenant, ctx.where(item), False))
        if owner != tenant and (needs or connector):
            ctx.at(item, f"pin {pin!r} is also a pin of tenant {owner!r} (at {where}): a "
                   "connector with this key would be refused as ambiguous; a tenant with "
                   "backend: tunnel or relay: true needs pins of its own")  # fmt: skip
            ok = False
        seen.pins[pin] = (owner, where, needs or connector)
    return ok


def _boolean(ctx: _Ctx, node: Node, what: str) -> bool | None:
    if not isinstance(node, ScalarNode) or node.tag != _BOOL:
        ctx.at(node, f"{what} must be true or false, got {_kind(node)}")
        return None
    return bool(SafeConstructor().construct_yaml_bool(node))


# --- the relay gateway --------------------------------------------------------------------


def _relay(ctx: _Ctx, node: Node, seen: _Seen, state_dir: Path | None) -> Relay | None:
    fields = _mapping(ctx, node, "relay", _RELAY_KEYS, required=("host", "cert"))
    if fields is None:
        return None
    host = fields.opt("host", _relay_host, seen)
    store = fields.opt("store", _path, "relay.store")
    if store is None and fields.get("store") is None and state_dir is not None:
        store = state_dir / "relay.sqlite"
    max_items = fields.opt("max_items", _integer, "relay.max_items", default=RELAY_MAX_ITEMS)
    max_bytes = fields.opt("max_bytes", _size, "relay.max_bytes", default=RELAY_MAX_BYTES)
    if host is None or None in (store, max_items, max_bytes):
        return None
    # The certificate is chosen exactly as for a terminate route of that host.
    route = Route(host, "-", "terminate", Backend(None))
    cert = _cert(ctx, fields, route, seen) if fields.get("cert") is not None else None
    if cert is None:
        return None
    return Relay(host, cert, store, max_items, max_bytes)  # type: ignore[arg-type]


def _relay_host(ctx: _Ctx, node: Node, seen: _Seen) -> str | None:
    host = _hostname(ctx, node, "relay.host")
    if host is None:
        return None
    if host == seen.tunnel_hostname:
        ctx.at(node, f"relay.host {host!r} is the tunnel hostname; pick a name of its own")
        return None
    seen.relay_host = (host, ctx.where(node))
    return host


def _tenant_name(ctx: _Ctx, node: Node, seen: _Seen) -> str | None:
    name = _string(ctx, node, "tenant name")
    if name is None:
        return None
    if not TENANT_NAME_RE.fullmatch(name) or len(name) > MAX_TENANT_NAME:
        ctx.at(node, f"tenant name {name!r} must match [a-z0-9][a-z0-9-]* (at most "
               f"{MAX_TENANT_NAME} characters): it names a file and a metric label")  # fmt: skip
        return None
    if name in seen.names:
        ctx.at(node, f"tenant {name!r} is defined twice (also at {seen.names[name]})")
        return None
    seen.names[name] = ctx.where(node)
    return name


def _pins(ctx: _Ctx, node: Node) -> tuple[str, ...] | None:
    items = _strings(ctx, node, "pins")
    bad = [(t, n, why) for t, n in items if (why := pin_problem(t)) is not None]
    for text, item, why in bad:
        ctx.at(item, f"pin {text!r} {why} "
               "(get it with `pact-ingress fingerprint KEYFILE` on the home node)")  # fmt: skip
    pins = tuple(t for t, _ in items)
    if not pins and isinstance(node, SequenceNode):
        ctx.at(node, "a tenant needs at least one pin (its home node's fingerprint)")
    if len(set(pins)) != len(pins):
        ctx.at(node, "pins lists the same fingerprint twice")
    if len(pins) > MAX_PINS_PER_TENANT:
        ctx.at(node, f"at most {MAX_PINS_PER_TENANT} pins per tenant")
    ok = pins and not bad and len(set(pins)) == len(pins) <= MAX_PINS_PER_TENANT
    return pins if ok else None


# --- routes -------------------------------------------------------------------------------


def _route(ctx: _Ctx, node: Node, seen: _Seen, tenant: str) -> Route | None:
    fields = _mapping(ctx, node, "route", _ROUTE_KEYS, required=("host", "mode", "backend"))
    if fields is None:
        return None
    host = fields.opt("host", _route_host, seen, tenant)
    mode = fields.opt("mode", _choice, "mode", ("passthrough", "terminate"))
    backend = fields.opt("backend", _backend, seen)
    limits = fields.opt("limits", _limits, seen.limits, "route limits", default=seen.limits)
    client_cert = fields.opt("client_cert", _choice, "client_cert", _CLIENT_CERT, default="none")
    if None in (host, mode, backend, limits, client_cert):
        return None
    base = Route(host, tenant, mode, backend, limits=limits, client_cert=client_cert)
    if mode == "passthrough":
        return _passthrough(ctx, fields, base)
    return _terminate(ctx, fields, base, seen)


def _route_host(ctx: _Ctx, node: Node, seen: _Seen, tenant: str) -> str | None:
    host = _hostname(ctx, node, "route host", wildcard=True)
    if host is None:
        return None
    if host == seen.tunnel_hostname:
        ctx.at(node, f"host {host!r} is the tunnel hostname; routes cannot claim it")
        return None
    if seen.relay_host is not None and host == seen.relay_host[0]:
        ctx.at(node, f"host {host!r} is the relay host (at {seen.relay_host[1]}); "
               "a host belongs to exactly one route or the relay")  # fmt: skip
        return None
    if host in seen.hosts:
        owner, where = seen.hosts[host]
        whose = "this tenant" if owner == tenant else f"tenant {owner!r}"
        ctx.at(node, f"host {host!r} is already routed by {whose} (at {where}); "
               "a host belongs to exactly one route")  # fmt: skip
        return None
    if not _wildcard_clash(ctx, node, seen, host, tenant):
        return None
    seen.hosts[host] = (tenant, ctx.where(node))
    return host


def _covers(wildcard: str, host: str) -> bool:
    """Whether route `wildcard` ("*.suffix") receives `host`'s SNI if nothing else does:
    any name below the suffix, at any depth (the router's rule)."""
    return host.endswith(wildcard[1:])


def _wildcard_clash(ctx: _Ctx, node: Node, seen: _Seen, host: str, tenant: str) -> bool:
    """A wildcard must not reach over names that belong to someone else.

    A wildcard receives every name below it that has no route of its own, ACME
    validations included. The tunnel hostname is only the tunnel's for connections that
    offer a tunnel ALPN, so any other client asking for it (a CA validating the name,
    say) would reach the wildcard's tenant. Another tenant's exact host is shadowed by
    its own route only while that route exists: removing it, or a typo in it, would hand
    its traffic and its certificate validations to the wildcard's owner without anyone
    having decided so. Both are refused at load time instead."""
    if host.startswith("*."):
        if seen.tunnel_hostname is not None and _covers(host, seen.tunnel_hostname):
            ctx.at(node, f"wildcard host {host!r} covers the tunnel hostname "
                   f"{seen.tunnel_hostname!r}; routes cannot claim it")  # fmt: skip
            return False
        clashes = [(h, o, w) for h, (o, w) in seen.hosts.items()
                   if o != tenant and not h.startswith("*.") and _covers(host, h)]
    else:
        labels = host.split(".")
        wildcards = ("*." + ".".join(labels[i:]) for i in range(1, len(labels)))
        clashes = [(w, *seen.hosts[w]) for w in wildcards
                   if w in seen.hosts and seen.hosts[w][0] != tenant]
    for other, owner, where in clashes[:1]:
        if host.startswith("*."):
            what = f"wildcard host {host!r} covers {other!r} of tenant {owner!r} (at {where})"
        else:
            what = (f"host {host!r} is covered by wildcard {other!r} of tenant {owner!r} "
                    f"(at {where})")
        ctx.at(node, f"{what}; a wildcard may only cover hosts of its own tenant")
    return not clashes


def _backend(ctx: _Ctx, node: Node, seen: _Seen) -> Backend | None:
    text = _string(ctx, node, "backend")
    if text is None:
        return None
    if text == "tunnel":
        if seen.tunnel_hostname is None and "tunnel" in seen.broken:
            return None  # the tunnel block's own error says it all
        if seen.tunnel_hostname is None:
            ctx.at(node, "backend: tunnel needs tunnel.hostname in the config "
                   "(the SNI name connectors dial)")  # fmt: skip
            return None
        return Backend(None)
    try:
        return Backend(parse_address(text))
    except ValueError as exc:
        ctx.at(node, f"backend must be 'tunnel' or HOST:PORT / [IPv6]:PORT: {exc}")
        return None


def _passthrough(ctx: _Ctx, fields: _Fields, route: Route) -> Route | None:
    ok = True
    for name in _TERMINATE_ONLY:
        if name in fields.keys:
            ctx.at(fields.keys[name], f"{name!r} applies to terminate routes only: in "
                   "passthrough the caller's TLS goes to the home node untouched")  # fmt: skip
            ok = False
    node = fields.get("proxy_protocol")
    proxy = _proxy_protocol(ctx, node) if node is not None else "off"
    if not ok or proxy is None:
        return None
    return dataclasses.replace(route, proxy_protocol=proxy)  # type: ignore[arg-type]


def _proxy_protocol(ctx: _Ctx, node: Node) -> str | None:
    # YAML 1.1 reads a bare `off` / `false` as a boolean: accept it as "off".
    if isinstance(node, ScalarNode) and node.tag == _BOOL:
        if node.value.lower() in ("false", "no", "off"):
            return "off"
        ctx.at(node, "proxy_protocol must be v2 or off (true does not say which version)")
        return None
    return _choice(ctx, node, "proxy_protocol", ("off", "v2"))


def _terminate(ctx: _Ctx, fields: _Fields, route: Route, seen: _Seen) -> Route | None:
    ok = _terminate_refusals(ctx, fields, route)
    seal = fields.opt("seal", _seal, default="required")
    mcp_path = fields.opt("mcp_path", _mcp_path, default="/mcp")
    cert = _cert(ctx, fields, route, seen)
    if not ok or seal is None or mcp_path is None or cert is None:
        return None
    return dataclasses.replace(route, seal=seal, mcp_path=mcp_path, cert=cert)


def _terminate_refusals(ctx: _Ctx, fields: _Fields, route: Route) -> bool:
    ok = True
    if "proxy_protocol" in fields.keys:
        ctx.at(fields.keys["proxy_protocol"], "proxy_protocol applies to passthrough routes "
               "only: a terminate route opens its own connection to the backend")  # fmt: skip
        ok = False
    if route.client_cert == "required":
        ctx.at(fields.get("client_cert") or fields.node, "client_cert: required cannot be "
               "served in terminate mode: a node that requires transport client "
               "certificates is unreachable through a terminating edge by construction "
               "(spec §13.4); use mode: passthrough")  # fmt: skip
        ok = False
    return ok


def _seal(ctx: _Ctx, node: Node) -> str | None:
    if isinstance(node, ScalarNode) and node.tag == _STR and node.value == "none":
        ctx.at(node, "seal: none is not allowed on a terminate route: behind a terminating "
               "edge callers can only be identified by sealed envelopes (spec §10, §13.4); "
               "use seal: required or optional, or mode: passthrough")  # fmt: skip
        return None
    return _choice(ctx, node, "seal", ("required", "optional"))


def _mcp_path(ctx: _Ctx, node: Node) -> str | None:
    path = _string(ctx, node, "mcp_path")
    if path is None:
        return None
    if not re.fullmatch(r"/[!$&'()*+,;=:@%A-Za-z0-9._~/-]*", path):
        ctx.at(node, f"mcp_path must be an absolute URL path like /mcp, got {path!r}")
        return None
    try:  # each request's path is compared with this one, normalised the same way
        normalise_path(path.encode("ascii"))
    except BadRequest:
        ctx.at(node, f"mcp_path {path!r} has a '%' not followed by two hex digits")
        return None
    return path


def _cert(ctx: _Ctx, fields: _Fields, route: Route, seen: _Seen) -> CertSource | None:
    node = fields.get("cert")
    if seen.acme is None and "acme" in seen.broken and (node is None or _is_acme(node)):
        return None  # the acme block's own error says it all
    if node is None:
        if seen.acme is not None:
            return _acme_cert(ctx, fields.node, route, seen)
        ctx.at(fields.node, f"terminate route {route.host!r} needs a certificate: "
               "cert: {cert: FILE, key: FILE}, or an acme block for cert: acme")  # fmt: skip
        return None
    if isinstance(node, MappingNode):
        files = _mapping(ctx, node, "cert", ("cert", "key"), required=("cert", "key"))
        if files is None:
            return None
        cert, key = files.opt("cert", _path, "cert.cert"), files.opt("key", _path, "cert.key")
        if not cert or not key:
            return None
        return _cert_files(ctx, files, route, CertFiles(cert, key))
    if _choice(ctx, node, "cert", ("acme",)) is None:
        return None
    if seen.acme is None:
        ctx.at(node, "cert: acme needs an acme block at the top of the config "
               "(directory, email, agree_tos: true)")  # fmt: skip
        return None
    return _acme_cert(ctx, node, route, seen)


#: Largest cert or key file read while checking (a long chain is a few KiB).
MAX_CERT_FILE_BYTES = 1024 * 1024


def _cert_files(ctx: _Ctx, fields: _Fields, route: Route, files: CertFiles) -> CertFiles | None:
    """Check cert files now, so `check-config` (and a reload) catch what would otherwise
    surface only as failed handshakes: both missing is fine (`serve` writes a self-signed
    pair), but they must then be creatable; present, they must be a PEM certificate and
    the unencrypted PEM private key of that certificate."""
    cert_node, key_node = fields.get("cert") or fields.node, fields.get("key") or fields.node
    where = f"terminate route {route.host!r}"
    missing = [(p, n) for p, n in ((files.cert, cert_node), (files.key, key_node))
               if not os.path.lexists(p)]
    if len(missing) == 2:
        blocked = [(p, n, b) for p, n in missing if (b := _not_a_directory(p)) is not None]
        for path, node, blocker in blocked:
            ctx.at(node, f"{where}: {path} cannot be created: {blocker} is not a directory")
        return None if blocked else files
    if missing:
        (path, node), = missing
        ctx.at(node, f"{where}: {path} does not exist, but its partner does: give both "
               "cert and key, or neither (serve then writes a self-signed pair)")  # fmt: skip
        return None
    cert_pem = _read_pem(ctx, cert_node, files.cert, f"{where}: cert")
    key_pem = _read_small_file(ctx, key_node, files.key, f"{where}: key",
                               MAX_CERT_FILE_BYTES, kind="PEM file", private=True)
    if cert_pem is None or key_pem is None:
        return None
    try:
        leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError:
        ctx.at(cert_node, f"{where}: cert {files.cert} holds no PEM certificate")
        return None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        ctx.at(key_node, f"{where}: key {files.key} is encrypted; serve cannot ask for "
               "a passphrase, so store it unencrypted (mode 0600)")  # fmt: skip
        return None
    except (ValueError, UnsupportedAlgorithm):
        ctx.at(key_node, f"{where}: key {files.key} is not a PEM private key")
        return None
    if _spki(key.public_key()) != _spki(leaf.public_key()):
        ctx.at(key_node, f"{where}: key {files.key} does not belong to the certificate in "
               f"{files.cert} (their public keys differ)")  # fmt: skip
        return None
    return files


def _not_a_directory(path: Path) -> Path | None:
    """The first existing ancestor of `path` that is not a directory (so nothing can be
    created below it), or None."""
    for parent in reversed(path.parents):
        if os.path.lexists(parent) and not parent.is_dir():
            return parent
    return None


def _read_pem(ctx: _Ctx, node: Node, path: Path, what: str) -> bytes | None:
    return _read_small_file(ctx, node, path, what, MAX_CERT_FILE_BYTES, kind="PEM file")


def _spki(public_key: Any) -> bytes:
    return bytes(public_key.public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo))


def _is_acme(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.value == "acme"


def _acme_cert(ctx: _Ctx, node: Node, route: Route, seen: _Seen) -> Literal["acme"] | None:
    assert seen.acme is not None
    if route.host.startswith("*.") and "dns-01" not in seen.acme.challenges:
        ctx.at(node, f"wildcard host {route.host!r} with an ACME certificate needs the dns-01 "
               "challenge (CAs issue wildcards over DNS-01 only)")  # fmt: skip
        return None
    return "acme"


# --- connector config ---------------------------------------------------------------------

_CONNECTOR_KEYS = ("identity", "ingress", "forward", "connections", "data_transport",
                   "on_mail")
_ON_MAIL_KEYS = ("url", "command")
#: argv items of an on_mail command: a program and its arguments, not a script.
MAX_ON_MAIL_ARGS = 64
_INGRESS_KEYS = ("address", "tunnel_hostname", "pin")


def load_connector_config(path: Path) -> ConnectorConfig:
    """Load and validate a home-side connector config; ConfigError if bad."""
    ctx, root = _start(path, {})
    config = None
    if root is not None:
        try:
            config = _connector(ctx, Path(path), root)
        except _Stop as stop:
            ctx.errors.append(str(stop))
    if ctx.errors or config is None:
        raise ConfigError(ctx.errors or [f"{path}:1: invalid connector config"])
    return config


def _connector(ctx: _Ctx, path: Path, root: Node) -> ConnectorConfig | None:
    top = _mapping(ctx, root, "the connector config", _CONNECTOR_KEYS,
                   required=("identity", "ingress", "forward"))  # fmt: skip
    if top is None:
        return None
    key = top.opt("identity", _connector_identity)
    ingress = top.opt("ingress", _connector_ingress)
    forward = top.opt("forward", _address, "forward")
    count = top.opt("connections", _integer, "connections", 1, MAX_TUNNEL_CONNECTIONS, default=2)
    transport = top.opt("data_transport", _choice, "data_transport", ("auto", "raw", "tls"),
                        default="auto")
    on_mail = top.opt("on_mail", _on_mail)
    if ctx.errors or None in (key, ingress, forward, count, transport):
        return None
    addresses, sni, pins = ingress
    return ConnectorConfig(Path(os.path.abspath(path)), key, addresses[0], sni, pins[0],
                           forward, count, transport, on_mail,
                           ingresses=addresses if len(addresses) > 1 else (),
                           pins=pins if len(pins) > 1 else ())


def _on_mail(ctx: _Ctx, node: Node) -> OnMail | None:
    fields = _mapping(ctx, node, "on_mail", _ON_MAIL_KEYS)
    if fields is None:
        return None
    url = fields.opt("url", _hook_url)
    command = None
    if (cmd := fields.get("command")) is not None:
        argv = [t for t, _ in _strings(ctx, cmd, "on_mail.command")]
        if isinstance(cmd, SequenceNode) and not cmd.value:
            ctx.at(cmd, "on_mail.command needs at least the program to run")
        elif len(argv) > MAX_ON_MAIL_ARGS:
            ctx.at(cmd, f"on_mail.command has more than {MAX_ON_MAIL_ARGS} items")
        elif argv and len(argv) == len(cmd.value):
            command = tuple(argv)
    if url is None and command is None:
        if fields.get("url") is None and fields.get("command") is None:
            ctx.at(node, "on_mail needs url, command or both")
        return None
    return OnMail(url, command)


def _hook_url(ctx: _Ctx, node: Node) -> str | None:
    text = _string(ctx, node, "on_mail.url")
    if text is None:
        return None
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        ctx.at(node, f"on_mail.url must be an http:// or https:// URL with a host, got {text!r}")
        return None
    try:
        parts.port
    except ValueError:
        ctx.at(node, f"on_mail.url has a bad port: {text!r}")
        return None
    return text


def _connector_identity(ctx: _Ctx, node: Node) -> Path | None:
    fields = _mapping(ctx, node, "identity", ("key",), required=("key",))
    key = fields.get("key") if fields else None
    path = _path(ctx, key, "identity.key") if key is not None else None
    if path is not None and key is not None:
        _key_not_public(ctx, key, path, "identity.key")
    return path


def _connector_ingress(ctx: _Ctx, node: Node
                       ) -> tuple[tuple[Address, ...], str, tuple[str, ...]] | None:
    fields = _mapping(ctx, node, "ingress", _INGRESS_KEYS, required=_INGRESS_KEYS)
    if fields is None:
        return None
    addresses = fields.opt("address", _one_or_list, "ingress.address", MAX_INGRESS_ADDRESSES,
                           lambda c, n, what: _address(c, n, what, 443))
    sni = fields.opt("tunnel_hostname", _hostname, "ingress.tunnel_hostname")
    pins = fields.opt("pin", _one_or_list, "ingress.pin", MAX_INGRESS_PINS, _connector_pin)
    return None if None in (addresses, sni, pins) else (addresses, sni, pins)


def _one_or_list(ctx: _Ctx, node: Node, what: str, cap: int,
                 item: Callable[[_Ctx, Node, str], Any]) -> tuple[Any, ...] | None:
    """One value, or a non-empty list of distinct ones (at most `cap`), each read by
    `item`; the single form stays what it always was."""
    if not isinstance(node, SequenceNode):
        value = item(ctx, node, what)
        return None if value is None else (value,)
    if node.tag != _SEQ:
        ctx.at(node, _tag_refused(what, node))
        return None
    if not node.value:
        ctx.at(node, f"{what} must not be an empty list")
        return None
    if len(node.value) > cap:
        ctx.at(node, f"{what} lists more than {cap} items")
        return None
    values = [item(ctx, n, f"each item of {what}") for n in node.value]
    if None in values:
        return None
    for n, value in zip(node.value, values):
        if values.count(value) > 1:
            ctx.at(n, f"{what} lists {value} twice")
            return None
    return tuple(values)


def _connector_pin(ctx: _Ctx, node: Node, what: str = "ingress.pin") -> str | None:
    pin = _string(ctx, node, what)
    why = pin_problem(pin) if pin is not None else None
    if why is not None:
        ctx.at(node, f"{what} {pin!r} {why} "
               "(`pact-ingress tenant add` prints the ingress's pin)")  # fmt: skip
        return None
    return pin
