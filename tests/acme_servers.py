"""Real ACME and DNS servers for the ACME tests, as subprocesses on loopback.

- `Pebble`: Debian's `pebble` (RFC 8555 test CA) with our own localhost API certificate
  (Debian ships no test/certs), validating challenges on the ports we choose.
- `ChallTestSrv`: `pebble-challtestsrv` as pebble's DNS resolver only (every A query →
  127.0.0.1); its HTTP/TLS challenge responders are disabled: our code answers those.
- `Named`: bind9 `named`, unprivileged-style on a free loopback port, authoritative for one
  zone with a TSIG key allowed to update TXT records (RFC 2136), A records → 127.0.0.1.

Each server gets its own temp directory with generated configs and keys, is waited for
until it answers (bounded), and is stopped with SIGTERM (then SIGKILL) by the fixture that
started it. Tools come from `tests.tools.require` (skip locally, fail under CI).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from tests.netutil import free_port, free_port_on
from tests.tools import require

#: Longest we wait for a server to come up, seconds (pebble generates keys: ~1 s).
STARTUP_TIMEOUT = 20.0


def _wait(check, what: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_path.read_text(errors='replace')[-2000:]}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up: {log_path.read_text(errors='replace')[-2000:]}")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass
class ChallTestSrv:
    """pebble-challtestsrv as a DNS server answering 127.0.0.1 for every A query."""

    tmp: Path
    dns_port: int = field(default_factory=lambda: free_port_on("127.0.0.1", udp=True))
    mgmt_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChallTestSrv:
        exe = require("pebble-challtestsrv")
        self.tmp.mkdir(parents=True, exist_ok=True)
        log_path = self.tmp / "challtestsrv.log"
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [exe, "-dns01", f"127.0.0.1:{self.dns_port}", "-defaultIPv4", "127.0.0.1",
                 "-defaultIPv6", "", "-http01", "", "-https01", "", "-tlsalpn01", "",
                 "-management", f"127.0.0.1:{self.mgmt_port}"],
                stdout=out, stderr=subprocess.STDOUT)
        _wait(lambda: _tcp_open(self.mgmt_port), "pebble-challtestsrv", self.proc, log_path)
        return self

    def stop(self) -> None:
        _stop(self.proc)


@dataclass
class Pebble:
    """One pebble instance; `restart()` keeps ports and API cert (but pebble forgets all)."""

    tmp: Path
    dns_server: str  # host:port pebble resolves challenge names with
    http_port: int  # where pebble validates HTTP-01 (our :80 listener in the test)
    tls_port: int  # where pebble validates TLS-ALPN-01 (our :443 router in the test)
    validity: int | None = None  # certificate lifetime in seconds (None: pebble's default)
    env: dict[str, str] = field(default_factory=dict)  # PEBBLE_* settings over ours
    port: int = field(default_factory=free_port)
    mgmt_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def directory(self) -> str:
        return f"https://localhost:{self.port}/dir"

    @property
    def ca_bundle(self) -> Path:
        """The CA that signed pebble's API certificate (what `acme.ca_bundle` points at)."""
        return self.tmp / "api-ca.pem"

    def acme_yaml(self, challenge: str, *extra: str) -> str:
        """An `acme:` config block ordering from this pebble with `challenge`; `extra`
        lines (indented as its fields) are added to it."""
        lines = "".join(f"  {line}\n" for line in extra)
        return (f"acme:\n  directory: {self.directory}\n  email: ops@pact.test\n"
                f"  agree_tos: true\n  challenges: [{challenge}]\n"
                f"  ca_bundle: {self.ca_bundle}\n{lines}")

    def serve_yaml(self, *, tls: int, admin: int, pin: str, host: str,
                   http: int | None = None) -> str:
        """A whole `serve` config: one terminate route for `host` (pinned to `pin`, an
        unused backend) with `cert: acme` from this pebble by TLS-ALPN-01."""
        listen_http = f'  http: ["127.0.0.1:{http}"]\n' if http is not None else ""
        return (f'state_dir: state\nlisten:\n  tls: ["127.0.0.1:{tls}"]\n{listen_http}'
                f'  admin: "127.0.0.1:{admin}"\n{self.acme_yaml("tls-alpn-01")}'
                f'tenants:\n  - name: t\n    pins: ["{pin}"]\n    routes:\n'
                f'      - {{host: {host}, mode: terminate, backend: "127.0.0.1:9", '
                f'cert: acme}}\n')

    def start(self) -> Pebble:
        exe = require("pebble")
        self.tmp.mkdir(parents=True, exist_ok=True)
        if not self.ca_bundle.exists():
            ca = trustme.CA()
            leaf = ca.issue_cert("localhost", "127.0.0.1")
            leaf.private_key_pem.write_to_path(str(self.tmp / "api-key.pem"))
            leaf.cert_chain_pems[0].write_to_path(str(self.tmp / "api-cert.pem"))
            ca.cert_pem.write_to_path(str(self.ca_bundle))
        conf: dict[str, object] = {
            "listenAddress": f"127.0.0.1:{self.port}",
            "managementListenAddress": f"127.0.0.1:{self.mgmt_port}",
            "certificate": str(self.tmp / "api-cert.pem"),
            "privateKey": str(self.tmp / "api-key.pem"),
            "httpPort": self.http_port, "tlsPort": self.tls_port,
            "ocspResponderURL": "", "externalAccountBindingRequired": False,
        }
        if self.validity is not None:
            conf["certificateValidityPeriod"] = self.validity
        (self.tmp / "pebble.json").write_text(json.dumps({"pebble": conf}))
        env = dict(os.environ, PEBBLE_VA_NOSLEEP="1", PEBBLE_WFE_NONCEREJECT="0",
                   PEBBLE_AUTHZREUSE="0")  # always validate: every test exercises challenges
        env.update(self.env)
        log_path = self.tmp / "pebble.log"
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [exe, "-config", str(self.tmp / "pebble.json"), "-dnsserver", self.dns_server],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        _wait(lambda: self._get(self.directory) is not None, "pebble", self.proc, log_path)
        return self

    def stop(self) -> None:
        _stop(self.proc)

    def restart(self) -> None:
        self.stop()
        self.start()

    def root_pem(self) -> bytes:
        """The issuing root (management /roots/0): what issued chains must verify against."""
        data = self._get(f"https://localhost:{self.mgmt_port}/roots/0")
        assert data is not None
        return data

    def _get(self, url: str) -> bytes | None:
        ctx = ssl.create_default_context(cafile=str(self.ca_bundle))
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
                return resp.read()
        except (OSError, ValueError):
            return None

    @property
    def log(self) -> str:
        return (self.tmp / "pebble.log").read_text(errors="replace")


