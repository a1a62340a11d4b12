"""The relay's shared state under a hostile or unlucky cluster: two instances sharing one
real redis-server, operations interleaved the way two VPSes serving two nodes can
interleave them."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import trio

from pact_ingress.state.relay_store import ENQUEUE_SCRIPT, RELAY_DEADLINE
from tests.redis_server import RedisServer
from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayH2,
    RelayIdentities,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    tool_body,
)
from tests.terminate_env import H2Result
from tests.test_relay_cluster import cluster, msg_ids, wait_mode
from tests.test_relay_redis import open_store
from tests.test_relay_wake import WAIT, Hook, start_connector, stop_connector, wait_tunnel_up

__all__ = ["cluster"]  # the two-instance fixture, shared with the relay cluster tests

R1, R2 = "sha256:" + "1" * 43, "sha256:" + "2" * 43
S = "sha256:" + "S" * 43


async def test_an_allowlist_change_by_another_instance_is_not_masked_by_an_own_one(
    nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """Node 2 removes sender S from its list via instance B while node 1's list change
    reaches instance A between A's last look at Redis and its own write. A must still
    see node 2's removal afterwards: otherwise A keeps queueing S's calls for node 2
    (a sender its owner removed) until some later change happens to be made."""
    server = RedisServer(tmp_path / "redis")
    try:
        a = await open_store(nursery, server, "cluster:")
        b = await open_store(nursery, server, "cluster:")
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


def test_a_sender_that_resets_while_its_call_commits_still_wakes_the_node(
    tmp_path: Path,
) -> None:
    """A sender's HTTP/2 stream reset after its relay_call was handed to the store, while
    the COMMIT waits (here: on the file's write lock, held as `relay purge` would hold
    it). The item is committed anyway; the node must then be woken for it, because
    nothing else will (a sender that reset its stream may never retry), and a node with
    on_mail waits for a wake rather than polling."""
    ids = relay_identities(tmp_path)
    hook = Hook()
    serve = RelayServe(tmp_path, recipients=[ids.recipient], tunnel=True, workers=1)
    connector = start_connector(tmp_path, serve, ids.recipient.key_path,
                                ids.ingress.fingerprint, f"http://127.0.0.1:{hook.port}/mail")
    lock = sqlite3.connect(tmp_path / "state" / "relay.sqlite", timeout=5,
                           isolation_level=None)
    try:
        wait_tunnel_up(serve)
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        lock.execute("BEGIN IMMEDIATE")  # the store's writer now waits for the lock
        sender = RelayH2(serve.port, ids.sender)
        body = tool_body("relay_call", envelope(ids.sender, ids.recipient, msg_id="rst-1"))
        sid = sender.conn.get_next_available_stream_id()
        sender.conn.send_headers(sid, [
            (b":method", b"POST"), (b":scheme", b"https"), (b":authority", RELAY_HOST.encode()),
            (b":path", b"/relay/mcp"), (b"content-length", str(len(body)).encode())])
        sender.conn.send_data(sid, body, end_stream=True)
        sender.sock.sendall(sender.conn.data_to_send())
        time.sleep(1.0)  # checked and handed to the store, which waits on the lock
        sender.conn.reset_stream(sid)
        sender.sock.sendall(sender.conn.data_to_send())
        time.sleep(0.3)  # the reset is read and the exchange cancelled
        lock.execute("ROLLBACK")  # the writer goes on and commits the item
        items: list[dict[str, object]] = []
        deadline = time.monotonic() + WAIT
        while not items and time.monotonic() < deadline:
            items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
            time.sleep(0.05)
        assert len(items) == 1, "the reset call was not committed (the test lost its window)"
        # woken by the stored item itself: a sender that reset may never come back
        assert hook.wait_for(1, timeout=5), "the node was never woken for its stored item"
        # and one that does is told what was stored: the duplicate
        again = RelayCaller(serve.port, ids.sender).tool(
            "relay_call", envelope(ids.sender, ids.recipient, msg_id="rst-1"))[0]
        assert again["structuredContent"] == {"status": "queued", "msg_id": "rst-1"}
    finally:
        lock.close()
        stop_connector(connector)
        serve.stop()
        hook.close()


def test_one_sender_filling_the_queue_does_not_starve_another(tmp_path: Path) -> None:
    """One allowed sender floods a recipient's queue: it meets its share (half the
    bounds) with `rate_limited`, and another allowed sender's call is still queued."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], max_items=8, workers=1)
    try:
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint,
                                        ids.other.fingerprint]).status == 200
        flooder = RelayCaller(serve.port, ids.sender)
        refused = None
        for i in range(20):  # within one (IP, key) burst
            result = flooder.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                         msg_id=f"flood-{i}"))[0]
            if code_of(result) is not None:
                refused = code_of(result)
                break
        assert refused == "rate_limited"  # the flooder met the bound
        other = RelayCaller(serve.port, ids.other)
        result = other.tool("relay_call", envelope(ids.other, ids.recipient,
                                                   msg_id="other-1"))[0]
        assert code_of(result) is None, result
    finally:
        serve.stop()


