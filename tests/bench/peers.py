"""Peer processes the benches compare against or lean on: HAProxy configs, test certs.

HAProxy (Debian's 2.6) plays two roles:

- the **peer proxy** for passthrough: `mode tcp`, wait for a complete ClientHello
  (`req_ssl_hello_type 1`), route on `req.ssl_sni`, splice both directions, one thread.
  HAProxy at its cheapest for this job, so the comparison is with C at its best;
- the fast **backends** of the connection-rate benches, on the load core: a TLS server
  answering `200 ok` from C, and a sink that closes once the ClientHello has arrived.
  They are the same for every path, and as cheap per connection as anything here.

OpenSSH (Debian's 9.2) is the peer of the tunnel bench: a throwaway `sshd` on loopback
and an `ssh -N -R …` client, the reverse forward many self-hosters run today (below).

The terminate bench adds its configs here.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.bench.harness import python_module

HAPROXY = "/usr/sbin/haproxy"
#: HAProxy's own connection cap; it derives fd needs from it (2 per proxied connection
#: plus pipes), so it must fit the fd limit (ulimit -n is 20000 on the bench machine).
HAPROXY_MAXCONN = 4000
#: Timeouts far beyond any bench phase: they must never be what ends a connection.
HAPROXY_TIMEOUTS = """\
    timeout connect 5s
    timeout client 120s
    timeout server 120s
"""


def haproxy_head(*defaults: str) -> str:
    """The `global` and `defaults` sections every peer config starts with; `defaults`:
    more lines for that section (e.g. "mode http")."""
    return "\n".join(["global", "    nbthread 1", f"    maxconn {HAPROXY_MAXCONN}",
                      "defaults", *(f"    {line}" for line in defaults),
                      f"    maxconn {HAPROXY_MAXCONN}", HAPROXY_TIMEOUTS])


def haproxy_sink_frontend(port: int) -> str:
    """A frontend that waits for a complete ClientHello, then closes (a flood's backend)."""
    return f"""\
frontend sink
    mode tcp
    bind 127.0.0.1:{port}
    tcp-request inspect-delay 5s
    tcp-request content reject if {{ req_ssl_hello_type 1 }}
"""


def haproxy_argv(cfg: Path) -> list[str]:
    """Foreground, no daemon, no master process: the PID is the one that works."""
    return [HAPROXY, "-f", str(cfg), "-db"]


def haproxy_passthrough_cfg(port: int, routes: Mapping[str, int], *, splice: bool = True
                            ) -> str:
    """An SNI passthrough frontend on 127.0.0.1:`port`; `routes` maps SNI → backend port."""
    lines = [haproxy_head("mode tcp").rstrip("\n")]
    if splice:
        lines += ["    option splice-request", "    option splice-response"]
    lines += [
        "frontend sni",
        f"    bind 127.0.0.1:{port}",
        "    tcp-request inspect-delay 5s",
        "    tcp-request content accept if { req_ssl_hello_type 1 }",
    ]
    for i, host in enumerate(routes):
        lines.append(f"    use_backend b{i} if {{ req.ssl_sni -i {host} }}")
    for i, backend_port in enumerate(routes.values()):
        lines += [f"backend b{i}", f"    server s{i} 127.0.0.1:{backend_port}"]
    return "\n".join(lines) + "\n"


def haproxy_backends_cfg(*, tls_port: int, pem: Path, sink_port: int) -> str:
    """Backends in C for the connection-rate benches, on the load core:

    - `tls_port`: terminates TLS and answers every request `200 ok` itself;
    - `sink_port`: waits for a complete ClientHello, then closes (the flood's backend).
      Measured here: ~40 µs of CPU per connection against ~60 µs for the cheapest
      Python epoll sink, and every µs on the load core caps the direct path.
    """
    return haproxy_head() + f"""\
frontend tls
    mode http
    bind 127.0.0.1:{tls_port} ssl crt {pem}
    http-request return status 200 content-type text/plain string ok
""" + haproxy_sink_frontend(sink_port)


def make_tls_pem(tmp: Path, name: str) -> Path:
    """A self-signed ECDSA P-256 cert + key in one PEM file (HAProxy's `crt` format)."""
    from pact_ingress.identity import keygen

    ident = keygen(tmp / f"{name}.key", common_name=name)
    pem = tmp / f"{name}.pem"
    pem.write_bytes(ident.cert_path.read_bytes() + ident.key_path.read_bytes())
    return pem


def raw_backends_argv(hello_len: int, *, bulk: int, echo: int) -> list[str]:
    """The Python byte-counting sink and echo server (`tests.bench.backends`)."""
    return python_module("tests.bench.backends", "--hello-len", str(hello_len),
                         "--bulk", str(bulk), "--echo", str(echo))


# --- OpenSSH reverse forward (tunnel bench) ---------------------------------------------

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
#: sshd refuses to start without its privilege-separation directory (root-owned, 0755);
#: Debian's package creates it only through systemd/init, which is not running here.
SSHD_PRIVSEP_DIR = Path("/run/sshd")


def ssh_keygen(path: Path) -> Path:
    """A throwaway passphrase-less Ed25519 key pair (`path`, `path`.pub)."""
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "pact-bench",
                    "-f", str(path)], check=True, timeout=30)
    return path


