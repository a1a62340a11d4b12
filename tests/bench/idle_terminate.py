"""Memory of idle keep-alive connections on a terminate route.

    python -m tests.bench.idle_terminate [--connections 1000] [--http2]

Starts `pact-ingress demo` (ingress, demo node and connector in one process, loopback
only), opens N TLS connections to its terminate route, sends one small request on each
and keeps them open and idle, then reports the process's RSS before, after and per
connection. Each request reaches the node, so the node's side of the pooled upstream
connections is counted too (they are shared: a handful for all N). Not a test: nothing
is asserted. Bounded: N connections, each closed at the end.
"""

from __future__ import annotations

import argparse
import resource
import socket
import ssl
import time

from tests.bench.abuse_terminate import HOST, Demo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18543)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--http2", action="store_true")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.connections)), hard))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2" if args.http2 else "http/1.1"])
    demo = Demo(args.port)
    socks = []
    try:
        time.sleep(2)
        before = demo.rss_mib()
        for i in range(args.connections):
            raw = socket.create_connection(("127.0.0.1", args.port), timeout=30,
                                           source_address=(f"127.0.{1 + i // 200}.{2 + i % 200}", 0))
            tls = ctx.wrap_socket(raw, server_hostname=HOST)
            if args.http2:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                tls.recv(65536)
            else:
                tls.sendall(f"GET /_demo/headers HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
                tls.recv(65536)
            socks.append(tls)
        time.sleep(2)
        after = demo.rss_mib()
        opened = demo.open_connections()
        print("| connections | protocol | RSS MiB before | after | added | per connection KiB | open_connections |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {args.connections} | {'h2' if args.http2 else 'http/1.1'} | {before:.0f} | "
              f"{after:.0f} | {after - before:.1f} | {1024 * (after - before) / args.connections:.1f} "
              f"| {opened:.0f} |")
    finally:
        for s in socks:
            s.close()
        demo.stop()


if __name__ == "__main__":
    main()
