"""Instructions per new terminate connection, counted by callgrind: a figure a busy machine
cannot move.

    python -m tests.bench.callgrind_terminate before=/tmp/before after=. [--conns 400]
    python -m tests.bench.callgrind_terminate before=/tmp/before after=. --keepalive 2000
    python -m tests.bench.callgrind_terminate now=. --haproxy   # HAProxy counted too

`--keepalive N` counts instructions per keep-alive request instead: 8 client threads
(`--threads`), each on one connection, `N` requests in all (`GET /`, each answer read
before the next request is sent, as wrk does).
`--keepalive N --h2` counts them over HTTP/2 instead: `h2load` with `--threads`
connections, one stream at a time on each, `N` requests in all.

CPU time per connection (`ab_terminate`) swings by tens of percent while other work
shares the cores; the number of instructions the process executes per connection does
not (repeat runs agree within ~1%). For each tree this starts `pact-ingress serve`
under `valgrind --tool=callgrind` with collection off, in front of the terminate bench's
node (`bench_terminate`'s rig: HAProxy answering 200 + 1 KiB over pinned mTLS), warms it
up (the upstream pool filled), switches collection on for `--conns` new connections
(8 client threads, each: a TLS 1.3 handshake resuming the thread's last session, as wrk
does, one `GET /` with `Connection: close`, read to EOF), switches it off and reports
instructions per connection by shared object:
libcrypto + libssl (the handshake's crypto, the same work HAProxy's OpenSSL does),
libpython (the interpreter: our Python), libc (malloc and friends for both).

Instructions are not time: the interpreter's are cheap per instruction in a hot loop and
dear when caches are cold, crypto's the other way round, and the kernel's work (syscalls,
loopback TCP) is not counted at all. Use it to compare trees, not to predict µs.
`--haproxy` counts the rig's HAProxy the same way (started under callgrind on a port of
its own): how many instructions the peer spends on the same work, next to each tree.
`--lean` counts `tests/bench/lean_proxy.py` too (see `ab_terminate --lean`), and
`--lean-epoll` `tests/bench/lean_epoll_proxy.py` (the same job on one epoll loop, no trio),
and `--epoll-checked` `tests/bench/epoll_checked_proxy.py` (that loop with the product's
per-request work), `--epoll-checked-h2up` `tests/bench/epoll_checked_h2up_proxy.py` (the
same speaking HTTP/2 to the node over one connection).
Needs valgrind (Debian: apt-get install valgrind); one run takes about a minute a tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.bench import bench_terminate as bt
from tests.bench.harness import CORE_LOAD, CORE_PROXY, free_port, pin_self, services
from tests.bench.peers import haproxy_argv

REQUEST = f"GET / HTTP/1.1\r\nHost: {bt.HOST}\r\nConnection: close\r\n\r\n".encode()
THREADS = 8


def _client_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _in_threads(worker: Callable[[int], None], each: int) -> None:
    """`worker(each)` in THREADS threads at once, all joined."""
    threads = [threading.Thread(target=worker, args=(each,)) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _connections(port: int, count: int) -> int:
    """`count` new connections from THREADS threads; how many got a 200."""
    ctx = _client_context()
    ok = [0]

    def one(last: list[ssl.SSLSession | None]) -> None:
        with (socket.create_connection(("127.0.0.1", port), timeout=120) as raw,
              ctx.wrap_socket(raw, server_hostname=bt.HOST, session=last[0]) as tls):
            tls.sendall(REQUEST)
            data = b""
            while True:
                try:
                    chunk = tls.recv(65536)
                except (ssl.SSLEOFError, ConnectionResetError):
                    break
                if not chunk:
                    break
                data += chunk
            last[0] = tls.session  # the ticket that came with the answer
        if data.startswith(b"HTTP/1.1 200"):
            ok[0] += 1

    def worker(n: int) -> None:
        last: list[ssl.SSLSession | None] = [None]
        for _ in range(n):
            one(last)

    _in_threads(worker, count // THREADS)
    return ok[0]


KA_REQUEST = f"GET / HTTP/1.1\r\nHost: {bt.HOST}\r\n\r\n".encode()


def _keepalive(port: int, count: int) -> int:
    """`count` keep-alive requests over THREADS connections; how many got a 200."""
    ctx = _client_context()
    ok = [0]

    def worker(n: int) -> None:
        with (socket.create_connection(("127.0.0.1", port), timeout=120) as raw,
              ctx.wrap_socket(raw, server_hostname=bt.HOST) as tls):
            for _ in range(n):
                tls.sendall(KA_REQUEST)
                data = b""
                while True:
                    data += tls.recv(65536)
                    head, sep, rest = data.partition(b"\r\n\r\n")
                    if not sep:
                        continue
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(rest) >= length:
                        break
                if data.startswith(b"HTTP/1.1 200"):
                    ok[0] += 1

    _in_threads(worker, count // THREADS)
    return ok[0]


def _keepalive_h2(port: int, count: int) -> int:
    """`count` requests over HTTP/2 on THREADS connections, one stream at a time on
    each (h2load); how many got a 2xx."""
    out = subprocess.run(
        ["taskset", "-c", str(CORE_LOAD), "h2load", "-t1", f"-c{THREADS}", "-m1",
         f"-n{count}", f"https://{bt.HOST}:{port}/"], capture_output=True, text=True,
        timeout=1800).stdout
    m = re.search(r"status codes: (\d+) 2xx", out)
    if m is None:
        raise SystemExit(f"h2load gave no status counts:\n{out[-800:]}")
    return int(m.group(1))


def _by_object(dump: Path) -> Counter[str]:
    out = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)],
                         capture_output=True, text=True, check=True).stdout
    objects: Counter[str] = Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+.*\[(.*)\]\s*$", line)
        if m:
            objects[Path(m.group(2)).name.split(".so")[0]] += int(m.group(1).replace(",", ""))
    return objects


def serve_under_callgrind(name: str, tree: Path, cfg: Path, tmp: Path, port: int
                          ) -> subprocess.Popen[bytes]:
    """`pact-ingress serve -c cfg` from `tree` under callgrind, collection off, on the
    proxy core; returned once it accepts on `port` (under valgrind that takes a while)."""
    out = tmp / f"callgrind-{name}.out"
    python = os.path.realpath(sys.executable)  # valgrind must run the interpreter itself
    proc = subprocess.Popen(
        ["taskset", "-c", str(CORE_PROXY), "valgrind", "--tool=callgrind",
         "--instr-atstart=no", f"--callgrind-out-file={out}", python, "-m", "pact_ingress",
         "serve", "-c", str(cfg)],
        cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)),
        stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    _wait_listening(proc, port, name)
    return proc


def _wait_listening(proc: subprocess.Popen[bytes], port: int, name: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"{name}: did not start under valgrind") from None
            time.sleep(0.5)


def collect(proc: subprocess.Popen[bytes], on: bool) -> None:
    """Switch instruction collection on, or off and dump what was counted."""
    control = ["callgrind_control", "-i", "on" if on else "off", str(proc.pid)]
    subprocess.run(control, check=True, capture_output=True)
    if not on:
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                       capture_output=True)


def counted(tmp: Path, name: str) -> Counter[str]:
    """Instructions by shared object in the last dump of `name`'s run."""
    return _by_object(max(tmp.glob(f"callgrind-{name}.out.*")))


