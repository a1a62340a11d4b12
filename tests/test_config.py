"""Config loader: every valid config loads, every invalid one fails with its lines.

Invalid files carry their expectations inline: a ``# ERROR: text`` comment on a line
means "an error on this line containing text" (several per line allowed), also in the
files an invalid config includes (``NAME.d/*.yaml``). The test requires exactly those
errors, no more, so a new spurious complaint fails too.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.config import (
    MAX_ERRORS,
    Address,
    CertFiles,
    Limits,
    load_config,
    load_config_with,
    load_connector_config,
    normalize_hostname,
    parse_address,
    parse_duration,
    parse_size,
)
from pact_ingress.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
VALID = sorted((ROOT / "tests/configs/valid").glob("*.yaml"))
INVALID = sorted((ROOT / "tests/configs/invalid").glob("*.yaml"))
SHIPPED = sorted((ROOT / "configs").rglob("*.yaml"))
PIN_A = "sha256:VMQn-nYYNbmhJNvkkNZO4_43tC4046AWxSTgnb8G3eY"
PIN_B = "sha256:x793VWsYDT8xeunXBhFx6_D5dIsCXFH2LhqWH_5t0o4"
MARK = re.compile(r"# ERROR: (.*?)\s*(?=# ERROR:|$)")


def _expected(path: Path) -> list[tuple[str, int, str]]:
    """(file as displayed, line, substring) for each `# ERROR:` mark in path and its includes."""
    files = [path] + sorted(path.with_suffix(".d").glob("*.yaml"))
    marks = []
    for file in files:
        shown = str(file.relative_to(path.parent))
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            marks += [(shown, number, text) for text in MARK.findall(line)]
    return marks


def _load_relative(path: Path) -> ConfigError:
    """Load `path` by its bare name from its directory, so messages name files as marked."""
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        with pytest.raises(ConfigError) as info:
            load_config(Path(path.name))
    finally:
        os.chdir(cwd)
    return info.value


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.path == path
    assert config.listen.tls


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_configs_load(path: Path, tmp_path: Path) -> None:
    if path.name.startswith("connector"):
        assert load_connector_config(path).connections >= 1
    elif path.name.startswith("tenant"):  # a tenants.d fragment: include it from a config
        main = tmp_path / "main.yaml"
        main.write_text(f"state_dir: s\nlisten: {{tls: ['127.0.0.1:1']}}\n"
                        f"tunnel: {{hostname: tunnel.example}}\ninclude: {path}\n")  # fmt: skip
        assert [t.source for t in load_config(main).tenants] == [path]
    else:
        assert load_config(path).tenants


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_configs_fail_with_their_lines(path: Path) -> None:
    expected = _expected(path)
    assert expected, f"{path.name} has no '# ERROR:' marks"
    messages = _load_relative(path).messages
    for shown, line, text in expected:
        prefix = f"{shown}:{line}: "
        assert any(m.startswith(prefix) and text in m for m in messages), (
            f"no error {prefix}…{text}… in:\n" + "\n".join(messages)
        )
    assert len(messages) == len(expected), "\n".join(messages)


# --- what valid configs mean ------------------------------------------------------------


def test_full_config_values() -> None:
    path = ROOT / "tests/configs/valid/full.yaml"
    base = path.parent
    config = load_config(path)
    assert config.identity_key == base / "keys/ingress.key"
    assert config.listen.admin == base / "run/admin.sock"
    assert config.listen.tls == (Address("0.0.0.0", 443), Address("::", 443),
                                 Address("localhost", 8443))  # fmt: skip
    assert config.tunnel_hostname == "tunnel.family.example"
    assert config.acme is not None and config.acme.ca_bundle == base / "pebble/ca.pem"
    assert config.acme.dns01 is not None and config.acme.dns01.zone == "family.example."
    assert config.acme.dns01.server == Address("127.0.0.1", 8053)
    assert config.limits == Limits(2.5, 300.0, 1000, 50, 100, 1000, 512 * 1024)
    assert [t.name for t in config.tenants] == ["alina", "0day", "carol", "dave"]
    assert config.tenant("carol").source == base / "full.d/carol.yaml"  # type: ignore[union-attr]
    assert config.tenant("alina").source == path  # type: ignore[union-attr]


def test_full_config_routes() -> None:
    config = load_config(ROOT / "tests/configs/valid/full.yaml")
    routes = {r.host: r for r in config.routes()}
    plain = routes["alina.family.example"]
    assert (plain.mode, plain.backend.is_tunnel) == ("passthrough", True)
    assert plain.proxy_protocol == "v2"
    assert plain.client_cert == "required"  # passthrough: the home node enforces it
    wild = routes["*.alina.family.example"]
    assert (wild.seal, wild.mcp_path, wild.cert, wild.client_cert) == (
        "optional", "/pact/mcp", "acme", "optional")  # fmt: skip
    assert str(wild.backend) == "[2001:db8::10]:443"
    # Route limits override single keys; the others come from the top-level block.
    assert wild.limits == Limits(2.5, 30.0, 1000, 50, 60, 1000, 1_000_000)
    assert routes["files.alina.family.example"].cert == CertFiles(
        ROOT / "tests/configs/valid/certs/files.crt", Path("/etc/ssl/files.key"))  # fmt: skip
    assert routes["zero.example"].cert == "acme"  # default when an acme block exists
    assert routes["zero.example"].seal == "required"
    assert routes["plain.zero.example"].proxy_protocol == "off"  # bare YAML `off`
    assert routes["plain.zero.example"].backend.address == Address("home-node.lan", 443)


def test_defaults_of_minimal_config() -> None:
    path = ROOT / "tests/configs/valid/minimal.yaml"
    config = load_config(path)
    assert config.state_dir == path.parent / "state"
    assert config.identity_key == config.state_dir / "identity.key"
    assert (config.limits, config.acme, config.tunnel_hostname) == (Limits(), None, None)
    assert (config.listen.http, config.listen.admin, config.tenants) == ((), None, ())


def test_units_and_route_limit_merge() -> None:
    config = load_config(ROOT / "tests/configs/valid/units.yaml")
    assert config.limits.clienthello_timeout == 1.5
    assert config.limits.idle_timeout == 3600.0
    a, b = config.routes()
    assert (a.limits.clienthello_timeout, a.limits.max_body_bytes) == (0.25, 2 * 1024**3)
    assert a.limits.idle_timeout == 3600.0
    assert b.limits.max_body_bytes == 100_000
    assert b.limits.clienthello_timeout == 1.5
    assert (config.limits.client_write_timeout, a.limits.client_write_timeout) == (120.0, 120.0)
    assert b.limits.client_write_timeout == 0.5


def test_local_config_is_loopback_only() -> None:
    config = load_config(ROOT / "configs/local.yaml")
    addresses = [*config.listen.tls, *config.listen.http, config.listen.admin]
    assert all(isinstance(a, Address) and a.host == "127.0.0.1" for a in addresses)
    assert config.state_dir == ROOT / ".pact-state"
    assert config.identity_key.parent == config.state_dir
    hosts = {r.host: r for r in config.routes()}
    assert hosts["demo.localhost"].mode == "passthrough"
    cert = hosts["mcp.demo.localhost"].cert
    assert isinstance(cert, CertFiles) and cert.cert.parent == config.state_dir / "selfsigned"


def test_include_missing_directory_is_no_tenants() -> None:
    config = load_config(ROOT / "tests/configs/valid/include-missing-dir.yaml")
    assert config.tenants == ()
    assert config.includes == (str(ROOT / "tests/configs/valid/tenants.d/*.yaml"),)


def test_overlay_file_is_included_without_touching_disk(tmp_path: Path) -> None:
    main = tmp_path / "ingress.yaml"
    main.write_text("state_dir: s\nlisten: {tls: ['127.0.0.1:1']}\ninclude: tenants.d/*.yaml\n")
    virtual = tmp_path / "tenants.d" / "x.yaml"
    text = f"name: x\npins: ['{PIN_A}']\nroutes:\n  - {{host: x.example, mode: passthrough}}\n"
    with pytest.raises(ConfigError) as info:
        load_config_with(main, {virtual: text})
    assert info.value.messages == [f"{main.parent}/tenants.d/x.yaml:4: route needs 'backend'"]
    good = text.replace("passthrough}", "passthrough, backend: '127.0.0.1:2'}")
    tenant = load_config_with(main, {virtual: good}).tenant("x")
    assert tenant is not None and tenant.source == virtual
    assert not virtual.parent.exists()


# --- file-level failures -----------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml:1: cannot read: No such file"):
        load_config(tmp_path / "nope.yaml")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"state_dir: s\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml:2: not UTF-8"):
        load_config(path)


def test_alias_bomb_is_bounded(tmp_path: Path) -> None:
    """YAML aliases can turn a small file into a huge tree; the walker has a budget."""
    route = "&r {host: x.example, mode: passthrough, backend: '127.0.0.1:1'}"
    routes = ", ".join([route] + ["*r"] * 999)
    first = f"  - &t {{name: a, pins: ['{PIN_A}'], routes: [{routes}]}}"
    tenants = "\n".join([first] + ["  - *t"] * 999)
    path = tmp_path / "bomb.yaml"
    path.write_text(f"state_dir: s\nlisten: {{tls: ['127.0.0.1:1']}}\ntenants:\n{tenants}\n")
    assert path.stat().st_size < 20_000
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.messages) <= MAX_ERRORS + 1
    assert "stopped after" in info.value.messages[-1] or "too large" in info.value.messages[-1]


def test_every_error_line_has_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text("a: 1\nb: 2\nc: 3\n")
    messages = _messages(path)
    assert [m.split(": ", 1)[0] for m in messages] == [
        f"{path}:1", f"{path}:2", f"{path}:3", f"{path}:1", f"{path}:1"]  # fmt: skip


def test_admin_token_file_readable_by_every_user_is_refused(tmp_path: Path) -> None:
    """The admin bearer token guards reload and the status of every tenant: like the
    state's secret files, one every local user may read is refused at its line."""
    token = tmp_path / "admin.token"
    token.write_text("t" * 40 + "\n")
    cfg = tmp_path / "ingress.yaml"
    cfg.write_text("listen:\n  tls: ['127.0.0.1:1']\n  admin: 127.0.0.1:2\n"
                   "  admin_token_file: admin.token\nstate_dir: state\n")
    for mode in (0o600, 0o640):
        token.chmod(mode)
        load_config(cfg)
    token.chmod(0o644)
    assert [m for m in _messages(cfg) if "every user" in m] == [
        f"{cfg}:4: listen.admin_token_file {token} is readable by every user: "
        "chmod o-rwx (e.g. 0600, or 0640 with the service's group)"]


