"""The operator's side of a home node attacked: `tenant add|remove`, `keygen`,
`fingerprint` and `connect` run as real processes on real files (and, for `connect`, a
real `serve` on loopback). What must hold whatever was tried: an expected failure is one
line on stderr with exit 2 (usage/config) or 1 (runtime) and never a traceback; nothing
the operator already had is overwritten without being asked; what `tenant add` leaves
behind is a config `serve` accepts; `connect` ends with 0 on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from pact_ingress.config import load_config
from pact_ingress.errors import PactIngressError
from pact_ingress.identity import b64url, keygen
from pact_ingress.tenants import add_tenant
from tests.cluster_env import serve_until_ready
from tests.netutil import free_port

PIN_A = "sha256:VMQn-nYYNbmhJNvkkNZO4_43tC4046AWxSTgnb8G3eY"
PIN_B = "sha256:x793VWsYDT8xeunXBhFx6_D5dIsCXFH2LhqWH_5t0o4"
LOOPBACK = "127.0.0.1"
TUNNEL = "tunnel.home.test"
WAIT = 20.0

MAIN = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:443"]
tunnel: {{hostname: {TUNNEL}}}
include: tenants.d/*.yaml
tenants:
  - name: alina
    pins: ["{PIN_A}"]
    routes:
      - {{host: alina.home.test, mode: passthrough, backend: tunnel}}
"""


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pact_ingress", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def one_line_failure(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The failure is `code` with exactly one stderr line and no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.fixture
def main(tmp_path: Path) -> Path:
    path = tmp_path / "etc" / "ingress.yaml"
    path.parent.mkdir()
    path.write_text(MAIN)
    return path


def pin_of(seed: str) -> str:
    """A well-formed pin of no real key (the config needs one pin per tunnel node)."""
    return "sha256:" + b64url(hashlib.sha256(seed.encode()).digest())


def add(main: Path, name: str, host: str, *extra: str,
        pin: str = PIN_B) -> subprocess.CompletedProcess[str]:
    return run("tenant", "add", name, "--host", host, "--pin", pin, *extra, "-c", str(main))


# --- tenant add ------------------------------------------------------------------------


def test_an_overlong_tenant_name_is_one_usage_line(main: Path) -> None:
    """A name longer than a file name can be (the loader caps names at 63 characters)
    is a usage error like any other bad name, not an OSError from the file system."""
    (main.parent / "tenants.d").mkdir()
    for name in ("a" * 64, "a" * 300):
        err = one_line_failure(add(main, name, "x.home.test"), 2)
        assert "63" in err
    assert not list((main.parent / "tenants.d").iterdir())


def test_a_tenants_d_that_is_a_file_or_cannot_be_written_is_one_line(main: Path) -> None:
    tenants_d = main.parent / "tenants.d"
    tenants_d.write_text("not a directory\n")
    err = one_line_failure(add(main, "bob", "bob.home.test"), 1)
    assert "tenants.d" in err
    assert tenants_d.read_text() == "not a directory\n"
    tenants_d.unlink()
    # a directory nobody (root included) can create files in
    tenants_d.symlink_to("/proc")
    err = one_line_failure(add(main, "bob", "bob.home.test"), 1)
    assert "bob.yaml" in err
    assert run("check-config", "-c", str(main)).returncode == 0


def test_an_ingress_key_that_cannot_be_created_is_one_line_and_writes_nothing(
        main: Path) -> None:
    main.write_text(MAIN.replace("state_dir: state", "state_dir: /proc/no-state"))
    err = one_line_failure(add(main, "bob", "bob.home.test"), 1)
    assert "identity.key" in err
    assert not (main.parent / "tenants.d").exists()  # no tenant without the ingress pin


