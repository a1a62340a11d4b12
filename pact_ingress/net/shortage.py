"""Running short of file descriptors or kernel memory, told apart from a peer's fault.

An accept, a handoff or a connection to a home node that fails with one of
`CAPACITY_ERRNOS` is this process running out, for now: the answer is to back off or
say the edge is busy, and the operator hears of it once per shortage, not once per
failure (`ShortageEpisode`).
"""

from __future__ import annotations

import errno

from pact_ingress.logs import log

#: Errors that mean "out of resources for now", not "listener broken" or "peer down".
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Back-off after an accept failed so: long enough to let connections close, short
#: enough that service resumes quickly (trio's serve_listeners uses the same 100 ms).
ACCEPT_BACKOFF = 0.1


class ShortageEpisode:
    """Failures for want of resources (accepts, handoffs, node connections), logged
    once per episode: a line when they start failing and one when the next attempt
    works again. A line per failure would flood the log for as long as the shortage
    lasts (an accept loop retries every 100 ms per listener); the counters still count
    every failure."""

    def __init__(self, event: str = "accept_failed", backoff: bool = True,
                 resumed: str = "accept_resumed") -> None:
        self.event = event
        self.resumed = resumed  # the line that ends an episode
        self.backoff = backoff  # whether the caller waits `ACCEPT_BACKOFF` after each
        self.failures = 0
        self.since = 0.0

    def failed(self, error: str, now: float) -> None:
        if not self.failures:
            self.since = now
            if self.backoff:
                log.error(self.event, error=error, backoff_s=ACCEPT_BACKOFF)
            else:
                log.error(self.event, error=error)
        self.failures += 1

    def accepted(self, now: float) -> None:
        """After an attempt that worked (callers check `failures` first: it is the hot path)."""
        log.info(self.resumed, failures=self.failures,
                 duration_s=round(now - self.since, 3))
        self.failures = 0
