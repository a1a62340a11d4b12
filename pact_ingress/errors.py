"""The exception tree: one root, local and remote errors kept apart.

Everything the package raises on purpose derives from `PactIngressError`, so the CLI can
turn any expected failure into one stderr line and an exit code without a traceback.
Errors caused by a peer's bytes (`RemoteProtocolError`) are distinct from errors in our
own configuration or state (`ConfigError`, `IdentityError`), as h11 and h2 do.
"""

from __future__ import annotations

import errno


class PactIngressError(Exception):
    """Root of every error this package raises deliberately."""

    exit_code = 1


#: Characters a message may not carry as they are: line breaks would split one problem
#: over several lines, escape sequences would reach the operator's terminal. A path or
#: value quoted in a message may hold them (YAML's "\n" and "\e" escapes).
UNPRINTABLE = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)]}
UNPRINTABLE.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                     0x2028: "\\u2028", 0x2029: "\\u2029"})


class ConfigError(PactIngressError):
    """A configuration file is invalid. `messages` are `FILE:LINE: message` lines, each
    one printable line (control characters in them are escaped)."""

    exit_code = 2

    def __init__(self, messages: list[str] | str) -> None:
        if isinstance(messages, str):
            messages = [messages]
        self.messages = [m.translate(UNPRINTABLE) for m in messages]
        super().__init__("\n".join(self.messages))


class UsageError(PactIngressError):
    """A command was called with arguments that cannot work."""

    exit_code = 2


class ListenError(PactIngressError):
    """A configured address could not be bound (in use, not ours, no permission)."""

    #: Plain words for the usual causes; anything else gets the system's wording.
    _REASONS = {
        errno.EADDRINUSE: "address in use",
        errno.EADDRNOTAVAIL: "address not available on this machine",
        errno.EACCES: "permission denied (ports below 1024 need CAP_NET_BIND_SERVICE)",
    }

    @classmethod
    def binding(cls, address: str, exc: OSError) -> ListenError:
        """`cannot listen on ADDRESS: reason` for a failed bind/listen of `address`."""
        reason = cls._REASONS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
        return cls(f"cannot listen on {address}: {reason}")


class IdentityError(PactIngressError):
    """A key, certificate or fingerprint could not be read or does not match."""


class RemoteProtocolError(PactIngressError):
    """A peer sent bytes that violate the protocol we expect from it."""


class BackendError(PactIngressError):
    """A backend (address or tunnel) could not be reached or failed mid-way."""


class EdgeShortage(BackendError):
    """No connection to the backend for want of this process's own resources (no fd
    left, no kernel memory): the edge is busy, the backend may well be up."""


class AcmeError(PactIngressError):
    """An ACME account, order or store operation failed. `reason` is a short metric label."""

    def __init__(self, message: str, *, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason
