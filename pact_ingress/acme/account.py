"""The ACME account: one key and one registration per CA directory, created once.

The account key (EC P-256, ES256 signatures) is generated on first use and written to the
store with mode 0600; the CA's registration resource is persisted beside it and reused on
every start, so restarts never create new accounts (Let's Encrypt limits those per IP).
Registration happens only with `agree_tos: true`: agreeing to a CA's terms is an explicit
operator decision, never a default.

Everything here is synchronous (the `acme` client is `requests` underneath) and runs in a
worker thread; each HTTP request carries `HTTP_TIMEOUT`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import josepy as jose
import requests
from acme import client as acme_client
from acme import errors as acme_errors
from acme import messages
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pact_ingress.errors import AcmeError
from pact_ingress.model import Acme

if TYPE_CHECKING:  # the Redis client is imported only when the redis backend runs
    from pact_ingress.state.acme import AcmeStore

#: Seconds for one HTTP request to the CA (connect + read). Bounds every worker-thread call.
HTTP_TIMEOUT = 20
USER_AGENT = "pact-ingress"
#: Rounds of the acme library's own send (a request and, after a badNonce refusal, one
#: more try) one POST gets before a badNonce refusal is given up on. A CA under load may
#: refuse a good share of nonces, and an order with a request that gives up is thrown
#: away whole: a new order at the CA (its new-orders limit) and from our own budget.
BAD_NONCE_ROUNDS = 4


class _Network(acme_client.ClientNetwork):
    """`ClientNetwork` whose POSTs ride out several badNonce refusals in a row (RFC 8555
    §6.5: each refusal carries a fresh nonce to retry with)."""

    def post(self, *args: Any, **kwargs: Any) -> requests.Response:
        for _ in range(BAD_NONCE_ROUNDS - 1):
            try:
                return super().post(*args, **kwargs)
            except messages.Error as error:
                if error.code != "badNonce":
                    raise
        return super().post(*args, **kwargs)


@dataclass
class Account:
    """A ready-to-use ACME client bound to our registered account."""

    cfg: Acme
    store: AcmeStore
    jwk: jose.JWK
    client: acme_client.ClientV2

    @property
    def offers_ari(self) -> bool:
        """True when the CA advertises renewalInfo (RFC 9773)."""
        try:
            self.client.directory["renewalInfo"]
        except KeyError:
            return False
        return True

    def register(self) -> None:
        """Create (or find, for our key) the account at the CA and persist it."""
        if not self.cfg.agree_tos:
            raise AcmeError("acme.agree_tos must be true to register an account with "
                            f"{self.cfg.directory}", reason="tos")
        new = messages.NewRegistration.from_data(email=self.cfg.email,
                                                 terms_of_service_agreed=True)
        self.client.net.account = None  # newAccount is signed with the JWK, not a kid
        try:
            regr = self.client.new_account(new)
        except acme_errors.ConflictError as exc:  # our key already has an account there
            regr = self.client.query_registration(
                messages.RegistrationResource(uri=exc.location, body=messages.Registration()))
        self.store.write_registration(self.cfg.directory, regr.to_json())


@contextlib.contextmanager
def translated_errors() -> Iterator[None]:
    """Turn the acme/requests/josepy exception zoo into `AcmeError` with a metric reason."""
    try:
        yield
    except AcmeError:
        raise
    except messages.Error as exc:
        raise AcmeError(f"CA refused: {exc.code}: {exc.detail}", reason="ca_error") from exc
    except acme_errors.TimeoutError as exc:
        raise AcmeError("order not finished before the deadline", reason="timeout") from exc
    except requests.RequestException as exc:
        raise AcmeError(f"CA unreachable: {type(exc).__name__}: {exc}",
                        reason="ca_unreachable") from exc
    except (acme_errors.Error, jose.errors.Error) as exc:
        raise AcmeError(f"ACME client error: {type(exc).__name__}: {exc}",
                        reason="client_error") from exc


def open_account(store: AcmeStore, cfg: Acme) -> Account:
    """Load or create the key, fetch the directory, reuse or create the registration."""
    with translated_errors():
        return _open_account(store, cfg)


def _open_account(store: AcmeStore, cfg: Acme) -> Account:
    jwk = jose.JWKEC(key=_load_or_create_key(store, cfg.directory))
    verify: bool | str = str(cfg.ca_bundle) if cfg.ca_bundle else True
    net = _Network(jwk, alg=jose.ES256, verify_ssl=verify,  # type: ignore[arg-type]
                   user_agent=USER_AGENT, timeout=HTTP_TIMEOUT)
    directory = acme_client.ClientV2.get_directory(cfg.directory, net)
    account = Account(cfg, store, jwk, acme_client.ClientV2(directory, net))
    _, registration = store.read_account(cfg.directory)
    if registration is None:
        account.register()
    else:
        net.account = messages.RegistrationResource.from_json(registration)
    return account


def _load_or_create_key(store: AcmeStore, directory_url: str) -> ec.EllipticCurvePrivateKey:
    key_pem, _ = store.read_account(directory_url)
    if key_pem is None:
        key = ec.generate_private_key(ec.SECP256R1())
        store.write_account_key(directory_url, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        # read back: in a cluster another instance's key may have been stored first
        key_pem, _ = store.read_account(directory_url)
        if key_pem is None:
            raise AcmeError("the account key just stored cannot be read back",
                            reason="account_key")
    loaded = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise AcmeError("stored ACME account key is not an EC key", reason="account_key")
    return loaded
