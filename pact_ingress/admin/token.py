"""The admin bearer token, read the same way by both sides of the admin endpoint: the
server that requires it (`app.py`) and the CLI commands that present it (`status`,
`certs renew`)."""

from __future__ import annotations

from pact_ingress.errors import ConfigError
from pact_ingress.files import read_small
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
        data = read_small(path, MAX_TOKEN_FILE_BYTES)[0]
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror}") from exc
    except ValueError as exc:  # NotAFile, TooLarge
        raise ConfigError(f"{where}: {exc}") from None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        # a header value carries it: only printable ASCII survives the trip intact
        raise ConfigError(f"{where}: not ASCII text") from None
