"""ClientHello parser: golden vectors from real clients, every-offset splitting, record
re-fragmentation, DoS caps, Hypothesis fuzzing; and TLS alerts as real clients see them."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.errors import RemoteProtocolError
from pact_ingress.proto import tls_alert
from pact_ingress.proto.clienthello import (
    MAX_CLIENT_HELLO,
    MAX_HANDSHAKE_RECORDS,
    ClientHello,
    ClientHelloError,
    parse_client_hello,
)
from pact_ingress.proto.tls_alert import alert_record
from tests.tools import require

VECTORS = Path(__file__).parent / "vectors" / "clienthello"
INDEX: dict[str, dict[str, object]] = json.loads((VECTORS / "vectors.json").read_text())
NAMES = sorted(INDEX)


def vector(name: str) -> bytes:
    return (VECTORS / name).read_bytes()


# --- helpers: pull the handshake message out of records, and re-frame it -----------------


def handshake_message(wire: bytes) -> bytes:
    """Concatenated handshake-record payloads (the test's own, independent de-framer)."""
    out, pos = b"", 0
    while pos < len(wire):
        assert wire[pos] == 22
        length = int.from_bytes(wire[pos + 3 : pos + 5], "big")
        out += wire[pos + 5 : pos + 5 + length]
        pos += 5 + length
    return out


def frame(message: bytes, size: int = 16384, version: int = 0x0301) -> bytes:
    """Wrap a handshake message in handshake records of at most `size` payload bytes."""
    chunks = [message[i : i + size] for i in range(0, len(message), size)]
    return b"".join(b"\x16" + version.to_bytes(2, "big") + len(c).to_bytes(2, "big") + c
                    for c in chunks)  # fmt: skip


def vec(len_size: int, body: bytes) -> bytes:
    return len(body).to_bytes(len_size, "big") + body


def ext(ext_type: int, data: bytes) -> bytes:
    return ext_type.to_bytes(2, "big") + vec(2, data)


def sni_ext(*names: bytes, name_type: int = 0) -> bytes:
    return ext(0, vec(2, b"".join(bytes([name_type]) + vec(2, n) for n in names)))


def alpn_ext(*protocols: bytes) -> bytes:
    return ext(16, vec(2, b"".join(vec(1, p) for p in protocols)))


def hello_message(
    *extensions: bytes,
    legacy_version: int = 0x0303,
    session_id: bytes = b"",
    suites: bytes = b"\x13\x01\x13\x02",
    compression: bytes = b"\x00",
    with_extensions_block: bool = True,
    trailer: bytes = b"",
) -> bytes:
    """A synthetic ClientHello handshake message (header included)."""
    body = legacy_version.to_bytes(2, "big") + bytes(32) + vec(1, session_id)
    body += vec(2, suites) + vec(1, compression)
    if with_extensions_block:
        body += vec(2, b"".join(extensions))
    body += trailer
    return b"\x01" + len(body).to_bytes(3, "big") + body


def reason_of(data: bytes) -> str:
    with pytest.raises(ClientHelloError) as info:
        parse_client_hello(data)
    return info.value.reason


# --- golden vectors ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_vector_parses_to_expected_sni_and_alpn(name: str) -> None:
    data = vector(name)
    hello = parse_client_hello(data)
    assert hello is not None
    assert hello.sni == INDEX[name]["sni"]
    assert list(hello.alpn) == INDEX[name]["alpn"]
    assert hello.raw_len == len(data)
    assert hello.legacy_version == 0x0303
    assert hello.record_version in (0x0301, 0x0303)


def test_vectors_cover_the_clients_the_issue_names() -> None:
    assert {"chromium.bin", "curl.bin", "gnutls.bin", "openssl_nosni.bin",
            "openssl_sni.bin", "openssl_tls12_alpn.bin", "python_ssl.bin"} <= set(NAMES)  # fmt: skip


def test_chromium_vector_is_post_quantum_sized() -> None:
    hello = parse_client_hello(vector("chromium.bin"))
    assert hello is not None
    assert 1800 < hello.raw_len < MAX_CLIENT_HELLO
    assert 0x0304 in hello.supported_versions
    assert 51 in hello.extensions  # key_share


def test_tls12_only_client_has_no_supported_versions() -> None:
    hello = parse_client_hello(vector("openssl_tls12_alpn.bin"))
    assert hello is not None and hello.supported_versions == ()


@pytest.mark.parametrize("name", NAMES)
def test_every_prefix_needs_more_bytes(name: str) -> None:
    data = vector(name)
    for cut in range(len(data)):
        assert parse_client_hello(data[:cut]) is None, cut
    assert parse_client_hello(bytearray(data)) == parse_client_hello(data)


@pytest.mark.parametrize("name", NAMES)
def test_bytes_after_the_hello_are_ignored(name: str) -> None:
    data = vector(name)
    app_data = b"\x17\x03\x03\x00\x05hello" + bytes(range(256))
    hello = parse_client_hello(data + app_data)
    assert hello == parse_client_hello(data)
    assert hello is not None and hello.raw_len == len(data)


# --- re-fragmentation across records ---------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 64, 100, 512, 1000, 16384])
@pytest.mark.parametrize("name", NAMES)
def test_refragmented_vectors_parse_the_same(name: str, size: int) -> None:
    message = handshake_message(vector(name))
    wire = frame(message, size)
    records = -(-len(message) // size)
    if records > MAX_HANDSHAKE_RECORDS:
        assert reason_of(wire) == "too_many_records"
        return
    hello = parse_client_hello(wire + b"\x17\x03\x03\x00\x01x")
    expected = parse_client_hello(vector(name))
    assert hello is not None and expected is not None
    assert (hello.sni, hello.alpn, hello.extensions) == (
        expected.sni, expected.alpn, expected.extensions)  # fmt: skip
    assert hello.raw_len == len(wire)


def test_one_byte_records_every_prefix() -> None:
    message = hello_message(sni_ext(b"a.example"), alpn_ext(b"h2"))
    wire = frame(message, 1)
    assert len(message) <= MAX_HANDSHAKE_RECORDS
    for cut in range(len(wire)):
        assert parse_client_hello(wire[:cut]) is None, cut
    hello = parse_client_hello(wire)
    assert hello is not None and hello.sni == "a.example" and hello.alpn == ("h2",)
    assert hello.raw_len == len(wire)


def test_chromium_in_records_of_100_every_prefix() -> None:
    wire = frame(handshake_message(vector("chromium.bin")), 100)
    for cut in range(len(wire)):
        assert parse_client_hello(wire[:cut]) is None, cut
    hello = parse_client_hello(wire)
    assert hello is not None and hello.sni == "somename.test"


def test_hello_ending_mid_record_reports_raw_len_at_its_last_byte() -> None:
    message = hello_message(sni_ext(b"x.example"))
    # Two records; the second also carries 3 bytes of a following handshake message.
    wire = frame(message[:10]) + frame(message[10:] + b"\x14\x00\x00")
    hello = parse_client_hello(wire)
    assert hello is not None and hello.raw_len == len(wire) - 3


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_random_record_boundaries(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(NAMES))
    message = handshake_message(vector(name))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(message) - 1), max_size=40)))
    pieces = [message[a:b] for a, b in zip([0, *cuts], [*cuts, len(message)], strict=True)]
    wire = b"".join(frame(p) for p in pieces)
    hello = parse_client_hello(wire)
    assert hello is not None and hello.sni == INDEX[name]["sni"]
    assert hello.raw_len == len(wire)


