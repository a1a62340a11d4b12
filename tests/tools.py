"""Finding the real external tools the tests drive (see tests/conftest.py)."""

from __future__ import annotations

import shutil

import pytest

#: Debian package per tool, for the skip message.
PACKAGES = {
    "haproxy": "haproxy", "pebble": "pebble", "pebble-challtestsrv": "pebble",
    "named": "bind9", "nsupdate": "bind9-utils", "chromium": "chromium",
    "gnutls-cli": "gnutls-bin", "systemd-analyze": "systemd", "curl": "curl",
    "openssl": "openssl", "ssh": "openssh-client", "sshd": "openssh-server",
    "nghttp": "nghttp2-client", "h2load": "nghttp2-client", "nghttpd": "nghttp2-server",
    "node": "nodejs",
    "redis-server": "redis-server",
}


def require(tool: str) -> str:
    """Path of `tool`, or skip ("tool not installed") — a failure under PACT_REQUIRE_TOOLS."""
    for candidate in (tool, f"/usr/sbin/{tool}", f"/usr/bin/{tool}"):
        path = shutil.which(candidate)
        if path:
            return path
    pkg = PACKAGES.get(tool, tool)
    pytest.skip(f"tool not installed: {tool} (apt-get install -y {pkg})")