def sshd_setup(tmp: Path) -> tuple[Path, Path]:
    """Host key, client key and authorized_keys for a loopback sshd; returns
    (sshd config path, client key path). Runs as root (the bench does): the client
    logs in as root with its key only (`PermitRootLogin prohibit-password`)."""
    SSHD_PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    host_key = ssh_keygen(tmp / "ssh_host_ed25519_key")
    user_key = ssh_keygen(tmp / "ssh_user_key")
    authorized = tmp / "authorized_keys"
    authorized.write_bytes(Path(f"{user_key}.pub").read_bytes())
    os.chmod(authorized, 0o600)
    cfg = tmp / "sshd_config"
    cfg.write_text(f"""\
ListenAddress 127.0.0.1
HostKey {host_key}
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowTcpForwarding yes
GatewayPorts no
StrictModes no
PidFile none
LogLevel INFO
""")
    return cfg, user_key


def sshd_argv(cfg: Path, port: int) -> list[str]:
    """Foreground (`-D`), log to stderr (`-e`); the listener forks one child per login."""
    return [SSHD, "-D", "-e", "-f", str(cfg), "-p", str(port)]


def ssh_reverse_argv(port: int, key: Path, forwards: Mapping[int, int],
                     cipher: str | None = None) -> list[str]:
    """`ssh -N -R 127.0.0.1:REMOTE:127.0.0.1:LOCAL …` for each `forwards` item, with
    OpenSSH's default crypto unless `cipher` is given; exits if a forward fails."""
    argv = [SSH, "-N", "-i", str(key), "-p", str(port),
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
            "-o", "LogLevel=ERROR"]
    if cipher:
        argv += ["-c", cipher]
    for remote, local in forwards.items():
        argv += ["-R", f"127.0.0.1:{remote}:127.0.0.1:{local}"]
    return [*argv, "root@127.0.0.1"]


def ssh_default_cipher(port: int) -> str:
    """The cipher OpenSSH picks against its own sshd: the client's first preference."""
    res = subprocess.run([SSH, "-G", "-p", str(port), "root@127.0.0.1"], capture_output=True,
                         timeout=10, check=False)
    for line in res.stdout.decode().splitlines():
        if line.startswith("ciphers "):
            return line.split()[1].split(",")[0]
    return "?"


# --- terminate + re-encrypt (terminate bench) -------------------------------------------


def haproxy_http_backend_cfg(*, port: int, pem: Path, body: Path, alpn: str,
                             client_ca: Path | None = None) -> str:
    """The home node of the terminate bench, in C on the load core: TLS with the node's
    key (`pem`, whose fingerprint the ingress pins), ALPN `alpn` (e.g. "h2,http/1.1"),
    and every request answered `200` with the bytes of `body` by HAProxy itself.

    With `client_ca`, a client certificate is requested (`verify optional`) and, when one
    is sent, checked against that file: the ingress's self-signed identity cert, which
    both proxies present, so the link is mutual TLS as with a real node while a direct
    client without a certificate still gets in.
    """
    verify = f" verify optional ca-file {client_ca}" if client_ca else ""
    return haproxy_head("mode http") + f"""\
frontend node
    bind 127.0.0.1:{port} ssl crt {pem} alpn {alpn}{verify}
    http-request return status 200 content-type text/plain file {body}
"""


def haproxy_terminate_cfg(*, port: int, pem: Path, backend_port: int, client_pem: Path,
                          alpn: str) -> str:
    """The terminate peer: `mode http`, TLS ends at `port` (cert `pem`, ALPN h2 and
    http/1.1 for the callers), every request re-encrypted to the backend with `client_pem`
    as client certificate and ALPN `alpn` upstream, idle server connections shared between
    callers (`http-reuse always`). HAProxy cannot pin a fingerprint: `verify none` is the
    closest it has (pact-ingress checks the pin on every new upstream connection)."""
    return haproxy_head("mode http", "option http-keep-alive") + f"""\
frontend terminate
    bind 127.0.0.1:{port} ssl crt {pem} alpn h2,http/1.1
    default_backend node
backend node
    http-reuse always
    server s1 127.0.0.1:{backend_port} ssl verify none crt {client_pem} alpn {alpn}
"""