def test_concurrent_adds_cannot_route_one_host_twice(main: Path) -> None:
    """Adds race between validating and writing: however they interleave, at most one
    tenant gets the host and the config stays loadable."""
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pact_ingress", "tenant", "add", f"racer{i}", "--host",
         "race.home.test", "--pin", PIN_B, "-c", str(main)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(6)]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.stderr.close()  # type: ignore[union-attr]
    check = run("check-config", "-c", str(main))
    assert check.returncode == 0, (check.stderr, results)
    assert [code for code, _ in results].count(0) == 1, results
    for code, err in results:
        assert code in (0, 2) and "Traceback" not in err, err
    owners = [t.name for t in load_config(main).tenants
              if any(r.host == "race.home.test" for r in t.routes)]
    assert len(owners) == 1


def test_concurrent_adds_in_one_process_cannot_route_one_host_twice(main: Path) -> None:
    """The same race made likely: threads released together, each add's fsync letting
    the others validate meanwhile. Several rounds, each on a host of its own."""
    for round_ in range(4):
        host = f"race{round_}.home.test"
        barrier = threading.Barrier(6)
        outcomes: list[str] = []

        def racer(i: int, host: str = host, barrier: threading.Barrier = barrier,
                  round_: int = round_, outcomes: list[str] = outcomes) -> None:
            barrier.wait()
            try:
                add_tenant(main, f"r{round_}-{i}", host, pin=pin_of(f"node {round_}"))
                outcomes.append("added")
            except PactIngressError as exc:
                outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        config = load_config(main)  # raises if two tenants route the host
        assert outcomes.count("added") == 1, outcomes
        assert sum(r.host == host for t in config.tenants for r in t.routes) == 1


def test_another_tenants_tunnel_pin_is_refused(main: Path) -> None:
    """A connector key pinned by two tenants is refused by the ingress (ambiguous), so
    giving a new tenant alina's pin would cut alina's tunnel off at the next reload."""
    err = one_line_failure(add(main, "bob", "bob.home.test", pin=PIN_A), 2)
    assert "alina" in err
    err = one_line_failure(add(main, "bob", "bob.home.test", "--backend", "192.0.2.7:443",
                               pin=PIN_A), 2)
    assert "alina" in err
    assert not (main.parent / "tenants.d" / "bob.yaml").exists()
    assert [t.name for t in load_config(main).tenants] == ["alina"]


