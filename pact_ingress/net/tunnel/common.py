"""trio helpers both ends of the tunnel use: reading a frame, best-effort sends, running
a connection's tasks so the first failure ends the connection, the heartbeat, and TCP
keepalive on data connections.

The two ends share these and the protocol (`proto/tunnel`), and never import each other:
a connector is a separate program that only has to speak the same protocol.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio

from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.constants import (
    CONTROL_READ,
    GOAWAY_TIMEOUT,
    HEARTBEAT_MISSES,
    KEEPALIVE,
)

#: Errors that mean the peer (or the path to it) went away.
PEER_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def read_message(stream: trio.abc.Stream, decoder: tf.Decoder) -> tf.Message:
    """The next frame; EOF before one is complete is a BrokenResourceError."""
    while (msg := decoder.next_message()) is None:
        data = await stream.receive_some(CONTROL_READ)
        if not data:
            raise trio.BrokenResourceError("peer closed before a complete frame")
        decoder.feed(data)
    return msg


async def send_quietly(send: Callable[[tf.Message], Awaitable[object]], msg: tf.Message,
                       *, shield: bool = False) -> None:
    """Send `msg` if it goes within GOAWAY_TIMEOUT; a peer that is gone or slow is no
    error on the way out. `shield`: also when the caller is being cancelled (the ingress
    wants its GOAWAY delivered while its handler is torn down)."""
    with trio.move_on_after(GOAWAY_TIMEOUT) as scope:
        scope.shield = shield
        try:
            await send(msg)
        except (*PEER_GONE, trio.BusyResourceError):
            pass


async def first_error(task: Callable[[], Awaitable[object]],
                      errors: tuple[type[BaseException], ...],
                      ended: Callable[[BaseException], None]) -> None:
    """Run one of a connection's tasks; an error in `errors` goes to `ended` (which ends
    the connection) instead of out of the task.

    (Raising out of the connection's nursery would wrap the reason in an ExceptionGroup,
    and on the ingress it would reach the router's nursery.)
    """
    try:
        await task()
    except errors as exc:
        ended(exc)


async def heartbeat(interval: float, last_rx: Callable[[], float],
                    ping: Callable[[int, float], Awaitable[object]]) -> float:
    """Ping every `interval` until the peer has been silent (no frame of any kind) for
    HEARTBEAT_MISSES intervals; then return how long it was silent.

    `last_rx()` is when the peer's last frame arrived; `ping(nonce, deadline)` sends one
    PING and must give up by `deadline` (by then the peer is dead anyway: the next turn
    says so).
    """
    timeout = interval * HEARTBEAT_MISSES
    next_ping = trio.current_time() + interval
    nonce = 0
    while True:
        await trio.sleep_until(min(next_ping, last_rx() + timeout))
        now = trio.current_time()
        if now >= last_rx() + timeout:
            return now - last_rx()
        if now >= next_ping:
            nonce += 1
            await ping(nonce, last_rx() + timeout)
            next_ping = now + interval


def set_keepalive(sock: socket.socket) -> None:
    """TCP keepalive with KEEPALIVE timings (Linux names; ignored where missing)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