def test_an_allowlist_read_via_one_instance_is_the_list_set_via_another(
    cluster: tuple[RedisServer, list[RelayServe], RelayIdentities],
) -> None:
    """A node syncs its list via B, then reads it back via A (DNS picked another
    address) to check the sync: it must read what is stored, not A's older copy, or it
    concludes the sync was lost (and A would judge nothing by that copy anyway)."""
    _redis, (a, b), ids = cluster
    via_a = RelayCaller(a.port, ids.recipient, a.address)
    via_b = RelayCaller(b.port, ids.recipient, b.address)
    try:
        assert json.loads(via_a.allowlist_get().body) == {"senders": []}
        assert via_b.allowlist_set([ids.sender.fingerprint]).status == 200
        assert json.loads(via_a.allowlist_get().body) == {"senders": [ids.sender.fingerprint]}
        assert via_a.allowlist_set([]).status == 200
        assert json.loads(via_b.allowlist_get().body) == {"senders": []}
    finally:
        via_a.close()
        via_b.close()


@pytest.mark.slow
def test_acknowledged_calls_survive_sigkill_of_redis_mid_flood(
    cluster: tuple[RedisServer, list[RelayServe], RelayIdentities],
) -> None:
    """Redis (appendonly yes, appendfsync always, as required) killed with SIGKILL while
    a sender queues via A, then started again on the same port: every call answered
    `queued` is fetched via B, none twice; the calls answered otherwise are answered
    (never hung), and the sender's retries are each stored once."""
    redis, (a, b), ids = cluster
    recipient_b = RelayCaller(b.port, ids.recipient, b.address)
    sender_a = RelayCaller(a.port, ids.sender, a.address)
    calls = 30
    envelopes = {f"z{n}": envelope(ids.sender, ids.recipient, msg_id=f"z{n}")
                 for n in range(calls)}
    acknowledged: list[str] = []
    answered: list[str] = []
    try:
        assert recipient_b.allowlist_set([ids.sender.fingerprint]).status == 200

        def send() -> None:
            for msg_id, env in envelopes.items():
                result, _ = sender_a.tool("relay_call", env)
                answered.append(msg_id)
                if result.get("structuredContent") == {"status": "queued", "msg_id": msg_id}:
                    acknowledged.append(msg_id)
                else:
                    assert code_of(result) == "unavailable", result

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while len(acknowledged) < calls // 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGKILL)
        redis.proc.wait(10)
        redis.proc = None
        time.sleep(0.3)  # calls meanwhile meet no Redis at all
        redis.start()
        thread.join(60)
        assert not thread.is_alive() and len(answered) == calls, answered
        for serve in (a, b):
            wait_mode(serve, "shared")
        page = recipient_b.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        fetched = msg_ids(page)
        assert len(fetched) == len(set(fetched)), fetched
        assert set(acknowledged) <= set(fetched), (acknowledged, fetched)
        for msg_id, env in envelopes.items():
            result, _ = sender_a.tool("relay_call", env)
            assert result["structuredContent"] == {"status": "queued", "msg_id": msg_id}
        page = recipient_b.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        assert sorted(msg_ids(page)) == sorted(envelopes), msg_ids(page)
    finally:
        recipient_b.close()
        sender_a.close()
    for serve in (a, b):
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]


