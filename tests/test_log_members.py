"""`EventLogger.emit_members` writes the very line `log.info` writes for the same fields."""

from __future__ import annotations

import io
import json
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest

from pact_ingress import logs


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    bound = dict(logs._bound)
    logs.setup("json", stream=out)
    try:
        yield out
    finally:
        logs._bound.clear()
        logs._bound.update(bound)
        logs._bound_members = logs.members(**bound) + "," if bound else ""
        logs.setup("json")


def _without_ts(line: str) -> dict[str, Any]:
    parsed = json.loads(line)
    assert isinstance(parsed.pop("ts"), float)
    return parsed


def _fields(rng: random.Random) -> dict[str, Any]:
    text = ["a.example", "tén\u00e4nt", 'q"uote\\', "", "\u2603 snow", "127.0.0.1"]
    return {
        "route": rng.choice(text),
        "tenant": rng.choice([*text, None]),
        "mode": "passthrough",
        "client_ip": rng.choice(["127.0.0.1", "::1", "2001:db8::1"]),
        "bytes_up": rng.randrange(1 << 40),
        "bytes_down": rng.randrange(1 << 40),
        "duration_s": round(rng.random() * 10 ** rng.randrange(6), 3),
        "outcome": rng.choice(["ok", "reset", "idle_timeout"]),
    }


@pytest.mark.parametrize("bound", [{}, {"worker": 3}])
def test_members_line_equals_info_line(stream: io.StringIO, bound: dict[str, Any]) -> None:
    logs.bind(**bound)
    rng = random.Random(7)
    for _ in range(200):
        fields = _fields(rng)
        logs.log.info("conn_close", **fields)
        assert logs.log.emit_members(logging.INFO, "conn_close", logs.members(**fields),
                                     frozenset(fields))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 400
    for plain, fast in zip(lines[::2], lines[1::2]):
        # same bytes apart from the timestamp: same keys, order and encoding
        assert plain.split(",", 1)[1] == fast.split(",", 1)[1]
        assert _without_ts(plain) == _without_ts(fast)


def test_held_lines_come_out_in_order(stream: io.StringIO) -> None:
    logs.log.hold()
    logs.log.emit_members(logging.INFO, "one", logs.members(n=1), frozenset({"n"}))
    logs.log.info("two", n=2)
    assert stream.getvalue() == ""
    logs.log.release()
    assert [json.loads(x)["event"] for x in stream.getvalue().splitlines()] == ["one", "two"]


def test_declines_when_a_bound_field_shares_a_name(stream: io.StringIO) -> None:
    logs.bind(route="bound")
    assert not logs.log.emit_members(logging.INFO, "e", logs.members(route="x"),
                                     frozenset({"route"}))
    assert stream.getvalue() == ""


def test_declines_for_the_text_format() -> None:
    out = io.StringIO()
    logs.setup("text", stream=out)
    try:
        assert not logs.log.emit_members(logging.INFO, "e", logs.members(n=1),
                                         frozenset({"n"}))
        assert out.getvalue() == ""
    finally:
        logs.setup("json")


def test_held_lines_are_judged_as_unheld_ones(stream: io.StringIO) -> None:
    """While lines are held, `emit_members` answers what it answers unheld: INFO lines
    below the level, other levels, a second handler and a bound field of the same name
    are declined (the caller logs them the usual way), the rest held and written."""
    def emit(level: int = logging.INFO, name: str = "n") -> bool:
        return logs.log.emit_members(level, "e", logs.members(**{name: 1}),
                                     frozenset({name}))

    logs.log.hold()
    try:
        assert emit() and emit(logging.WARNING)
        assert not emit(logging.DEBUG)
    finally:
        logs.log.release()
    assert len(stream.getvalue().splitlines()) == 2
    logging.getLogger("pact_ingress").setLevel(logging.WARNING)
    logs.log.hold()
    try:
        assert not emit() and emit(logging.WARNING)
    finally:
        logs.log.release()
    logging.getLogger("pact_ingress").setLevel(logging.INFO)
    extra = logging.StreamHandler(io.StringIO())
    logging.getLogger("pact_ingress").addHandler(extra)
    logs.log.hold()
    try:
        assert not emit()
    finally:
        logs.log.release()
        logging.getLogger("pact_ingress").removeHandler(extra)
    logs.bind(n="bound")
    logs.log.hold()
    try:
        assert not emit() and emit(name="m")
    finally:
        logs.log.release()
    assert len(stream.getvalue().splitlines()) == 4
