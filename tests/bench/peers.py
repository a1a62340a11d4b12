"""Peer processes the benches compare against or lean on: HAProxy configs, test certs.

HAProxy (Debian's 2.6) plays two roles:

- the **peer proxy** for passthrough: `mode tcp`, wait for a complete ClientHello
  (`req_ssl_hello_type 1`), route on `req.ssl_sni`, splice both directions, one thread.
  This is the configuration DESIGN §5 measured (~55 µs CPU per new connection);
- the fast **backends** of the connection-rate benches, on the load core: a TLS server
  answering `200 ok` from C, and a sink that closes once the ClientHello has arrived.
  They are the same for every path, and as cheap per connection as anything here.

The terminate and tunnel benches add their configs here.
"""

from __future__ import annotations

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


def haproxy_argv(cfg: Path) -> list[str]:
    """Foreground, no daemon, no master process: the PID is the one that works."""
    return [HAPROXY, "-f", str(cfg), "-db"]


def haproxy_passthrough_cfg(port: int, routes: Mapping[str, int], *, splice: bool = True
                            ) -> str:
    """An SNI passthrough frontend on 127.0.0.1:`port`; `routes` maps SNI → backend port."""
    lines = [
        "global",
        "    nbthread 1",
        f"    maxconn {HAPROXY_MAXCONN}",
        "defaults",
        "    mode tcp",
        f"    maxconn {HAPROXY_MAXCONN}",
        HAPROXY_TIMEOUTS.rstrip("\n"),
    ]
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
    return f"""\
global
    nbthread 1
    maxconn {HAPROXY_MAXCONN}
defaults
    maxconn {HAPROXY_MAXCONN}
{HAPROXY_TIMEOUTS}\
frontend tls
    mode http
    bind 127.0.0.1:{tls_port} ssl crt {pem}
    http-request return status 200 content-type text/plain string ok
frontend sink
    mode tcp
    bind 127.0.0.1:{sink_port}
    tcp-request inspect-delay 5s
    tcp-request content reject if {{ req_ssl_hello_type 1 }}
"""


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