def test_identity_key_readable_by_every_user_is_refused(tmp_path: Path) -> None:
    """A private key must not be readable by every local user: the ingress's identity
    key (named, or the default in the state directory) and the connector's are refused
    at the line that names them; group-readable (0640) and a key not there yet (written
    0600 on the first start) are fine."""
    from pact_ingress.identity import keygen

    keygen(tmp_path / "named.key")
    (tmp_path / "state").mkdir()
    keygen(tmp_path / "state" / "identity.key")
    head = "listen: {tls: ['127.0.0.1:1']}\n"
    named = tmp_path / "named.yaml"
    named.write_text(head + "state_dir: s2\nidentity:\n  key: named.key\n")
    default = tmp_path / "default.yaml"
    default.write_text(head + "state_dir: state\n")
    for mode in (0o600, 0o640):
        (tmp_path / "named.key").chmod(mode)
        (tmp_path / "state" / "identity.key").chmod(mode)
        load_config(named)
        load_config(default)
    (tmp_path / "named.key").chmod(0o644)
    (tmp_path / "state" / "identity.key").chmod(0o604)
    assert [m for m in _messages(named) if "every user" in m] == [
        f"{named}:4: identity.key {tmp_path / 'named.key'} is readable by every user: "
        "chmod o-rwx (e.g. 0600, or 0640 with the service's group)"]
    assert [m.split(": ", 1)[0] for m in _messages(default) if "every user" in m] == [
        f"{default}:2"]
    keygen(tmp_path / "node.key")
    connector = tmp_path / "connector.yaml"
    connector.write_text(CONNECTOR)
    (tmp_path / "node.key").chmod(0o644)
    assert any(m.startswith(f"{connector}:") and "readable by every user" in m
               for m in _connector_messages(connector))
    (tmp_path / "node.key").chmod(0o600)
    load_connector_config(connector)
    (tmp_path / "gone.yaml").write_text(head + "state_dir: s3\n")
    load_config(tmp_path / "gone.yaml")  # no key yet: serve makes one, 0600


