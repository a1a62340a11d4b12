"""Tunnels across several ingress instances, real processes on loopback: one connector
given two instances (127.0.0.2 and 127.0.0.3, each its own identity, both pinned) holds
tunnels on both; the tenant's passthrough and terminate routes work through either;
`kill -9` of one leaves the other serving; a restart brings the connector back to it."""

from __future__ import annotations

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

ADDRESSES = ("127.0.0.2", "127.0.0.3")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RecordingNode]:
    node = home_node(tmp_path)
    yield node
    node.stop()


def test_connector_holds_tunnels_on_every_instance(tmp_path: Path,
                                                   node: RecordingNode) -> None:
    port = free_port_on("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
    fp = node.identity.fingerprint
    instances = [Instance(tmp_path, a, port, fp) for a in ADDRESSES]
    connect = None
    try:
        for instance in instances:
            instance.start()
        connect = Connect(tmp_path, node.identity, node.port,
                          [f"{i.address}:{port}" for i in instances],
                          [i.identity.fingerprint for i in instances], connections=1)
        for instance in instances:
            wait_for(lambda i=instance: i.tunnels_up() >= 1,
                     f"a tunnel on {instance.address}:\n{connect.logs()[-3000:]}")
        for instance in instances:
            for host in (PT_HOST, TM_HOST):
                assert request(instance, host) == 200, (instance.address, host)

        a, b = instances
        a.kill()
        for host in (PT_HOST, TM_HOST):  # B keeps serving, without a pause
            assert request(b, host) == 200, host
        assert request(a, PT_HOST) is None

        a.start()  # same address, same key: the connector's slot comes back to it
        wait_for(lambda: a.tunnels_up() >= 1, f"the connector back on A:\n{connect.logs()}")
        for instance in instances:
            for host in (PT_HOST, TM_HOST):
                assert request(instance, host) == 200, (instance.address, host)
    finally:
        close_all(connect, instances)


async def test_a_name_stands_for_every_record() -> None:
    from pact_ingress.model import Address
    from pact_ingress.net.tunnel.multi import resolve_all

    assert await resolve_all(Address("127.0.0.3", 9)) == [Address("127.0.0.3", 9)]
    found = await resolve_all(Address("localhost", 9))
    assert found is not None and Address("127.0.0.1", 9) in found
    assert len(found) == len(set(found))
    assert await resolve_all(Address("no-such-name.invalid", 9)) is None


def test_registry_in_redis_lists_members_and_holders(tmp_path: Path,
                                                     node: RecordingNode) -> None:
    import base64
    import os

    import jsonschema

    from pact_ingress.admin.schema import STATUS_SCHEMA
    from tests.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis")
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    state = (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
             " deadline: 500ms}\n")
    port = free_port_on("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")
    instances = [Instance(tmp_path, a, port, node.identity.fingerprint, extra=state)
                 for a in ADDRESSES]
    connect = None

    def cluster(instance: Instance) -> dict:
        doc = instance.status()
        jsonschema.validate(doc, STATUS_SCHEMA)
        return doc["cluster"]

    def view(instance: Instance, members: set[str], holders: set[str]) -> bool:
        c = cluster(instance)
        return (not c["stale"] and {m["fingerprint"] for m in c["members"]} == members
                and set(c["holders"].get("family", ())) == holders)

    try:
        for instance in instances:
            instance.start()
        a, b = instances
        fps = {i.identity.fingerprint for i in instances}
        connect = Connect(tmp_path, node.identity, node.port,
                          [f"{i.address}:{port}" for i in instances],
                          [i.identity.fingerprint for i in instances])
        for instance in instances:
            wait_for(lambda i=instance: view(i, fps, fps), f"both held, seen by {instance.address}")
        members = {m["fingerprint"]: m for m in cluster(b)["members"]}
        assert members[a.identity.fingerprint]["address"] == f"{a.address}:{port}"
        assert members[b.identity.fingerprint]["self"]
        assert members[a.identity.fingerprint]["last_heartbeat"] > 0

        a.kill()  # its keys expire on their own: nobody cleans up after a dead instance
        only_b = {b.identity.fingerprint}
        wait_for(lambda: view(b, only_b, only_b), "A gone from the registry", timeout=15)

        redis.stop()  # the registry is unavailable; B serves its own tunnels as before
        wait_for(lambda: cluster(b)["stale"], "a stale registry", timeout=15)
        assert request(b, PT_HOST) == 200
        a.start()
        redis.start()  # recovery needs nothing but Redis answering again
        wait_for(lambda: view(b, fps, fps), "the registry back", timeout=20)
        assert "Traceback" not in b.logs()
    finally:
        close_all(connect, instances)
        redis.stop()
