"""The config surface attacked by a careless or hostile operator.

Each case is a file an operator could really write (or a file system state they could
really leave behind). What must hold for every one of them:

* `pact-ingress check-config` exits 0, or exits 2 with one `FILE:LINE: message` line per
  problem, naming the file that holds it (an included file, not the main one) and no
  traceback;
* `serve` refuses to start on it the same way;
* a SIGHUP reload of it is refused (`reload_refused`), the process lives on and the
  routes it served before are still served.

Most cases go through the loader or one `check-config` process; a few representative
ones through a real `serve` and SIGHUP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pact_ingress.config import load_config, load_connector_config, parse_address
from pact_ingress.errors import ConfigError

PIN_A = "sha256:VMQn-nYYNbmhJNvkkNZO4_43tC4046AWxSTgnb8G3eY"
PIN_B = "sha256:x793VWsYDT8xeunXBhFx6_D5dIsCXFH2LhqWH_5t0o4"
BASE = """\
state_dir: state
listen:
  tls: ["127.0.0.1:8443"]
tunnel: {hostname: tunnel.example}
"""
#: `FILE:LINE: message`, nothing else, on one line.
ERROR_LINE = re.compile(r"[^\n:]+:\d+: [^\n]+")


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pact_ingress", "check-config", "-c",
                           str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def refused(path: Path) -> list[str]:
    """The lines `check-config` refuses `path` with, each checked for shape."""
    result = check_config(path)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(ERROR_LINE.fullmatch(line) for line in lines), result.stderr
    return lines


def messages(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.messages


# --- YAML shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("nest", ["flow", "block"])
def test_deeply_nested_yaml_is_one_error_at_its_line(tmp_path: Path, nest: str) -> None:
    """A few KiB of nesting (a runaway generator, a hostile file) must not reach the
    interpreter's recursion limit inside the YAML composer: that was a traceback from
    check-config and from serve's start, where a config error belongs."""
    if nest == "flow":
        deep = "limits: " + "[" * 2000 + "]" * 2000 + "\n"
    else:  # indentation grows with depth: 400 levels stay well under the size cap
        deep = "limits:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(400))
    path = tmp_path / "deep.yaml"
    path.write_text(BASE + deep)
    lines = refused(path)
    assert len(lines) == 1 and lines[0].startswith(f"{path}:"), lines
    where, message = lines[0].split(": ", 1)
    assert "nested" in message, lines
    line = int(where.rsplit(":", 1)[1])
    if nest == "flow":
        assert line == 5, lines
    else:  # where the nesting passes the limit, not the file's first or last line
        assert 5 + 32 < line < 5 + 100, lines


# --- include: what the glob finds ---------------------------------------------------------

TENANT = """\
name: {name}
pins: ["{pin}"]
routes:
  - host: {name}.example
    mode: passthrough
    backend: "127.0.0.1:9000"
"""
INCLUDING = BASE + "include: tenants.d/*.yaml\n"


def as_ordinary_user() -> list[str]:
    """A command prefix under which file modes hold: root reads every file, so as root
    the process gives up the capabilities that let it (and the test fails, never skips,
    without setpriv)."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    return [shutil.which("setpriv") or "setpriv", f"--inh-caps={caps}",
            f"--bounding-set={caps}"]


def test_an_include_directory_that_cannot_be_listed_is_an_error(tmp_path: Path) -> None:
    """`chmod 700 tenants.d` by root while the service runs as its own user: the glob
    sees nothing in a directory it may not list. That must not read as "no tenants" (a
    reload would then drop every included tenant and its routes); it is an error at the
    include line, naming the directory."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    (tmp_path / "tenants.d").mkdir()
    (tmp_path / "tenants.d" / "a.yaml").write_text(TENANT.format(name="a", pin=PIN_A))
    (tmp_path / "tenants.d").chmod(0o311)  # may enter, may not list
    try:
        result = subprocess.run([*as_ordinary_user(), sys.executable, "-m", "pact_ingress",
                                 "check-config", "-c", str(main)], capture_output=True,
                                text=True, timeout=60, check=False)
    finally:
        (tmp_path / "tenants.d").chmod(0o755)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{main}:5: "), lines
    assert "tenants.d" in lines[0] and "Permission denied" in lines[0], lines


@pytest.mark.parametrize("kind", ["dangling-symlink", "symlink-loop", "fifo", "socket",
                                  "device"])
def test_an_included_name_that_is_no_readable_file_is_an_error(tmp_path: Path,
                                                                kind: str) -> None:
    """`tenants.d/b.yaml` matched by the glob but not a file that can be read (a symlink
    to a volume not mounted, a loop, a pipe, a socket, a device): its tenant would vanish
    without a word, and with it its routes on the next reload. It is an error naming that
    file; nothing blocks on the pipe."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    tenants = tmp_path / "tenants.d"
    tenants.mkdir()
    (tenants / "a.yaml").write_text(TENANT.format(name="a", pin=PIN_A))
    bad = tenants / "b.yaml"
    if kind == "dangling-symlink":
        bad.symlink_to(tmp_path / "unmounted" / "b.yaml")
    elif kind == "symlink-loop":
        bad.symlink_to(tenants / "c.yaml")
        (tenants / "c.yaml").symlink_to(bad)
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(bad))
    else:
        bad.symlink_to("/dev/zero")
    lines = refused(main)
    shown = [line for line in lines if line.startswith(f"{bad}:")]
    assert len(shown) == 1, lines
    assert all(line.startswith(f"{tenants}/") for line in lines), lines


# --- numbers, durations, sizes, ports -----------------------------------------------------


def limit_messages(tmp_path: Path, key: str, value: str) -> list[str]:
    path = tmp_path / "limits.yaml"
    path.write_text(BASE + f"limits:\n  {key}: {value}\n")
    found = messages(path)
    assert all(m.startswith(f"{path}:6: limits.{key}") for m in found), found
    return found


@pytest.mark.parametrize(("key", "value"), [
    ("max_body_bytes", "99999999999999999999GiB"),  # the unit form had no upper bound
    ("max_body_bytes", "4611686018427387905"),
    ("max_connections", "99999999999999999999999999"),
    ("relay_max_bytes", "99999999999999999999GiB"),
])
def test_a_huge_number_is_refused_as_too_large(tmp_path: Path, key: str, value: str) -> None:
    """A number past any sane bound is refused for what it is: the size form with a unit
    had no bound at all (while the same number of bytes written plainly had one), and a
    huge plain integer was refused with "must be at least 1"."""
    if key.startswith("relay_"):
        path = tmp_path / "relay.yaml"
        path.write_text(BASE + f"relay: {{host: relay.example, cert: {{cert: r.crt, "
                               f"key: r.key}}, max_bytes: {value}}}\n")
        found = messages(path)
        assert found and all(m.startswith(f"{path}:5: relay.max_bytes") for m in found), found
    else:
        found = limit_messages(tmp_path, key, value)
    assert len(found) == 1 and "at most" in found[0] and "at least" not in found[0], found


@pytest.mark.parametrize(("key", "value"), [
    ("idle_timeout", "１０s"),  # full-width digits
    ("idle_timeout", "٣"),  # an Arabic-Indic digit
    ("max_body_bytes", "６MiB"),
    ("max_body_bytes", "٣٣"),
])
def test_digits_are_ascii_digits(tmp_path: Path, key: str, value: str) -> None:
    """Python's `\\d` and `int()` take any script's digits: a value no YAML reader or
    operator would read as that number must be refused, not quietly converted."""
    assert len(limit_messages(tmp_path, key, value)) == 1


@pytest.mark.parametrize("value", ["0", "-1", "0s", "2d", "ten", "[1]", ".nan"])
def test_client_write_timeout_is_a_duration_like_the_others(tmp_path: Path, value: str) -> None:
    """The write deadline is checked like every duration limit: a zero, negative, over a
    day or unreadable one (which would drop every client, or never drop a stalled one)
    is refused with its line, not taken."""
    assert len(limit_messages(tmp_path, "client_write_timeout", value)) == 1


def with_backend(tmp_path: Path, backend: str) -> Path:
    """A config whose one route (line 9) is a passthrough to `backend`."""
    path = tmp_path / "backend.yaml"
    path.write_text(BASE + f"""tenants:
  - name: a
    pins: ["{PIN_A}"]
    routes:
      - {{host: a.example, mode: passthrough, backend: "{backend}"}}
