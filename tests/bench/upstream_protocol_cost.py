"""CPU of the node leg's protocol work per request: HTTP/1.1 as the terminate engine
speaks it to the node, against HTTP/2 through the `h2` library, streams one at a time
or several per write.

    python -m tests.bench.upstream_protocol_cost [--count 4000] [--rounds 3]

Why it exists: HAProxy, the terminate bench's peer, re-originates over HTTP/2 when the
node offers it and carries every client's requests on one connection, so at 32 client
connections its node leg sends fewer TCP segments, TLS records and syscalls per request
than one HTTP/1.1 connection per request in flight can (`ab_terminate` prints the
segments per request of each path). Whether the engine should do the same is a
question of price: what the kernel would save per request against what speaking
HTTP/2 costs the interpreter. This measures the second part, with no sockets and no
TLS, on one core:

* `http/1.1`: the request head built (`request_head`), the node's answer (`200`, two
  fields, 1 KiB) parsed by a new `ResponseParser` and its body taken, as the lane does;
* `h2 xN`: an `h2` client connection (validation and normalisation off, as a trusting
  client would run it) sends N requests' HEADERS in one `data_to_send`, then takes the
  node's answers (HEADERS + DATA for each) and acknowledges the data (WINDOW_UPDATE).
  The node's side is an `h2` server connection run outside the timed part.

Process CPU time over bounded counts; the figure is µs per request, median of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events

from pact_ingress.proto.http_upstream import ResponseParser, request_head

BODY = b"x" * 1024
ANSWER_FIELDS = [(b"content-length", b"1024"), (b"content-type", b"text/plain")]
#: What the engine sends the bench's node for `GET /` (its cleaned fields).
REQUEST_FIELDS = [(b"host", b"localhost"), (b"forwarded", b'for="127.0.0.1";proto=https')]
H1_ANSWER = (b"HTTP/1.1 200 OK\r\n"
             + b"".join(n + b": " + v + b"\r\n" for n, v in ANSWER_FIELDS) + b"\r\n" + BODY)
_FAST = dict(header_encoding=None, validate_outbound_headers=False,
             normalize_outbound_headers=False, validate_inbound_headers=False,
             normalize_inbound_headers=False)


def http11(count: int) -> float:
    """CPU seconds for `count` requests' HTTP/1.1 work."""
    start = time.process_time()
    for _ in range(count):
        request_head("GET", b"/", REQUEST_FIELDS)
        parser = ResponseParser("GET")
        parser.feed(H1_ANSWER)
        if not parser.done or len(parser.take_body()) != len(BODY):
            raise SystemExit("the HTTP/1.1 answer did not parse")
    return time.process_time() - start


def _h2_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, **_FAST))
    node = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, **_FAST))
    client.initiate_connection()
    node.initiate_connection()
    node.receive_data(client.data_to_send())
    client.receive_data(node.data_to_send())
    node.receive_data(client.data_to_send())
    return client, node


def h2_batched(per_write: int) -> Callable[[int], float]:
    """CPU seconds of the client's side for `count` requests, `per_write` streams per
    write (the node's side is run too, but not counted)."""
    head = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"localhost"),
            (b":path", b"/"), REQUEST_FIELDS[1]]

    def run(count: int) -> float:
        client, node = _h2_pair()
        stream_id, used, ended = 1, 0.0, 0
        for _ in range(count // per_write):
            start = time.process_time()
            ids = []
            for _ in range(per_write):
                client.send_headers(stream_id, head, end_stream=True)
                ids.append(stream_id)
                stream_id += 2
            out = client.data_to_send()
            used += time.process_time() - start
            node.receive_data(out)
            for sid in ids:
                node.send_headers(sid, [(b":status", b"200"), *ANSWER_FIELDS])
                node.send_data(sid, BODY, end_stream=True)
            answers = node.data_to_send()
            start = time.process_time()
            for event in client.receive_data(answers):
                if isinstance(event, h2.events.DataReceived):
                    client.acknowledge_received_data(event.flow_controlled_length,
                                                     event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended += 1
            updates = client.data_to_send()
            used += time.process_time() - start
            node.receive_data(updates)
        if ended != count // per_write * per_write:
            raise SystemExit(f"h2: {ended} of {count} streams ended")
        return used

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    ways: dict[str, Callable[[int], float]] = {
        "http/1.1 (the engine's node leg)": http11,
        "h2 x1 (one stream per write)": h2_batched(1),
        "h2 x8 (eight streams per write)": h2_batched(8),
    }
    for run in ways.values():  # warm: imports, caches, the interpreter's specialisation
        run(min(400, args.count))
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, run in ways.items():
            results[name].append(run(args.count) / args.count * 1e6)
    base = statistics.median(results["http/1.1 (the engine's node leg)"])
    print("| node leg's protocol work | µs of CPU per request (median) | rounds | ÷ HTTP/1.1 |")
    print("|---|---|---|---|")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{med / base:.1f}× |")
    print(f"\n{args.count} requests per round, {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
