"""Relay wakes: an item queued for a node with a live tunnel reaches its connector as a
content-free WAKE, and the connector calls its local on_mail hook. Real processes: a
`serve` with a tunnel and a relay, a `connect` with `on_mail: {url: ...}`, and a hook
server on loopback. Plus the frame-level rules that keep older connectors working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pact_ingress.proto.tunnel import frames as tf
from tests.relay_env import (
    TUNNEL_HOST,
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
)

WAIT = 20.0


class Hook:
    """A local HTTP endpoint recording each POST (time, body)."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, dict[str, object]]] = []
        self.arrived = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with hook.arrived:
                    hook.posts.append((time.monotonic(), json.loads(body)))
                    hook.arrived.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout: float = WAIT) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.posts) >= count, timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_connector(tmp: Path, serve: RelayServe, key: Path, ingress_pin: str,
                    hook_url: str | None) -> subprocess.Popen[bytes]:
    on_mail = f"on_mail: {{url: '{hook_url}'}}\n" if hook_url else ""
    config = tmp / "connector.yaml"
    config.write_text(f"""\
identity: {{key: {key}}}
ingress: {{address: "127.0.0.1:{serve.port}", tunnel_hostname: {TUNNEL_HOST}, pin: "{ingress_pin}"}}
forward: "127.0.0.1:9"
connections: 1
{on_mail}""")
    log = open(tmp / "connector.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "pact_ingress", "connect", "-c", str(config)],
                            stdout=log, stderr=subprocess.STDOUT)


def stop_connector(connector: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if it is still there after 10 s; waited for either way."""
    if connector is None:
        return
    connector.terminate()
    try:
        connector.wait(timeout=10)
    except subprocess.TimeoutExpired:
        connector.kill()
        connector.wait()


def wait_tunnel_up(serve: RelayServe) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if any(t["state"] == "up" for t in serve.status()["tunnels"]):
            return
        time.sleep(0.05)
    raise AssertionError("the connector's tunnel did not come up")


@pytest.mark.parametrize("with_hook", [True, False], ids=["on_mail", "old-style"])
def test_wake_reaches_the_hook(tmp_path: Path, with_hook: bool) -> None:
    ids = relay_identities(tmp_path)
    hook = Hook()
    serve = RelayServe(tmp_path, recipients=[ids.recipient], tunnel=True)
    connector = start_connector(tmp_path, serve, ids.recipient.key_path,
                                ids.ingress.fingerprint,
                                f"http://127.0.0.1:{hook.port}/mail" if with_hook else None)
    try:
        wait_tunnel_up(serve)
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="w1"))
        assert code_of(result) is None
        if not with_hook:
            # a connector that did not offer CAP_WAKE gets no WAKE: its link stays up
            time.sleep(1.5)
            assert "relay_wakes_total 0.0" in serve.metrics()
            assert all(t["state"] == "up" for t in serve.status()["tunnels"])
            assert connector.poll() is None
            return
        assert hook.wait_for(1), "no POST reached the on_mail hook"
        assert hook.posts[0][1] == {"queued": 1}
        # a burst of calls: the hook runs at most once a second, and the last one counts
        for i in range(5):
            sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id=f"b{i}"))
        assert hook.wait_for(2)
        time.sleep(2.5)
        assert 2 <= len(hook.posts) <= 4, hook.posts
        gaps = [b[0] - a[0] for a, b in zip(hook.posts, hook.posts[1:], strict=False)]
        assert all(g > 0.8 for g in gaps), gaps
        # the wake is content-free, the node fetches
        items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert len(items) == 6
    finally:
        stop_connector(connector)
        serve.stop()
        hook.close()


def test_wake_frame_and_capability() -> None:
    assert tf.encode(tf.Wake()) == bytes([10, 0, 0])
    dec = tf.Decoder()
    dec.feed(tf.encode(tf.Wake()))
    assert dec.next_message() == tf.Wake()
    with pytest.raises(tf.FrameError):
        tf.decode_payload(tf.FrameType.WAKE, b"x")  # content-free, always
    # the capability rides in HELLO's slot byte; an old HELLO (slot < 0x80) has none
    hello = tf.Hello(tf.VERSION, 3, b"i" * tf.ID_BYTES, wake=True)
    raw = tf.encode(hello)
    assert raw[4] == 3 | tf.CAP_WAKE
    assert tf.decode_payload(raw[0], raw[3:]) == hello
    old = tf.encode(tf.Hello(tf.VERSION, 3, b"i" * tf.ID_BYTES))
    assert old[4] == 3 and tf.decode_payload(old[0], old[3:]).wake is False
    # why the gate: an unknown frame type is fatal to a peer's decoder
    dec = tf.Decoder()
    dec.feed(bytes([99, 0, 0]))
    with pytest.raises(tf.FrameError):
        dec.next_message()


def test_mail_queued_while_offline_wakes_the_node_when_it_connects(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    hook = Hook()
    serve = RelayServe(tmp_path, recipients=[ids.recipient], tunnel=True)
    connector = None
    try:
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="off1"))
        assert code_of(result) is None  # queued while no tunnel was up: nobody to wake
        connector = start_connector(tmp_path, serve, ids.recipient.key_path,
                                    ids.ingress.fingerprint, f"http://127.0.0.1:{hook.port}/mail")
        wait_tunnel_up(serve)
        assert hook.wait_for(1), "the node was not woken when its tunnel came up"
        items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert len(items) == 1  # the wake is content-free: the node fetched what waited
    finally:
        stop_connector(connector)
        serve.stop()
        hook.close()
