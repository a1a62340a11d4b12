"""Numbers and names both ends of the tunnel must agree on.

Anything here is part of what a connector and an ingress expect of each other (ALPN
names, the DATA_OK answer, heartbeat timing, how long a handshake may take). Values that
only one end uses stay with that end (`net/tunnel/server.py`, `net/tunnel/connector.py`).
"""

from __future__ import annotations

from pact_ingress.proto.tunnel import frames

#: ALPN of a control connection (small frames inside pinned mutual TLS).
ALPN_CONTROL = "pact-tunnel/1"
#: ALPN of a TLS data connection (the fallback: DATA_HELLO inside TLS, then unwrapped).
ALPN_DATA = "pact-tunnel-data/1"
#: Every ALPN the router hands to the tunnel server.
TUNNEL_ALPNS = (ALPN_CONTROL, ALPN_DATA)

#: Ping interval. With HEARTBEAT_MISSES = 3 a dead path is noticed within 15 s, well
#: before callers give up. Each end pings at its own interval (the connector takes the
#: smaller of its own and the one WELCOME announces) and declares the control connection
#: dead after HEARTBEAT_MISSES intervals without any frame.
HEARTBEAT_INTERVAL = 5.0
HEARTBEAT_MISSES = 3
#: TLS handshake plus the first frame or answer (HELLO / WELCOME / DATA_HELLO / DATA_OK)
#: must arrive within this.
HANDSHAKE_TIMEOUT = 10.0
#: Best-effort sends on the way out (GOAWAY, close_notify) give up after this.
GOAWAY_TIMEOUT = 1.0
#: Read size on control connections (frames are ≤ 1 KiB).
CONTROL_READ = 4096
#: TCP keepalive on data connections, both ends: first probe after 30 s idle, every 10 s,
#: dead after 3 misses — keeps NAT mappings warm and frees a dead socket within ~1 minute.
KEEPALIVE = (30, 10, 3)
#: The ingress's answer on a data connection whose token it accepted, as bytes: a raw
#: data connection's whole answer, compared (connector) and written (ingress) as is.
DATA_OK = frames.encode(frames.DataOk())

#: ALPN of an instance-to-instance forward link (SNI `tunnel.hostname`, mutual TLS with
#: instance keys): one caller connection carried to the instance holding the tunnel.
ALPN_FORWARD = "pact-forward/1"
