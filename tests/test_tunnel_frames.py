"""Tunnel framing (sans-I/O) and the connector's pure helpers: no sockets, no clock."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.net.tunnel.connector import BACKOFF_CAP, Backoff
from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.session import POOL_MAX, POOL_MIN, PoolSizer

TOKEN = bytes(range(32))
MESSAGES: list[tf.Message] = [
    tf.Hello(tf.VERSION, 3, b"i" * 16),
    tf.Welcome(b"s" * 16, 5000),
    tf.Ping(0),
    tf.Ping(2**64 - 1),
    tf.Pong(42),
    tf.Token(TOKEN),
    tf.Spare(TOKEN),
    tf.Goaway(tf.GoawayCode.SHUTDOWN, 2000, "ingress shutting down"),
    tf.Goaway(tf.GoawayCode.DRAINING),
    tf.DataHello(TOKEN),
    tf.DataOk(),
]


def drain(decoder: tf.Decoder) -> list[tf.Message]:
    out = []
    while (msg := decoder.next_message()) is not None:
        out.append(msg)
    return out


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: tf.Message) -> None:
    decoder = tf.Decoder()
    decoder.feed(tf.encode(msg))
    assert drain(decoder) == [msg]
    assert decoder.buffered == 0


def test_split_at_every_offset() -> None:
    wire = b"".join(tf.encode(m) for m in MESSAGES)
    for cut in range(len(wire) + 1):
        decoder = tf.Decoder()
        decoder.feed(wire[:cut])
        got = drain(decoder)
        decoder.feed(wire[cut:])
        got += drain(decoder)
        assert got == MESSAGES, cut


def test_byte_by_byte_returns_none_until_complete() -> None:
    wire = tf.encode(tf.Token(TOKEN))
    decoder = tf.Decoder()
    for b in wire[:-1]:
        decoder.feed(bytes([b]))
        assert decoder.next_message() is None
    decoder.feed(wire[-1:])
    assert decoder.next_message() == tf.Token(TOKEN)


@pytest.mark.parametrize("wire, why", [
    (b"\x63\x00\x00", "unknown frame type"),
    (b"\x03\xff\xff", "over cap"),
    (b"\x03\x00\x07" + b"\x00" * 7, "bad PING"),
    (b"\x05\x00\x05" + b"short", "bad TOKEN"),
    (b"\x09\x00\x21" + b"t" * 33, "bad SPARE"),
    (b"\x08\x00\x01x", "bad DATA_OK"),
    (b"\x06\x00\x05" + b"\x63\x00\x00\x00\x00", "bad GOAWAY"),
    (b"\x01\x00\x12" + b"\x01\x00" + b"i" * 16, None),  # a valid HELLO, for contrast
])
def test_invalid_frames_raise(wire: bytes, why: str | None) -> None:
    decoder = tf.Decoder()
    decoder.feed(wire)
    if why is None:
        assert isinstance(decoder.next_message(), tf.Hello)
        return
    with pytest.raises(tf.FrameError, match=why):
        decoder.next_message()


def test_unknown_type_fails_on_header_alone() -> None:
    decoder = tf.Decoder()
    decoder.feed(b"\x99\x00\x10")  # the payload never needs to arrive
    with pytest.raises(tf.FrameError):
        decoder.next_message()


def test_buffer_cap() -> None:
    decoder = tf.Decoder()
    decoder.feed(b"\x03\x00\x08")
    with pytest.raises(tf.FrameError, match="buffered"):
        decoder.feed(b"\x00" * tf.MAX_BUFFERED)


def test_goaway_reason_is_cut_not_refused() -> None:
    wire = tf.encode(tf.Goaway(tf.GoawayCode.PROTOCOL_ERROR, 0, "é" * 500))
    decoder = tf.Decoder()
    decoder.feed(wire)
    msg = decoder.next_message()
    assert isinstance(msg, tf.Goaway) and len(msg.reason.encode()) <= tf.MAX_REASON + 3


def test_encode_rejects_wrong_sizes() -> None:
    with pytest.raises(ValueError):
        tf.encode(tf.Token(b"short"))
    with pytest.raises(ValueError):
        tf.encode(tf.Hello(1, 0, b"x"))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_never_crashes(data: bytes) -> None:
    decoder = tf.Decoder()
    decoder.feed(data)
    try:
        drain(decoder)
    except tf.FrameError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(MESSAGES), max_size=8), st.data())
def test_any_chunking_decodes_the_same(msgs: list[tf.Message], data: st.DataObject) -> None:
    wire = b"".join(tf.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    decoder, got, last = tf.Decoder(), [], 0
    for cut in [*cuts, len(wire)]:
        decoder.feed(wire[last:cut])
        last = cut
        got += drain(decoder)
    assert got == msgs


def test_frame_budget_refuses_floods_and_refills() -> None:
    budget = tf.FrameBudget(rate=10, burst=5, now=0.0)
    assert all(budget.take(0.0) for _ in range(5))
    assert not budget.take(0.0)
    assert budget.take(0.1)  # one token back after 1/rate seconds
    assert not budget.take(0.1)
    assert sum(budget.take(100.0) for _ in range(10)) == 5  # never above burst


def test_backoff_grows_jittered_capped_and_resets() -> None:
    backoff = Backoff(base=0.5, cap=BACKOFF_CAP, rng=random.Random(7))
    delays = [backoff.next() for _ in range(12)]
    for i, d in enumerate(delays):
        ceiling = min(BACKOFF_CAP, 0.5 * 2**i)
        assert ceiling / 2 <= d <= ceiling
    assert max(delays) <= BACKOFF_CAP and delays[-1] >= BACKOFF_CAP / 2
    backoff.reset()
    assert backoff.next() <= 0.5
    assert len({round(Backoff(rng=random.Random(s)).next(), 6) for s in range(10)}) > 1


def test_pool_sizer_follows_open_rate_and_latency() -> None:
    sizer = PoolSizer()
    assert sizer.target(0.0) == POOL_MIN
    for i in range(500):  # 100 opens/s for 5 s
        sizer.took(i / 100)
    for i in range(50):
        sizer.refilled(4.0 + i / 50, 0.2)  # 200 ms refills (a far-away connector)
    assert sizer.target(5.0) >= POOL_MIN + 30
    assert sizer.target(5.0) <= POOL_MAX
    assert sizer.target(100.0) == POOL_MIN  # the rate window forgot the burst


def test_pool_sizer_does_not_feed_on_its_own_bursts() -> None:
    """Refills queued behind each other look slow; that must not grow the pool (which
    would queue more refills: the loop the bench hinted at)."""
    sizer = PoolSizer()
    for i in range(500):  # 100 opens/s for 5 s
        sizer.took(i / 100)
    for i in range(10):
        sizer.refilled(i / 10, 0.002)  # the path: 2 ms
    calm = sizer.target(5.0)
    assert calm == POOL_MIN + 1
    for i in range(POOL_MAX):
        sizer.refilled(1.0 + i / 100, 0.05 * (i + 1))  # a burst, each queued behind the last
    assert sizer.target(5.0) == calm
    # a path that really became slower is followed once the fast samples age out
    for i in range(20):
        sizer.refilled(12.0 + i / 100, 0.1)
    for i in range(500):
        sizer.took(12.0 + i / 100)
    assert sizer.target(17.0) == POOL_MIN + math.ceil(2 * 100 * 0.1)
