"""What both HTTP/1.1 parsers (`http1_server` for clients, `http_upstream` for nodes) ask
llhttp (through `httptools`) of a parsed head, answered cheaply.

`httptools` gives a message's version only as text that it formats in Cython on every
call, a large part of a small message's whole parse. llhttp takes only HTTP/0.9, 1.0,
1.1 and 2.0, and of those only 1.1 keeps a connection alive with neither `Connection`
nor `Proxy-Connection` (which llhttp reads as `Connection`) among the fields: there
`should_keep_alive`, which the callers ask anyway, tells the version too.
"""

from __future__ import annotations

import httptools


def version(parser: httptools.HttpRequestParser | httptools.HttpResponseParser,
            keep_alive: bool, connection_fields: bool) -> str:
    """The version of the head `parser` just parsed ("1.1", "1.0", ...). `keep_alive`:
    what its `should_keep_alive()` said; `connection_fields`: a `Connection` or
    `Proxy-Connection` field was among its fields."""
    if keep_alive and not connection_fields:
        return "1.1"
    return parser.get_http_version()  # type: ignore[no-any-return]