""")
    return path


@pytest.mark.parametrize(("host", "canonical"), [
    ("0x7f000001", "127.0.0.1"),  # one hex number
    ("0X7F000001", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),  # one decimal number
    ("127.1", "127.0.0.1"),  # the last part fills the remaining bytes
    ("0177.0.0.1", "127.0.0.1"),  # octal
    ("127.0.0.01", "127.0.0.1"),
    ("0x7f.0.0.1", "127.0.0.1"),
    ("10.0x10.1", "10.16.0.1"),
])
def test_a_backend_in_a_legacy_ipv4_spelling_is_refused_with_the_address(
        tmp_path: Path, host: str, canonical: str) -> None:
    """The C resolver reads these as IPv4 addresses (inet_aton's old forms), so a backend
    written so was dialled at an address nobody wrote down. A name of numbers only is no
    host name: refused at its line, with the dotted quad it stands for."""
    path = with_backend(tmp_path, f"{host}:9000")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:9: backend"), found
    assert repr(host) in found[0] and f"write {canonical}" in found[0], found


@pytest.mark.parametrize("backend", ["127.0.0.1:9000", "[::1]:9000", "[::ffff:127.0.0.1]:9000",
                                     "localhost:9000", "deadbeef:9000", "x0.example:9000",
                                     "0x7f.example:9000", "1.example:9000"])
def test_canonical_addresses_and_real_host_names_stay_backends(tmp_path: Path,
                                                               backend: str) -> None:
    [route] = load_config(with_backend(tmp_path, backend)).routes()
    assert str(route.backend) == backend


def test_a_legacy_ipv4_spelling_is_refused_where_any_address_is_read(tmp_path: Path) -> None:
    """Listen addresses and the connector's addresses go through the same reader."""
    path = tmp_path / "listen.yaml"
    path.write_text(BASE.replace("127.0.0.1:8443", "0x7f000001:8443"))
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:3: listen.tls"), found
    assert "write 127.0.0.1" in found[0], found
    connector = tmp_path / "connector.yaml"
    connector.write_text(f"""identity: {{key: node.key}}
ingress: {{address: "127.1", tunnel_hostname: tunnel.example, pin: "{PIN_A}"}}
forward: "2130706433:8443"
""")
    with pytest.raises(ConfigError) as info:
        load_connector_config(connector)
    found = info.value.messages
    assert [m for m in found if m.startswith(f"{connector}:2: ") and "write 127.0.0.1" in m]
    assert [m for m in found if m.startswith(f"{connector}:3: ") and "write 127.0.0.1" in m]


@pytest.mark.parametrize("port", ["０８０", "٨٠", "²"])
def test_a_port_is_ascii_digits(tmp_path: Path, port: str) -> None:
    path = with_backend(tmp_path, f"127.0.0.1:{port}")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:9: backend"), found
    assert "port must be 1..65535" in found[0], found


@pytest.mark.parametrize(("key", "value", "plain"), [
    ("max_connections", "010", "10"),  # YAML 1.1: octal, 8
    ("max_connections", "0x10", "16"),
    ("max_connections", "0b101", "5"),
    ("max_connections", "1_000", "1000"),
    ("max_connections", "1:30", "90"),  # base 60
    ("max_connections", "0o10", "8"),  # YAML 1.2's octal: a string to YAML 1.1
    ("idle_timeout", "010", "10"),
    ("idle_timeout", "0x10", "16"),
    ("idle_timeout", "1:30", "90"),
    ("idle_timeout", "1:30.5", "90.5"),
    ("idle_timeout", "1_0.5", "10.5"),
    ("idle_timeout", "0o10", "8"),
    ("max_body_bytes", "010", "10"),
    ("max_body_bytes", "1_000", "1000"),
])
def test_a_number_in_a_yaml_11_spelling_is_refused_naming_it(tmp_path: Path, key: str,
                                                              value: str, plain: str) -> None:
    """PyYAML reads 010 as 8 and 1:30 as 90 (and 0x10, 0b101, 1_000 in ways a count or
    a duration is never meant to be written): taken silently, `idle_timeout: 010` was
    eight seconds. Refused at its line, naming the value and its plain spelling."""
    found = limit_messages(tmp_path, key, value)
    assert len(found) == 1 and f"write {plain}, not {value}" in found[0], found


def test_numbers_in_plain_decimal_and_quoted_strings_load_as_written(tmp_path: Path) -> None:
    """The refusal is of the spelling only: decimals (a float with a leading zero too)
    load, and a quoted "010" stays the string it is where a string is expected, or is
    read as decimal text where a duration or size is."""
    path = tmp_path / "plain.yaml"
    path.write_text(BASE + f"""limits:
  max_connections: 10
  idle_timeout: 010.5
  clienthello_timeout: "010"
  max_body_bytes: "010"
tenants:
  - name: "010"
    pins: ["{PIN_A}"]
    routes:
      - {{host: a.example, mode: passthrough, backend: "127.0.0.1:9000"}}
""")
    config = load_config(path)
    assert config.limits.max_connections == 10
    assert config.limits.idle_timeout == 10.5
    assert config.limits.clienthello_timeout == 10.0
    assert config.limits.max_body_bytes == 10
    assert [t.name for t in config.tenants] == ["010"]


def test_a_connector_count_in_a_yaml_11_spelling_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "connector.yaml"
    path.write_text(f"""identity: {{key: node.key}}
ingress: {{address: "127.0.0.1:443", tunnel_hostname: tunnel.example, pin: "{PIN_A}"}}
forward: "127.0.0.1:8443"
connections: 02
""")
    with pytest.raises(ConfigError) as info:
        load_connector_config(path)
    assert [m for m in info.value.messages if m.startswith(f"{path}:4: connections")
            and "write 2, not 02" in m], info.value.messages


def test_a_redis_database_number_is_ascii_digits(tmp_path: Path) -> None:
    path = tmp_path / "state.yaml"
    path.write_text(BASE + "state:\n  backend: redis\n  url: redis://127.0.0.1/٣\n"
                           "  encryption_key_file: nope.key\n")
    found = messages(path)
    assert any(m.startswith(f"{path}:7: state.url") and "database number" in m
               for m in found), found


def with_listen(tmp_path: Path, tls: list[str], http: list[str] | None = None,
                admin: str | None = None) -> Path:
    """A config whose listen block has tls on line 3, then http, then admin."""
    path = tmp_path / "listen.yaml"
    lines = ["state_dir: state", "listen:", f"  tls: {tls!r}".replace("'", '"')]
    if http is not None:
        lines.append(f"  http: {http!r}".replace("'", '"'))
    if admin is not None:
        lines.append(f'  admin: "{admin}"')
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("tls", "http", "admin", "lines"), [
    (["localhost:8443", "127.0.0.1:8443"], None, None, (3, 3)),
    (["127.0.0.1:8443"], ["localhost:8443"], None, (4, 3)),
    (["localhost:8443"], ["0.0.0.0:8443"], None, (4, 3)),
    (["[::]:8443"], None, "localhost:8443", (4, 3)),  # localhost is ::1 as well
    (["0.0.0.0:8443"], ["127.0.0.1:8443"], None, (4, 3)),
    (["127.0.0.1:8443"], ["127.0.0.1:8443"], None, (4, 3)),  # two kinds, one socket
    (["127.0.0.1:8443"], None, "127.0.0.1:8443", (4, 3)),
    (["[::1]:8443"], ["[0:0:0:0:0:0:0:1]:8443"], None, (4, 3)),  # one address, two spellings
    (["LocalHost:8443"], ["localhost.:8443"], None, (4, 3)),
])
def test_listeners_that_cannot_both_bind_are_refused_naming_both_lines(
        tmp_path: Path, tls: list[str], http: list[str] | None, admin: str | None,
        lines: tuple[int, int]) -> None:
    """Two listen addresses that take one socket were found only by serve's bind, as
    "address in use" after the config was accepted (and never by check-config)."""
    path = with_listen(tmp_path, tls, http, admin)
    found = messages(path)
    assert len(found) == 1, found
    at, first = lines
    assert found[0].startswith(f"{path}:{at}: listen address") and "overlaps" in found[0]
    assert f"(line {first})" in found[0], found


