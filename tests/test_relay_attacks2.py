"""The relay's shared state under a hostile or unlucky cluster: two instances sharing one
real redis-server, operations interleaved the way two VPSes serving two nodes can
interleave them."""

from __future__ import annotations

from pathlib import Path

import trio

from pact_ingress.model import RedisSettings, Relay
from pact_ingress.state.redis import RedisState
from pact_ingress.state.relay_store import RedisRelayStore
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer

R1, R2 = "sha256:" + "1" * 43, "sha256:" + "2" * 43
S = "sha256:" + "S" * 43


async def _instance(nursery: trio.Nursery, server: RedisServer) -> RedisRelayStore:
    """One instance's relay store: every instance of a cluster uses the same prefix."""
    state = RedisState(RedisSettings(
        host=server.host, port=server.port, db=0, encryption_key_file=Path("/nonexistent"),
        key_prefix="cluster:", deadline=0.5), Stats(), probe_interval=0.05)
    await nursery.start(state.run)
    store = state.relay_store(Relay(host="relay.test", cert="acme", store=Path("/unused"),
                                    max_items=100, max_bytes=10_000), Stats(), trio.current_time)
    assert isinstance(store, RedisRelayStore)
    await store.open()
    return store


async def test_an_allowlist_change_by_another_instance_is_not_masked_by_an_own_one(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """Node 2 removes sender S from its list via instance B while node 1's list change
    reaches instance A between A's last look at Redis and its own write. A must still
    see node 2's removal afterwards: otherwise A keeps queueing S's calls for node 2
    (a sender its owner removed) until some later change happens to be made."""
    server = RedisServer(tmp_path / "redis")
    try:
        a = await _instance(nursery, server)
        b = await _instance(nursery, server)
        await b.set_allowlist(R2, (S,))
        await a.refresh()
        assert S in a.allowlists()[R2]
        await b.set_allowlist(R2, ())  # node 2 drops S, via B
        await a.set_allowlist(R1, (S,))  # node 1's change, via A, in the same moment
        await a.refresh()  # what A does before its next tool call
        assert a.allowlists().get(R1) == frozenset({S})
        assert S not in a.allowlists().get(R2, frozenset()), a.allowlists()
    finally:
        server.stop()