def measure(name: str, tree: Path, yaml: str, rig: bt.Rig, tmp: Path, conns: int,
            keepalive: int = 0, h2: bool = False) -> Counter[str]:
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.replace(f'127.0.0.1:{rig.ports[bt.SUBJECT]}"', f'127.0.0.1:{port}"')
                   .replace(f"state_dir: {tmp}/state", f"state_dir: {tmp}/state-{name}"))
    proc = serve_under_callgrind(name, tree, cfg, tmp, port)
    return _count(proc, name, port, tmp, conns, keepalive, h2)


def _count(proc: subprocess.Popen[bytes], name: str, port: int, tmp: Path, conns: int,
           keepalive: int, h2: bool = False) -> Counter[str]:
    """Warm `proc` up, count `conns` new connections (or `keepalive` requests, over
    HTTP/2 with `h2`) with collection on, stop it; its instructions by shared object."""
    requests = _keepalive_h2 if h2 else _keepalive
    try:
        _connections(port, 8 * THREADS)  # warm: pools filled, every path run once
        if keepalive:
            requests(port, 8 * THREADS)
        collect(proc, True)
        if keepalive:
            ok, conns = requests(port, keepalive), keepalive
        else:
            ok = _connections(port, conns)
        collect(proc, False)
        if ok != conns // THREADS * THREADS:
            raise SystemExit(f"{name}: {ok} of {conns} connections answered 200")
    finally:
        proc.terminate()
        proc.wait(60)
    return counted(tmp, name)


def measure_haproxy(rig: bt.Rig, tmp: Path, conns: int, keepalive: int = 0
                    ) -> Counter[str]:
    """The same counts for the rig's HAProxy (its config on a port of its own), started
    under callgrind the same way: the peer's instructions beside each tree's."""
    port = free_port()
    cfg = (tmp / "haproxy.cfg").read_text().replace(
        f"127.0.0.1:{rig.ports[bt.PEER]} ", f"127.0.0.1:{port} ")
    (tmp / "haproxy-cg.cfg").write_text(cfg)
    out = tmp / "callgrind-haproxy.out"
    proc = subprocess.Popen(
        ["taskset", "-c", str(CORE_PROXY), "valgrind", "--tool=callgrind",
         "--instr-atstart=no", f"--callgrind-out-file={out}",
         *haproxy_argv(tmp / "haproxy-cg.cfg")],
        stdout=open(tmp / "haproxy-cg.log", "w"), stderr=subprocess.STDOUT)
    _wait_listening(proc, port, "haproxy")
    return _count(proc, "haproxy", port, tmp, conns, keepalive)