# --- errors and caps ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"G", b"GET / HTTP/1.1\r\n", b"\x80\x2e\x01\x03\x01", b"\x16\x04", b"\x16\x03\x04",
     b"SSH-2.0-OpenSSH_9.2\r\n", b"\x00"],
)  # fmt: skip
def test_not_tls_fails_on_the_first_bytes(data: bytes) -> None:
    assert reason_of(data) == "not_tls"
    with pytest.raises(ClientHelloError) as info:
        parse_client_hello(data)
    assert info.value.alert is None
    assert isinstance(info.value, RemoteProtocolError)


def test_empty_input_needs_more() -> None:
    assert parse_client_hello(b"") is None
    assert parse_client_hello(b"\x16") is None
    assert parse_client_hello(b"\x16\x03\x01\x02") is None


def test_not_a_client_hello() -> None:
    server_hello = b"\x02" + (40).to_bytes(3, "big") + bytes(40)
    with pytest.raises(ClientHelloError) as info:
        parse_client_hello(frame(server_hello)[:9])  # decided from the header alone
    assert info.value.reason == "not_client_hello"
    assert info.value.alert == tls_alert.UNEXPECTED_MESSAGE


def test_too_large_is_refused_from_the_header_alone() -> None:
    header = b"\x01" + (MAX_CLIENT_HELLO - 3).to_bytes(3, "big")
    assert reason_of(b"\x16\x03\x01\x40\x00" + header) == "too_large"
    assert reason_of(b"\x16\x03\x01\x00\x04" + b"\x01\xff\xff\xff") == "too_large"


