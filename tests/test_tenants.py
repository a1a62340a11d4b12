"""tenant add | list | remove on real files in temp dirs (pact_ingress.tenants)."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from pact_ingress.config import Address, CertFiles, load_config, load_connector_config
from pact_ingress.errors import ConfigError, UsageError
from pact_ingress.identity import load_identity
from pact_ingress.tenants import (
    RELOAD_COMMANDS,
    _write_new,
    add_tenant,
    list_tenants,
    remove_tenant,
)

ROOT = Path(__file__).resolve().parent.parent
PIN_A = "sha256:VMQn-nYYNbmhJNvkkNZO4_43tC4046AWxSTgnb8G3eY"
PIN_B = "sha256:x793VWsYDT8xeunXBhFx6_D5dIsCXFH2LhqWH_5t0o4"
PIN_C = "sha256:YeoIA_iFNSO3d9QUrOMTDNTT-S3izX_4aVwzfXnC7u4"

MAIN = """\
state_dir: state
listen:
  tls: ["0.0.0.0:443", "[::]:443"]
tunnel: {hostname: tunnel.family.example}
ACME_LINEinclude: tenants.d/*.yaml
tenants:
  - name: alina
    pins: ["PIN_A"]
    routes:
      - {host: alina.family.example, mode: passthrough, backend: tunnel}
""".replace("PIN_A", PIN_A)
ACME = "acme: {directory: 'https://acme.example/dir', agree_tos: true}\n"


def _main(acme: str = "") -> str:
    return MAIN.replace("ACME_LINE", acme)


@pytest.fixture
def main(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "ingress.yaml"
    path.parent.mkdir()
    path.write_text(_main())
    return path


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_add_passthrough_tenant(main: Path) -> None:
    added = add_tenant(main, "bob", "Bob.Family.Example.", pin=PIN_B)
    assert added.path == main.parent / "tenants.d" / "bob.yaml"
    assert _files(main.parent / "tenants.d") == ["bob.yaml"]  # no temp files left behind
    config = load_config(main)  # what a SIGHUP reload will see
    bob = config.tenant("bob")
    assert bob is not None and bob.source == added.path and bob.pins == (PIN_B,)
    (route,) = bob.routes
    assert (route.host, route.mode, route.backend.is_tunnel) == (
        "bob.family.example", "passthrough", True)  # fmt: skip
    assert added.tenant == bob
    assert added.reload_commands == RELOAD_COMMANDS


def test_add_creates_ingress_identity_and_prints_its_pin(main: Path, tmp_path: Path) -> None:
    added = add_tenant(main, "bob", "bob.family.example", pin=PIN_B)
    key = main.parent / "state" / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert added.ingress_pin == load_identity(key).fingerprint
    assert added.connector_config is not None
    connector = tmp_path / "connector.yaml"
    connector.write_text(added.connector_config)
    cfg = load_connector_config(connector)  # the printed config is valid as is
    assert cfg.pin == added.ingress_pin
    assert cfg.ingress == Address("tunnel.family.example", 443)
    assert cfg.tunnel_hostname == "tunnel.family.example"
    assert PIN_B in added.connector_config  # names the node key it expects


def test_dns_records(main: Path) -> None:
    added = add_tenant(main, "bob", "bob.family.example", pin=PIN_B)
    records = [(r.name, r.type) for r in added.dns_records]
    assert records == [
        ("bob.family.example.", "A"), ("bob.family.example.", "AAAA"),
        ("tunnel.family.example.", "A"), ("tunnel.family.example.", "AAAA"),
    ]  # fmt: skip
    assert all(r.value.startswith("<public IPv") for r in added.dns_records)
    text = added.render()
    for needle in ("bob.family.example. A <public IPv4", "pin:", "systemctl reload pact-ingress"):
        assert needle in text


def test_add_address_backend_has_no_connector(main: Path) -> None:
    added = add_tenant(main, "carol", "carol.example", pin=PIN_B, backend="192.0.2.7:443")
    assert added.connector_config is None
    assert {r.name for r in added.dns_records} == {"carol.example."}
    assert str(added.tenant.routes[0].backend) == "192.0.2.7:443"


def test_add_terminate_with_acme(main: Path) -> None:
    main.write_text(_main(ACME))
    added = add_tenant(main, "bob", "mcp.bob.example", mode="terminate", pin=PIN_B)
    route = added.tenant.routes[0]
    assert (route.mode, route.cert, route.seal) == ("terminate", "acme", "required")
    assert added.notes == ()


def test_add_terminate_without_acme_uses_cert_files(tmp_path: Path) -> None:
    """On the local config (no ACME) a terminate tenant gets self-signed file paths."""
    configs = tmp_path / "repo" / "configs"
    configs.mkdir(parents=True)
    shutil.copy(ROOT / "configs/local.yaml", configs / "local.yaml")
    added = add_tenant(configs / "local.yaml", "bob", "mcp.bob.localhost", "terminate", PIN_B,
                       backend="127.0.0.1:9444")  # fmt: skip
    cert = added.tenant.routes[0].cert
    state = tmp_path / "repo" / ".pact-state"
    assert cert == CertFiles(state / "selfsigned/mcp.bob.localhost.crt",
                             state / "selfsigned/mcp.bob.localhost.key")  # fmt: skip
    assert "../.pact-state/selfsigned/mcp.bob.localhost.crt" in added.path.read_text()
    assert added.notes and "mcp.bob.localhost.crt" in added.notes[0]
    assert [r.value for r in added.dns_records] == ["127.0.0.1"]  # a concrete listen IP
    assert added.connector_config is None  # direct backend: no tunnel


def test_connector_dials_concrete_listen_ip(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(ROOT / "configs/local.yaml", configs / "local.yaml")
    added = add_tenant(configs / "local.yaml", "bob", "bob.localhost", pin=PIN_B)
    connector = tmp_path / "connector.yaml"
    connector.write_text(added.connector_config or "")
    cfg = load_connector_config(connector)
    assert (cfg.ingress, cfg.tunnel_hostname) == (Address("127.0.0.1", 8443), "tunnel.localhost")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pin": None}, "tenant add needs --pin"),
        ({"pin": "sha256:nope"}, "is not 'sha256:' + 43 base64url"),
        ({"name": "alina"}, "tenant 'alina' already exists"),
        ({"name": "Bob"}, "must match [a-z0-9][a-z0-9-]*"),
        ({"host": "ALINA.family.example."}, "already belongs to tenant 'alina'"),
        ({"host": "a..b"}, "--host:"),
        ({"host": "a\n.demo.localhost"}, "--host:"),  # no newline hidden before a '$'
        ({"name": "bob\n"}, "must match [a-z0-9][a-z0-9-]*"),
        ({"pin": PIN_B + "\n"}, "is not 'sha256:' + 43 base64url"),
        ({"pin": PIN_B[:-1] + "5"}, "is not canonical base64url"),  # '4' with padding bits
        ({"mode": "splice"}, "--mode must be passthrough or terminate"),
        ({"backend": "192.0.2.1"}, "--backend must be 'tunnel' or HOST:PORT"),
    ],
)
def test_add_refusals(main: Path, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"name": "bob", "host": "bob.example", "pin": PIN_B} | kwargs
    with pytest.raises(UsageError) as info:
        add_tenant(main, **args)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert _files(main.parent / "tenants.d") == []


def test_add_refuses_config_without_include(main: Path) -> None:
    main.write_text(_main().replace("include: tenants.d/*.yaml\n", ""))
    with pytest.raises(UsageError, match=r"has no include: add `include: tenants.d/\*.yaml`"):
        add_tenant(main, "bob", "bob.example", pin=PIN_B)


def test_add_refuses_include_that_misses_tenants_d(main: Path) -> None:
    main.write_text(_main().replace("tenants.d/*.yaml", "people/*.yaml"))
    with pytest.raises(UsageError, match="do not cover"):
        add_tenant(main, "bob", "bob.example", pin=PIN_B)


def test_add_validates_whole_config_before_writing(main: Path) -> None:
    """A tenant that makes the config invalid is never written (here: wildcard over ACME
    without dns-01); the error names the would-be file and line."""
    main.write_text(_main(ACME))
    with pytest.raises(ConfigError) as info:
        add_tenant(main, "bob", "*.bob.example", mode="terminate", pin=PIN_B)
    (message,) = info.value.messages
    assert "tenants.d/bob.yaml:" in message and "needs the dns-01 challenge" in message
    assert _files(main.parent / "tenants.d") == []



@pytest.mark.parametrize(("host", "why"), [
    ("*.family.example", "covers the tunnel hostname 'tunnel.family.example'"),
    ("x.alina.family.example", "is covered by wildcard '*.alina.family.example' of tenant"),
])
def test_add_refuses_wildcards_reaching_over_other_tenants(main: Path, host: str,
                                                            why: str) -> None:
    """A wildcard may not cover another tenant's host or the tunnel hostname, whichever
    of the two routes comes second; nothing is written."""
    main.write_text(main.read_text().replace(
        "{host: alina.family.example,", '{host: "*.alina.family.example",'))
    with pytest.raises(ConfigError) as info:
        add_tenant(main, "bob", host, pin=PIN_B)
    (message,) = info.value.messages
    assert "tenants.d/bob.yaml:" in message and why in message
    assert _files(main.parent / "tenants.d") == []

def test_add_refuses_when_existing_config_is_invalid(main: Path) -> None:
    main.write_text(main.read_text() + "bogus: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        add_tenant(main, "bob", "bob.example", pin=PIN_B)


def test_add_refuses_existing_file_not_loaded(main: Path) -> None:
    """A stray tenants.d/NAME.yml-like clash: the target file exists already."""
    (main.parent / "tenants.d").mkdir()
    (main.parent / "tenants.d" / "bob.yaml").write_text("")  # empty: config invalid
    with pytest.raises(ConfigError, match="empty file"):
        add_tenant(main, "bob", "bob.example", pin=PIN_B)


def test_write_new_never_clobbers(tmp_path: Path) -> None:
    target = tmp_path / "tenants.d" / "x.yaml"
    _write_new(target, "first\n")
    with pytest.raises(UsageError, match="already exists"):
        _write_new(target, "second\n")
    assert target.read_text() == "first\n"
    assert _files(target.parent) == ["x.yaml"]


def test_second_add_with_same_host_is_refused(main: Path) -> None:
    add_tenant(main, "bob", "bob.example", pin=PIN_B)
    with pytest.raises(UsageError, match="already belongs to tenant 'bob'"):
        add_tenant(main, "bobby", "bob.example", pin=PIN_A)


def test_list_tenants(main: Path) -> None:
    assert [t.name for t in list_tenants(main)] == ["alina"]
    add_tenant(main, "bob", "bob.example", pin=PIN_B)
    add_tenant(main, "carol", "carol.example", pin=PIN_C)  # a tunnel needs a pin of its own
    tenants = list_tenants(main)
    assert [t.name for t in tenants] == ["alina", "bob", "carol"]
    assert tenants[0].source == main


def test_remove_tenant(main: Path) -> None:
    add_tenant(main, "bob", "bob.example", pin=PIN_B)
    removed = remove_tenant(main, "bob")
    assert removed == main.parent / "tenants.d" / "bob.yaml"
    assert not removed.exists()
    assert load_config(main).tenant("bob") is None


def test_remove_refuses_inline_and_unknown(main: Path) -> None:
    with pytest.raises(UsageError, match="defined inline in .*ingress.yaml: edit that file"):
        remove_tenant(main, "alina")
    with pytest.raises(UsageError, match=r"no tenant named 'zed' .*\(tenants: alina\)"):
        remove_tenant(main, "zed")
    assert load_config(main).tenant("alina") is not None


def test_remove_refuses_files_outside_tenants_d(main: Path) -> None:
    main.write_text(_main().replace("tenants.d/*.yaml", "[tenants.d/*.yaml, people/*.yaml]"))
    (main.parent / "people").mkdir()
    other = main.parent / "people" / "zoe.yaml"
    other.write_text(f"name: zoe\npins: ['{PIN_B}']\n")
    with pytest.raises(UsageError, match="outside tenants.d/: remove that file by hand"):
        remove_tenant(main, "zoe")
    assert other.exists()
