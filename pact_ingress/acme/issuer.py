"""One certificate order, start to finish, synchronously (run it in a worker thread).

new key + CSR → new order → for each pending authorization: pick a challenge, make the
answer available (TLS-ALPN-01 / HTTP-01 through `ChallengeHooks`, DNS-01 through
`Dns01Solver`), tell the CA, poll until decided → finalize → download the chain.

Why our own authorization polling: the library's `poll_authorizations` sleeps a fixed 1 s
between polls; against a fast CA that second dominates time-to-certificate, so we poll
with `client.poll` every `AUTHZ_POLL` seconds instead (still bounded by the deadline).

Every call to the CA has the account's HTTP timeout and every loop the order `deadline`
(a `time.monotonic()` value), so the thread always terminates even if trio abandoned it.
Errors leave as `AcmeError` with a short `reason` (the metric label); a CA that forgot
our account (it was reset) gets one re-registration with the same key and a retry.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from acme import challenges, messages
from acme import crypto_util as acme_crypto
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pact_ingress.acme import tlsalpn
from pact_ingress.acme.account import Account, translated_errors
from pact_ingress.acme.dns01 import Dns01Solver
from pact_ingress.acme.kinds import DNS_01, TLS_ALPN_01
from pact_ingress.errors import AcmeError
from pact_ingress.logs import log

#: Seconds between authorization polls (the CA's Retry-After is not sent for authzs).
AUTHZ_POLL = 0.2
#: Longest a whole order may take (validation + finalization), seconds.
ORDER_TIMEOUT = 120.0



class ChallengeHooks(Protocol):
    """Where TLS-ALPN-01 and HTTP-01 answers are published (the manager's tables)."""

    def offer(self, kind: str, host: str, token: str, key_authorization: str) -> None: ...

    def withdraw(self, kind: str, host: str, token: str) -> None: ...


@dataclass(frozen=True)
class Issued:
    chain_pem: bytes
    key_pem: bytes = field(repr=False)
    challenge: str  # which challenge type validated (or "reused" when the CA had a valid authz)


def issue(account: Account, host: str, *, kinds: Sequence[str], hooks: ChallengeHooks,
          dns01: Dns01Solver | None, deadline: float,
          on_order: Callable[[], None] = lambda: None) -> Issued:
    """Obtain a certificate for `host`; `kinds` are the usable challenge types, preferred first.

    `on_order` is called right before the new-order request (the manager's order budget).
    """
    with translated_errors():
        try:
            return _issue_once(account, host, kinds, hooks, dns01, deadline, on_order)
        except messages.Error as exc:
            if exc.code != "accountDoesNotExist":
                raise
            account.register()  # the CA was reset or forgot us: same key, fresh registration
            return _issue_once(account, host, kinds, hooks, dns01, deadline, on_order)


def _issue_once(account: Account, host: str, kinds: Sequence[str], hooks: ChallengeHooks,
                dns01: Dns01Solver | None, deadline: float,
                on_order: Callable[[], None]) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    csr_pem = acme_crypto.make_csr(key_pem, [host])
    on_order()
    orderr = account.client.new_order(csr_pem)
    used = "reused"
    for authzr in orderr.authorizations:
        if authzr.body.status == messages.STATUS_VALID:
            continue
        used = _solve(account, host, authzr, kinds, hooks, dns01, deadline)
    wall_deadline = datetime.datetime.now() + datetime.timedelta(
        seconds=max(0.0, deadline - time.monotonic()))
    orderr = account.client.finalize_order(orderr, wall_deadline)
    return Issued(orderr.fullchain_pem.encode("ascii"), key_pem, used)


def pick_challenge(authzr: messages.AuthorizationResource, host: str,
                   kinds: Sequence[str]) -> messages.ChallengeBody:
    """The first offered challenge among `kinds` (wildcards: DNS-01 only, RFC 8555 §7.1.3)."""
    usable = [DNS_01] if host.startswith("*.") else list(kinds)
    offered = {c.chall.typ: c for c in authzr.body.challenges}
    for kind in usable:
        if kind in kinds and kind in offered:
            return offered[kind]
    raise AcmeError(f"no usable challenge for {host}: CA offers {sorted(offered)}, "
                    f"we can answer {list(usable if host.startswith('*.') else kinds)}",
                    reason="no_challenge")


def _solve(account: Account, host: str, authzr: messages.AuthorizationResource,
           kinds: Sequence[str], hooks: ChallengeHooks, dns01: Dns01Solver | None,
           deadline: float) -> str:
    challb = pick_challenge(authzr, host, kinds)
    chall = challb.chall
    assert isinstance(chall, challenges.KeyAuthorizationChallenge)
    kind, token = chall.typ, chall.encode("token")
    key_authz = chall.key_authorization(account.jwk)
    cleanup = _present(kind, host, token, key_authz, chall, account, hooks, dns01)
    try:
        account.client.answer_challenge(challb, chall.response(account.jwk))
        _wait_decided(account, authzr, host, deadline)
    finally:
        cleanup()
    return kind


def _present(kind: str, host: str, token: str, key_authz: str,
             chall: challenges.KeyAuthorizationChallenge, account: Account,
             hooks: ChallengeHooks, dns01: Dns01Solver | None) -> Callable[[], None]:
    """Publish the answer; returns the matching cleanup."""
    if kind == DNS_01:
        if dns01 is None:
            raise AcmeError("dns-01 chosen without a dns01 configuration", reason="no_challenge")
        value = chall.validation(account.jwk)
        dns01.present(host, value)
        return lambda: _quiet(lambda: dns01.cleanup(host, value))
    hooks.offer(kind, host, token, key_authz)
    return lambda: hooks.withdraw(kind, host, token)


def _wait_decided(account: Account, authzr: messages.AuthorizationResource, host: str,
                  deadline: float) -> None:
    while True:
        authzr, _ = account.client.poll(authzr)
        status = authzr.body.status
        if status == messages.STATUS_VALID:
            return
        if status not in (messages.STATUS_PENDING, messages.STATUS_PROCESSING):
            raise AcmeError(f"validation of {host} failed: {_challenge_errors(authzr)}",
                            reason="validation")
        if time.monotonic() >= deadline:
            raise AcmeError(f"validation of {host} not decided before the deadline",
                            reason="timeout")
        time.sleep(AUTHZ_POLL)


def _challenge_errors(authzr: messages.AuthorizationResource) -> str:
    errs = [f"{c.chall.typ}: {c.error.detail or c.error.code}"
            for c in authzr.body.challenges if c.error is not None]
    return "; ".join(errs) or f"authorization {authzr.body.status}"


def _quiet(fn: Callable[[], None]) -> None:
    """Run a cleanup whose failure must not hide the order's own outcome."""
    try:
        fn()
    except AcmeError as exc:
        log.warning("acme_cleanup_failed", error=str(exc))


# keep the TLS-ALPN-01 classes registered with the acme library whenever issuing is possible
assert tlsalpn.TLSALPN01.typ == TLS_ALPN_01