def test_the_cap_itself_is_allowed() -> None:
    base = hello_message(sni_ext(b"big.example"), ext(21, b""))
    pad = MAX_CLIENT_HELLO - len(base)
    message = hello_message(sni_ext(b"big.example"), ext(21, bytes(pad)))
    assert len(message) == MAX_CLIENT_HELLO
    hello = parse_client_hello(frame(message))
    assert hello is not None and hello.sni == "big.example"
    over = hello_message(sni_ext(b"big.example"), ext(21, bytes(pad + 1)))
    assert reason_of(frame(over)) == "too_large"


def test_too_many_records() -> None:
    message = hello_message(sni_ext(b"a.example"), ext(21, bytes(400)))
    wire = frame(message, 1)
    cut = (MAX_HANDSHAKE_RECORDS + 1) * 6  # one byte of payload per 6-byte record
    assert reason_of(wire[:cut]) == "too_many_records"


@pytest.mark.parametrize(
    ("wire", "reason", "alert"),
    [
        (b"\x16\x03\x01\x00\x00", "malformed", tls_alert.DECODE_ERROR),  # empty record
        (b"\x16\x03\x01\x40\x01", "malformed", tls_alert.RECORD_OVERFLOW),
        (b"\x16\x03\x01\x00\x02\x01\x00" + b"\x15\x03\x03\x00\x02\x02\x28", "malformed",
         tls_alert.UNEXPECTED_MESSAGE),  # an alert record before the hello ended
        (b"\x16\x03\x01\x00\x02\x01\x00" + b"\x17", "malformed", tls_alert.UNEXPECTED_MESSAGE),
        (b"\x16\x03\x01\x00\x02\x01\x00" + b"\x16\x02\x01\x00\x01\x00", "malformed",
         tls_alert.DECODE_ERROR),
    ],
)  # fmt: skip
def test_record_layer_errors(wire: bytes, reason: str, alert: int) -> None:
    with pytest.raises(ClientHelloError) as info:
        parse_client_hello(wire)
    assert (info.value.reason, info.value.alert) == (reason, alert)


@pytest.mark.parametrize(
    "message",
    [
        hello_message(ext(0x0A, b"\x00\x02\x00\x1d"), ext(0x0A, b"\x00\x02\x00\x1d")),
        hello_message(sni_ext(b"a.example", b"b.example")),
        hello_message(ext(0, b"")),  # empty server_name extension
        hello_message(ext(0, vec(2, b""))),  # empty server_name_list
        hello_message(ext(0, vec(2, b"\x00\x00\x09a.example") + b"x")),  # junk after list
        hello_message(alpn_ext(b"h2", b"")),
        hello_message(ext(16, vec(2, b""))),
        hello_message(ext(43, b"\x03\x03\x04\x03")),  # odd version list
        hello_message(ext(43, b"\x00")),
        hello_message(trailer=b"\x00"),
        hello_message(suites=b""),
        hello_message(suites=b"\x13"),
        hello_message(compression=b""),
        hello_message(session_id=bytes(33)),
        hello_message(legacy_version=0x0200),
        hello_message(ext(0, b"\x00\x05\x00\x00\x09a.exa")),  # name overruns the list
        b"\x01\x00\x00\x05\x03\x03\x00\x00\x00",  # body ends inside random
    ],
)
def test_malformed_bodies(message: bytes) -> None:
    assert reason_of(frame(message)) == "malformed"


