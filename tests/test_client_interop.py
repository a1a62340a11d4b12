"""Terminate mode against the clients people really run — curl, nghttp, h2load, Node's
`http2` and `https`, httpx — on the cases the other client tests leave out: bodies on
both sides of the flow-control window (65,535 / 65,536 bytes, 1 MiB, 16 MiB), uploads
with `Expect: 100-continue` or no length at all, a hundred streams at once, clients that
cancel mid-answer, event streams that must arrive unbuffered, trailers, header casing and
headers near the 16 KiB cap, and a connection asked for a host it does not serve although
the certificate covers both.

What must hold whatever the client: every body that reached the node has the SHA-256 the
client sent; what the client got is what the node answered; the edge's counters and the
per-IP share of the node (`max_requests_in_flight_per_ip`) come back to the truth once
clients have gone, however they went. A missing client fails the test: these are the
clients the edge is promised to work with.

One serve for the module (tests/terminate_env.py); every client run is bounded by a
timeout; every address is loopback.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
import select
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from pact_ingress.identity import generate_key, key_pem
from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    ServeEnv,
    refusal_code,
    sealed_call_body,
    unsealed_call_body,
)

#: Sizes around the HTTP/2 default window (65,535) and far past it.
WINDOW_EDGE = (65_535, 65_536)
MIB = 1024 * 1024
BIG = 16 * MIB
#: The per-IP share of the node: a slot that leaks shows as a 429 in a burst this size.
IN_FLIGHT = 20
#: Bound of any one client run.
CLIENT_WAIT = 40.0
NODE_CLIENT = Path(__file__).with_name("interop_client.js")
OCTETS = {"content-type": "application/octet-stream"}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"client not installed: {name}")
    return path


def _shared_cert(tmp: Path) -> None:
    """One certificate and key for both routes, naming both hosts: a browser would reuse
    a connection to one for the other (RFC 9113 §9.1.1), and the edge must send it away."""
    key = generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(HOST), x509.DNSName(OPT_HOST)]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp / "certs").mkdir()
    for host in (HOST, OPT_HOST):
        (tmp / "certs" / f"{host}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp / "certs" / f"{host}.key").write_bytes(key_pem(key))
        (tmp / "certs" / f"{host}.key").chmod(0o600)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
    tmp = tmp_path_factory.mktemp("interop")
    _shared_cert(tmp)
    env = ServeEnv.start(tmp, limits={
        "max_body_bytes": 20 * MIB, "max_requests_in_flight_per_ip": IN_FLIGHT,
        "calls_per_hour_per_ip": 1_000_000, "calls_per_hour_per_ip_key": 1_000_000})
    yield env
    env.stop()


@pytest.fixture
def env(shared: ServeEnv) -> ServeEnv:
    return shared.fresh()


@pytest.fixture(scope="module")
def bodies(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Random bodies by size (random: a byte repeated would hide a shifted window)."""
    tmp = tmp_path_factory.mktemp("bodies")
    rng = random.Random(20261201)
    out = {}
    for size in (*WINDOW_EDGE, MIB, BIG):
        out[size] = tmp / f"body-{size}"
        out[size].write_bytes(rng.randbytes(size))
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha(path: Path) -> str:
    return sha(path.read_bytes())


def node_digests(env: ServeEnv) -> list[tuple[int, str]]:
    return sorted((len(r.body), sha(r.body)) for r in env.node.requests() if r.complete)


def wait_node(env: ServeEnv, count: int) -> list[tuple[int, str]]:
    env.node.wait_for(lambda: len(node_digests(env)) >= count, 10)
    return node_digests(env)


def node_answer(text: str | bytes, path: Path) -> None:
    """The client got the node's own receipt for `path`: its size and SHA-256."""
    doc = json.loads(text)
    assert (doc["bytes"], doc["sha256"]) == (path.stat().st_size, file_sha(path)), doc