class SlowScriptProxy:
    """A TCP relay in front of redis-server that, once armed, holds the first chunk
    carrying `marker` (a script's SHA) for `delay` seconds before passing it on: a Redis
    whose answer to one write comes after the caller's deadline, but which does run it
    (as a Redis fsyncing on a stalled disk does). Everything else passes at once."""

    def __init__(self, upstream: tuple[str, int], marker: bytes, delay: float) -> None:
        self.upstream, self.marker, self.delay = upstream, marker, delay
        self.armed = threading.Event()
        self.held = threading.Event()  # a chunk was held (and then passed on)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if outbound and self.armed.is_set() and self.marker in chunk:
                    self.armed.clear()
                    chunk += self._rest_of(src)  # before the client's reset drops it
                    time.sleep(self.delay)
                    dst.sendall(chunk)
                    self.held.set()
                    continue
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            # only this direction ends: a held write still reaches Redis after its
            # client gave up, as one already sent would
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    @staticmethod
    def _rest_of(src: socket.socket) -> bytes:
        """What the client sent right behind the held chunk (the rest of the command)."""
        src.settimeout(0.3)
        rest = b""
        try:
            while more := src.recv(65536):
                rest += more
        except OSError:  # quiet for a while (timeout), or reset: it is all here
            pass
        src.settimeout(None)
        return rest

    def close(self) -> None:
        self.listener.close()
        for sock in self.socks:
            sock.close()


def _zcard(redis: RedisServer, key: str) -> int:
    """ZCARD straight from redis-server (raw RESP: what is stored, not what we think)."""
    with socket.create_connection((redis.host, redis.port), timeout=WAIT) as sock:
        raw = key.encode()
        sock.sendall(b"*2\r\n$5\r\nZCARD\r\n$%d\r\n%s\r\n" % (len(raw), raw))
        reply = sock.recv(64)
    assert reply.startswith(b":"), reply
    return int(reply[1:].strip())


def _durable_redis(tmp_path: Path) -> RedisServer:
    """Redis as the relay requires it: every write in the append-only file, fsynced."""
    return RedisServer(tmp_path / "redis", extra=(
        "--save", "", "--appendonly", "yes", "--appendfsync", "always"))


def _state_key(tmp_path: Path) -> Path:
    """A shared-state encryption key file, 0600."""
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    return key


def test_a_call_stored_after_its_answer_gave_up_still_wakes_the_node(tmp_path: Path) -> None:
    """Redis runs a relay_call's write only after the relay's deadline for it passed: the
    call is answered `unavailable`, yet the item is stored. The sender's retry is then
    answered as the duplicate it is; the node, whose connector waits for wakes, must
    still be woken for the item, or it sits unseen until some other mail arrives."""
    redis = _durable_redis(tmp_path)
    proxy = SlowScriptProxy((redis.host, redis.port),
                            hashlib.sha1(ENQUEUE_SCRIPT.encode()).hexdigest().encode(),
                            delay=RELAY_DEADLINE + 1)
    key = _state_key(tmp_path)
    ids = relay_identities(tmp_path)
    hook = Hook()
    serve = RelayServe(tmp_path, recipients=[ids.recipient], tunnel=True, workers=1, extra=(
        f"state:\n  backend: redis\n  url: redis://127.0.0.1:{proxy.port}/0\n"
        f"  encryption_key_file: {key}\n  deadline: 500ms\n"))
    connector = start_connector(tmp_path, serve, ids.recipient.key_path,
                                ids.ingress.fingerprint, f"http://127.0.0.1:{hook.port}/mail")
    try:
        wait_mode(serve, "shared")
        wait_tunnel_up(serve)
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        # a first call, woken for and acked: Redis knows the script from then on
        warm = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="w"))[0]
        assert code_of(warm) is None, warm
        assert hook.wait_for(1)
        first = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert recipient.tool("ack", {"ids": [first[0]["id"]]})[0]["structuredContent"] == {
            "acked": 1}
        call = envelope(ids.sender, ids.recipient, msg_id="late-1")
        proxy.armed.set()
        assert code_of(sender.tool("relay_call", call)[0]) == "unavailable"
        assert proxy.held.wait(WAIT)  # and then Redis ran it:
        queue = f"pact-ingress:relay:{{{ids.recipient.fingerprint}}}:q"
        deadline = time.monotonic() + WAIT
        while _zcard(redis, queue) != 1:
            assert time.monotonic() < deadline, "the held write never ran"
            time.sleep(0.02)
        wait_mode(serve, "shared")
        retry = sender.tool("relay_call", call)[0]
        assert retry["structuredContent"] == {"status": "queued", "msg_id": "late-1"}
        page = recipient.tool("fetch_queued", {})[0]["structuredContent"]
        assert msg_ids(page) == ["late-1"]
        assert hook.wait_for(2, timeout=5), "the node was never woken for its stored item"
    finally:
        stop_connector(connector)
        serve.stop()
        hook.close()
        proxy.close()
        redis.stop()


