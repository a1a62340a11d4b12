"""Admin surface: Prometheus metrics, the /status document and page, reload, renewal.

`server.serve_admin` runs the endpoint (loopback or unix socket only unless explicitly
opened with a token); `client` is the CLI's synchronous side; `schema` defines the
`/status` document; `page` renders it as HTML; `token` reads the bearer token both sides
use.
"""

from pact_ingress.admin.client import AdminError, fetch_status, format_status, post
from pact_ingress.admin.schema import (
    STATUS_SCHEMA,
    counters_from,
    iso,
    refusals_from,
    routes_from,
    tenants_from,
)
from pact_ingress.admin.server import serve_admin

__all__ = [
    "STATUS_SCHEMA", "AdminError", "counters_from", "fetch_status", "format_status", "iso",
    "post", "refusals_from", "routes_from", "serve_admin", "tenants_from",
]