#: Where Debian's AppArmor profile for named allows reading and writing; on machines that
#: enforce it (CI VMs may), named cannot read configs under /tmp. Used when writable.
BIND_CACHE = Path("/var/cache/bind")


@dataclass
class Named:
    """bind9 authoritative for `zone`, updatable with a TSIG key (TXT only)."""

    tmp: Path
    zone: str  # with trailing dot
    hosts: tuple[str, ...]  # names (relative or absolute) that get A 127.0.0.1
    port: int = field(default_factory=lambda: free_port_on("127.0.0.1", udp=True))
    key_name: str = "pact-acme"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def key_file(self) -> Path:
        return self.tmp / "tsig.key"

    def start(self) -> Named:
        exe = require("named")
        if BIND_CACHE.is_dir() and os.access(BIND_CACHE, os.W_OK):
            self.tmp = Path(tempfile.mkdtemp(prefix="pact-test-", dir=BIND_CACHE))
        self.tmp.mkdir(parents=True, exist_ok=True)
        secret = base64.b64encode(secrets.token_bytes(32)).decode()
        key_clause = f'key "{self.key_name}" {{\n\talgorithm hmac-sha256;\n\tsecret "{secret}";\n}};\n'
        self.key_file.write_text(key_clause)
        self.key_file.chmod(0o600)
        records = "\n".join(f"{h} 60 IN A 127.0.0.1" for h in self.hosts)
        (self.tmp / "zone.db").write_text(
            f"$ORIGIN {self.zone}\n$TTL 60\n"
            f"@ IN SOA ns.{self.zone} hostmaster.{self.zone} 1 60 60 600 60\n"
            f"@ IN NS ns.{self.zone}\nns IN A 127.0.0.1\n{records}\n")
        (self.tmp / "named.conf").write_text(f"""
include "{self.key_file}";
options {{
    directory "{self.tmp}";
    pid-file "{self.tmp}/named.pid";
    listen-on port {self.port} {{ 127.0.0.1; }};
    listen-on-v6 {{ none; }};
    recursion no;
    dnssec-validation no;
    notify no;
}};
controls {{ }};
zone "{self.zone}" {{
    type primary;
    file "{self.tmp}/zone.db";
    update-policy {{ grant {self.key_name} zonesub TXT; }};
}};
""")
        log_path = self.tmp / "named.log"
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [exe, "-g", "-4", "-n", "1", "-c", str(self.tmp / "named.conf")],
                stdout=out, stderr=subprocess.STDOUT)
        _wait(self._answers, "named", self.proc, log_path)
        return self

    def _answers(self) -> bool:
        import dns.exception
        import dns.message
        import dns.query

        q = dns.message.make_query(self.zone, "SOA")
        try:
            resp = dns.query.udp(q, "127.0.0.1", port=self.port, timeout=0.5)
        except dns.exception.Timeout:
            return False
        return bool(resp.answer)

    def stop(self) -> None:
        _stop(self.proc)
        if self.tmp.parent == BIND_CACHE:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _tcp_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
