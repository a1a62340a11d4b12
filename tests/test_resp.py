"""proto.resp: the encoder, the incremental parser at every split, the caps, and garbage
(only RespProtocolError may come out)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.proto import resp
from pact_ingress.proto.resp import (
    NEED_DATA,
    Parser,
    RespError,
    RespProtocolError,
    encode_command,
)


def test_encode_command() -> None:
    assert encode_command("EVALSHA", b"ab", 2, "k\u00e9") == (
        b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$3\r\nk\xc3\xa9\r\n")
    assert encode_command("SET", "") == b"*2\r\n$3\r\nSET\r\n$0\r\n\r\n"
    with pytest.raises(ValueError):
        encode_command()
    with pytest.raises(TypeError):
        encode_command("SET", True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_command("SET", None)  # type: ignore[arg-type]


#: (wire bytes, the replies they hold)
STREAM = [
    (b"+OK\r\n", b"OK"),
    (b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
     RespError("NOSCRIPT No matching script. Please use EVAL.")),
    (b":0\r\n", 0),
    (b":-9223372036854775808\r\n", -9223372036854775808),
    (b"$2\r\nok\r\n", b"ok"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"$4\r\na\r\nb\r\n", b"a\r\nb"),  # a bulk string may hold CRLF
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n$1\r\na\r\n*2\r\n:1\r\n$-1\r\n*0\r\n", [b"a", [1, None], []]),
    (b"*2\r\n-ERR x\r\n+y\r\n", [RespError("ERR x"), b"y"]),
]


def test_each_reply() -> None:
    for wire, want in STREAM:
        p = Parser()
        p.feed(wire)
        assert p.next_reply() == want, wire
        assert p.next_reply() is NEED_DATA
        assert p.buffered == 0


def test_error_kind() -> None:
    assert RespError("NOSCRIPT No matching script").kind == "NOSCRIPT"
    assert RespError("WRONGPASS invalid").kind == "WRONGPASS"


def _replies(parts: list[bytes]) -> list[object]:
    p = Parser()
    got = []
    for part in parts:
        p.feed(part)
        while (r := p.next_reply()) is not NEED_DATA:
            got.append(r)
    return got


def test_every_split_offset() -> None:
    wire = b"".join(w for w, _ in STREAM)
    want = [r for _, r in STREAM]
    for cut in range(len(wire) + 1):
        assert _replies([wire[:cut], wire[cut:]]) == want, cut
    assert _replies([wire[i:i + 1] for i in range(len(wire))]) == want


def test_byte_by_byte_nothing_early() -> None:
    wire = b"*2\r\n$5\r\nhello\r\n:42\r\n"
    p = Parser()
    for i, byte in enumerate(wire):
        p.feed(bytes([byte]))
        r = p.next_reply()
        assert (r is NEED_DATA) == (i < len(wire) - 1)
    assert r == [b"hello", 42]


@pytest.mark.parametrize("wire", [
    b"?x\r\n",                       # unknown type byte
    b":12a\r\n", b":+1\r\n", b": 1\r\n", b":\r\n", b":1_0\r\n",
    b":" + b"9" * 30 + b"\r\n",      # longer than any 64-bit integer
    b"$-2\r\n", b"$x\r\n",
    b"$2\r\nokXY",                   # bulk not followed by CRLF
    b"*-2\r\n",
    b"+a\nb\r\n",                    # bare LF in a line
    b"+abc\n",
])
def test_malformed(wire: bytes) -> None:
    p = Parser()
    p.feed(wire)
    with pytest.raises(RespProtocolError):
        p.next_reply()
    with pytest.raises(RespProtocolError):  # and for good: the stream is out of step
        p.next_reply()


def test_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Parser()
    p.feed(b"$%d\r\n" % (resp.MAX_BULK_LENGTH + 1))
    with pytest.raises(RespProtocolError, match="MAX_BULK_LENGTH"):
        p.next_reply()
    p = Parser()
    p.feed(b"$%d\r\n" % resp.MAX_BULK_LENGTH)  # at the cap: waits for the data
    assert p.next_reply() is NEED_DATA
    p = Parser()
    p.feed(b"*%d\r\n" % (resp.MAX_ARRAY_LENGTH + 1))
    with pytest.raises(RespProtocolError, match="MAX_ARRAY_LENGTH"):
        p.next_reply()
    p = Parser()
    p.feed(b"*1\r\n" * resp.MAX_NESTING + b":1\r\n")
    r = p.next_reply()
    for _ in range(resp.MAX_NESTING):
        assert isinstance(r, list)
        r = r[0]
    assert r == 1
    p = Parser()
    p.feed(b"*1\r\n" * (resp.MAX_NESTING + 1) + b":1\r\n")
    with pytest.raises(RespProtocolError, match="MAX_NESTING"):
        p.next_reply()
    p = Parser()
    p.feed(b"+" + b"a" * resp.MAX_LINE_LENGTH)  # at the cap, no CRLF yet: waits
    assert p.next_reply() is NEED_DATA
    p.feed(b"aa")
    with pytest.raises(RespProtocolError, match="MAX_LINE_LENGTH"):
        p.next_reply()
    p = Parser()
    p.feed(b"+" + b"a" * resp.MAX_LINE_LENGTH + b"\r\n")  # at the cap: a reply
    assert p.next_reply() == b"a" * resp.MAX_LINE_LENGTH


@settings(max_examples=500)
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_garbage_raises_only_protocol_error(chunks: list[bytes]) -> None:
    p = Parser()
    try:
        for chunk in chunks:
            p.feed(chunk)
            while p.next_reply() is not NEED_DATA:
                pass
    except RespProtocolError:
        pass


_reply = st.recursive(
    st.one_of(st.binary(max_size=20), st.integers(-2**63, 2**63 - 1), st.none(),
              st.text(alphabet=st.characters(blacklist_characters="\r\n",
                                             blacklist_categories=("Cs",)),
                      max_size=10).map(lambda t: RespError("ERR " + t))),
    lambda inner: st.lists(inner, max_size=4), max_leaves=12)


def _wire(value: object) -> bytes:
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%b\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, RespError):
        return b"-" + value.message.encode() + b"\r\n"
    assert isinstance(value, list)
    return b"*%d\r\n" % len(value) + b"".join(_wire(v) for v in value)


@settings(max_examples=300)
@given(st.lists(_reply, min_size=1, max_size=5), st.data())
def test_roundtrip_any_split(replies: list[object], data: st.DataObject) -> None:
    wire = b"".join(_wire(r) for r in replies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    p = Parser()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)]):
        p.feed(wire[a:b])
        while (r := p.next_reply()) is not NEED_DATA:
            got.append(r)
    assert got == replies
