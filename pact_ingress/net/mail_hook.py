"""The connector's "you have mail" hook: a relay WAKE turned into something a node can use.

Theory of operation
-------------------
The ingress sends a content-free WAKE frame on a control link when an item was queued at
its relay for this node (`net/tunnel/server.py`). The frame says nothing but "look":
no count, no sender, no envelope. `MailHook.notify()` is called for each one and returns
at once; `run()` turns them into at most one hook run per `HOOK_INTERVAL`, never two at
a time, and never drops the last one (a wake that arrives while the hook runs, or
within the interval, makes one more run after it). The hook is:

* ``url``: an HTTP POST of ``{"queued": 1}`` — "at least one item is queued"; the node
  then calls ``fetch_queued`` until ``more`` is false. The count is 1 because the wake
  carries none (a real count would need the ingress to tell the tunnel more than that
  mail exists). http, or https verified against the system's CAs.
* ``command``: the argv run without a shell, stdin empty, output discarded, with
  ``PACT_QUEUED=1`` in its environment; killed after `HOOK_TIMEOUT`.

Both are bounded by `HOOK_TIMEOUT`; a failure is one log line, never a traceback, and
the next wake tries again.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from urllib.parse import urlsplit

import h11
import trio

from pact_ingress.logs import log
from pact_ingress.model import OnMail

#: Hook runs at most this often: a burst of wakes becomes one fetch by the node.
HOOK_INTERVAL = 1.0
#: A hook (HTTP answer, or the command's exit) must come within this.
HOOK_TIMEOUT = 10.0
#: Bytes of a hook URL's answer read before we stop caring (it is only a status).
MAX_ANSWER = 64 * 1024
BODY = json.dumps({"queued": 1}).encode()


class MailHook:
    """Runs the configured on_mail hook for relay wakes (see module docstring)."""

    def __init__(self, on_mail: OnMail, *, interval: float = HOOK_INTERVAL) -> None:
        self.on_mail = on_mail
        self.interval = interval
        self._wanted = trio.Event()
        #: Hook runs done (tests).
        self.runs = 0

    def notify(self) -> None:
        self._wanted.set()

    async def run(self) -> None:
        last = -float("inf")
        while True:
            await self._wanted.wait()
            await trio.sleep_until(last + self.interval)
            self._wanted = trio.Event()  # a wake from here on means one more run
            last = trio.current_time()
            await self.fire()

    async def fire(self) -> None:
        self.runs += 1
        if self.on_mail.url is not None:
            try:
                with trio.fail_after(HOOK_TIMEOUT):
                    status = await post_json(self.on_mail.url, BODY)
                log.info("mail_hook", kind="url", status=status)
            except (trio.TooSlowError, OSError, trio.BrokenResourceError, h11.ProtocolError,
                    ssl.SSLError, ValueError) as exc:
                log.warning("mail_hook_failed", kind="url", url=self.on_mail.url,
                            error=f"{type(exc).__name__}: {exc}")
        if self.on_mail.command is not None:
            await self._command(self.on_mail.command)

    async def _command(self, argv: tuple[str, ...]) -> None:
        try:
            with trio.fail_after(HOOK_TIMEOUT):
                done = await trio.run_process(
                    list(argv), stdin=b"", stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, check=False,
                    env={**os.environ, "PACT_QUEUED": "1"})
            log.info("mail_hook", kind="command", exit=done.returncode)
        except trio.TooSlowError:
            log.warning("mail_hook_failed", kind="command", program=argv[0],
                        error=f"still running after {HOOK_TIMEOUT:g} s: killed")
        except OSError as exc:
            log.warning("mail_hook_failed", kind="command", program=argv[0],
                        error=f"{type(exc).__name__}: {exc.strerror or exc}")


async def post_json(url: str, body: bytes) -> int:
    """POST `body` as JSON to `url`; the response status (the body is read and dropped)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    try:
        if parts.scheme == "https":
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
        conn = h11.Connection(h11.CLIENT)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc.rpartition("@")[2]
        data = conn.send(h11.Request(method="POST", target=target, headers=[
            ("Host", authority), ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))), ("Connection", "close")]))
        data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        await stream.send_all(data)
        status = 0
        seen = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                chunk = await stream.receive_some(16384)
                seen += len(chunk)
                if seen > MAX_ANSWER and status:
                    return status
                conn.receive_data(chunk)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status
    finally:
        await trio.aclose_forcefully(stream)