@pytest.mark.parametrize(("tls", "http", "admin", "line", "v4"), [
    (["[::ffff:127.0.0.1]:8443"], None, None, 3, "127.0.0.1:8443"),
    (["127.0.0.1:8443"], ["[::ffff:7f00:2]:8080"], None, 4, "127.0.0.2:8080"),
    (["[::]:8443"], None, "[0:0:0:0:0:ffff:127.0.0.1]:9180", 4, "127.0.0.1:9180"),
])
def test_an_ipv4_mapped_listen_address_is_refused_with_its_ipv4_spelling(
        tmp_path: Path, tls: list[str], http: list[str] | None, admin: str | None,
        line: int, v4: str) -> None:
    """IPv6 listeners are v6-only, and the kernel refuses to bind one to an IPv4-mapped
    address: such a config passed check-config and serve then died with "cannot listen
    on ...: invalid argument", naming no line and no way out."""
    path = with_listen(tmp_path, tls, http, admin)
    found = messages(path)
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}:{line}: listen.") and "IPv4-mapped" in found[0], found
    assert f"write {v4}" in found[0], found
    # the same through the command line: one FILE:LINE line, no traceback
    assert refused(path) == found


@pytest.mark.parametrize(("tls", "http", "admin"), [
    (["127.0.0.2:8443", "127.0.0.3:8443"], None, None),  # several instances on one host
    (["[::]:8443", "0.0.0.0:8443"], None, None),  # IPv6 listeners are v6-only
    (["localhost:8443"], ["127.0.0.2:8443"], None),
    (["0.0.0.0:8443"], ["[::1]:8443"], None),
    (["localhost:8443"], ["localhost:8080"], "localhost:9180"),
])
def test_listeners_on_distinct_sockets_load(tmp_path: Path, tls: list[str],
                                            http: list[str] | None, admin: str | None) -> None:
    assert load_config(with_listen(tmp_path, tls, http, admin)).listen.tls


# --- route values -------------------------------------------------------------------------


def terminate_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "route.yaml"
    path.write_text(BASE + f"""tenants:
  - name: a
    pins: ["{PIN_A}"]
    routes:
      - host: a.example
        mode: terminate
        backend: "127.0.0.1:9000"
        cert: {{cert: c.crt, key: c.key}}
{extra}""")
    return path


@pytest.mark.parametrize("mcp_path", ["/mcp%zz", "/mcp%", "/mcp%2", "/a%g1/mcp"])
def test_an_mcp_path_with_a_broken_percent_escape_is_refused(tmp_path: Path,
                                                             mcp_path: str) -> None:
    """The edge compares each request's normalised path with the normalised mcp_path;
    one whose escape cannot be decoded made that comparison fail on every POST to the
    route (a 400 blamed on the caller, or worse), long after check-config said ok."""
    path = terminate_with(tmp_path, f"        mcp_path: '{mcp_path}'\n")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:13: mcp_path"), found


def test_an_mcp_path_with_good_escapes_loads(tmp_path: Path) -> None:
    path = terminate_with(tmp_path, "        mcp_path: '/m%41cp/x%2Fy'\n")
    route, = load_config(path).routes()
    assert route.mcp_path == "/m%41cp/x%2Fy"


# --- one key, two tenants -----------------------------------------------------------------


def two_tenants(backend_a: str, backend_b: str) -> tuple[str, str]:
    inline = f"""tenants:
  - name: a
    pins: ["{PIN_A}"]
    routes:
      - {{host: a.example, mode: passthrough, backend: "{backend_a}"}}
"""
    included = f"""name: b
pins:
  - "{PIN_B}"
  - "{PIN_A}"
routes:
  - {{host: b.example, mode: passthrough, backend: "{backend_b}"}}
"""
    return BASE + "include: tenants.d/*.yaml\n" + inline, included


@pytest.mark.parametrize(("backend_a", "backend_b"), [("tunnel", "127.0.0.1:9000"),
                                                      ("127.0.0.1:9000", "tunnel")])
def test_a_pin_of_two_tenants_is_refused_when_a_tunnel_depends_on_it(
        tmp_path: Path, backend_a: str, backend_b: str) -> None:
    """A tenant file copied from another and its pin left as it was: the tunnel server
    refuses a connector whose key two tenants pin (it cannot tell whose traffic it may
    carry), so the reload that brings the copy would cut the first tenant's live
    tunnels and no tunnel of either could come back. check-config says so, at the
    copied pin, in the file that holds it."""
    main, included = two_tenants(backend_a, backend_b)
    (tmp_path / "main.yaml").write_text(main)
    (tmp_path / "tenants.d").mkdir()
    (tmp_path / "tenants.d" / "b.yaml").write_text(included)
    lines = refused(tmp_path / "main.yaml")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{tmp_path}/tenants.d/b.yaml:4: "), lines
    assert "'a'" in lines[0] and f"(at {tmp_path}/main.yaml:8)" in lines[0], lines


