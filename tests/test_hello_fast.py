"""`proto/hello_fast.quick_sni` against the parser it stands in for.

The property: on any input, `quick_sni` either declines (None) or returns exactly the
SNI the full parser returns, and then the parser accepts the input (no error, whole
hello). So the engine's verdict — route, alert, reason — is the parser's on every input.
Inputs: the captured hellos of real clients, every prefix of them, random single-byte
and length-field mutations, hellos re-framed into several records, and synthetic hellos
built to hit each check (duplicates, framing of server_name / ALPN / supported_versions,
bad host names, bytes after the extensions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.proto import hello_fast
from pact_ingress.proto.clienthello import ClientHelloError, parse_client_hello
from pact_ingress.proto.hello_fast import quick_sni
from tests.test_clienthello import (
    INDEX,
    NAMES,
    alpn_ext,
    ext,
    frame,
    handshake_message,
    hello_message,
    sni_ext,
    vec,
    vector,
)


def agrees(data: bytes) -> str | None:
    """Check the property on `data`; the quick answer."""
    quick = quick_sni(data)
    try:
        full = parse_client_hello(data)
    except ClientHelloError:
        assert quick is None, data.hex()
        return None
    if quick is not None:
        assert full is not None and full.sni == quick, data.hex()
    return quick


@pytest.mark.parametrize("name", NAMES)
def test_real_hellos_take_the_quick_path(name: str) -> None:
    wire = vector(name)
    sni = INDEX[name]["sni"]
    # every captured client with an SNI is answered without the parser; without, declined
    assert agrees(wire) == sni
    assert agrees(wire + b"\x17\x03\x03\x00\x05hello") == sni  # bytes behind it ignored


@pytest.mark.parametrize("name", NAMES)
def test_every_prefix_declines(name: str) -> None:
    wire = vector(name)
    for cut in range(len(wire)):
        assert agrees(wire[:cut]) is None


@pytest.mark.parametrize("name", NAMES)
def test_several_records_decline(name: str) -> None:
    message = handshake_message(vector(name))
    assert agrees(frame(message, size=len(message) // 2 + 1)) is None


@given(st.data())
@settings(max_examples=600, deadline=None)
def test_mutated_hellos_agree(data: st.DataObject) -> None:
    wire = bytearray(vector(data.draw(st.sampled_from(NAMES))))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(wire) - 1))
        wire[at] = data.draw(st.sampled_from([0, 1, 2, 3, 0x10, 0x2b, 0x7f, 0xff,
                                              wire[at] ^ 1, wire[at] + 1 & 0xFF]))
    agrees(bytes(wire))


@given(st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_random_bytes_agree(data: bytes) -> None:
    agrees(b"\x16\x03\x01" + data)
    agrees(data)


GOOD_SNI = sni_ext(b"Www.Example.TEST.")


@pytest.mark.parametrize("message, expected", [
    (hello_message(GOOD_SNI), "www.example.test"),
    (hello_message(GOOD_SNI, alpn_ext(b"h2", b"http/1.1"),
                   ext(43, vec(1, b"\x03\x04\x03\x03"))), "www.example.test"),
    (hello_message(GOOD_SNI, session_id=bytes(32)), "www.example.test"),
    (hello_message(GOOD_SNI, ext(0xFFFF, b"")), "www.example.test"),
    (hello_message(sni_ext(b"a_b-c.d")), "a_b-c.d"),
    # declined: the parser decides (and either refuses, or finds no SNI)
    (hello_message(), None),
    (hello_message(with_extensions_block=False), None),
    (hello_message(GOOD_SNI, GOOD_SNI), None),
    (hello_message(GOOD_SNI, ext(16, b"")), None),
    (hello_message(GOOD_SNI, ext(16, vec(2, b""))), None),
    (hello_message(GOOD_SNI, alpn_ext(b"")), None),
    (hello_message(GOOD_SNI, ext(16, vec(2, b"\x05h2"))), None),
    (hello_message(GOOD_SNI, ext(43, b"")), None),
    (hello_message(GOOD_SNI, ext(43, vec(1, b"\x03"))), None),
    (hello_message(GOOD_SNI, ext(43, vec(1, b"\x03\x04") + b"\x00")), None),
    (hello_message(GOOD_SNI, ext(43, vec(1, b""))), None),
    (hello_message(sni_ext(b"a", b"b")), None),
    (hello_message(sni_ext(b"x.test", name_type=1)), None),
    (hello_message(ext(0, b"")), None),
    (hello_message(ext(0, vec(2, b""))), None),
    (hello_message(ext(0, vec(2, b"\x00\x00\x05ab"))), None),
    (hello_message(sni_ext(b"bad name")), None),
    (hello_message(sni_ext(b"a..b")), None),
    (hello_message(sni_ext(b"\xc3\xa9.test")), None),
    (hello_message(sni_ext(b"a" * 64 + b".test")), None),
    (hello_message(sni_ext(b".".join([b"a" * 63] * 4) + b".b")), None),
    (hello_message(GOOD_SNI, trailer=b"\x00"), None),
    (hello_message(GOOD_SNI, session_id=bytes(33)), None),
    (hello_message(GOOD_SNI, suites=b""), None),
    (hello_message(GOOD_SNI, suites=b"\x13"), None),
    (hello_message(GOOD_SNI, compression=b""), None),
    (hello_message(GOOD_SNI, legacy_version=0x0203), None),
])  # fmt: skip
def test_synthetic_hellos(message: bytes, expected: str | None) -> None:
    assert agrees(frame(message)) == expected
    assert agrees(frame(message, version=0x0303)) == expected
    assert agrees(frame(message, version=0x0304)) is None  # record version 3.4


# --- remembered extension layouts --------------------------------------------------------


def header_offsets(wire: bytes) -> list[int]:
    """Offsets in `wire` (one record) of its extension headers (the test's own walk)."""
    pos = 5 + 4 + 2 + 32
    pos += 1 + wire[pos]  # session_id
    pos += 2 + int.from_bytes(wire[pos : pos + 2], "big")  # cipher_suites
    pos += 1 + wire[pos]  # compression_methods
    end = pos + 2 + int.from_bytes(wire[pos : pos + 2], "big")
    pos += 2
    offsets = []
    while pos < end:
        offsets.append(pos)
        pos += 4 + int.from_bytes(wire[pos + 2 : pos + 4], "big")
    return offsets


def learned(wire: bytes, whole: bool = True) -> None:
    """Make `quick_sni` remember the layout of `wire` (an accepted hello, seen twice):
    its extension headers, and (`whole`) the whole hello's framing for its size, else
    no whole-hello layout of that size (its extension layout is what answers)."""
    hello_fast._WHOLE.pop(len(wire), None)
    hello_fast._LAYOUTS.clear()  # (a layout of its extensions learned earlier: again)
    assert agrees(wire) is not None
    assert agrees(wire) is not None
    assert any(layout[1] == tuple(
        int.from_bytes(wire[at + i : at + i + 2], "big")
        for at in header_offsets(wire) for i in (0, 2)) for layout in hello_fast._LAYOUTS.values())
    assert len(wire) in hello_fast._WHOLE
    if not whole:
        del hello_fast._WHOLE[len(wire)]


SNI_NAMES = [name for name in NAMES if INDEX[name]["sni"]]


@pytest.mark.parametrize("name", SNI_NAMES)
def test_a_layout_is_learned_from_accepted_hellos(name: str) -> None:
    learned(vector(name))
    assert agrees(vector(name)) == INDEX[name]["sni"]  # answered from the layout


def test_a_layout_is_learned_only_from_accepted_hellos() -> None:
    hello_fast._LAYOUTS.clear()
    hello_fast._SEEN.clear()
    hello_fast._WHOLE.clear()
    refused = frame(hello_message(sni_ext(b"bad name"), alpn_ext(b"h2")))
    for _ in range(3):
        assert agrees(refused) is None
    assert not hello_fast._LAYOUTS and not hello_fast._SEEN and not hello_fast._WHOLE


def test_layouts_are_bounded() -> None:
    for n in range(hello_fast._REMEMBERED + 10):  # a new layout each time, each seen twice
        wire = frame(hello_message(GOOD_SNI, ext(0xFF00, bytes(n % 300)),
                                   session_id=bytes(n // 300)))
        assert agrees(wire) == "www.example.test"
        assert agrees(wire) == "www.example.test"
        assert len(hello_fast._LAYOUTS) <= hello_fast._REMEMBERED
        assert len(hello_fast._SEEN) <= hello_fast._REMEMBERED
        assert len(hello_fast._WHOLE) <= hello_fast._REMEMBERED


@given(st.data())
@settings(max_examples=600, deadline=None)
def test_headers_mutated_against_a_learned_layout_agree(data: st.DataObject) -> None:
    """With its layout remembered, a hello whose extension headers (types, lengths) are
    mutated gets the parser's verdict: a duplicate type, a length that shifts the next
    header, one that overruns the block."""
    original = vector(data.draw(st.sampled_from(SNI_NAMES)))
    learned(original, whole=data.draw(st.booleans()))
    wire = bytearray(original)
    offsets = header_offsets(original)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.sampled_from(offsets)) + data.draw(st.integers(0, 3))
        wire[at] = data.draw(st.sampled_from([0, 1, 0x10, 0x2b, 0xff, wire[at] ^ 1,
                                              wire[at] + 1 & 0xFF, wire[at] - 1 & 0xFF]))
    agrees(bytes(wire))
    # a type made equal to another extension's type: a duplicate, never accepted
    first, second = data.draw(st.lists(st.sampled_from(offsets), min_size=2, max_size=2,
                                       unique=True))
    twice = bytearray(original)
    twice[second : second + 2] = original[first : first + 2]
    assert agrees(bytes(twice)) is None


@pytest.mark.parametrize("name", SNI_NAMES)
def test_a_whole_layout_answers_without_the_walk(name: str) -> None:
    wire = vector(name)
    learned(wire)
    hello_fast._LAYOUTS.clear()
    hello_fast._SEEN.clear()
    assert agrees(wire) == INDEX[name]["sni"]
    # answered from the whole layout: the walk, which notes every accepted layout, did
    # not run
    assert not hello_fast._SEEN and not hello_fast._LAYOUTS


@given(st.data())
@settings(max_examples=600, deadline=None)
def test_bytes_mutated_against_a_whole_layout_agree(data: st.DataObject) -> None:
    """With the whole hello's layout remembered, any byte of a hello of the same size
    mutated (a record or message length, the session_id length, a list length inside
    server_name, ALPN or supported_versions, a host name byte, a header) gets the
    parser's verdict."""
    original = vector(data.draw(st.sampled_from(SNI_NAMES)))
    learned(original)
    wire = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(wire) - 1))
        wire[at] = data.draw(st.sampled_from([0, 1, 2, 0x20, 0x2e, 0x41, 0xff, wire[at] ^ 1,
                                              wire[at] + 1 & 0xFF, wire[at] - 1 & 0xFF]))
    agrees(bytes(wire))


def test_a_size_keeps_its_first_whole_layout() -> None:
    """Two accepted layouts of one size: the first keeps the size, the second is
    answered as before (the walk, then its extension layout), each with its own name."""
    hello_fast._WHOLE.clear()
    first = frame(hello_message(sni_ext(b"one.test"), alpn_ext(b"h2")))
    second = frame(hello_message(alpn_ext(b"h2"), sni_ext(b"two.test")))
    assert len(first) == len(second)
    for _ in range(3):
        assert agrees(first) == "one.test"
    kept = hello_fast._WHOLE[len(first)]
    for _ in range(3):
        assert agrees(second) == "two.test"
    for _ in range(3):
        assert agrees(first) == "one.test"
        assert agrees(second) == "two.test"
    assert hello_fast._WHOLE[len(first)] is kept


def _variants(name: bytes) -> list[bytes]:
    """Spellings of `name` around the host-name rule: case, dots, bytes it must refuse."""
    return [name, name.upper(), name.title(), name + b".", name + b"..", b"." + name,
            name.upper() + b".", name + b"\x00", name + b" ", name + b"\xc3\xa9",
            name.replace(b".", b".."), name.replace(b".", b"\x00"), name[:-1],
            name + b"." + b"a" * 63, name + b"." + b"a" * 64,
            (name + b".") * (253 // (len(name) + 1)) + name[:1],
            b"a" * (253 - len(name) - 1) + b"." + name,
            b"a" * (254 - len(name) - 1) + b"." + name,
            b"a" * (253 - len(name) - 1) + b"." + name + b"."]


ALPNS = [(b"h2", b"http/1.1"), (b"http/1.1",), (b"acme-tls/1",), (b"h2",),
         (b"h2", b""), (b"", b"h2"), (b"h2", b"http/1.1", b"x" * 255)]


@pytest.mark.parametrize("cold", [True, False], ids=["cold-cache", "warm-cache"])
def test_remembered_names_and_alpn_lists_never_change_a_verdict(cold: bool) -> None:
    """A client fills the remembered names and ALPN lists with valid entries; then every
    hostile spelling of those names and every ALPN list around the remembered ones, as
    bytes and as a bytearray, still gets exactly the parser's verdict. `cold`: the maps
    are emptied first, and again by overfilling them (more names than they keep)."""
    names = [b"mcp.attack.test", b"Opt.Attack.Test", b"a_b-c.d", b"x" * 63 + b".test"]
    if cold:
        hello_fast._HOSTS.clear()
        hello_fast._ALPN_LISTS.clear()
    for name in names:  # the honest client first: valid entries remembered
        for alpn in ALPNS[:4]:
            assert agrees(frame(hello_message(sni_ext(name), alpn_ext(*alpn)))) is not None
    if cold:  # forgotten by overfilling, then the same hostile inputs again below
        for i in range(hello_fast._REMEMBERED + 5):
            agrees(frame(hello_message(sni_ext(b"n%d.fill.test" % i))))
    for name in names:
        for variant in _variants(name):
            for alpn in ALPNS:
                wire = frame(hello_message(sni_ext(variant), alpn_ext(*alpn)))
                quick = agrees(wire)
                assert quick_sni(bytearray(wire)) == quick
                assert agrees(wire) == quick  # asked again: the remembered answer
    assert len(hello_fast._HOSTS) <= hello_fast._REMEMBERED
    assert len(hello_fast._ALPN_LISTS) <= hello_fast._REMEMBERED
    assert all(type(k) is bytes for k in hello_fast._HOSTS)