def _messages(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.messages



def test_trailing_newline_is_not_a_valid_value(tmp_path: Path) -> None:
    """Patterns must match whole values: a `$` anchor alone lets "x\\n" through."""
    path = tmp_path / "nl.yaml"
    path.write_text(f"""\
state_dir: state
listen: {{tls: ["127.0.0.1:8443"]}}
acme: {{directory: "https://acme.example/dir", email: "ops@example.org\\n", agree_tos: true}}
tenants:
  - name: "alina\\n"
    pins: ["{PIN_A}"]
    routes: []
  - name: bob
    pins: ["{PIN_B}\\n"]
    routes:
      - {{host: "bob\\n.example", mode: passthrough, backend: "127.0.0.1:1"}}
      - {{host: b.example, mode: terminate, backend: "127.0.0.1:1", mcp_path: "/mcp\\n"}}
""")
    lines = [m.split(": ", 1)[0] for m in _messages(path)]
    assert lines == [f"{path}:{n}" for n in (3, 5, 9, 11, 12)]


# --- connector config --------------------------------------------------------------------

CONNECTOR = f"""\
identity: {{key: node.key}}
ingress:
  address: ingress.example
  tunnel_hostname: Tunnel.Example.
  pin: "{PIN_B}"
forward: "[::1]:8443"
"""


def test_connector_config(tmp_path: Path) -> None:
    path = tmp_path / "connector.yaml"
    path.write_text(CONNECTOR)
    config = load_connector_config(path)
    assert config.identity_key == tmp_path / "node.key"
    assert config.ingress == Address("ingress.example", 443)  # port defaults to 443
    assert (config.tunnel_hostname, config.pin) == ("tunnel.example", PIN_B)
    assert (config.forward, config.connections) == (Address("::1", 8443), 2)
    assert config.data_transport == "auto"
    path.write_text(CONNECTOR + "data_transport: tls\n")
    assert load_connector_config(path).data_transport == "tls"
    assert load_connector_config(path).on_mail is None
    path.write_text(CONNECTOR + "on_mail: {url: 'http://127.0.0.1:9/mail', command: [a, '-b']}\n")
    on_mail = load_connector_config(path).on_mail
    assert on_mail is not None
    assert (on_mail.url, on_mail.command) == ("http://127.0.0.1:9/mail", ("a", "-b"))


def test_relay_config() -> None:
    config = load_config(ROOT / "tests/configs/valid/relay.yaml")
    relay = config.relay
    assert relay is not None
    assert relay.host == "relay.example"
    assert relay.store == ROOT / "tests/configs/valid/relay/queue.sqlite"
    assert (relay.max_items, relay.max_bytes) == (500, 64 * 1024 * 1024)
    assert config.relay_recipients() == {PIN_A: "alina"}
    acme = load_config(ROOT / "tests/configs/valid/relay-acme.yaml")
    assert acme.relay is not None and acme.relay.cert == "acme"
    assert acme.relay.store == ROOT / "tests/configs/valid/state/relay.sqlite"
    assert load_config(ROOT / "tests/configs/valid/minimal.yaml").relay is None


@pytest.mark.parametrize(
    ("change", "line", "text"),
    [
        (("connections", "connections: 0\n"), 7, "connections must be between 1 and 16"),
        (("connections", "connections: 17\n"), 7, "connections must be between 1 and 16"),
        (("connections", "retries: 3\n"), 7, "unknown key 'retries' in the connector config"),
        (("connections", "data_transport: udp\n"), 7, "data_transport must be one of auto, raw"),
        (("pin", 'pin: "sha256:short"'), 5, "ingress.pin 'sha256:short' is not"),
        (("pin", f'pin: "{PIN_B[:-1]}5"'), 5, "is not canonical base64url"),
        (("forward", "forward: 8443"), 6, "forward must be a string, got an integer"),
        (("forward", 'forward: "127.0.0.1"'), 6, "forward: '127.0.0.1': missing port"),
        (("address", "adress: x:1"), 3, "(did you mean 'address'?)"),
        (("connections", "on_mail: {url: ftp://x/}\n"), 7, "on_mail.url must be an http://"),
        (("connections", "on_mail: {command: []}\n"), 7, "on_mail.command needs at least"),
        (("connections", "on_mail: {command: [notify, 3]}\n"), 7,
         "each item of on_mail.command must be a string"),
        (("connections", "on_mail: {}\n"), 7, "on_mail needs url, command or both"),
        (("connections", "on_mail: {shell: x}\n"), 7, "unknown key 'shell' in on_mail"),
    ],
)
def test_connector_config_errors(
    tmp_path: Path, change: tuple[str, str], line: int, text: str
) -> None:
    lines = CONNECTOR.splitlines(keepends=True)
    key, replacement = change
    if key == "connections":
        lines.append(replacement)
    else:
        index = next(i for i, x in enumerate(lines) if x.strip().startswith(key))
        indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
        lines[index] = indent + replacement + "\n"
    path = tmp_path / "connector.yaml"
    path.write_text("".join(lines))
    with pytest.raises(ConfigError) as info:
        load_connector_config(path)
    assert any(m.startswith(f"{path}:{line}: ") and text in m for m in info.value.messages), (
        info.value.messages
    )


def test_connector_config_missing_sections(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("connections: 2\n")
    assert _connector_messages(path) == [
        f"{path}:1: the connector config needs 'identity'",
        f"{path}:1: the connector config needs 'ingress'",
        f"{path}:1: the connector config needs 'forward'",
    ]


def _connector_messages(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_connector_config(path)
    return info.value.messages


# --- value parsers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("10s", 10.0), ("5m", 300.0), ("1h", 3600.0), ("30", 30.0), ("1.5s", 1.5)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "10 sec", "-1s", "0", "0ms", "1d", "25h", "1e3"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [("6MiB", 6 * 2**20), ("512KiB", 2**19), ("1GiB", 2**30), ("100kB", 100_000),
     ("2MB", 2_000_000), ("1GB", 10**9), ("4096", 4096), ("10B", 10)],
)  # fmt: skip
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["6mb", "6MIB", "1.5MiB", "0", "-1", "KiB", "1 TiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@given(st.integers(1, 10**6), st.sampled_from(["ms", "s", "m", "h"]))
def test_duration_units_scale(number: int, unit: str) -> None:
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    if number * scale > 86_400:
        with pytest.raises(ValueError):
            parse_duration(f"{number}{unit}")
    else:
        assert parse_duration(f"{number}{unit}") == pytest.approx(number * scale)


@given(st.ip_addresses(), st.integers(1, 65535))
def test_address_round_trip(ip: object, port: int) -> None:
    address = parse_address(str(Address(str(ip), port)))
    assert address == Address(str(ip), port)


@given(st.text(max_size=30))
def test_parse_address_only_raises_value_error(text: str) -> None:
    try:
        address = parse_address(text)
    except ValueError:
        return
    assert 1 <= address.port <= 65535 and address.host


def test_normalize_hostname() -> None:
    assert normalize_hostname("MCP.Alina.Example.") == "mcp.alina.example"
    assert normalize_hostname("*.Alina.Example", wildcard=True) == "*.alina.example"
    for bad in ("*.alina.example", "a..b", "-a.example", "a" * 64 + ".example", "1.2.3.4",
                "a\n.example", "a.example\n.x"):
        with pytest.raises(ValueError):
            normalize_hostname(bad)


# --- robustness: anything YAML can say ends in a Config or a ConfigError ------------------

_KEYS = ["identity", "key", "state_dir", "listen", "tls", "http", "admin", "tunnel", "hostname",
         "acme", "directory", "agree_tos", "challenges", "dns01", "server", "zone", "limits",
         "idle_timeout", "max_body_bytes", "include", "tenants", "name", "pins", "routes", "host",
         "mode", "backend", "seal", "cert", "proxy_protocol", "client_cert", "mcp_path"]  # fmt: skip
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=True),
    st.sampled_from(["tunnel", "terminate", "passthrough", "acme", "v2", "none", "10s", "6MiB",
                     "127.0.0.1:1", "[::1]:2", "*.a.example", "a.example", PIN_A, "unix:", ""]),
    st.text(max_size=8),
)  # fmt: skip
_TREES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner,
                                                                 max_size=4),
    max_leaves=25,
)  # fmt: skip