def test_a_pin_of_two_tenants_without_tunnels_loads(tmp_path: Path) -> None:
    """One node behind two tenants, each route reaching it at its address: the edge
    pins the node's key for both, which works, so it stays allowed."""
    main, included = two_tenants("127.0.0.1:9000", "127.0.0.1:9001")
    (tmp_path / "main.yaml").write_text(main)
    (tmp_path / "tenants.d").mkdir()
    (tmp_path / "tenants.d" / "b.yaml").write_text(included)
    assert [t.name for t in load_config(tmp_path / "main.yaml").tenants] == ["a", "b"]


# --- the same configs as a running serve sees them ----------------------------------------


def bad_reloads(tmp: Path, good: str, node_fp: str) -> list[tuple[str, str, str]]:
    """(name, main config text, file the first refusal must name) for each bad config
    a reload is given; `good` is the running config (with its include)."""
    tenants = tmp / "tenants.d"
    shared = (f"name: copy\npins: [\"{node_fp}\"]\nroutes:\n"
              "  - {host: copy.test, mode: passthrough, backend: tunnel}\n")
    cases: list[tuple[str, str, str]] = [
        ("nested", good + "limits: " + "[" * 3000 + "]" * 3000 + "\n", "ingress.yaml"),
        ("duplicate key", good + "state_dir: again\n", "ingress.yaml"),
        ("merge key", good + "<<: {state_dir: x}\n", "ingress.yaml"),
        ("python tag", good + "state: !!python/object/apply:os.system ['true']\n",
         "ingress.yaml"),
        ("dangling include", good, "tenants.d/gone.yaml"),
        ("shared pin", good, "tenants.d/copy.yaml"),
        ("broken mcp_path", good.replace("mcp_path: /mcp", "mcp_path: /mcp%zz", 1),
         "ingress.yaml"),
    ]
    setups = {
        "dangling include": lambda: (tenants / "gone.yaml").symlink_to(tmp / "nowhere"),
        "shared pin": lambda: (tenants / "copy.yaml").write_text(shared),
    }
    teardowns = {
        "dangling include": lambda: (tenants / "gone.yaml").unlink(),
        "shared pin": lambda: (tenants / "copy.yaml").unlink(),
    }
    return [(name, text, where, setups.get(name), teardowns.get(name))  # type: ignore[misc]
            for name, text, where in cases]


def test_serve_refuses_each_bad_reload_in_one_line_and_keeps_serving(tmp_path: Path) -> None:
    """One running serve given each bad config in turn by SIGHUP: each is refused with
    `reload_refused` lines of the shape FILE:LINE: message naming the file at fault, the
    process lives on without a traceback, and the routes it served (an included
    tenant's too) are still served. A good config afterwards applies."""
    from tests.terminate_env import (
        OPT_HOST,
        RecordingNode,
        Serve,
        exchange,
        make_identities,
        request_bytes,
    )

    ids = make_identities(tmp_path)
    node = RecordingNode(ids.node, client_ca=ids.ingress)
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1)
    try:
        (tmp_path / "tenants.d").mkdir()
        (tmp_path / "tenants.d" / "b.yaml").write_text(
            f"name: b\npins: [\"{PIN_B}\"]\nroutes:\n"
            "  - {host: b.test, mode: passthrough, backend: '127.0.0.1:9'}\n")
        good = serve.render() + ("tunnel: {hostname: tunnel.test}\n"
                                 "include: tenants.d/*.yaml\n")
        assert serve.reload(good) == "reloaded"
        hosts = {r["host"] for r in serve.status()["routes"]}
        assert "b.test" in hosts and OPT_HOST in hosts
        for name, text, where, setup, teardown in bad_reloads(tmp_path, good,
                                                              ids.node.fingerprint):
            if setup:
                setup()
            before = len(serve.log_events())
            outcome = serve.reload(text)
            lines = [e["error"] for e in serve.log_events()[before:]
                     if e.get("event") == "reload_refused"]
            if teardown:
                teardown()
            assert outcome == "reload_refused", (name, outcome, serve.logs()[-2000:])
            assert lines and all(ERROR_LINE.fullmatch(line) for line in lines), (name, lines)
            assert lines[0].startswith(f"{tmp_path / where}:"), (name, lines)
            assert serve.alive() and "Traceback" not in serve.logs(), name
            assert {r["host"] for r in serve.status()["routes"]} == hosts, name
            assert exchange(serve.port, request_bytes("GET", "/ok", OPT_HOST),
                            host=OPT_HOST).status == 200, name
        b_yaml = tmp_path / "tenants.d" / "b.yaml"
        b_yaml.write_text(b_yaml.read_text().replace("b.test", "c.test"))
        assert serve.reload(good) == "reloaded"
        assert "c.test" in {r["host"] for r in serve.status()["routes"]}
    finally:
        serve.stop()
        node.stop()


@pytest.mark.parametrize("case", ["nested", "dangling include"])
def test_serve_does_not_start_on_a_bad_config(tmp_path: Path, case: str) -> None:
    """`serve` on such a config exits 2 with the one line check-config prints."""
    main = tmp_path / "main.yaml"
    if case == "nested":
        main.write_text(BASE + "limits: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    else:
        main.write_text(INCLUDING)
        (tmp_path / "tenants.d").mkdir()
        (tmp_path / "tenants.d" / "a.yaml").symlink_to(tmp_path / "nowhere.yaml")
    result = subprocess.run([sys.executable, "-m", "pact_ingress", "serve", "-c", str(main)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and ERROR_LINE.fullmatch(lines[0]), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# --- NUL characters -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line"), [
    (BASE.replace("state_dir: state", 'state_dir: "st\\0ate"'), 1),
    (BASE + 'identity: {key: "id\\0.key"}\n', 5),
    (BASE.replace('tls: ["127.0.0.1:8443"]', 'tls: ["127.0.0.1:8443"]\n'
                  '  admin: "0.0.0.0:9180"\n  admin_token_file: "tok\\0en"'), 5),
    (BASE + 'state: {backend: redis, url: "redis://h/0", password_file: "p\\0w",\n'
            '        encryption_key_file: "k\\0ey"}\n', 5),
    (BASE + 'acme: {directory: "https://ca.example/dir", agree_tos: true,\n'
            '       email: "ops\\0@example.org"}\n', 6),
    (BASE + 'include: "tenants.d/\\0*.yaml"\n', 5),
    (BASE + f"""tenants:
  - name: a
    pins: ["{PIN_A}"]
    routes:
      - {{host: a.example, mode: terminate, backend: '127.0.0.1:1',
         cert: {{cert: "a\\0.crt", key: a.key}}}}
""", 10),
    (BASE + 'relay: {host: r.example, cert: {cert: r.crt, key: r.key}, store: "s\\0"}\n', 5),
])
def test_a_nul_in_a_value_is_an_error_at_its_line(tmp_path: Path, text: str,
                                                  line: int) -> None:
    """YAML's "\\0" escape puts a NUL into a string: as a path it made os.stat raise
    ValueError (a traceback from check-config and serve), and elsewhere it passed
    check-config unseen (an e-mail address, a cert path that then "does not exist
    yet")."""
    path = tmp_path / "nul.yaml"
    path.write_text(text)
    found = messages(path)
    at_line = [m for m in found if m.startswith(f"{path}:{line}: ") and "NUL" in m]
    assert at_line, found


# --- what serve would trip over at start, said by check-config ----------------------------


@pytest.mark.parametrize("case", ["state_dir-file", "state_dir-below-file", "identity-dir",
                                  "admin-too-long", "admin-not-socket"])
def test_what_serve_cannot_start_with_is_a_config_error_at_its_line(tmp_path: Path,
                                                                    case: str) -> None:
    """check-config said ok, then serve failed at start (exit 1 or 2 without a line):
    a state_dir that is a file or sits below one, an identity key that is a directory,
    an admin socket path longer than a unix socket address holds, or one naming
    something that is not a socket."""
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "adir").mkdir()
    listen = 'listen:\n  tls: ["127.0.0.1:8443"]\n'
    text, line = {
        "state_dir-file": ("state_dir: afile\n" + listen, 1),
        "state_dir-below-file": ("state_dir: afile/state\n" + listen, 1),
        "identity-dir": ("state_dir: state\n" + listen + "identity: {key: adir}\n", 4),
        "admin-too-long": ("state_dir: state\n" + listen
                           + f'  admin: "unix:/tmp/{"a" * 120}.sock"\n', 4),
        "admin-not-socket": ("state_dir: state\n" + listen + '  admin: "unix:afile"\n', 4),
    }[case]
    path = tmp_path / "main.yaml"
    path.write_text(text)
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:{line}: "), found


