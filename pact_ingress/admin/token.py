"""The admin bearer token, read the same way by both sides of the admin endpoint: the
server that requires it (`app.py`) and the CLI commands that present it (`status`,
`certs renew`)."""

from __future__ import annotations

import os
import stat

from pact_ingress.errors import ConfigError
from pact_ingress.model import Config

#: A bearer token is a line of text; a bigger file is not one.
MAX_TOKEN_FILE_BYTES = 4096


def read_admin_token(config: Config) -> str | None:
    """The admin bearer token from `listen.admin_token_file` (None when not configured)."""
    path = config.listen.admin_token_file
    if path is None:
        return None
    where = f"{config.path}: listen.admin_token_file {path}"
    try:
        # non-blocking: opening a FIFO must not wait for a writer that never comes
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ConfigError(f"{where}: not a regular file")
            data = fh.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror}") from exc
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        # a header value carries it: only printable ASCII survives the trip intact
        raise ConfigError(f"{where}: not ASCII text") from None