def as_ordinary_user() -> list[str]:
    """A command prefix under which file modes hold: root writes into any directory, so as
    root the process gives up the capabilities that let it (and the test fails, never
    skips, without setpriv)."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    return [shutil.which("setpriv") or "setpriv", f"--inh-caps={caps}",
            f"--bounding-set={caps}"]


def test_a_tenant_file_that_cannot_be_deleted_is_a_runtime_failure(main: Path) -> None:
    """The command was right and the tenant exists; the file system said no (a read-only
    tenants.d). That is exit 1, a runtime failure, not 2, which tells the operator the
    command or the config is wrong."""
    add_tenant(main, "bob", "bob.home.test", pin=PIN_B)
    tenants_d = main.parent / "tenants.d"
    tenants_d.chmod(0o555)
    try:
        result = subprocess.run([*as_ordinary_user(), sys.executable, "-m", "pact_ingress",
                                 "tenant", "remove", "bob", "-c", str(main)],
                                capture_output=True, text=True, timeout=60, check=False)
    finally:
        tenants_d.chmod(0o755)
    err = one_line_failure(result, 1)
    assert "bob.yaml" in err and "cannot remove" in err, err
    assert (tenants_d / "bob.yaml").exists()
    one_line_failure(run("tenant", "remove", "zed", "-c", str(main)), 2)  # no such tenant


def test_a_wildcard_over_a_top_level_domain_is_a_usage_error(main: Path) -> None:
    """`--host '*.test'` would route every unrouted name under a whole top-level domain
    to one tenant: refused like the loader refuses it, and nothing is written."""
    for host in ("*.test", "*.COM."):
        with pytest.raises(PactIngressError) as info:
            add_tenant(main, "bob", host, pin=PIN_B)
        assert info.value.exit_code == 2 and "at least two labels" in str(info.value)
    assert not (main.parent / "tenants.d").exists()
    add_tenant(main, "bob", "*.bob.test", pin=PIN_B)  # two labels below the star: fine


def test_directories_made_under_a_lax_umask_are_not_world_writable(main: Path,
                                                                     tmp_path: Path) -> None:
    """Under umask 000 (a service manager's or a container's) the directories the CLI
    creates must still not let every user drop a tenant file (a route and a pin of their
    choosing at the next reload) or swap a key."""
    def lax(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pact_ingress", *args],
                              capture_output=True, text=True, timeout=60, check=False,
                              preexec_fn=lambda: os.umask(0))

    result = lax("tenant", "add", "bob", "--host", "bob.home.test", "--pin", PIN_B,
                 "-c", str(main))
    assert result.returncode == 0, result.stderr
    result = lax("keygen", "-o", str(tmp_path / "new" / "node.key"))
    assert result.returncode == 0, result.stderr
    for directory in (main.parent / "tenants.d", main.parent / "state", tmp_path / "new"):
        assert os.stat(directory).st_mode & 0o022 == 0, oct(os.stat(directory).st_mode)
    assert stat.S_IMODE(os.stat(main.parent / "tenants.d" / "bob.yaml").st_mode) == 0o644
    for key in (main.parent / "state" / "identity.key", tmp_path / "new" / "node.key"):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600


def test_the_printed_connector_config_brings_the_tunnel_up(tmp_path: Path) -> None:
    """`tenant add` prints the home node's connector config: saved as printed (only the
    key path and the forward target are the node's to fill in), `connect` accepts it and
    the ingress, started on the written tenant file, takes the tunnel."""
    port = free_port()
    node = keygen(tmp_path / "node" / "node.key")
    main = tmp_path / "etc" / "ingress.yaml"
    main.parent.mkdir()
    main.write_text(f"""\
state_dir: state
listen:
  tls: ["{LOOPBACK}:{port}"]