# --- IPv6 zones ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[fe80::1%lo]:443", "[fe80::1%1]:443"])
def test_a_link_local_address_may_name_its_interface(text: str) -> None:
    address = parse_address(text)
    assert address.host.startswith("fe80::1%") and address.port == 443


@pytest.mark.parametrize(("text", "why"), [
    ("[fe80::1%nosuchif0]:443", "no network interface"),
    ("[fe80::1%25lo]:443", "no network interface"),  # the URL spelling of %lo
    ("[fe80::1%999999]:443", "no network interface"),
    ("[2001:db8::1%lo]:443", "link-local"),
    ("[::1%lo]:443", "link-local"),
])
def test_a_zone_that_cannot_work_is_refused(tmp_path: Path, text: str, why: str) -> None:
    """A zone (`%IFACE`) was taken as part of any IPv6 address and only failed when the
    edge connected or bound: on an address that is not link-local, or naming an
    interface this machine does not have (the URL spelling %25 included)."""
    with pytest.raises(ValueError, match=why):
        parse_address(text)
    path = with_backend(tmp_path, text)
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:9: backend") and why in found[0]


# --- anchors and aliases ------------------------------------------------------------------


def test_an_alias_is_blamed_at_its_own_line(tmp_path: Path) -> None:
    """An alias is the anchored node itself in PyYAML's tree, so a tenant or route
    repeated through `*x` was reported at the anchor's line, as defined twice "also at"
    that same line. The complaint belongs where the alias is."""
    path = tmp_path / "alias.yaml"
    path.write_text(BASE + f"""tenants:
  - &t
    name: a
    pins: ["{PIN_A}"]
    routes:
      - &r {{host: a.example, mode: passthrough, backend: "127.0.0.1:1"}}
  - name: b
    pins: ["{PIN_B}"]
    routes:
      - *r
  - *t
""")
    routed = f"host 'a.example' is already routed by tenant 'a' (at {path}:10)"
    assert messages(path) == [
        f"{path}:14: {routed}; a host belongs to exactly one route",
        f"{path}:15: tenant 'a' is defined twice (also at {path}:7)",
        f"{path}:15: {routed}; a host belongs to exactly one route",
    ]


# --- line breaks only YAML sees -----------------------------------------------------------


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
def test_a_line_break_only_yaml_sees_is_refused_at_its_editor_line(tmp_path: Path,
                                                                   char: str) -> None:
    """YAML 1.1 takes U+2028, U+2029 and NEL for line breaks; editors and `grep -n` do
    not. One pasted into a comment ended the comment for YAML (its tail became a key)
    and moved every later line number by one. It is refused where an editor shows it."""
    path = tmp_path / "ls.yaml"
    path.write_text("state_dir: state\r\nlisten:  # from the wiki" + char + "page\n"
                    "  tls: ['127.0.0.1:1']\nbogus: 1\n", newline="")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:2: "), found
    assert f"U+{ord(char):04X}" in found[0], found


# --- YAML 1.1 reading words as booleans ---------------------------------------------------


@pytest.mark.parametrize(("name", "extra", "kind"), [
    ("on", "", "a boolean"),
    ("no", "", "a boolean"),
    ("1234", "", "an integer"),
    ("2026-12-01", "", "a timestamp"),
    ("a", "seal: off", "a boolean"),
    ("a", "client_cert: off", "a boolean"),
])
def test_a_word_yaml_reads_as_another_type_gets_a_hint_to_quote_it(
        tmp_path: Path, name: str, extra: str, kind: str) -> None:
    """YAML 1.1 reads a bare on/off/yes/no as a boolean, 1234 as a number and a date as
    a timestamp. "must be a string, got a boolean" left the operator to work out why
    `name: on` is not a string; the message says to quote it."""
    path = tmp_path / "words.yaml"
    path.write_text(BASE + f"""tenants:
  - name: {name}
    pins: ["{PIN_A}"]
    routes:
      - host: a.example
        mode: terminate
        backend: "127.0.0.1:1"
        cert: {{cert: c.crt, key: c.key}}
        {extra}
""")
    line, value = (13, extra.split(": ")[1]) if extra else (6, name)
    found = messages(path)
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}:{line}: ") and kind in found[0], found
    assert "quote" in found[0] and repr(value) in found[0], found


# --- what a message may carry to the terminal ---------------------------------------------


def test_a_path_with_control_characters_stays_one_printable_line(tmp_path: Path) -> None:
    """A double-quoted YAML path may hold "\\n" or "\\e": messages that quote the path
    as it is split one problem over two lines (the one-line-per-problem contract) and
    sent an escape sequence to the operator's terminal."""
    (tmp_path / "a\nb").mkdir()
    (tmp_path / "k\x1b[2J").mkdir()
    path = tmp_path / "main.yaml"
    path.write_text('state_dir: "a\\nb/s"\nlisten: {tls: ["127.0.0.1:1"]}\n'
                    'identity: {key: "k\\e[2J"}\n'
                    'state: {backend: redis, url: "redis://h/0",\n'
                    '        encryption_key_file: "x\\ny\\e[31m"}\n')
    result = check_config(path)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all(ERROR_LINE.fullmatch(line) for line in lines), lines
    assert all(line.isprintable() for line in lines), lines
    assert lines[0].startswith(f"{path}:3: ") and lines[1].startswith(f"{path}:5: "), lines