@given(_TREES)
def test_any_yaml_tree_loads_or_raises_config_error(tree: object) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(yaml.safe_dump(tree))
        try:
            load_config(path)
        except ConfigError as exc:
            assert exc.messages and all(m.startswith(str(path)) for m in exc.messages)
        try:
            load_connector_config(path)
        except ConfigError as exc:
            assert exc.messages


@given(st.text(max_size=200))
def test_any_text_loads_or_raises_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load_config(path)
        except ConfigError as exc:
            assert exc.messages


def _mutate(data: st.DataObject, node: object) -> object:
    """Replace a few subtrees of a valid config with random YAML."""
    if data.draw(st.integers(0, 9)) == 0:
        return data.draw(_TREES)
    if isinstance(node, dict):
        return {k: _mutate(data, v) for k, v in node.items()}
    if isinstance(node, list):
        return [_mutate(data, v) for v in node]
    return node


@settings(max_examples=60)
@given(st.data())
def test_mutated_valid_config_loads_or_raises_config_error(data: st.DataObject) -> None:
    base = yaml.safe_load((ROOT / "tests/configs/valid/full.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutated.yaml"
        path.write_text(yaml.safe_dump(_mutate(data, base)))
        try:
            load_config(path)
        except ConfigError as exc:
            assert exc.messages and all(m.startswith(str(path)) for m in exc.messages)


def test_connector_config_several_ingresses(tmp_path: Path) -> None:
    path = tmp_path / "connector.yaml"
    path.write_text(CONNECTOR.replace(
        "address: ingress.example", 'address: ["127.0.0.2:8443", edge.example]').replace(
        f'pin: "{PIN_B}"', f'pin: ["{PIN_B}", "{PIN_A}"]'))
    config = load_connector_config(path)
    assert config.ingress_addresses == (Address("127.0.0.2", 8443), Address("edge.example", 443))
    assert config.ingress == Address("127.0.0.2", 8443)
    assert config.ingress_pins == (PIN_B, PIN_A)
    # the single forms stay what they were: one address, one pin
    path.write_text(CONNECTOR)
    config = load_connector_config(path)
    assert (config.ingress_addresses, config.ingress_pins) == ((config.ingress,), (PIN_B,))


@pytest.mark.parametrize(("address", "pin", "text"), [
    ("[]", f'"{PIN_B}"', "ingress.address must not be an empty list"),
    ('["a.example", "a.example:443"]', f'"{PIN_B}"', "ingress.address lists a.example:443 twice"),
    ('["a.example", "bad host!"]', f'"{PIN_B}"', "each item of ingress.address"),
    ("a.example", f'["{PIN_B}", "sha256:nope"]', "each item of ingress.pin 'sha256:nope'"),
    ("a.example", f'["{PIN_B}", "{PIN_B}"]', "ingress.pin lists"),
    ("[" + ", ".join(f'"127.0.0.{i}"' for i in range(1, 18)) + "]", f'"{PIN_B}"',
     "ingress.address lists more than 16 items"),
])
def test_connector_config_several_ingresses_errors(tmp_path: Path, address: str, pin: str,
                                                  text: str) -> None:
    path = tmp_path / "connector.yaml"
    path.write_text(CONNECTOR.replace("address: ingress.example", f"address: {address}")
                    .replace(f'pin: "{PIN_B}"', f"pin: {pin}"))
    messages = _connector_messages(path)
    assert any(text in m for m in messages), messages
