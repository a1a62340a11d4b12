"""A connector that moves between instances, real processes on loopback: three `serve`
instances (A, B, C) sharing one Redis, each listing the other two as peers; C never
holds a tunnel, so its callers are always forwarded. The home node's connector reaches A;
A is killed (`kill -9`) and the connector comes back through B. Whatever the order of
events, C's callers reach the node through B, the registry's holders return to the
truth (B alone, then nobody once that connector is gone too), and no instance keeps a
connection open for a caller that left."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pact_ingress.admin.client import AdminError
from pact_ingress.admin.client import request as admin_request
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
from tests.redis_server import RedisServer
from tests.terminate_env import RecordingNode

#: The README's bound for a dead instance in the registry (its keys' TTL), plus a
#: heartbeat for the view to be read again, plus slack for a loaded test machine.
REGISTRY_BOUND = 5.0 + 1.0 + 4.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RecordingNode]:
    node = home_node(tmp_path)
    yield node
    node.stop()


def _holders(instance: Instance) -> set[str] | None:
    """The tenant's holders in `instance`'s view; None while the view is stale."""
    try:
        cluster = instance.status()["cluster"]
    except (OSError, ValueError, AdminError):  # not answering (yet): no view
        return None
    return None if cluster["stale"] else set(cluster["holders"].get("family", ()))


def _open_connections(instance: Instance) -> float:
    text = admin_request(instance.admin, "GET", "/metrics")[1].decode()
    m = re.search(r"^pact_ingress_open_connections (\S+)$", text, re.MULTILINE)
    assert m is not None
    return float(m.group(1))


def test_a_connector_that_moves_is_followed(tmp_path: Path, node: RecordingNode) -> None:
    redis = RedisServer(tmp_path / "redis")
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    port = free_port_on("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
    state = (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
             " deadline: 500ms, peers: [PEERS]}\n")
    a, b, c = instances = [Instance(tmp_path, addr, port, node.identity.fingerprint,
                                    extra=state)
                           for addr in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    for instance in instances:
        peers = [i.identity.fingerprint for i in instances if i is not instance]
        instance.config.write_text(
            instance.config.read_text().replace("PEERS", ", ".join(peers)))
    fa, fb = a.identity.fingerprint, b.identity.fingerprint
    first = second = None
    try:
        for instance in instances:
            instance.start()
        (tmp_path / "first").mkdir()
        first = Connect(tmp_path / "first", node.identity, node.port,
                        [f"{a.address}:{port}"], [fa])
        wait_for(lambda: _holders(c) == {fa}, "C sees A hold the tunnel")
        for host in (PT_HOST, TM_HOST):
            assert request(c, host) == 200, host

        a.kill()  # the instance dies; its connector reconnects elsewhere
        first.close()
        (tmp_path / "second").mkdir()
        second = Connect(tmp_path / "second", node.identity, node.port,
                         [f"{b.address}:{port}"], [fb])
        wait_for(lambda: b.tunnels_up() >= 1, "the connector on B")
        # C's callers reach the node through B, at the latest once A's keys expired
        wait_for(lambda: request(c, PT_HOST, timeout=3) == 200, "C forwarding to B",
                 timeout=REGISTRY_BOUND)
        wait_for(lambda: _holders(c) == {fb} and _holders(b) == {fb},
                 "the holders back to the truth (B alone)", timeout=REGISTRY_BOUND)
        for _ in range(3):  # and from then on every time, both modes
            for host in (PT_HOST, TM_HOST):
                assert request(c, host) == 200, host

        second.close()  # no connector anywhere: nobody holds the tenant, defined answers
        wait_for(lambda: _holders(c) == set() and _holders(b) == set(),
                 "no holder once the connector is gone", timeout=REGISTRY_BOUND)
        assert request(c, PT_HOST) is None  # alert 80
        wait_for(lambda: request(c, TM_HOST) == 503, "C's terminate answer for no tunnel")
        # nothing is left open for callers that are gone
        wait_for(lambda: _open_connections(c) == 0 and _open_connections(b) == 0,
                 "open connections back to zero")
        for instance in (b, c):
            assert "Traceback" not in instance.logs(), instance.address
    finally:
        for connect in (first, second):
            if connect is not None:
                connect.close()
        close_all(None, instances)
        redis.stop()
