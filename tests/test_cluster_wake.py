"""Relay wakes across instances, real processes: two `serve` instances (127.0.0.2 and
127.0.0.3) share one Redis (the relay queue, the registry) and list each other as peers;
the home node's connector reaches A only (the README's "connector that reaches only
some instances"). A call queued through B is in the queue every instance shares, and
the node must be woken for it as it is for one queued through A."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

from pact_ingress.identity import keygen
from tests.redis_server import RedisServer
from tests.relay_env import (
    TUNNEL_HOST,
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
)
from tests.test_relay_wake import Hook, stop_connector

DURABLE = ("--save", "", "--appendonly", "yes", "--appendfsync", "always")
WAIT = 20.0


def _wait(check: object, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_call_queued_through_another_instance_wakes_the_node(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    redis = RedisServer(tmp_path / "redis", extra=DURABLE)
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    dirs = {name: tmp_path / name for name in ("a", "b")}
    for d in dirs.values():
        d.mkdir()
    fps = {name: keygen(d / "ingress.key", common_name=name).fingerprint
           for name, d in dirs.items()}

    def state(peer: str) -> str:
        return (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
                f' deadline: 500ms, peers: ["{fps[peer]}"]}}\n')

    hook = Hook()
    servers: list[RelayServe] = []
    connector: subprocess.Popen[bytes] | None = None
    try:
        a = RelayServe(dirs["a"], recipients=[ids.recipient], tunnel=True,
                       address="127.0.0.2", extra=state("b"))
        servers.append(a)
        b = RelayServe(dirs["b"], recipients=[ids.recipient], tunnel=True,
                       address="127.0.0.3", extra=state("a"))
        servers.append(b)
        config = tmp_path / "connector.yaml"
        config.write_text(f"""\
identity: {{key: {ids.recipient.key_path}}}
ingress: {{address: "127.0.0.2:{a.port}", tunnel_hostname: {TUNNEL_HOST}, pin: "{fps['a']}"}}
forward: "127.0.0.1:9"
connections: 1
on_mail: {{url: 'http://127.0.0.1:{hook.port}/mail'}}
""")
        log = open(tmp_path / "connector.log", "ab")  # noqa: SIM115  (the process's)
        connector = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "connect", "-c", str(config)],
            stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: b.status()["cluster"]["holders"].get("home") == [fps["a"]],
              "B sees A hold the tunnel")
        assert not any(t["state"] == "up" for t in b.status()["tunnels"])

        recipient = RelayCaller(a.port, ids.recipient, host="127.0.0.2")
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        # through A, the instance with the link: woken (the harness works)
        via_a = RelayCaller(a.port, ids.sender, host="127.0.0.2")
        result, _ = via_a.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="a1"))
        assert code_of(result) is None
        assert hook.wait_for(1), "no wake for a call queued through A"
        time.sleep(1.2)  # past the once-a-second cap per tenant

        via_b = RelayCaller(b.port, ids.sender, host="127.0.0.3")
        result, _ = via_b.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="b1"))
        assert code_of(result) is None  # queued in the shared queue
        items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert len(items) == 2  # the node could fetch it, if it knew
        # B has no link: it asks a holder (A) through the registry, within two heartbeats
        assert hook.wait_for(2), "no wake reached the node for the call queued through B"
        assert len(hook.posts) == 2 and hook.posts[1][1] == {"queued": 1}
    finally:
        stop_connector(connector)
        for server in servers:
            server.stop()
        hook.close()
        redis.stop()