# --- the rest of the list: already right, kept right ---------------------------------------

ROUTE = "      - {host: HOST, mode: passthrough, backend: 'BACKEND'}\n"


def tenant_block(name: str, pin: str, *hosts: str, backend: str = "127.0.0.1:9000") -> str:
    routes = "".join(ROUTE.replace("HOST", h).replace("BACKEND", backend) for h in hosts)
    return f"  - name: {name}\n    pins: [\"{pin}\"]\n    routes:\n{routes}"


def tenant_file(name: str, pin: str, host: str) -> str:
    return (f"name: {name}\npins: [\"{pin}\"]\nroutes:\n"
            f"  - {{host: {host}, mode: passthrough, backend: '127.0.0.1:9000'}}\n")


SHAPES: list[tuple[str, bytes | str, dict[str, str], str, int, str]] = [
    # (id, main text, included files, file at fault, line, words in the message)
    ("duplicate-key", BASE + "state_dir: other\n", {}, "main.yaml", 5, "duplicate key"),
    ("merge-key", BASE + "<<: {state_dir: x}\n", {}, "main.yaml", 5, "merge keys"),
    ("python-tag", BASE + "tenants: !!python/object/apply:os.system ['true']\n", {},
     "main.yaml", 5, "tag"),
    ("python-tag-on-mapping", BASE + "state: !!python/object:x.Y {backend: local}\n", {},
     "main.yaml", 5, "tag"),
    ("set-tag", BASE + "limits: !!set {max_connections}\n", {}, "main.yaml", 5, "tag"),
    ("binary-tag", BASE.replace("state_dir: state", "state_dir: !!binary aGk="), {},
     "main.yaml", 1, "must be a string"),
    ("crlf", (BASE + "bogus: 1\n").replace("\n", "\r\n").encode(), {}, "main.yaml", 5,
     "unknown key 'bogus'"),
    ("bom", b"\xef\xbb\xbf" + (BASE + "bogus: 1\n").encode(), {}, "main.yaml", 5,
     "unknown key 'bogus'"),
    ("tab", BASE + "limits:\n\tidle_timeout: 5s\n", {}, "main.yaml", 6, "'\\t'"),
    ("not-utf8", BASE.encode() + b"# caf\xe9\n", {}, "main.yaml", 5, "not UTF-8"),
    ("nul-byte", BASE.encode() + b"x: \x00\n", {}, "main.yaml", 5, "#x0000"),
    ("empty", "", {}, "main.yaml", 1, "empty file"),
    ("only-comment", "# nothing yet\n", {}, "main.yaml", 1, "empty file"),
    ("top-list", "- a\n- b\n", {}, "main.yaml", 1, "must be a mapping, got a list"),
    ("top-scalar", "hello\n", {}, "main.yaml", 1, "must be a mapping, got a string"),
    ("two-documents", BASE + "---\nx: 1\n", {}, "main.yaml", 5, "single document"),
    ("seal-none", BASE + f"""tenants:
  - name: a
    pins: ["{PIN_A}"]
    routes:
      - host: a.example
        mode: terminate
        backend: "127.0.0.1:1"
        seal: none
""", {}, "main.yaml", 12, "seal: none is not allowed"),
    ("host-case-and-dot", BASE + "tenants:\n" + tenant_block("a", PIN_A, "a.example")
     + tenant_block("b", PIN_B, "A.Example."), {}, "main.yaml", 13, "already routed"),
    ("host-in-two-files", INCLUDING, {"tenants.d/a.yaml": tenant_file("a", PIN_A, "x.example"),
                                      "tenants.d/b.yaml": tenant_file("b", PIN_B, "X.EXAMPLE.")},
     "tenants.d/b.yaml", 4, "already routed by tenant 'a'"),
    ("name-in-two-files", INCLUDING, {"tenants.d/a.yaml": tenant_file("a", PIN_A, "x.example"),
                                      "tenants.d/b.yaml": tenant_file("a", PIN_B, "y.example")},
     "tenants.d/b.yaml", 1, "defined twice"),
    ("tenant-file-list", INCLUDING, {"tenants.d/a.yaml": "- name: a\n  pins: []\n"},
     "tenants.d/a.yaml", 1, "not a list"),
    ("tenant-file-two-docs", INCLUDING,
     {"tenants.d/a.yaml": tenant_file("a", PIN_A, "x.example") + "---\n"
      + tenant_file("b", PIN_B, "y.example")}, "tenants.d/a.yaml", 5, "single document"),
    ("tenant-file-crlf", INCLUDING,
     {"tenants.d/a.yaml": (tenant_file("a", PIN_A, "x.example") + "bogus: 1\n")
      .replace("\n", "\r\n")}, "tenants.d/a.yaml", 5, "unknown key 'bogus'"),
    ("pin-padding", BASE + "tenants:\n" + tenant_block("a", PIN_A + "=", "a.example"), {},
     "main.yaml", 7, "43 base64url"),
    ("pin-std-base64", BASE + "tenants:\n"
     + tenant_block("a", PIN_A.replace("-", "+").replace("_", "/"), "a.example"), {},
     "main.yaml", 7, "43 base64url"),
    ("backend-no-port", BASE + "tenants:\n" + tenant_block("a", PIN_A, "a.example",
                                                           backend="127.0.0.1"), {},
     "main.yaml", 9, "missing port"),
    ("backend-v6-bare", BASE + "tenants:\n" + tenant_block("a", PIN_A, "a.example",
                                                           backend="2001:db8::1:443"), {},
     "main.yaml", 9, "in brackets"),
    ("backend-port-0", BASE + "tenants:\n" + tenant_block("a", PIN_A, "a.example",
                                                          backend="a.example:0"), {},
     "main.yaml", 9, "1..65535"),
    ("backend-port-65536", BASE + "tenants:\n" + tenant_block("a", PIN_A, "a.example",
                                                              backend="[::1]:65536"), {},
     "main.yaml", 9, "1..65535"),
    ("wildcard-twice", BASE + "tenants:\n" + tenant_block("a", PIN_A, "'*.*.x'"), {},
     "main.yaml", 9, "whole first label"),
    ("wildcard-partial", BASE + "tenants:\n" + tenant_block("a", PIN_A, "'a*.x'"), {},
     "main.yaml", 9, "whole first label"),
    ("wildcard-alone", BASE + "tenants:\n" + tenant_block("a", PIN_A, "'*'"), {},
     "main.yaml", 9, "whole first label"),
    # a wildcard over a top-level domain would take every name under it that is not
    # routed elsewhere: a typo for `*.x.com`, never a wish
    ("wildcard-one-label", BASE + "tenants:\n" + tenant_block("a", PIN_A, "'*.com'"), {},
     "main.yaml", 9, "at least two labels"),
    ("wildcard-one-label-dot", BASE + "tenants:\n" + tenant_block("a", PIN_A, "'*.Test.'"),
     {}, "main.yaml", 9, "at least two labels"),
    ("unicode-host", BASE + "tenants:\n" + tenant_block("a", PIN_A, "bücher.example"), {},
     "main.yaml", 9, "punycode"),
    ("duration-inf", BASE + "limits: {idle_timeout: .inf}\n", {}, "main.yaml", 5,
     "greater than zero"),
    ("duration-nan", BASE + "limits: {idle_timeout: .nan}\n", {}, "main.yaml", 5,
     "greater than zero"),
    ("duration-1e999", BASE + "limits: {idle_timeout: 1e999}\n", {}, "main.yaml", 5,
     "bad duration"),
    ("duration-upper-S", BASE + "limits: {idle_timeout: 10S}\n", {}, "main.yaml", 5,
     "bad duration"),
    ("size-lower-mib", BASE + "limits: {max_body_bytes: 6mib}\n", {}, "main.yaml", 5,
     "bad size"),
    ("count-yes", BASE + "limits: {max_connections: yes}\n", {}, "main.yaml", 5,
     "got a boolean"),
    ("count-negative", BASE + "limits: {max_connections: -1}\n", {}, "main.yaml", 5,
     "at least 1"),
    ("count-hex-no-digits", BASE + "limits: {max_connections: 0x_}\n", {}, "main.yaml", 5,
     "no number"),  # PyYAML tags it an integer it cannot convert: was a traceback
]