def test_mail_waiting_in_redis_wakes_a_node_that_connects_after_a_cold_start(
    tmp_path: Path,
) -> None:
    """The host reboots: the ingress starts before Redis does (it serves alone until
    Redis answers), Redis comes back with the queue its AOF kept, then the node's
    connector connects. Mail waited for the node all along: it must be woken for it, as
    it is when the ingress alone restarts."""
    redis = _durable_redis(tmp_path)
    key = _state_key(tmp_path)
    ids = relay_identities(tmp_path)
    hook = Hook()
    serve = RelayServe(tmp_path, recipients=[ids.recipient], tunnel=True, workers=1, extra=(
        f"state:\n  backend: redis\n  url: {redis.url}\n  encryption_key_file: {key}\n"
        "  deadline: 500ms\n"))
    connector = None
    try:
        wait_mode(serve, "shared")
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        queued = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="c1"))[0]
        assert code_of(queued) is None, queued
        recipient.close()
        sender.close()
        serve.kill9()  # the reboot
        redis.stop()
        serve.restart()  # Redis not there yet
        redis.start()
        wait_mode(serve, "shared")
        connector = start_connector(tmp_path, serve, ids.recipient.key_path,
                                    ids.ingress.fingerprint,
                                    f"http://127.0.0.1:{hook.port}/mail")
        wait_tunnel_up(serve)
        assert hook.wait_for(1, timeout=5), "the node was not woken for the mail waiting"
        page = RelayCaller(serve.port, ids.recipient).tool("fetch_queued", {})[0]
        assert msg_ids(page["structuredContent"]) == ["c1"]
    finally:
        stop_connector(connector)
        serve.stop()
        hook.close()
        redis.stop()


def test_a_node_cannot_pile_up_unread_fetch_pages(tmp_path: Path) -> None:
    """A node (its own key: compromised, or just a buggy poller) opens many
    fetch_queued streams on one HTTP/2 connection and reads none of the answers. Each
    answer is a page of up to 16 MiB of envelopes held in memory (several times that while
    it is built) until the client takes it: a hundred streams per connection, and
    connections by the hundred, would hold gigabytes. Pages of one queue are the same
    oldest-first items anyway, so only a couple may be in flight per caller; the others
    are answered rate_limited at once, without building a page."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1)
    try:
        owner = RelayCaller(serve.port, ids.recipient)
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        big = "x" * (100 * 1024)
        for n in range(4):  # a page larger than the HTTP/2 window: it waits for the reader
            queued = sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                        msg_id=f"big-{n}", text=big))[0]
            assert code_of(queued) is None, queued
        h2c = RelayH2(serve.port, ids.recipient)
        body = tool_body("fetch_queued", {"limit": 1000})
        sids = []
        for _ in range(6):
            sid = h2c.conn.get_next_available_stream_id()
            h2c._results[sid] = H2Result(None, [], b"")
            h2c.conn.send_headers(sid, [
                (b":method", b"POST"), (b":scheme", b"https"),
                (b":authority", RELAY_HOST.encode()), (b":path", b"/relay/mcp"),
                (b"content-length", str(len(body)).encode())])
            h2c.conn.send_data(sid, body, end_stream=True)
            sids.append(sid)
        h2c.sock.sendall(h2c.conn.data_to_send())
        time.sleep(1.0)  # every stream reached the relay while no page was read
        answers = [json.loads(h2c.wait(sid, timeout=60).body)["result"] for sid in sids]
        pages = [a for a in answers if code_of(a) is None]
        assert all(code_of(a) == "rate_limited" for a in answers if a not in pages), answers
        assert 1 <= len(pages) <= 2, [code_of(a) for a in answers]
        assert all(len(p["structuredContent"]["items"]) == 4 for p in pages)
        h2c.close()
        # once read, the next fetch is served again
        page = owner.tool("fetch_queued", {"limit": 1})[0]
        assert len(page["structuredContent"]["items"]) == 1, page
    finally:
        serve.stop()
