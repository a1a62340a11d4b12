"""Forwarding between instances, real processes on loopback: the connector dials only
instance A; callers reaching B (which lists A in `state.peers`) are carried to A's
tunnel over the forward link, for a passthrough and a terminate route. C, which A does
not list, is refused at the link, and its callers get the answer for a tunnel that is
down. With Redis stopped B has no registry view and answers the same way; when Redis
returns, forwarding comes back by itself."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster_env import (
    PT_HOST,
    TM_HOST,
    Connect,
    Instance,
    close_all,
    home_node,
    request,
    wait_for,
)
from tests.netutil import free_port_on
from tests.terminate_env import RecordingNode
from tests.tools import require


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RecordingNode]:
    node = home_node(tmp_path)
    yield node
    node.stop()


def _holders(instance: Instance) -> set[str]:
    try:
        cluster = instance.status()["cluster"]
    except Exception:
        return set()
    return set() if cluster["stale"] else set(cluster["holders"].get("family", ()))


def _forwards(instance: Instance, side: str, outcome: str) -> float:
    from pact_ingress.admin.client import request as admin_request

    text = admin_request(instance.admin, "GET", "/metrics")[1].decode()
    m = re.search(rf'pact_ingress_forwards_total{{outcome="{outcome}",side="{side}"}} (\S+)',
                  text)
    return float(m.group(1)) if m else 0.0


def test_a_caller_through_b_reaches_the_tunnel_on_a(tmp_path: Path,
                                                    node: RecordingNode) -> None:
    require("redis-server")
    from tests.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis")
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    port = free_port_on("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
    state = (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
             " deadline: 500ms, peers: [PEERS]}\n")
    a, b, c = (Instance(tmp_path, addr, port, node.identity.fingerprint, extra=state)
               for addr in ("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    fa, fb = a.identity.fingerprint, b.identity.fingerprint
    # A and B are each other's peers; C lists A, but A does not list C
    for instance, peers in ((a, [fb]), (b, [fa]), (c, [fa])):
        instance.config.write_text(instance.config.read_text().replace("PEERS", ", ".join(peers)))
    connect = None
    try:
        for instance in (a, b, c):
            instance.start()
        connect = Connect(tmp_path, node.identity, node.port, [f"{a.address}:{port}"], [fa])
        wait_for(lambda: a.tunnels_up() >= 1, f"a tunnel on A:\n{connect.logs()[-3000:]}")
        for instance in (b, c):
            wait_for(lambda i=instance: _holders(i) == {fa}, f"{instance.address} sees A hold")
        assert b.tunnels_up() == 0 and c.tunnels_up() == 0

        for host in (PT_HOST, TM_HOST):  # B has no tunnel, and serves through A's
            for _ in range(3):
                assert request(b, host) == 200, (host, b.logs()[-3000:])
        # (terminate keeps its upstream connection: 3 requests, at least 1 forward)
        assert _forwards(b, "out", "ok") >= 4 and _forwards(a, "in", "ok") >= 4

        # C is not A's peer: refused at the link, its callers get today's answer
        assert request(c, PT_HOST) is None
        assert request(c, TM_HOST) == 503
        assert _forwards(a, "in", "refused_peer") >= 2
        assert _forwards(c, "out", "refused") >= 2

        redis.stop()  # no registry view → no forwarding, today's answer
        wait_for(lambda: b.status()["cluster"]["stale"], "a stale view on B", timeout=15)
        assert request(b, PT_HOST) is None
        # (a terminate request may still ride the upstream connection forwarded before:
        # a link once made does not depend on Redis, so only new connections are shown)
        assert request(a, PT_HOST) == 200  # A serves its own tunnel regardless

        redis.start()  # recovery needs nothing but Redis answering again
        wait_for(lambda: _holders(b) == {fa}, "B's view back", timeout=20)
        for host in (PT_HOST, TM_HOST):
            assert request(b, host) == 200, host
        for instance in (a, b, c):
            assert "Traceback" not in instance.logs(), instance.address
    finally:
        close_all(connect, (a, b, c))
        redis.stop()
