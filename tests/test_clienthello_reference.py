"""Differential test: `proto.clienthello` against its previous implementation
(`tests/clienthello_reference.py`) on real clients' hellos, mutated every way the parser
tests mutate them and more: the fast path for a hello in one record and the in-place body
parser must answer exactly as before (the same fields, or the same error reason, TLS
alert and message), so routing and the alerts malformed hellos get are unchanged."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.proto.clienthello import ClientHelloError, parse_client_hello
from tests import clienthello_reference as reference
from tests.test_clienthello import (
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


def _answer(parse: object, data: bytes) -> object:
    try:
        result = parse(data)  # type: ignore[operator]
    except (ClientHelloError, reference.ClientHelloError) as exc:
        return ("error", exc.reason, exc.alert, str(exc))
    if result is None:
        return None
    if dataclasses.is_dataclass(result):
        return tuple(dataclasses.astuple(result))
    return tuple(result)


def same(data: bytes) -> None:
    assert _answer(parse_client_hello, data) == _answer(reference.parse_client_hello, data)


def test_vectors_every_prefix_and_refragmented() -> None:
    for name in NAMES:
        wire = vector(name)
        for cut in range(len(wire) + 1):
            same(wire[:cut])
        message = handshake_message(wire)
        for size in (1, 7, 100, 511, 16384):
            same(frame(message, size))
        same(wire + b"\x17\x03\x03\x00\x01x")  # bytes behind the hello


@given(st.sampled_from(NAMES), st.data())
@settings(max_examples=1500, deadline=None)
def test_bit_flips_and_overwrites(name: str, data: st.DataObject) -> None:
    wire = bytearray(vector(name))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(wire) - 1))
        if data.draw(st.booleans()):
            wire[index] ^= 1 << data.draw(st.integers(0, 7))
        else:
            wire[index] = data.draw(st.integers(0, 255))
    same(bytes(wire))
    same(bytes(wire[: data.draw(st.integers(0, len(wire)))]))


@given(st.sampled_from(NAMES), st.data())
@settings(max_examples=800, deadline=None)
def test_message_overwrites_in_one_or_many_records(name: str, data: st.DataObject) -> None:
    message = bytearray(handshake_message(vector(name)))
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.integers(0, len(message) - 1))
        message[index] = data.draw(st.integers(0, 255))
    same(frame(bytes(message)))
    same(frame(bytes(message), data.draw(st.integers(1, 600))))


_EXTENSIONS = st.one_of(
    st.builds(ext, st.sampled_from([0, 10, 16, 43, 45, 51, 0xFE0D]), st.binary(max_size=12)),
    st.builds(sni_ext, st.sampled_from([b"a.example", b"B.Example.", b"bad name", b""])),
    st.builds(alpn_ext, st.sampled_from([b"h2", b"http/1.1", b""])),
    st.builds(lambda v: ext(43, vec(1, v)), st.sampled_from([b"\x03\x04\x03\x03", b"\x03"])),
    st.binary(min_size=1, max_size=6),  # a torn extension header or body
)


@given(st.lists(_EXTENSIONS, max_size=8), st.binary(max_size=3), st.binary(max_size=40),
       st.integers(0, 3))
@settings(max_examples=1500, deadline=None)
def test_synthetic_extension_blocks(extensions: list[bytes], trailer: bytes,
                                    session_id: bytes, dup: int) -> None:
    """Duplicates, overruns, torn headers and trailing bytes, alone and together: the
    error named first must be the one named before."""
    if extensions and dup:
        extensions = [*extensions, extensions[dup % len(extensions)]]
    message = hello_message(*extensions, trailer=trailer, session_id=session_id)
    same(frame(message))
    same(frame(message, 64))
    cut = len(message) - len(trailer) - 1
    same(frame(message[:cut]))
