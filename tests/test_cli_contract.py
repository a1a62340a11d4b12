"""The `certs` commands as an operator runs them: real subprocesses, a real `serve`.

* `certs list` is the offline inventory of every certificate the ingress serves: the
  relay host's certificate expires like any terminate route's, so it has a row too.
* `certs list HOST` lists that host alone; a HOST the ingress holds no certificate for
  is a usage error (2), not ignored.
* `tenant list NAME` likewise lists that tenant alone, and an unknown NAME is exit 2.
* A `certs renew` the running instance refuses is one line on stderr that names why,
  and exit 1; nothing of it lands on stdout, where a script reads what was renewed. A
  `certs renew` of every host where no host has `cert: acme` renews nothing and says so
  the same way, rather than `renewed`.
* `demo` whose loopback port is taken is one line on stderr and exit 1, as `serve` is:
  the cause comes out of the demo's nursery wrapped in an exception group.
* `relay purge --recipient` with something that is not a pin is a usage error (2): it
  would match no queue, and "purged 0" would read as done.
* The defaults the configuration reference promises are the numbers a config that
  names none of them gets (elsewhere they are only compared with the model's own).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pact_ingress.config import load_config
from pact_ingress.config.loader import load_connector_config
from pact_ingress.identity import ensure_selfsigned_cert
from tests.netutil import free_port
from tests.terminate_env import json_events

LOOPBACK = "127.0.0.1"
WAIT = 20.0
PIN = "sha256:" + "A" * 43


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    return env


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pact_ingress", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env=_env(), check=False)


def write_config(tmp: Path, admin_port: int | None = None) -> Path:
    """A terminate route and the relay host, each with its own self-signed files."""
    for host in ("mcp.contract.test", "relay.contract.test"):
        ensure_selfsigned_cert(host, tmp / f"{host}.crt", tmp / f"{host}.key")
    admin = f'  admin: "{LOOPBACK}:{admin_port}"\n' if admin_port else ""
    config = tmp / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen:
  tls: ["{LOOPBACK}:{free_port()}"]
{admin}relay:
  host: relay.contract.test
  cert: {{cert: relay.contract.test.crt, key: relay.contract.test.key}}
tenants:
  - name: contract
    pins: ["{PIN}"]
    relay: true
    routes:
      - host: mcp.contract.test
        mode: terminate
        backend: "{LOOPBACK}:9"
        cert: {{cert: mcp.contract.test.crt, key: mcp.contract.test.key}}
""")
    return config


def test_certs_list_has_a_row_for_the_relay_host(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result = run_cli(tmp_path, "certs", "list", "-c", str(config))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"mcp.contract.test", "relay.contract.test"}, result.stdout
    relay = rows["relay.contract.test"]
    assert " file " in relay and "CN=relay.contract.test" in relay and "UTC" in relay


def test_certs_list_of_one_host(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    result = run_cli(tmp_path, "certs", "list", "relay.contract.test", "-c", str(config))
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == [
        "relay.contract.test"], result.stdout
    result = run_cli(tmp_path, "certs", "list", "other.contract.test", "-c", str(config))
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and "other.contract.test" in result.stderr


def test_tenant_list_of_one_tenant(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    with config.open("a") as f:
        f.write(f"  - {{name: other, pins: ['sha256:{'B' * 42}A'], routes: []}}\n")
    result = run_cli(tmp_path, "tenant", "list", "other", "-c", str(config))
    assert result.returncode == 0, result.stderr
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == ["other"]
    result = run_cli(tmp_path, "tenant", "list", "nobody", "-c", str(config))
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and "nobody" in result.stderr


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Path]:
    config = write_config(tmp_path, admin_port=free_port())
    log_path = tmp_path / "serve.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config),
             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=_env(),
            cwd=tmp_path)
        try:
            deadline = time.monotonic() + WAIT
            while not any(e.get("event") == "serving"
                          for e in json_events(log_path.read_text(errors="replace"))):
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "serve never logged serving"
                time.sleep(0.05)
            yield config
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_certs_renew_refused_is_one_stderr_line_naming_why(serve: Path) -> None:
    result = run_cli(serve.parent, "certs", "renew", "mcp.contract.test", "-c", str(serve))
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pact-ingress:")]
    assert len(errors) == 1, result.stderr
    assert "mcp.contract.test" in errors[0] and "certificate files" in errors[0], errors


