"""`pact-ingress certs list|renew [HOST] -c FILE`.

`list` works offline: it reads the certificate store under `state_dir` (ACME certs) and
the cert files named in the config, so an operator can look even while the ingress is
down. `renew` asks the *running* instance through its admin endpoint, because only the
running instance answers the CA's TLS-ALPN-01 / HTTP-01 challenges on its listeners.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from urllib.parse import quote

from cryptography import x509

from pact_ingress.acme.store import CertInfo, list_store
from pact_ingress.admin.client import clean_text
from pact_ingress.config import CertFiles, Config, load_config
from pact_ingress.errors import ConfigError, PactIngressError, UsageError


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M UTC")


def _file_info(host: str, files: CertFiles) -> CertInfo:
    try:
        cert = x509.load_pem_x509_certificates(files.cert.read_bytes())[0]
    except (OSError, ValueError) as exc:
        return CertInfo(host, "file", last_error=f"cannot read {files.cert}: {exc}")
    return CertInfo(host, "file", issuer=cert.issuer.rfc4514_string(),
                    not_before=cert.not_valid_before_utc.timestamp(),
                    not_after=cert.not_valid_after_utc.timestamp())


def inventory(config: Config) -> list[CertInfo]:
    """Every host the ingress ends TLS for (terminate routes, then the relay host) with
    what the store or its files hold: the relay's certificate expires like the others."""
    stored = {c.host: c for c in list_store(config.state_dir)}
    sources = [(r.host, r.cert) for r in config.routes() if r.mode == "terminate"]
    if config.relay is not None:
        sources.append((config.relay.host, config.relay.cert))
    rows: list[CertInfo] = []
    for host, cert in sources:
        if isinstance(cert, CertFiles):
            rows.append(_file_info(host, cert))
        else:
            rows.append(stored.get(host) or CertInfo(host, "acme",
                                                     last_error="no certificate yet"))
    return rows


def format_rows(rows: list[CertInfo]) -> str:
    head = ("HOST", "SOURCE", "ISSUER", "NOT AFTER", "NEXT RENEWAL", "LAST ERROR")
    # the issuer's name and the last error are a CA's words: no raw control characters
    table = [head] + [
        (r.host, r.source, clean_text((r.issuer or "-")[:40]), _when(r.not_after),
         _when(r.next_renewal), clean_text(r.last_error or "-"))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in table
    )


def main(config_path: Path, action: str, host: str | None) -> int:
    config = load_config(config_path)
    if action == "list":
        rows = inventory(config)
        if host is not None:  # one host's row; a name the config serves no TLS for is a slip
            wanted = host.lower().removesuffix(".")
            rows = [r for r in rows if r.host == wanted]
            if not rows:
                raise UsageError(f"{config_path}: no terminate route or relay host named "
                                 f"{host!r}: it has no certificate")
        print(format_rows(rows))
        return 0
    from pact_ingress.admin.client import post

    if config.listen.admin is None:
        raise ConfigError(f"{config_path}: listen.admin is not set; `certs renew` asks the "
                          "running instance through it")
    target = host or "every host with cert: acme"
    print(f"renewing {target} through the running instance at {config.listen.admin} …",
          file=sys.stderr, flush=True)
    from pact_ingress.admin.token import read_admin_token

    answer = post(config.listen.admin, "/certs/renew" + (f"?host={quote(host)}" if host else ""),
                  token=read_admin_token(config))
    # the CA's words can reach the message: no raw control characters
    lines = [clean_text(line) for line in str(answer.get("message", "")).splitlines()]
    if not answer.get("ok"):  # why goes to stderr with the failure, in its one line
        raise PactIngressError(f"renewal of {target} failed" +
                               (f": {'; '.join(lines)}" if lines else ""))
    for line in lines:
        print(line)
    return 0