@pytest.mark.parametrize(("main", "files", "where", "line", "words"),
                         [case[1:] for case in SHAPES], ids=[case[0] for case in SHAPES])
def test_each_bad_shape_is_refused_at_its_file_and_line(
        tmp_path: Path, main: bytes | str, files: dict[str, str], where: str, line: int,
        words: str) -> None:
    """What a careless operator writes, each refused at the file and line that hold it
    (the included file, not the main one), with a message that says what is wrong."""
    path = tmp_path / "main.yaml"
    path.write_bytes(main if isinstance(main, bytes) else main.encode())
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(text.encode())
    found = messages(path)
    assert any(m.startswith(f"{tmp_path / where}:{line}: ") and words in m
               for m in found), found


def test_each_bad_shape_is_one_line_per_problem_from_check_config(tmp_path: Path) -> None:
    """The same files through the real command: exit 2, FILE:LINE lines, no traceback
    (one process for several files, each checked in turn, keeps this fast)."""
    for name, main, files, *_ in SHAPES[:12]:
        case = tmp_path / name
        case.mkdir()
        (case / "main.yaml").write_bytes(main if isinstance(main, bytes) else main.encode())
        for file, text in files.items():
            (case / file).parent.mkdir(exist_ok=True)
            (case / file).write_text(text)
        assert refused(case / "main.yaml"), name


def test_the_line_that_ends_a_long_list_of_errors_has_a_line_too(tmp_path: Path) -> None:
    """At 100 errors the loader stops; that last line was `FILE: stopped after 100
    errors`, the one line of its output without a line number."""
    path = tmp_path / "many.yaml"
    path.write_text(BASE + "".join(f"k{i}: 1\n" for i in range(150)))
    lines = refused(path)
    assert len(lines) == 101 and "stopped after 100 errors" in lines[-1], lines[-2:]


def test_an_include_naming_one_file_needs_no_listing(tmp_path: Path) -> None:
    """`include: tenants.d/a.yaml` (no wildcard) reads that file; a directory the service
    may enter but not list is no obstacle to it, so it is no error either."""
    main = tmp_path / "main.yaml"
    main.write_text(BASE + "include: tenants.d/a.yaml\n")
    (tmp_path / "tenants.d").mkdir()
    (tmp_path / "tenants.d" / "a.yaml").write_text(TENANT.format(name="a", pin=PIN_A))
    (tmp_path / "tenants.d").chmod(0o311)
    try:
        result = subprocess.run([*as_ordinary_user(), sys.executable, "-m", "pact_ingress",
                                 "check-config", "-c", str(main)], capture_output=True,
                                text=True, timeout=60, check=False)
    finally:
        (tmp_path / "tenants.d").chmod(0o755)
    assert result.returncode == 0 and "(1 tenants, 1 routes)" in result.stdout, result


def test_agree_tos_quoted_says_why_it_is_not_true(tmp_path: Path) -> None:
    """`agree_tos: "true"` is a string, not YAML's true: refused (terms are agreed to
    explicitly), but "must be true" alone reads as nonsense next to "true"."""
    path = tmp_path / "tos.yaml"
    path.write_text(BASE + "acme: {directory: 'https://ca.example/d', agree_tos: 'true'}\n")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:5: acme.agree_tos"), found
    assert "string" in found[0] and "quotes" in found[0], found


def test_an_include_directory_that_is_a_dangling_symlink_is_an_error(tmp_path: Path) -> None:
    """tenants.d a symlink to a volume that is not mounted (yet): not the same as no
    tenants.d at all, which is fine. A reload then would drop every included tenant."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    (tmp_path / "tenants.d").symlink_to(tmp_path / "unmounted" / "tenants.d")
    lines = refused(main)
    assert len(lines) == 1 and lines[0].startswith(f"{main}:5: "), lines
    assert "tenants.d" in lines[0], lines


# --- files any local user may change ------------------------------------------------------


@pytest.mark.parametrize("what", ["main", "tenant-file", "tenant-dir", "connector"])
def test_a_config_any_local_user_may_change_is_refused(tmp_path: Path, what: str) -> None:
    """A config, a tenant file or the directory the include searches that every local
    user may write lets any of them reroute a tenant's traffic (or add a tenant) at the
    next reload, and the connector's `on_mail.command` would run whatever they write
    there. Refused like a key every user may read, naming the file (or the include)."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    tenants = tmp_path / "tenants.d"
    tenants.mkdir()
    (tenants / "a.yaml").write_text(TENANT.format(name="a", pin=PIN_A))
    if what == "connector":
        main.write_text(f"""identity: {{key: node.key}}
ingress: {{address: ingress.example, tunnel_hostname: tunnel.example, pin: "{PIN_B}"}}
forward: "127.0.0.1:8443"
on_mail: {{command: [/usr/bin/true]}}
""")
        main.chmod(0o666)
        with pytest.raises(ConfigError) as info:
            load_connector_config(main)
        found = info.value.messages
        assert len(found) == 1 and found[0].startswith(f"{main}:1: "), found
        assert "every user" in found[0], found
        return
    target, shown = {"main": (main, f"{main}:1: "),
                     "tenant-file": (tenants / "a.yaml", f"{tenants}/a.yaml:1: "),
                     "tenant-dir": (tenants, f"{main}:5: ")}[what]
    target.chmod(0o777 if target.is_dir() else 0o646)
    lines = refused(main)
    assert len(lines) == 1 and lines[0].startswith(shown), lines
    assert "every user" in lines[0], lines