def measure_reference(rig: bt.Rig, tmp: Path, conns: int, keepalive: int,
                      name: str) -> Counter[str]:
    """The same counts for the reference proxy `name` (`bench_terminate.REFERENCES`:
    `lean` is the plain terminate proxy on this stack, without the product's work)."""
    module = bt.REFERENCES[name]
    port = free_port()
    out = tmp / f"callgrind-{name}.out"
    proc = subprocess.Popen(
        ["taskset", "-c", str(CORE_PROXY), "valgrind", "--tool=callgrind",
         "--instr-atstart=no", f"--callgrind-out-file={out}",
         os.path.realpath(sys.executable), "-m", module, str(port),
         str(tmp / f"{bt.HOST}.crt"), str(tmp / f"{bt.HOST}.key"), str(rig.ports["node"]),
         str(tmp / "ingress.crt"), str(tmp / "ingress.key")],
        stdout=open(tmp / f"{name}-cg.log", "w"), stderr=subprocess.STDOUT)
    _wait_listening(proc, port, name)
    return _count(proc, name, port, tmp, conns, keepalive)


def require_valgrind() -> None:
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (Debian: apt-get install valgrind)")


def print_table(rows: dict[str, Counter[str]], groups: dict[str, tuple[str, ...]],
                per: int, title: str, cell: str) -> None:
    """A markdown table: one column per tree, thousands of instructions per unit (`per`
    units counted) in each group of shared objects, then the total."""
    print(f"| {title} | " + " | ".join(rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for label, prefixes in groups.items():
        cells = [sum(v for k, v in c.items() if k in prefixes) / per / 1e3
                 for c in rows.values()]
        print(f"| {label} | " + " | ".join(cell.format(x) for x in cells) + " |")
    totals = [sum(c.values()) / per / 1e3 for c in rows.values()]
    print("| total (user space) | " + " | ".join(cell.format(x) for x in totals) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="NAME=DIR: a tree holding pact_ingress")
    p.add_argument("--conns", type=int, default=400)
    p.add_argument("--keepalive", type=int, default=0,
                   help="count per keep-alive request: this many requests in all")
    p.add_argument("--haproxy", action="store_true",
                   help="also count the rig's HAProxy, the same way")
    p.add_argument("--lean", action="store_true",
                   help="also count tests/bench/lean_proxy.py, the same way")
    p.add_argument("--lean-epoll", action="store_true",
                   help="also count tests/bench/lean_epoll_proxy.py, the same way")
    p.add_argument("--epoll-checked", action="store_true",
                   help="also count tests/bench/epoll_checked_proxy.py, the same way")
    p.add_argument("--epoll-checked-h2up", action="store_true",
                   help="add that reference speaking HTTP/2 to the node over one "
                        "connection (tests/bench/epoll_checked_h2up_proxy.py)")
    p.add_argument("--h2", action="store_true",
                   help="with --keepalive: the requests over HTTP/2 (h2load), pact-ingress only")
    p.add_argument("--threads", type=int, default=THREADS,
                   help="client threads (keep-alive: connections)")
    args = p.parse_args(argv)
    if args.h2 and (not args.keepalive or args.haproxy or args.lean or args.lean_epoll
                    or args.epoll_checked or args.epoll_checked_h2up):
        p.error("--h2 counts keep-alive requests (--keepalive N) of pact-ingress trees only")
    globals()["THREADS"] = args.threads
    require_valgrind()
    if (os.cpu_count() or 1) >= 2:
        pin_self(CORE_LOAD)
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-cg-"))
    rows: dict[str, Counter[str]] = {}
    with services() as started:
        rig = bt.build_rig(tmp, started, "h2,http/1.1")
        yaml = (tmp / "ingress.yaml").read_text()
        for name, tree in (t.split("=", 1) for t in args.trees):
            rows[name] = measure(name, Path(tree).resolve(), yaml, rig, tmp, args.conns,
                                 args.keepalive, args.h2)
        for name in bt.REFERENCES:  # `--lean` etc.: the flag is the path's name
            if getattr(args, name.replace("-", "_")):
                rows[name] = measure_reference(rig, tmp, args.conns, args.keepalive, name)
        if args.haproxy:
            rows["haproxy"] = measure_haproxy(rig, tmp, args.conns, args.keepalive)
    shutil.rmtree(tmp, ignore_errors=True)
    groups = {"libpython (our Python)": ("libpython3.11", "libpython3"),
              "libcrypto + libssl (TLS)": ("libcrypto", "libssl"),
              "libc": ("libc",)}
    if args.haproxy:
        groups["haproxy (its own code)"] = ("haproxy",)
    n = (args.keepalive or args.conns) // THREADS * THREADS
    unit = "request" if args.keepalive else "connection"
    print_table(rows, groups, n, f"k instructions per {unit}", "{:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
