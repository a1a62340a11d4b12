"""systemd's notify protocol: readiness, reload, stop and watchdog pings.

Why our own ~80 lines instead of a library: the protocol is one datagram of `KEY=VALUE`
lines sent to the AF_UNIX socket named by `$NOTIFY_SOCKET` (sd_notify(3)); a path, or an
abstract-namespace name when it starts with '@'. Everything here is a no-op that returns
False when the variable is absent, so the same binary runs under systemd, in a terminal
and in tests.

The send is non-blocking: if systemd's receive queue were ever full we drop the message
instead of stalling the trio event loop (a missed `WATCHDOG=1` is retried half an
interval later; a missed `READY=1` shows as a start timeout, which is the right signal).

Reload follows systemd's `Type=notify-reload` contract (systemd ≥ 253): `RELOADING=1`
together with `MONOTONIC_USEC=` (CLOCK_MONOTONIC, the clock systemd compares against),
then `READY=1` once the new config is in service. Older systemd (Debian 12 ships 252)
accepts the same messages under `Type=notify` and ignores `MONOTONIC_USEC`.

Watchdog: systemd sets `WATCHDOG_USEC` (and `WATCHDOG_PID`, which must be us); we ping at
half the interval, as sd_watchdog_enabled(3) recommends. `watchdog_loop` uses only
`trio.sleep`, so trio's MockClock drives it in tests.
"""

from __future__ import annotations

import os
import socket
import time

import trio

#: Name of the environment variable systemd uses to pass the notification socket.
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"

#: Fraction of the watchdog interval between pings (sd_watchdog_enabled(3): "half").
WATCHDOG_PING_FRACTION = 0.5


def _address(raw: str) -> str | bytes:
    """The connect() address for a $NOTIFY_SOCKET value ('@' = abstract namespace)."""
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    return raw


def notify(state: str) -> bool:
    """Send one notification datagram; True when it was handed to the socket."""
    raw = os.environ.get(NOTIFY_SOCKET_ENV)
    if not raw:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.connect(_address(raw))
            sock.send(state.encode())
    except OSError:  # includes BlockingIOError: drop rather than block the event loop
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Tell systemd the service is up (also ends a reload)."""
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def reloading() -> bool:
    """Tell systemd a reload started; follow with `ready()` once it is done."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def stopping() -> bool:
    """Tell systemd we are draining and about to exit."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """Free-form one-line status shown by `systemctl status`."""
    return notify(f"STATUS={text}")


def watchdog_interval() -> float | None:
    """Seconds between the pings systemd expects, or None when no watchdog is armed."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # the watchdog is meant for another process (e.g. our parent)
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None


async def watchdog_loop() -> None:
    """Ping `WATCHDOG=1` every half interval until cancelled; returns at once if unarmed."""
    interval = watchdog_interval()
    if interval is None:
        return
    period = interval * WATCHDOG_PING_FRACTION
    while True:  # runs for the service's lifetime; ends by cancellation
        notify("WATCHDOG=1")
        await trio.sleep(period)