def test_no_extensions_at_all_is_legal() -> None:
    hello = parse_client_hello(frame(hello_message(with_extensions_block=False)))
    assert hello == ClientHello(None, (), 0x0303, 0x0301, len(hello_message()) + 3)


def test_unknown_server_name_types_are_skipped() -> None:
    message = hello_message(
        ext(0, vec(2, b"\x07" + vec(2, b"zzz") + b"\x00" + vec(2, b"ok.example")))
    )
    hello = parse_client_hello(frame(message))
    assert hello is not None and hello.sni == "ok.example"
    only_other = hello_message(sni_ext(b"zzz", name_type=7))
    hello = parse_client_hello(frame(only_other))
    assert hello is not None and hello.sni is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"Alina.Family.EXAMPLE", "alina.family.example"),
        (b"a.example.", "a.example"),
        (b"xn--bcher-kva.example", "xn--bcher-kva.example"),
        (b"_acme.a-b.example", "_acme.a-b.example"),
        (b"localhost", "localhost"),
        (b"a" * 63 + b".example", "a" * 63 + ".example"),
    ],
)
def test_sni_normalised(raw: bytes, expected: str) -> None:
    hello = parse_client_hello(frame(hello_message(sni_ext(raw))))
    assert hello is not None and hello.sni == expected


@pytest.mark.parametrize(
    "raw",
    [b"", b".", b"a..example", b"a.example..", b".a.example", b"a example", b"b\xc3\xbccher.de",
     b"a" * 64 + b".example", b"a." * 127 + b"ab", b"a/b", b"a\x00.example", b"*.example"],
)  # fmt: skip
def test_bad_sni(raw: bytes) -> None:
    with pytest.raises(ClientHelloError) as info:
        parse_client_hello(frame(hello_message(sni_ext(raw))))
    assert info.value.reason == "bad_sni"
    assert info.value.alert == tls_alert.ILLEGAL_PARAMETER


def test_alpn_is_latin1_decoded_so_any_bytes_round_trip() -> None:
    hello = parse_client_hello(frame(hello_message(alpn_ext(b"\xff\x00x", b"h2"))))
    assert hello is not None and hello.alpn == ("\xff\x00x", "h2")
    assert hello.alpn[0].encode("latin-1") == b"\xff\x00x"


# --- Hypothesis: only ClientHelloError may escape ------------------------------------------


def parse_or_error(data: bytes) -> ClientHello | None | ClientHelloError:
    try:
        return parse_client_hello(data)
    except ClientHelloError as exc:
        assert exc.reason in {"not_tls", "not_client_hello", "too_large", "too_many_records",
                              "malformed", "bad_sni"}  # fmt: skip
        return exc


@given(st.sampled_from(NAMES), st.data())
@settings(max_examples=300, deadline=None)
def test_truncation_never_errors(name: str, data: st.DataObject) -> None:
    wire = vector(name)
    cut = data.draw(st.integers(0, len(wire) - 1))
    assert parse_client_hello(wire[:cut]) is None


@given(st.binary(max_size=600))
@settings(max_examples=500, deadline=None)
def test_garbage_only_raises_clienthello_error(data: bytes) -> None:
    parse_or_error(data)


@given(st.binary(max_size=400))
@settings(max_examples=500, deadline=None)
def test_garbage_behind_a_valid_record_header(payload: bytes) -> None:
    parse_or_error(b"\x16\x03\x01" + len(payload).to_bytes(2, "big") + payload)
    parse_or_error(frame(b"\x01" + len(payload).to_bytes(3, "big") + payload))


@given(st.sampled_from(NAMES), st.data())
@settings(max_examples=500, deadline=None)
def test_bit_flips_only_raise_clienthello_error(name: str, data: st.DataObject) -> None:
    wire = bytearray(vector(name))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(wire) - 1))
        wire[index] ^= 1 << data.draw(st.integers(0, 7))
    result = parse_or_error(bytes(wire))
    if isinstance(result, ClientHello):
        assert result.raw_len <= len(wire)