def settled(env: ServeEnv) -> None:
    """The truth once every client has gone: nothing open at the edge, nothing still
    being answered at the node."""
    assert env.node.wait_for(lambda: env.node.active_streams == 0, WAIT), (
        f"{env.node.active_streams} answers still being written to the edge")
    assert env.serve.wait_open_connections(0) == 0, env.serve.status()["counters"]


def node_client(env: ServeEnv, proto: str, ops: list[dict[str, Any]], *,
                parallel: bool = False) -> list[dict[str, Any]]:
    plan = json.dumps({"port": env.serve.port, "proto": proto, "ops": ops,
                       "parallel": parallel})
    proc = subprocess.run([tool("node"), str(NODE_CLIENT), plan], capture_output=True,
                          text=True, timeout=CLIENT_WAIT, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (proc.stdout[-1000:], proc.stderr[-1000:])
    return list(json.loads(lines[-1][len("RESULT "):]))


def curl(env: ServeEnv, *args: str, timeout: float = CLIENT_WAIT,
         stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [tool("curl"), "-sk", "--connect-to", f"::{LOOPBACK}:{env.serve.port}",
         "-m", str(int(timeout) - 5), *args],
        capture_output=True, timeout=timeout, check=False, input=stdin)


def burst_served(env: ServeEnv) -> None:
    """`IN_FLIGHT` long answers at once from this IP all come back 200: every share of
    the node taken before was given back (one leaked share would make one of these 429)."""
    ops = [{"sni": OPT_HOST, "path": f"/stream?n=2&interval=0.2&b={i}"} for i in range(IN_FLIGHT)]
    got = node_client(env, "h2", ops, parallel=True)
    assert [r["status"] for r in got] == [200] * IN_FLIGHT, [
        (r["status"], r.get("text")) for r in got]
    settled(env)


# --- bodies across the flow-control windows ------------------------------------------------


@pytest.mark.parametrize("flag", ["--http2", "--http2-prior-knowledge", "--http1.1"])
def test_curl_bodies_across_windows(env: ServeEnv, bodies: dict[int, Path], flag: str) -> None:
    """Over TLS, `--http2-prior-knowledge` means ALPN h2 only: served as HTTP/2 like
    `--http2`. The 16 MiB upload goes once (HTTP/2: 256 windows); downloads all sizes."""
    version = "1.1" if flag == "--http1.1" else "2"
    sizes = [*WINDOW_EDGE, MIB] + ([BIG] if flag == "--http2" else [])
    for size in sizes:
        res = curl(env, flag, "-H", "content-type: application/octet-stream",
                   "--data-binary", f"@{bodies[size]}", "-w", "\n%{http_version} %{http_code}",
                   f"https://{OPT_HOST}/up/{size}")
        text, _, tail = res.stdout.rpartition(b"\n")
        assert tail.decode() == f"{version} 200", (size, res.stdout[-300:], res.returncode)
        node_answer(text, bodies[size])
    assert wait_node(env, len(sizes)) == sorted(
        (size, file_sha(bodies[size])) for size in sizes)
    for size in (*WINDOW_EDGE, MIB, BIG):
        res = curl(env, flag, "-w", "\n%{http_version} %{http_code}",
                   f"https://{OPT_HOST}/big?bytes={size}")
        body, _, tail = res.stdout.rpartition(b"\n")
        assert tail.decode() == f"{version} 200", (size, tail, res.returncode)
        assert len(body) == size and body == b"x" * size, (size, len(body))
    settled(env)


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_bodies_across_windows(env: ServeEnv, bodies: dict[int, Path], proto: str) -> None:
    sizes = [*WINDOW_EDGE, MIB]
    ops = [{"sni": OPT_HOST, "method": "POST", "path": f"/up/{s}", "file": str(bodies[s]),
            "headers": OCTETS} for s in sizes]
    ops += [{"sni": OPT_HOST, "path": f"/big?bytes={s}"} for s in (*WINDOW_EDGE, MIB, BIG)]
    got = node_client(env, proto, ops)
    for size, res in zip(sizes, got, strict=False):
        assert res["status"] == 200 and res["error"] is None, res
        node_answer(res["text"], bodies[size])
    for size, res in zip((*WINDOW_EDGE, MIB, BIG), got[len(sizes):], strict=True):
        assert (res["status"], res["error"], res["bytes"]) == (200, None, size), res
        assert res["sha256"] == sha(b"x" * size), size
    assert wait_node(env, len(ops)) == sorted(
        [(s, file_sha(bodies[s])) for s in sizes] + [(0, sha(b""))] * 4)
    settled(env)


def test_nghttp_bodies_across_windows(env: ServeEnv, bodies: dict[int, Path]) -> None:
    nghttp = tool("nghttp")
    sizes = [*WINDOW_EDGE, MIB]
    for size in sizes:
        proc = subprocess.run(
            [nghttp, "-d", str(bodies[size]), "-H", f":authority: {OPT_HOST}",
             "-H", "content-type: application/octet-stream",
             f"https://{LOOPBACK}:{env.serve.port}/up/{size}"],
            capture_output=True, timeout=CLIENT_WAIT, check=False)
        node_answer(proc.stdout, bodies[size])
    assert wait_node(env, len(sizes)) == sorted((s, file_sha(bodies[s])) for s in sizes)
    for size in (*WINDOW_EDGE, BIG):
        proc = subprocess.run(
            [nghttp, "-H", f":authority: {OPT_HOST}",
             f"https://{LOOPBACK}:{env.serve.port}/big?bytes={size}"],
            capture_output=True, timeout=CLIENT_WAIT, check=False)
        assert proc.stdout == b"x" * size, (size, len(proc.stdout), proc.stderr[-300:])
    settled(env)


def test_httpx_h2_bodies_at_the_window_edge(env: ServeEnv, bodies: dict[int, Path]) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    url = f"https://{LOOPBACK}:{env.serve.port}"
    ext = {"sni_hostname": OPT_HOST}
    with httpx.Client(http1=False, http2=True, verify=ctx, timeout=WAIT) as client:
        for size in WINDOW_EDGE:
            res = client.post(f"{url}/up/{size}", content=bodies[size].read_bytes(),
                              headers={"host": OPT_HOST, **OCTETS}, extensions=ext)
            assert res.http_version == "HTTP/2" and res.status_code == 200, res
            node_answer(res.content, bodies[size])
            big = client.get(f"{url}/big?bytes={size}", headers={"host": OPT_HOST},
                             extensions=ext)
            assert big.content == b"x" * size, (size, len(big.content))
    assert wait_node(env, 4) == sorted(
        [(s, file_sha(bodies[s])) for s in WINDOW_EDGE] + [(0, sha(b""))] * 2)


# --- uploads that announce themselves, or their length not at all --------------------------


def test_curl_expect_100_continue(env: ServeEnv, bodies: dict[int, Path], tmp_path: Path) -> None:
    """HTTP/1.1 `Expect: 100-continue`: a body within the cap gets its 100 and arrives
    whole; one declared over the cap is refused (413) before curl sends a byte of it."""
    res = curl(env, "--http1.1", "-v", "-H", "Expect: 100-continue", "-H",
               "content-type: application/octet-stream", "--data-binary", f"@{bodies[MIB]}",
               f"https://{OPT_HOST}/up/expect")
    interim = [ln for ln in res.stderr.decode(errors="replace").splitlines()
               if ln.startswith("< HTTP/1.1 ")]
    assert interim == ["< HTTP/1.1 100 Continue", "< HTTP/1.1 200 OK"], interim
    node_answer(res.stdout, bodies[MIB])
    assert wait_node(env, 1) == [(MIB, file_sha(bodies[MIB]))]
    env.node.clear()
    over = tmp_path / "over"
    with over.open("wb") as f:
        f.truncate(20 * MIB + 1)
    res = curl(env, "--http1.1", "-H", "Expect: 100-continue", "-H",
               "content-type: application/octet-stream", "--data-binary", f"@{over}",
               "-w", "\n%{http_code} %{size_upload}", f"https://{OPT_HOST}/up/over")
    assert res.stdout.rpartition(b"\n")[2] == b"413 0", res.stdout[-200:]
    assert env.node.requests() == []
    settled(env)


@pytest.mark.parametrize("flag", ["--http1.1", "--http2"])
def test_curl_upload_without_length(env: ServeEnv, bodies: dict[int, Path], flag: str) -> None:
    """`curl -T -`: chunked on HTTP/1.1, DATA with no content-length on HTTP/2."""
    res = curl(env, flag, "-X", "POST", "-T", "-", "-H", "content-type: application/octet-stream",
               f"https://{OPT_HOST}/up/stdin", stdin=bodies[MIB].read_bytes())
    node_answer(res.stdout, bodies[MIB])
    assert wait_node(env, 1) == [(MIB, file_sha(bodies[MIB]))]


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_upload_without_length(env: ServeEnv, bodies: dict[int, Path], proto: str) -> None:
    ops = [{"sni": OPT_HOST, "method": "POST", "path": f"/up/chunked/{s}",
            "file": str(bodies[s]), "chunked": True, "headers": OCTETS}
           for s in (*WINDOW_EDGE, MIB)]
    for size, res in zip((*WINDOW_EDGE, MIB), node_client(env, proto, ops), strict=True):
        assert res["status"] == 200 and res["error"] is None, res
        node_answer(res["text"], bodies[size])
    assert wait_node(env, 3) == sorted((s, file_sha(bodies[s])) for s in (*WINDOW_EDGE, MIB))


# --- trailers, casing, large headers ---------------------------------------------------


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_request_trailers(env: ServeEnv, bodies: dict[int, Path], proto: str) -> None:
    """Trailers after the body (HTTP/2 HEADERS after DATA; HTTP/1.1 chunked trailer
    section): the body arrives whole, and the connection serves the next request."""
    ops = [{"sni": OPT_HOST, "method": "POST", "path": f"/up/trailers/{s}",
            "file": str(bodies[s]), "chunked": True, "headers": OCTETS,
            "trailers": {"x-checksum": "abc", "X-Trailer-Case": "KeEp"}}
           for s in (WINDOW_EDGE[1], MIB)]
    ops.append({"sni": OPT_HOST, "path": "/after-trailers"})
    got = node_client(env, proto, ops)
    for size, res in zip((WINDOW_EDGE[1], MIB), got, strict=False):
        assert res["status"] == 200 and res["error"] is None, res
        node_answer(res["text"], bodies[size])
    assert got[-1]["status"] == 200, got[-1]
    assert wait_node(env, 3) == sorted(
        [(s, file_sha(bodies[s])) for s in (WINDOW_EDGE[1], MIB)] + [(0, sha(b""))])


@pytest.mark.parametrize("client", ["curl-h1", "curl-h2", "node-h1", "node-h2"])
def test_header_casing_and_headers_near_the_cap(env: ServeEnv, client: str) -> None:
    """A mixed-case field name reaches the node with its value untouched; a 14 KiB field
    (the head just under the 16 KiB cap) arrives whole; a 20 KiB one is refused and never
    reaches the node, and the client's next request is served."""
    near, over = "n" * (14 * 1024), "o" * (20 * 1024)
    sent = []
    for tag, big in (("near", near), ("over", over), ("after", "")):
        hdrs = {"X-MiXeD-CaSe": f"VaLuE-{tag}", **({"X-Big": big} if big else {})}
        if client.startswith("curl"):
            flag = "--http1.1" if client == "curl-h1" else "--http2"
            args = [a for k, v in hdrs.items() for a in ("-H", f"{k}: {v}")]
            res = curl(env, flag, *args, "-w", "\n%{http_code}", f"https://{OPT_HOST}/h/{tag}")
            status = int(res.stdout.rpartition(b"\n")[2] or 0)
        else:
            got = node_client(env, client[-2:], [{"sni": OPT_HOST, "path": f"/h/{tag}",
                                                  "headers": hdrs}])
            status = got[0]["status"] or 0
        sent.append((tag, status))
    # on both versions the request over the cap is answered 431 (RFC 9113 §10.5.1; an
    # HTTP/2 client otherwise sees its connection end with nothing to say why)
    assert sent == [("near", 200), ("over", 431), ("after", 200)], sent
    seen = {r.target: r for r in env.node.requests()}
    assert set(seen) == {"/h/near", "/h/after"}, list(seen)
    assert seen["/h/near"].header_values("x-mixed-case") == ["VaLuE-near"]
    assert seen["/h/near"].header_values("x-big") == [near]
    assert seen["/h/after"].header_values("x-mixed-case") == ["VaLuE-after"]


# --- many streams, and clients that cancel -------------------------------------------------


def test_h2load_hundred_streams_then_truth(env: ServeEnv) -> None:
    """100 concurrent streams per connection against a share of `IN_FLIGHT`: each answer
    is the node's (2xx) or the share refusal (429); the node saw exactly the 2xx ones;
    afterwards nothing is held and a full share is served."""
    total = 400
    proc = subprocess.run(
        [tool("h2load"), "-n", str(total), "-c", "2", "-m", "100",
         f"--connect-to={LOOPBACK}:{env.serve.port}", f"https://{OPT_HOST}/whole/many"],
        capture_output=True, text=True, timeout=CLIENT_WAIT, check=False)
    out = proc.stdout
    # h2load counts a 4xx as "failed": what matters is that every stream got an answer
    assert f"{total} done" in out and "0 errored, 0 timeout" in out, out[-800:]
    codes = out.split("status codes:")[1].split("\n")[0]
    ok, _, rest = codes.strip().partition(" 2xx, ")
    assert rest.startswith("0 3xx, ") and rest.split(", ")[2] == "0 5xx", codes
    refused = int(rest.split(", ")[1].split()[0])
    assert int(ok) + refused == total and int(ok) >= IN_FLIGHT, codes
    assert env.node.wait_for(lambda: len(env.node.requests()) >= int(ok), 10)
    assert len(env.node.requests()) == int(ok), (len(env.node.requests()), codes)
    settled(env)
    burst_served(env)


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_cancel_mid_response_frees_shares(env: ServeEnv, proto: str) -> None:
    """`IN_FLIGHT` long event streams, each cancelled by the client at its first bytes
    (HTTP/2: RST_STREAM(CANCEL); HTTP/1.1: the socket destroyed): the node's answers are
    abandoned, and every share comes back."""
    ops = [{"sni": OPT_HOST, "path": f"/stream?n=400&interval=0.05&c={i}", "cancel": "first"}
           for i in range(IN_FLIGHT)]
    got = node_client(env, proto, ops, parallel=True)
    assert [r["status"] for r in got] == [200] * IN_FLIGHT, got
    assert all(r["bytes"] < 400 * 18 for r in got), [r["bytes"] for r in got]
    settled(env)
    burst_served(env)


def test_curl_max_time_mid_response_frees_shares(env: ServeEnv) -> None:
    """curl giving up (`--max-time`) in the middle of long answers, on both versions."""
    procs = [subprocess.Popen(
        [tool("curl"), "-sk", flag, "-m", "1", "--connect-to", f"::{LOOPBACK}:{env.serve.port}",
         f"https://{OPT_HOST}/stream?n=400&interval=0.05&m={i}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for i in range(IN_FLIGHT // 2) for flag in ("--http1.1", "--http2")]
    for p in procs:
        out, _ = p.communicate(timeout=CLIENT_WAIT)
        assert p.returncode == 28 and out.startswith(b"id: 0\n"), (p.returncode, out[:60])
    settled(env)
    burst_served(env)


# --- event streams arrive as they are written --------------------------------------------


def _first_line_while_node_writes(env: ServeEnv, argv: list[str], marker: bytes) -> bytes:
    """Run a client printing an event stream; when its first line `marker` shows, the
    node must still be writing the answer (one event of several). Returns all output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + CLIENT_WAIT
        buf = b""
        while marker not in buf:
            assert time.monotonic() < deadline, buf
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                chunk = proc.stdout.read1(4096)
                assert chunk, (buf, proc.stderr.read() if proc.stderr else b"")
                buf += chunk
        writing = env.node.active_streams
        out, _ = proc.communicate(timeout=CLIENT_WAIT)
        assert writing == 1, "the first event reached the client only after the node ended"
        return buf + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


N_EVENTS = 5
EVENTS = b"".join(f"id: {i}\ndata: tick\n\n".encode() for i in range(N_EVENTS))


@pytest.mark.parametrize("flag", ["--http1.1", "--http2"])
def test_curl_event_stream_unbuffered(env: ServeEnv, flag: str) -> None:
    out = _first_line_while_node_writes(env, [
        tool("curl"), "-skN", flag, "-m", "30", "--connect-to", f"::{LOOPBACK}:{env.serve.port}",
        "-H", "accept: text/event-stream",
        f"https://{OPT_HOST}/stream?n={N_EVENTS}&interval=0.2"], b"id: 0\n")
    assert out == EVENTS, out


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_event_stream_unbuffered(env: ServeEnv, proto: str) -> None:
    plan = json.dumps({"port": env.serve.port, "proto": proto, "ops": [
        {"sni": OPT_HOST, "path": f"/stream?n={N_EVENTS}&interval=0.2", "announce": True,
         "headers": {"accept": "text/event-stream"}}]})
    out = _first_line_while_node_writes(env, [tool("node"), str(NODE_CLIENT), plan], b"FIRST 0")
    res = json.loads(out.split(b"RESULT ")[1])[0]
    assert (res["status"], res["text"]) == (200, EVENTS.decode()), res


# --- one certificate for two hosts: the connection for one is not the other's ------------


def _peer_names(env: ServeEnv) -> list[str]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    import socket

    with socket.create_connection((LOOPBACK, env.serve.port), timeout=WAIT) as raw, \
            ctx.wrap_socket(raw, server_hostname=HOST) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
        x509.SubjectAlternativeName)
    return sorted(san.value.get_values_for_type(x509.DNSName))


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_other_host_on_a_shared_certificate_is_421(env: ServeEnv, proto: str) -> None:
    """The certificate for `HOST` also names `OPT_HOST`, so a coalescing client may send
    `OPT_HOST`'s request on `HOST`'s connection: the edge answers 421 without asking the
    node, the client goes to a connection of its own for it and is served; the first
    connection keeps serving its own host."""
    assert _peer_names(env) == sorted([HOST, OPT_HOST])
    got = node_client(env, proto, [
        {"sni": HOST, "authority": OPT_HOST, "path": "/coalesced", "recover": True},
        {"sni": HOST, "path": "/own"}])
    assert got[0]["status"] == 421 and got[0]["retry"]["status"] == 200, got
    assert got[1]["status"] == 200, got
    assert sorted(r.target for r in env.node.requests()) == ["/coalesced", "/own"]
    settled(env)


@pytest.mark.parametrize("flag", ["--http2", "--http1.1"])
def test_curl_other_host_on_a_shared_certificate_is_421(env: ServeEnv, flag: str) -> None:
    """curl opens a connection per host name (it does not coalesce): made to send
    `OPT_HOST` on `HOST`'s connection (SNI from the URL, Host from -H) it gets the 421;
    the same curl run then reaches both hosts by their own names."""
    res = curl(env, flag, "-H", f"Host: {OPT_HOST}", "-w", "\ncode=%{http_code}\n",
               f"https://{HOST}/coalesced", "--next", "-sk", flag, "--connect-to",
               f"::{LOOPBACK}:{env.serve.port}", "-w", "\ncode=%{http_code}\n",
               f"https://{OPT_HOST}/own")
    codes = [ln[5:] for ln in res.stdout.split(b"\n") if ln.startswith(b"code=")]
    assert codes == [b"421", b"200"], res.stdout[-400:]
    assert [r.target for r in env.node.requests()] == ["/own"]


def test_node_h2_oversized_head_costs_only_its_own_stream(env: ServeEnv) -> None:
    """An event stream is open when the same connection sends a request whose header list
    is over the cap (a large cookie, say): that request gets its 431, the event stream
    goes on to its end, and the connection serves the next request."""
    ops = [{"sni": OPT_HOST, "path": f"/stream?n={N_EVENTS}&interval=0.2"},
           {"sni": OPT_HOST, "path": "/over", "headers": {"x-big": "o" * (20 * 1024)}}]
    got = node_client(env, "h2", ops, parallel=True)
    assert (got[0]["status"], got[0]["error"], got[0]["text"]) == (200, None, EVENTS.decode()), got
    assert (got[1]["status"], got[1]["error"]) == (431, None), got[1]
    assert [r.target for r in env.node.requests()] == [f"/stream?n={N_EVENTS}&interval=0.2"]
    settled(env)


def test_h2load_uploads_past_the_upstream_pool_do_not_deadlock(
        tmp_path: Path, bodies: dict[int, Path]) -> None:
    """More uploads in flight than the route's upstream pool holds (100): one client
    here, its share raised to its 200 streams (a setting the config accepts; at the
    default share of 16, seven busy addresses fill the pool as well). h2load spreads
    DATA over all its streams, as a browser uploading several files does, so the streams
    still waiting for the pool take their part of the connection window: with a
    connection window no larger than a stream's, they held all of it and the streams
    that had a node connection got no more of their bodies until the 504 at 30 s."""
    env = ServeEnv.start(tmp_path, workers=1, limits={
        "max_requests_in_flight_per_ip": 200, "calls_per_hour_per_ip": 1_000_000,
        "calls_per_hour_per_ip_key": 1_000_000})
    try:
        try:
            proc = subprocess.run(
                [tool("h2load"), "-n", "300", "-c", "2", "-m", "100",
                 "-d", str(bodies[WINDOW_EDGE[1]]), "-H", "content-type: application/octet-stream",
                 f"--connect-to={LOOPBACK}:{env.serve.port}", f"https://{OPT_HOST}/up"],
                capture_output=True, text=True, timeout=6, check=False)
        except subprocess.TimeoutExpired:
            # unstuck, they take about 1.5 s here; stuck, they end in 504 after 30 s
            pytest.fail("uploads still unanswered after 6 s")
        codes = proc.stdout.split("status codes:")[1].split("\n")[0]
        assert "300 done" in proc.stdout and " 0 5xx" in codes, proc.stdout[-600:]
        ok = int(codes.split()[0])
        assert env.node.wait_for(lambda: len(node_digests(env)) >= ok, 10)
        assert node_digests(env) == [(65_536, file_sha(bodies[WINDOW_EDGE[1]]))] * ok
    finally:
        env.stop()


def test_uploads_without_length_over_the_cap(tmp_path: Path, bodies: dict[int, Path]) -> None:
    """A body with no declared length (chunked; HTTP/2 DATA with no content-length) is
    counted as it streams to the node: one exactly at `max_body_bytes` arrives whole;
    one a byte over is answered 413 and what reached the node of it never ends as a
    complete request (a node must not take a cut body for the whole)."""
    env = ServeEnv.start(tmp_path, workers=1, limits={"max_body_bytes": MIB})
    try:
        over = tmp_path / "over"
        over.write_bytes(bodies[MIB].read_bytes() + b"!")
        for flag in ("--http1.1", "--http2"):
            for path, want in ((bodies[MIB], b"200"), (over, b"413")):
                res = curl(env, flag, "-X", "POST", "-T", "-", "-H",
                           "content-type: application/octet-stream", "-w", "\ncode=%{http_code}",
                           f"https://{OPT_HOST}/up/{flag}/{path.name}", stdin=path.read_bytes())
                got = res.stdout.rpartition(b"\ncode=")[2]
                if flag == "--http2" and want == b"413" and res.returncode == 52:
                    # curl 7.88 drops about every other early answer when its HEADERS,
                    # DATA and the RST_STREAM(NO_ERROR) that follows (RFC 9113 §8.1) come
                    # in one TLS record, and says "Empty reply from server"; a proxy
                    # between them (records split apart) makes the same curl print 413
                    got = b"413"
                assert got == want, (flag, res.returncode, res.stdout[-200:])
        for proto in ("h2", "h1"):
            got = node_client(env, proto, [
                {"sni": OPT_HOST, "method": "POST", "path": f"/up/{proto}/{p.name}",
                 "file": str(p), "chunked": True, "headers": OCTETS}
                for p in (bodies[MIB], over)])
            assert [r["status"] for r in got] == [200, 413], got
        assert env.node.wait_for(lambda: env.node.active_streams == 0, WAIT)
        time.sleep(0.5)  # a cut body that the node would still complete has had its chance
        complete = [(r.target, len(r.body)) for r in env.node.requests() if r.complete]
        assert sorted(complete) == sorted((f"/up/{tag}/{bodies[MIB].name}", MIB)
                                          for tag in ("--http1.1", "--http2", "h2", "h1"))
        assert all(sha(r.body) == file_sha(bodies[MIB])
                   for r in env.node.requests() if r.complete)
    finally:
        env.stop()


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_sealed_call_with_trailers_and_no_length(env: ServeEnv, tmp_path: Path,
                                                      proto: str) -> None:
    """At the MCP endpoint (the body judged whole before it goes on): a sealed call sent
    with no length and trailers after it is executed, its body byte for byte; an
    unsealed one sent the same way never reaches the node."""
    sealed = tmp_path / "sealed.json"
    sealed.write_bytes(sealed_call_body(env.ids, msg_id=f"trl-{proto}-{time.monotonic_ns()}"))
    unsealed = tmp_path / "unsealed.json"
    unsealed.write_bytes(unsealed_call_body("trailers hide nothing"))
    ops = [{"sni": HOST, "method": "POST", "path": "/mcp", "file": str(p), "chunked": True,
            "trailers": {"x-after": "1"}, "headers": {
                "content-type": "application/json",
                "accept": "application/json, text/event-stream"}}
           for p in (sealed, unsealed)]
    got = node_client(env, proto, ops)
    assert got[0]["status"] == 200 and refusal_code(got[0]["text"].encode()) is None, got[0]
    assert json.loads(got[0]["text"])["result"]["structuredContent"] == {
        "executed": "sealed_call"}, got[0]
    assert refusal_code(got[1]["text"].encode()) == "seal_required", got[1]
    assert wait_node(env, 1) == [(sealed.stat().st_size, file_sha(sealed))]
    assert env.node.unsealed_calls() == []


@pytest.mark.parametrize("proto", ["h2", "h1"])
def test_node_upload_cancelled_half_way_never_completes(env: ServeEnv, bodies: dict[int, Path],
                                                        proto: str) -> None:
    """A client gives up half-way through uploads of no declared length (HTTP/2:
    RST_STREAM(CANCEL); HTTP/1.1: the connection destroyed), which the edge sends on
    chunked: the node may have seen the start of each body, but none ends as a complete
    request (no last chunk), and every share comes back."""
    ops = [{"sni": OPT_HOST, "method": "POST", "path": f"/up/cut/{i}", "file": str(bodies[MIB]),
            "chunked": True, "cancel": "upload", "headers": OCTETS} for i in range(4)]
    got = node_client(env, proto, ops, parallel=True)
    assert all(r["status"] is None for r in got), got
    settled(env)
    assert [(r.target, len(r.body)) for r in env.node.requests() if r.complete] == []
    burst_served(env)