def test_a_world_writable_directory_with_the_sticky_bit_is_still_refused(tmp_path: Path
                                                                         ) -> None:
    """The sticky bit stops users from replacing each other's files, not from adding
    new ones: a new tenants.d/x.yaml is a new tenant at the next reload."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    (tmp_path / "tenants.d").mkdir()
    (tmp_path / "tenants.d").chmod(0o1777)
    lines = refused(main)
    assert len(lines) == 1 and lines[0].startswith(f"{main}:5: "), lines


# --- the TSIG key file --------------------------------------------------------------------

TSIG_KEY = 'key "pact-acme" {\n\talgorithm hmac-sha256;\n\tsecret "c2VjcmV0c2VjcmV0c2VjcmV0";\n};\n'


def dns01_config(tmp_path: Path, key: str) -> Path:
    path = tmp_path / "dns.yaml"
    path.write_text(BASE + f"""acme:
  directory: https://ca.example/dir
  agree_tos: true
  challenges: [dns-01]
  dns01:
    server: "127.0.0.1:53"
    zone: example.
    tsig_key_file: {key}
""")
    return path


@pytest.mark.parametrize("kind", ["fifo", "device", "world-readable", "garbage", "huge"])
def test_a_tsig_key_file_that_cannot_be_used_is_an_error_at_its_line(tmp_path: Path,
                                                                     kind: str) -> None:
    """The TSIG key was read only when the certificate manager was updated, in the event
    loop, with a plain read: a pipe there held start and every reload for ever, a device
    was read without end, a key every user may read (it can change the zone, so obtain
    certificates for it) was taken, and garbage showed only at the first DNS-01 order.
    An existing file is now checked at load; one not there yet is fine (systemd's
    LoadCredential puts it there only for the service)."""
    key = tmp_path / "tsig.key"
    if kind == "fifo":
        os.mkfifo(key, 0o600)
    elif kind == "device":
        key.symlink_to("/dev/zero")
    else:
        key.write_text({"world-readable": TSIG_KEY, "garbage": "not a key\n",
                        "huge": TSIG_KEY + "#" * 10_000}[kind])
        key.chmod(0o644 if kind == "world-readable" else 0o600)
    found = messages(dns01_config(tmp_path, str(key)))
    assert len(found) == 1 and found[0].startswith(f"{tmp_path}/dns.yaml:12: "), found
    assert "tsig_key_file" in found[0], found


def test_a_tsig_key_file_not_there_yet_or_good_loads(tmp_path: Path) -> None:
    config = load_config(dns01_config(tmp_path, "/run/credentials/x.service/tsig.key"))
    assert config.acme is not None and config.acme.dns01 is not None
    key = tmp_path / "tsig.key"
    key.write_text(TSIG_KEY)
    key.chmod(0o600)
    assert load_config(dns01_config(tmp_path, str(key))).acme is not None


def test_reading_a_tsig_key_that_became_a_pipe_does_not_block(tmp_path: Path) -> None:
    """Swapped for a pipe after the config was checked: the solver's own read must not
    wait for a writer (it runs in the event loop)."""
    from pact_ingress.acme.dns01 import read_tsig_key
    from pact_ingress.errors import AcmeError

    key = tmp_path / "tsig.key"
    os.mkfifo(key, 0o600)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_tsig_key(key)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # let the blocked reader go, then fail
        os.close(os.open(key, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=10)
        pytest.fail("read_tsig_key blocked on a named pipe")
    assert len(outcome) == 1 and isinstance(outcome[0], AcmeError), outcome


#: Run in its own process: an audit hook, once added, stays for the process's life.
DNS01_LOOKUPS = """
import json, sys, threading
from pathlib import Path

lookups = []
def hook(event, args):
    if event == "socket.getaddrinfo" and args[0] == "localhost":
        lookups.append(threading.current_thread() is threading.main_thread())
sys.addaudithook(hook)

import trio
from pact_ingress.acme.dns01 import Dns01Solver
from pact_ingress.model import Address, Dns01

async def main():
    # what the certificate manager does at start and at each reload, on trio's thread
    solver = Dns01Solver(Dns01(Address("localhost", int(sys.argv[1])), "dns.test.",
                               Path(sys.argv[2])))
    made = list(lookups)
    # an order runs in a worker thread: that is where the name may be looked up
    await trio.to_thread.run_sync(solver.present, "x.dns.test", "made-in-a-thread")
    await trio.to_thread.run_sync(solver.cleanup, "x.dns.test", "made-in-a-thread")
    print(json.dumps({"while_made": made, "all": lookups}))

trio.run(main)
"""


def test_a_dns01_server_name_is_not_looked_up_in_the_event_loop(tmp_path: Path) -> None:
    """acme.dns01.server may be a name (nsupdate takes one too). Its lookup blocks: made
    where the manager builds the solver, at start and at every reload, it held the event
    loop and every connection with it for as long as the resolver took. The name is
    looked up where the order runs, in its worker thread, and an order still works."""
    from tests.acme_servers import Named

    named = Named(tmp_path / "named", "dns.test.", hosts=("x",)).start()
    try:
        result = subprocess.run([sys.executable, "-c", DNS01_LOOKUPS, str(named.port),
                                 str(named.key_file)], capture_output=True, text=True,
                                timeout=60, check=False)
    finally:
        named.stop()
    assert result.returncode == 0, result.stderr
    lookups = json.loads(result.stdout)
    assert lookups["while_made"] == [], lookups
    assert lookups["all"] and not any(lookups["all"]), lookups  # only in worker threads


@pytest.mark.parametrize("kind", ["dangling", "fifo", "garbage"])
def test_an_acme_ca_bundle_that_cannot_be_used_is_an_error_at_its_line(tmp_path: Path,
                                                                       kind: str) -> None:
    """check-config said ok to a CA bundle that is a symlink to nowhere, a pipe or holds
    no certificate; every order then failed against the CA, minutes later, in a log.
    (One not there at all may still appear before the first order: not refused.)"""
    bundle = tmp_path / "ca.pem"
    if kind == "dangling":
        bundle.symlink_to(tmp_path / "nowhere.pem")
    elif kind == "fifo":
        os.mkfifo(bundle)
    elif kind == "garbage":
        bundle.write_text("not a certificate\n")
    path = tmp_path / "ca.yaml"
    path.write_text(BASE + "acme: {directory: 'https://ca.example/d', agree_tos: true,\n"
                           f"       ca_bundle: {bundle}}}\n")
    found = messages(path)
    assert len(found) == 1 and found[0].startswith(f"{path}:6: acme.ca_bundle"), found


def test_tenant_add_at_umask_0_writes_what_check_config_accepts(tmp_path: Path) -> None:
    """`tenant add` creates tenants.d; at umask 0 it came out writable by every user,
    which the include check (rightly) refuses at the next reload."""
    main = tmp_path / "main.yaml"
    main.write_text(INCLUDING)
    main.chmod(0o644)
    added = subprocess.run(
        [sys.executable, "-m", "pact_ingress", "tenant", "add", "bob", "--host", "bob.example",
         "--pin", PIN_B, "--backend", "127.0.0.1:9000", "-c", str(main)],
        capture_output=True, text=True, timeout=60, check=False,
        preexec_fn=lambda: os.umask(0))
    assert added.returncode == 0, added.stderr
    assert not (tmp_path / "tenants.d").stat().st_mode & 0o002
    result = check_config(main)
    assert result.returncode == 0 and "(1 tenants, 1 routes)" in result.stdout, result