def test_documented_defaults(tmp_path: Path) -> None:
    config = tmp_path / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen: {{tls: ["{LOOPBACK}:8443"]}}
tunnel: {{hostname: tunnel.contract.test}}
acme: {{directory: "https://ca.contract.test/dir", agree_tos: true}}
relay: {{host: relay.contract.test, cert: acme}}
tenants:
  - name: contract
    pins: ["{PIN}"]
    routes:
      - {{host: pass.contract.test, mode: passthrough, backend: tunnel}}
      - {{host: mcp.contract.test, mode: terminate, backend: tunnel}}
""")
    loaded = load_config(config)
    limits = loaded.limits
    assert (limits.clienthello_timeout, limits.idle_timeout) == (10.0, 300.0)
    assert (limits.max_connections, limits.max_connections_per_ip) == (20000, 200)
    assert (limits.calls_per_hour_per_ip_key, limits.calls_per_hour_per_ip) == (600, 3000)
    assert limits.max_body_bytes == 6 * 1024 * 1024
    assert limits.max_requests_in_flight_per_ip == 16
    assert limits.client_write_timeout == 30.0
    assert loaded.acme is not None and loaded.acme.challenges == ("tls-alpn-01", "http-01")
    routes = {r.host: r for r in loaded.routes()}
    assert (routes["pass.contract.test"].proxy_protocol,
            routes["pass.contract.test"].client_cert) == ("off", "none")
    term = routes["mcp.contract.test"]
    assert (term.seal, term.mcp_path, term.cert) == ("required", "/mcp", "acme")
    relay = loaded.relay
    assert relay is not None and relay.cert == "acme"
    assert (relay.store, relay.max_items, relay.max_bytes) == (
        tmp_path / "state/relay.sqlite", 10_000, 256 * 1024 * 1024)
    assert loaded.state.backend == "local"

    connector = tmp_path / "connector.yaml"
    connector.write_text(f"""\
identity: {{key: node.key}}
ingress: {{address: ingress.contract.test, tunnel_hostname: tunnel.contract.test,
          pin: "{PIN}"}}
forward: "{LOOPBACK}:8443"
""")
    home = load_connector_config(connector)
    assert (home.ingress.port, home.connections, home.data_transport) == (443, 2, "auto")
    assert home.on_mail is None


def _free_block(size: int) -> int:
    """The first of `size` consecutive loopback ports that are free right now."""
    for _ in range(50):  # bounded
        first = free_port()
        try:
            for port in range(first, first + size):
                with socket.socket() as s:
                    s.bind((LOOPBACK, port))
        except OSError:
            continue
        return first
    raise AssertionError("no block of free loopback ports")


@pytest.mark.parametrize("taken", [0, 2], ids=["ingress_port", "node_port"])
def test_demo_on_a_taken_port_is_one_line(tmp_path: Path, taken: int) -> None:
    from pact_ingress.demo import PORTS

    first = _free_block(PORTS)
    with socket.create_server((LOOPBACK, first + taken)):
        result = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "demo", "--port", str(first)],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**_env(), "TMPDIR": str(tmp_path)}, check=False)  # its state dir lands here
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("pact-ingress:")]
    assert len(errors) == 1 and str(first + taken) in errors[0], result.stderr[-3000:]


def test_relay_purge_of_a_mistyped_pin_is_a_usage_error(tmp_path: Path) -> None:
    from pact_ingress.relay.store import _open

    config = write_config(tmp_path)
    _open(tmp_path / "state/relay.sqlite").close()  # an empty store, as serve leaves it
    result = run_cli(tmp_path, "relay", "purge", "--all", "--recipient", PIN[:-1], "-c",
                     str(config))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and PIN[:-1] in result.stderr, result.stderr


def test_certs_renew_of_every_host_with_none_managed_says_so(serve: Path) -> None:
    result = run_cli(serve.parent, "certs", "renew", "-c", str(serve))
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pact-ingress:")]
    assert len(errors) == 1 and "cert: acme" in errors[0], result.stderr