tunnel: {{hostname: {TUNNEL}}}
include: tenants.d/*.yaml
""")
    added = add(main, "bob", "bob.home.test", pin=node.fingerprint)
    assert added.returncode == 0, added.stderr
    lines = added.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("connector config"))
    block = []
    for line in lines[start + 1:]:
        if line and not line.startswith("  "):
            break
        block.append(line[2:])
    printed = "\n".join(block)
    ingress_pin = (main.parent / "state" / "identity.key")
    assert run("fingerprint", str(ingress_pin)).stdout.strip() in printed
    connector = tmp_path / "node" / "connector.yaml"
    connector.write_text(printed.replace("/var/lib/pact/node.key", str(node.key_path)))
    log_path = tmp_path / "connect.log"
    with open(tmp_path / "serve.log", "ab") as serve_log, open(log_path, "ab") as log:
        serve, ready = serve_until_ready(tmp_path, main, ["--workers", "1"], serve_log)
        proc = subprocess.Popen([sys.executable, "-m", "pact_ingress", "connect", "-c",
                                 str(connector)], stdout=log, stderr=subprocess.STDOUT)
        try:
            assert ready, (tmp_path / "serve.log").read_text()
            deadline = time.monotonic() + WAIT
            while not events(log_path.read_text(), "tunnel_up"):
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=WAIT) == 0, log_path.read_text()
        finally:
            for p in (proc, serve):
                if p.poll() is None:
                    p.kill()
                    p.wait()


# --- keygen ----------------------------------------------------------------------------


def test_keygen_does_not_overwrite_a_certificate_beside_the_key(tmp_path: Path) -> None:
    """`-o node.key` also writes node.crt; a node.crt already there (the node's own
    certificate) is not replaced without --force, and nothing is written at all."""
    cert = tmp_path / "node.crt"
    cert.write_text("the node's certificate\n")
    err = one_line_failure(run("keygen", "-o", str(tmp_path / "node.key")), 1)
    assert "node.crt" in err and "--force" in err
    assert cert.read_text() == "the node's certificate\n"
    assert not (tmp_path / "node.key").exists()
    forced = run("keygen", "-o", str(tmp_path / "node.key"), "--force")
    assert forced.returncode == 0, forced.stderr
    assert run("fingerprint", str(cert)).stdout == forced.stdout


def test_keygen_onto_a_directory_or_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    one_line_failure(run("keygen", "-o", str(tmp_path / "d"), "--force"), 1)
    assert (tmp_path / "d").is_dir() and not list((tmp_path / "d").iterdir())
    one_line_failure(run("keygen", "-o", "/proc/node.key"), 1)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temp files left behind


# --- connect ---------------------------------------------------------------------------


CONNECTOR = """\
identity: {{key: {key}}}
ingress:
  address: "127.0.0.1:{port}"
  tunnel_hostname: {tunnel}
  pin: "{pin}"
forward: "127.0.0.1:{forward}"
connections: 1
"""


def test_connect_with_an_unreadable_key_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "connector.yaml"
    for content in (None, "garbage\n"):
        key = tmp_path / "node.key"
        if content is not None:
            key.write_text(content)
            key.chmod(0o600)
        config.write_text(CONNECTOR.format(key=key, port=free_port(), tunnel=TUNNEL, pin=PIN_A,
                                           forward=free_port()))
        err = one_line_failure(run("connect", "-c", str(config), timeout=20), 1)
        assert str(key) in err


class Edge:
    """A real `serve` with one passthrough tunnel tenant, its `connect`, and a forward
    target that accepts and holds connections."""

    def __init__(self, tmp: Path, ingress_pin: str | None = None) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.ingress = keygen(tmp / "ingress.key", common_name="ingress")
        self.node = keygen(tmp / "node.key", common_name="node")
        self.forward = socket.create_server((LOOPBACK, 0))
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()
        self.config = tmp / "ingress.yaml"
        self.config.write_text(f"""\
identity: {{key: ingress.key}}
state_dir: state
listen:
  tls: ["{LOOPBACK}:{self.port}"]
tunnel: {{hostname: {TUNNEL}}}
tenants:
  - name: home
    pins: ["{self.node.fingerprint}"]
    routes:
      - {{host: home.home.test, mode: passthrough, backend: tunnel}}
""")
        self.serve_log: IO[bytes] = open(tmp / "serve.log", "ab")  # noqa: SIM115 - close()
        self.serve, ready = serve_until_ready(tmp, self.config, ["--workers", "1"],
                                              self.serve_log)
        assert ready, (tmp / "serve.log").read_text()
        self.connector_config = tmp / "connector.yaml"
        self.connector_config.write_text(CONNECTOR.format(
            key=self.node.key_path, port=self.port, tunnel=TUNNEL,
            pin=ingress_pin or self.ingress.fingerprint,
            forward=self.forward.getsockname()[1]))
        self.connect_log_path = tmp / "connect.log"
        self.connect_log: IO[bytes] = open(self.connect_log_path, "ab")  # noqa: SIM115
        self.connect = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "connect", "-c", str(self.connector_config)],
            stdout=self.connect_log, stderr=subprocess.STDOUT)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.forward.accept()
            except OSError:
                return
            self.held.append(sock)

    def connect_logs(self) -> str:
        self.connect_log.flush()
        return self.connect_log_path.read_text(errors="replace")

    def wait_log(self, needle: str) -> None:
        deadline = time.monotonic() + WAIT
        while needle not in self.connect_logs():
            assert self.connect.poll() is None, self.connect_logs()
            assert time.monotonic() < deadline, f"no {needle!r}:\n{self.connect_logs()}"
            time.sleep(0.05)

    def close(self) -> None:
        for proc in (self.connect, self.serve):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            self.forward.shutdown(socket.SHUT_RDWR)
        self.forward.close()
        for sock in self.held:
            sock.close()
        self.serve_log.close()
        self.connect_log.close()


@pytest.fixture
def edge(tmp_path: Path) -> Iterator[Edge]:
    e = Edge(tmp_path)
    try:
        yield e
    finally:
        e.close()


def client_hello(host: str) -> bytes:
    """A real ClientHello naming `host`, as a caller's TLS stack sends it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=host)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("second", ["SIGHUP", "SIGTERM", "SIGINT"])
def test_signals_while_draining_do_not_kill_the_connector(edge: Edge, second: str) -> None:
    """SIGHUP is documented as harmless for `connect` (it logs that a restart applies a
    changed config), and a second stop signal asks for the stop already under way (as
    for `serve`): both must hold while SIGTERM's drain waits for a stream, or a stray
    signal turns a clean stop into death by signal."""
    edge.wait_log("tunnel_up")
    caller = socket.create_connection((LOOPBACK, edge.port), timeout=10)
    try:
        caller.sendall(client_hello("home.home.test"))
        deadline = time.monotonic() + WAIT
        while not edge.held:  # the stream reached the node through the tunnel
            assert time.monotonic() < deadline, edge.connect_logs()
            time.sleep(0.02)
        edge.connect.send_signal(signal.SIGTERM)
        edge.wait_log("connector_draining")
        edge.connect.send_signal(getattr(signal, second))
        edge.wait_log("connector_draining")  # still alive to read its log: not yet proof
    finally:
        caller.close()
        for sock in edge.held:
            sock.close()
    assert edge.connect.wait(timeout=WAIT) == 0, edge.connect_logs()
    assert "Traceback" not in edge.connect_logs()


def test_connect_with_the_ingress_down_at_start_retries_then_stops_with_0(
        tmp_path: Path) -> None:
    key = keygen(tmp_path / "node.key")
    config = tmp_path / "connector.yaml"
    config.write_text(CONNECTOR.format(key=key.key_path, port=free_port(), tunnel=TUNNEL,
                                       pin=PIN_A, forward=free_port()))
    log = tmp_path / "connect.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pact_ingress", "connect", "-c",
                                 str(config)], stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + WAIT
            while log.read_text().count("tunnel_reconnect") < 3:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=WAIT) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    delays = [json.loads(line)["delay_s"] for line in log.read_text().splitlines()
              if "tunnel_reconnect" in line]
    assert delays[0] >= 0.25 and delays[-1] > delays[0], delays  # backs off, never spins
    assert "Traceback" not in log.read_text()


def test_a_read_only_key_directory_leaves_no_certificate_behind(tmp_path: Path,
                                                                main: Path) -> None:
    """A key in a read-only directory (a systemd credential, a read-only mount) with no
    certificate beside it: the certificate made from it goes to a private temporary
    file. `tenant add` needs only the key's fingerprint, and `connect` needs the file
    while it runs; neither may leave one behind in the temporary directory, where every
    start added another."""
    private = tmp_path / "tmpdir"
    private.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RUNTIME_DIRECTORY"}
    env["TMPDIR"] = str(private)
    state = main.parent / "state"
    keygen(state / "identity.key").cert_path.unlink()
    home = tmp_path / "home"
    node = keygen(home / "node.key")
    node.cert_path.unlink()
    config = tmp_path / "connector.yaml"
    config.write_text(CONNECTOR.format(key=node.key_path, port=free_port(), tunnel=TUNNEL,
                                       pin=PIN_A, forward=free_port()))
    log = tmp_path / "connect.log"
    state.chmod(0o555)
    home.chmod(0o555)
    try:
        added = subprocess.run([*as_ordinary_user(), sys.executable, "-m", "pact_ingress",
                                "tenant", "add", "bob", "--host", "bob.home.test", "--pin",
                                PIN_B, "-c", str(main)], env=env, capture_output=True,
                               text=True, timeout=60, check=False)
        assert added.returncode == 0, added.stderr
        assert list(private.iterdir()) == []
        with open(log, "ab") as out:
            proc = subprocess.Popen([*as_ordinary_user(), sys.executable, "-m",
                                     "pact_ingress", "connect", "-c", str(config)],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + WAIT
                while "tunnel_reconnect" not in log.read_text():
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.05)
                assert len(list(private.iterdir())) == 1  # the one it runs with
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=WAIT) == 0, log.read_text()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        state.chmod(0o755)
        home.chmod(0o755)
    assert list(private.iterdir()) == []
    assert not node.cert_path.exists() and not (state / "identity.crt").exists()


def events(text: str, name: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == name:
            out.append(doc)
    return out


def test_an_ingress_with_another_key_is_refused_and_retried_with_backoff(
        tmp_path: Path) -> None:
    """The connector pins the ingress: one whose key differs gets no HELLO, the log says
    which fingerprint was expected and which was seen, and the slot keeps retrying,
    further apart each time, until SIGTERM ends it with 0."""
    e = Edge(tmp_path, ingress_pin=PIN_A)
    try:
        deadline = time.monotonic() + WAIT
        while len(events(e.connect_logs(), "tunnel_reconnect")) < 3:
            assert e.connect.poll() is None, e.connect_logs()
            assert time.monotonic() < deadline, e.connect_logs()
            time.sleep(0.05)
        mismatches = events(e.connect_logs(), "ingress_pin_mismatch")
        assert mismatches, e.connect_logs()
        assert all(m["expected"] == [PIN_A] and m["seen"] == e.ingress.fingerprint
                   for m in mismatches)
        assert "tunnel_up" not in e.connect_logs()
        delays = [float(d["delay_s"]) for d in events(e.connect_logs(), "tunnel_reconnect")
                  if d["slot"] == 0]  # type: ignore[arg-type]
        assert len(delays) >= 2 and delays[-1] > delays[0], delays
        e.connect.send_signal(signal.SIGTERM)
        assert e.connect.wait(timeout=WAIT) == 0, e.connect_logs()
        assert "Traceback" not in e.connect_logs()
    finally:
        e.close()


def test_a_forward_target_that_is_down_fails_the_stream_not_the_tunnel(edge: Edge) -> None:
    """Requests arriving while the home node's endpoint is down end at once; the tunnel
    stays and the next request, once the endpoint is back, reaches it."""
    edge.wait_log("tunnel_up")
    port = edge.forward.getsockname()[1]
    # the home node's TLS endpoint goes away (shutdown first: a listener closed while a
    # thread waits in accept() would go on accepting)
    edge.forward.shutdown(socket.SHUT_RDWR)
    edge.forward.close()
    for _ in range(3):
        with socket.create_connection((LOOPBACK, edge.port), timeout=10) as caller:
            caller.sendall(client_hello("home.home.test"))
            caller.settimeout(10)
            while caller.recv(4096):  # ends: an alert or EOF, never a hang
                pass
    edge.wait_log("forward_unreachable")
    edge.forward = socket.create_server((LOOPBACK, port))  # back
    threading.Thread(target=edge._accept, daemon=True).start()
    with socket.create_connection((LOOPBACK, edge.port), timeout=10) as caller:
        caller.sendall(client_hello("home.home.test"))
        deadline = time.monotonic() + WAIT
        while not edge.held:
            assert time.monotonic() < deadline, edge.connect_logs()
            time.sleep(0.02)
    assert edge.connect.poll() is None
    assert events(edge.connect_logs(), "tunnel_up") and not events(
        edge.connect_logs(), "tunnel_down"), edge.connect_logs()
    edge.connect.send_signal(signal.SIGINT)
    for sock in edge.held:
        sock.close()
    assert edge.connect.wait(timeout=WAIT) == 0, edge.connect_logs()
    assert "Traceback" not in edge.connect_logs()
