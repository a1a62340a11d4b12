"""The HTTP/2 flood meter: a burst passes, a sustained flood trips, time refills."""

from __future__ import annotations

from pact_ingress.proto.h2_guard import WINDOW_CREDIT_BYTES, Allowance, Flood, FloodGuard


def test_burst_then_trip_then_refill() -> None:
    guard = FloodGuard({Flood.PING: Allowance(burst=3, per_second=1)})
    assert all(guard.charge(Flood.PING, 0.0) for _ in range(3))
    assert not guard.charge(Flood.PING, 0.0)
    assert guard.charge(Flood.PING, 1.5)  # one and a half tokens back
    assert not guard.charge(Flood.PING, 1.5)


def test_a_steady_client_never_trips() -> None:
    guard = FloodGuard()
    # a keep-alive PING every 2 s and a cancelled stream a second, for an hour
    assert all(guard.charge(Flood.PING, t * 2.0) for t in range(1800))
    assert all(guard.charge(Flood.RESET, float(t)) for t in range(3600))


def test_kinds_are_metered_apart() -> None:
    guard = FloodGuard({Flood.PING: Allowance(1, 0), Flood.RESET: Allowance(1, 0)})
    assert guard.charge(Flood.PING, 0) and guard.charge(Flood.RESET, 0)
    assert not guard.charge(Flood.PING, 0) and not guard.charge(Flood.RESET, 0)


def test_window_updates_explained_by_data_sent_never_trip() -> None:
    guard = FloodGuard({Flood.WINDOW_UPDATE: Allowance(burst=10, per_second=0)})
    # a download: per 16 KiB DATA frame sent, the client opens stream and connection
    for _ in range(10_000):
        guard.credit(Flood.WINDOW_UPDATE, 16384 / WINDOW_CREDIT_BYTES)
        assert guard.charge(Flood.WINDOW_UPDATE, 0.0)
        assert guard.charge(Flood.WINDOW_UPDATE, 0.0)
    # updates no data explains draw the bucket down, and credit never lifts it past burst
    guard.credit(Flood.WINDOW_UPDATE, 1_000_000)
    assert sum(guard.charge(Flood.WINDOW_UPDATE, 0.0) for _ in range(50)) == 10
