"""The admin bearer token, read the same way by both sides of the admin endpoint: the
server that requires it (`app.py`) and the CLI commands that present it (`status`,
`certs renew`)."""

from __future__ import annotations

from pact_ingress.errors import ConfigError
from pact_ingress.model import Config


def read_admin_token(config: Config) -> str | None:
    """The admin bearer token from `listen.admin_token_file` (None when not configured)."""
    path = config.listen.admin_token_file
    if path is None:
        return None
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{config.path}: listen.admin_token_file {path}: cannot read: "
                          f"{exc.strerror}") from exc
