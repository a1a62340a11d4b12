"""The forward link's preamble (pure): round trip at every split, caps, garbage."""

from __future__ import annotations

import pytest

from pact_ingress.proto.forward import (
    MAGIC,
    MAX_TENANT,
    REQUEST_MAX,
    VERSION,
    Answer,
    ForwardProtocolError,
    RequestDecoder,
    decode_answer,
    encode_answer,
    encode_request,
)


@pytest.mark.parametrize("tenant", ["family", "a", "x" * MAX_TENANT, "a-1"])
def test_request_round_trips_at_every_split(tenant: str) -> None:
    wire = encode_request(tenant) + b"tail"
    for cut in range(len(wire) + 1):
        d = RequestDecoder()
        first = d.feed(wire[:cut])
        assert first in (None, tenant)
        assert d.feed(wire[cut:]) == tenant
        assert d.rest == b"tail"
    d = RequestDecoder()  # one byte at a time
    got = [d.feed(bytes((b,))) for b in wire]
    assert got[len(encode_request(tenant)) - 1] == tenant
    assert got[len(encode_request(tenant)) - 2] is None


def test_the_longest_request_is_request_max() -> None:
    assert len(encode_request("x" * MAX_TENANT)) == REQUEST_MAX


@pytest.mark.parametrize("tenant", ["", "x" * (MAX_TENANT + 1), "Family", "-a", "a:b", "ä"])
def test_encode_refuses_non_tenant_names(tenant: str) -> None:
    with pytest.raises(ValueError):
        encode_request(tenant)


@pytest.mark.parametrize("wire", [
    b"GET / HTTP/1.1\r\n",
    b"\x16\x03\x01",
    b"PFWx",
    MAGIC + bytes((VERSION + 1, 1)) + b"a",
    MAGIC + bytes((VERSION, 0)),
    MAGIC + bytes((VERSION, MAX_TENANT + 1)) + b"a" * (MAX_TENANT + 1),
    MAGIC + bytes((VERSION, 255)),
    MAGIC + bytes((VERSION, 3)) + b"a:b",
    MAGIC + bytes((VERSION, 2)) + b"-a",
    MAGIC + bytes((VERSION, 1)) + b"\x00",
])
def test_garbage_is_a_protocol_error_at_any_split(wire: bytes) -> None:
    for cut in range(len(wire) + 1):
        d = RequestDecoder()
        with pytest.raises(ForwardProtocolError):
            d.feed(wire[:cut])
            d.feed(wire[cut:])


def test_garbage_is_refused_before_the_cap() -> None:
    d = RequestDecoder()
    with pytest.raises(ForwardProtocolError):
        d.feed(b"x")  # the first wrong byte decides; nothing is buffered towards a cap


def test_answers() -> None:
    for answer in Answer:
        assert decode_answer(encode_answer(answer)) is answer
    for bad in (b"", b"\x00\x00", b"\x09"):
        with pytest.raises(ForwardProtocolError):
            decode_answer(bad)