@given(st.sampled_from(NAMES), st.data())
@settings(max_examples=200, deadline=None)
def test_byte_overwrites_in_the_message_only_raise_clienthello_error(
    name: str, data: st.DataObject
) -> None:
    message = bytearray(handshake_message(vector(name)))
    index = data.draw(st.integers(4, len(message) - 1))
    message[index] = data.draw(st.integers(0, 255))
    parse_or_error(frame(bytes(message)))


# --- TLS alerts as real clients report them --------------------------------------------------


def test_alert_record_bytes() -> None:
    assert alert_record(tls_alert.UNRECOGNIZED_NAME) == bytes.fromhex("15030300020270")
    assert alert_record(80, version=0x0301) == bytes.fromhex("15030100020250")
    with pytest.raises(ValueError):
        alert_record(256)
    with pytest.raises(ValueError):
        alert_record(40, version=0x0200)


def _answer_with_alert(listener: socket.socket, alert: bytes, seen: list[ClientHello]) -> None:
    """Accept one connection, read its ClientHello, answer with `alert`, close."""
    listener.settimeout(30)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        buf = b""
        hello = None
        while hello is None and len(buf) < 64 * 1024:  # bounded by the byte cap
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
            hello = parse_client_hello(buf)
        if hello is None:
            return
        seen.append(hello)
        conn.sendall(alert)


@pytest.fixture
def alert_server(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[ClientHello]]]:
    description: int = request.param
    seen: list[ClientHello] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        thread = threading.Thread(
            target=_answer_with_alert, args=(listener, alert_record(description), seen),
            daemon=True,
        )  # fmt: skip
        thread.start()
        yield listener.getsockname()[1], seen
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("alert_server", "expected"),
    [(tls_alert.UNRECOGNIZED_NAME, "TLSV1_UNRECOGNIZED_NAME"),
     (tls_alert.INTERNAL_ERROR, "TLSV1_ALERT_INTERNAL_ERROR")],
    indirect=["alert_server"],
)  # fmt: skip
def test_python_ssl_sees_the_alert(alert_server: tuple[int, list[ClientHello]],
                                   expected: str) -> None:  # fmt: skip
    port, seen = alert_server
    ctx = ssl.create_default_context()
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        pytest.raises(ssl.SSLError, match=expected),
    ):
        ctx.wrap_socket(sock, server_hostname="unknown.example")
    assert seen[0].sni == "unknown.example"


def _run_client(argv: list[str]) -> str:
    out = subprocess.run([require(argv[0]), *argv[1:]], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode != 0
    return out.stdout + out.stderr


@pytest.mark.parametrize("alert_server", [tls_alert.UNRECOGNIZED_NAME], indirect=True)
def test_openssl_s_client_sees_unrecognized_name(
    alert_server: tuple[int, list[ClientHello]],
) -> None:
    port, seen = alert_server
    text = _run_client(["openssl", "s_client", "-connect", f"127.0.0.1:{port}",
                        "-servername", "unknown.example"])  # fmt: skip
    assert "unrecognized name" in text and "alert number 112" in text
    assert seen[0].sni == "unknown.example"


@pytest.mark.parametrize("alert_server", [tls_alert.UNRECOGNIZED_NAME], indirect=True)
def test_curl_sees_unrecognized_name(alert_server: tuple[int, list[ClientHello]]) -> None:
    port, seen = alert_server
    text = _run_client(
        [
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--resolve",
            f"unknown.example:{port}:127.0.0.1",
            f"https://unknown.example:{port}/",
        ]
    )
    assert "unrecognized name" in text
    assert seen[0].sni == "unknown.example"


@pytest.mark.parametrize("alert_server", [tls_alert.UNRECOGNIZED_NAME], indirect=True)
def test_gnutls_cli_sees_unrecognized_name(alert_server: tuple[int, list[ClientHello]]) -> None:
    port, seen = alert_server
    text = _run_client(["gnutls-cli", "--insecure", "--sni-hostname=unknown.example",
                        "-p", str(port), "127.0.0.1"])  # fmt: skip
    assert "Received alert [112]: The server name sent was not recognized" in text
    assert seen[0].sni == "unknown.example"
