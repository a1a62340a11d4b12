"""Reading the small files an operator names (the config, keys, certificates, tokens and
secrets) so that a wrong one cannot hang or flood the process.

A path that names a FIFO would block `open` until a writer comes (a reload, and with it
the whole event loop, would wait for ever), a device may never end, and a file of
gigabytes would be read whole. So the file is opened non-blocking, checked on the open
descriptor (no window for the path to change between a check and the open) and read
only up to one byte past its cap. Callers turn the exceptions into their own one-line
messages.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotAFile(ValueError):
    """The path is a directory, a FIFO, a device or a socket."""

    def __init__(self, path: Path | str, mode: int) -> None:
        self.is_dir = stat.S_ISDIR(mode)
        super().__init__("is a directory" if self.is_dir else "not a regular file")


class TooLarge(ValueError):
    """The file holds more than the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        super().__init__(f"larger than {cap} bytes")


def read_small(path: Path | str, cap: int) -> tuple[bytes, int]:
    """The bytes of the regular file at `path` (at most `cap`) and its mode. OSError when
    it cannot be opened or read, NotAFile or TooLarge as their names say."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # before `open`, which refuses a directory its own way
            raise NotAFile(path, mode)
        fh = open(fd, "rb")  # noqa: SIM115 - `with` below; it owns the fd from here
    except BaseException:
        os.close(fd)
        raise
    with fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise TooLarge(cap)
    return data, mode
