"""The access log's buffer: lines are kept in memory and written together, never lost,
never reordered against the process's other lines."""

from __future__ import annotations

import io
import json
import math

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress import logs
from pact_ingress.logs import log


def _events(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in stream.getvalue().splitlines()]


def test_access_lines_wait_then_come_before_the_next_line() -> None:
    stream = io.StringIO()
    logs.setup("json", stream=stream)
    try:
        log.access("request", path="/a", status=200)
        log.access("request", path="/b", status=200)
        assert stream.getvalue() == ""  # buffered: no write per request
        log.info("reloaded")  # any other line flushes what came before it first
        assert _events(stream) == ["request", "request", "reloaded"]
        assert [json.loads(x).get("path") for x in stream.getvalue().splitlines()][:2] == [
            "/a", "/b"]
    finally:
        log.flush()


def test_a_full_buffer_is_written_at_once_and_masked_fields_stay_masked() -> None:
    stream = io.StringIO()
    logs.setup("json", stream=stream)
    try:
        count = logs.ACCESS_BUFFER_BYTES // 60 + 2
        for i in range(count):
            log.access("request", path=f"/{i:040d}", body="never")
        written = stream.getvalue().splitlines()
        assert written, "a full buffer must be written without waiting for the timer"
        assert all(json.loads(line)["body"] == "MASKED" for line in written)
        log.flush()
        assert len(stream.getvalue().splitlines()) == count
    finally:
        log.flush()


def test_flush_forever_bounds_the_wait() -> None:
    stream = io.StringIO()
    logs.setup("json", stream=stream)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log.flush_forever)
            log.access("request", path="/late")
            await trio.sleep(logs.ACCESS_FLUSH_INTERVAL * 1.5)
            assert _events(stream) == ["request"]
            log.access("request", path="/at-exit")
            nursery.cancel_scope.cancel()  # the task's exit writes what is left
        assert _events(stream) == ["request", "request"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_text_format_writes_each_line_at_once() -> None:
    stream = io.StringIO()
    logs.setup("text", stream=stream)
    try:
        log.access("request", path="/t", status=200)
        assert "request" in stream.getvalue()
    finally:
        log.flush()


@given(st.dictionaries(
    st.one_of(st.sampled_from(["ts", "level", "event", "path"]), st.text(min_size=1,
                                                                         max_size=12)),
    st.one_of(st.text(max_size=40), st.integers(), st.floats(allow_nan=False), st.none(),
              st.booleans()), max_size=8),
       st.text(min_size=1, max_size=12), st.floats(min_value=0, max_value=4e9))
def test_access_line_is_the_same_json_as_every_other_line(fields: dict[str, object],
                                                          event: str, ts: float) -> None:
    assert logs._access_line(ts, event, fields) == logs._json_line(ts, "info", event,
                                                                   fields) + "\n"


@given(st.text(max_size=30), st.text(max_size=40), st.text(max_size=12), st.text(max_size=60),
       st.integers(min_value=100, max_value=999),
       st.one_of(st.floats(min_value=0, max_value=1e7),
                 st.floats(allow_nan=False, allow_infinity=False),  # beyond the fast path
                 st.integers(-10**15, 10**15).map(lambda n: n / 20)),  # ties at .05
       st.sampled_from([{}, {"worker": 1}, {"route": "bound", "worker": 2}]))
def test_request_line_is_the_access_line(route: str, client_ip: str, method: str, path: str,
                                         status: int, ms: float,
                                         bound: dict[str, object]) -> None:
    """`log.request` (the terminate engine's line, from a per-connection prefix) writes
    what `log.access` writes for the same fields with the milliseconds rounded to one
    decimal, bound fields included — also when a bound field shares a name with a
    request field; and the milliseconds' text is the rounded float's repr."""
    saved = dict(logs._bound)
    fields = {"route": route, "client_ip": client_ip, "method": method, "path": path,
              "status": status, "ms": round(ms, 1)}
    try:
        logs._bound.clear()
        logs.bind(**bound)
        lines = []
        for emit in (lambda: log.request(logs.request_prefix(route, client_ip), method, path,
                                         status, ms),
                     lambda: log.access("request", **fields)):
            stream = io.StringIO()
            logs.setup("json", stream=stream)
            emit()
            log.flush()
            text = stream.getvalue()
            assert text.endswith(f',"ms":{round(ms, 1)!r}}}\n')
            lines.append(json.loads(text))
        lines[0].pop("ts")
        lines[1].pop("ts")
        assert lines[0] == lines[1]
        assert list(lines[0]) == list(lines[1])  # and in the same order
    finally:
        logs._bound.clear()
        logs.bind(**saved)


def test_request_line_in_text_format() -> None:
    stream = io.StringIO()
    logs.setup("text", stream=stream)
    try:
        log.request(logs.request_prefix("a.test", "192.0.2.1"), "GET", "/x", 200, 1.5)
        assert "request route=a.test client_ip=192.0.2.1 method=GET path=/x status=200" \
            in stream.getvalue()
    finally:
        log.flush()


@given(st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                 st.floats(min_value=0, max_value=1e5),
                 st.floats(min_value=1.5e9, max_value=2.5e9),
                 st.integers(-10**15, 10**15).map(lambda n: n / 2000)))  # ties at .0005
@settings(max_examples=3000)
def test_ms_repr_is_repr_of_round(x: float) -> None:
    assert logs.ms_repr(x) == repr(round(x, 3))


def test_ms_repr_edges() -> None:
    for x in (0.0, -0.0, 0.0004, -0.0004, 0.0005, 0.0015, 0.9995, 1e12 - 0.0005, 1e12,
              -1e12, 1e16, 1.5e300, 5e-324, float("inf"), float("-inf")):
        assert logs.ms_repr(x) == repr(round(x, 3)), x


_NEAR = st.one_of(st.sampled_from([0.0, 1e-9, 1e-7, 2.4e-7, 1e-4, 4.9e-4, 5e-4, 5.1e-4,
                                   1e-3, 0.0015]),
                  st.floats(min_value=0, max_value=0.002))


@given(st.one_of(st.floats(min_value=-1, max_value=1e5),
                 st.floats(min_value=1.5e9, max_value=4.1e9),
                 st.integers(-10**6, 10**13).map(lambda n: n / 2000)),  # ties at .0005
       st.lists(st.tuples(st.sampled_from([1, -1]), _NEAR), min_size=1, max_size=8),
       st.sampled_from([0, 1, -1]))
@settings(max_examples=1000)
def test_a_kept_millisecond_is_repr_of_round(x: float, steps: list[tuple[int, float]],
                                             ulps: int) -> None:
    """Floats next to the last one (within a millisecond or two, a few ulps, across a
    half, through 0 to -0.0 and the negatives) print as `repr(round(y, 3))` whether or
    not they fall in the kept interval."""
    text = logs._ms_texts()  # a fresh one: nothing kept yet
    assert text(x) == repr(round(x, 3))
    y = x
    for sign, step in steps:
        y = y + sign * step
        if ulps:
            y = math.nextafter(y, math.copysign(math.inf, ulps))
        for z in (y, -0.0, 0.0, -y):
            assert text(z) == repr(round(z, 3)), (x, z)


def test_a_millisecond_is_kept() -> None:
    """Within one millisecond, the text is not made again (the kept interval answers)."""
    text = logs._ms_texts()
    first = text(1796100041.2931)
    assert text(1796100041.2934) is first and text(1796100041.2929) is first
    assert text(1796100041.2937) == "1796100041.294"
