"""PACT sealed envelopes (spec §13): seal, open, verify — and the edge's header check.

Theory of operation
-------------------
An envelope is a JSON object of exactly four string members, each unpadded base64url::

    {"protected": B64(header), "enc": B64(hpke_enc), "ct": B64(hpke_ct), "sig": B64(sig)}

* ``header`` is canonical JSON (UTF-8, keys sorted, no insignificant whitespace, no
  escaping beyond what JSON demands) with exactly the members ``v suite cty from to kid
  msg_id ts exp`` (spec README, recovered from the vectors). Its decoded bytes are the
  HPKE AAD, so "canonical" is checked by re-serialising and comparing bytes: two parties
  that disagree on what was authenticated must fail loudly, not silently.
* ``enc``/``ct`` are HPKE (RFC 9180) Base mode to the *recipient's identity key*, with
  info ``PACT-SEAL-v1``. The suite follows the recipient's key type: P-256 keys use
  DHKEM(P-256)/HKDF-SHA256/AES-128-GCM, Ed25519 keys are mapped to X25519 (RFC 7748
  §4.1 for the public key, RFC 8032 §5.1.5 for the private scalar) and use
  DHKEM(X25519)/HKDF-SHA256/ChaCha20-Poly1305.
* ``sig`` is the *sender's* signature, in the sender's own algorithm, over the decoded
  ``protected ‖ enc ‖ ct``: ECDSA P-256/SHA-256 (ASN.1 DER) or pure Ed25519. Signing the
  ciphertext (not the plaintext) is what lets a relay or an edge verify without opening.

Two audiences use this module:

* the edge (which holds no tenant private key) calls :func:`check_header` — the checks
  that need no private key: shape, canonical header, version, suite, direction,
  addressee among the tenant's pins, non-empty msg_id, freshness;
* a node calls :func:`open_envelope`, which runs spec §13.3's order exactly: decode,
  v/suite, ``to`` is local, ``kid`` resolves, HPKE-open, verify the signature (pinned key
  of ``from``, or the payload's ``spk`` hashing to ``from``), then time.

Every failure caused by the envelope's bytes raises :class:`EnvelopeInvalid` (spec §12's
``envelope_invalid``) with a short ``reason`` safe to show the sender. Misuse by our own
caller (e.g. sealing with an RSA key) raises ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, x25519
from pyhpke import AEADId, CipherSuite, KDFId, KEMId, KEMKey, PyHPKEError

from pact_ingress.errors import RemoteProtocolError
from pact_ingress.identity import (
    PrivateKey,
    PublicKey,
    b64url,
    b64url_decode,
    fingerprint,
    fingerprint_of_spki,
    is_pin,
)

CALL_CTY = "application/pact-call+json"
RESULT_CTY = "application/pact-result+json"
SUITE_P256 = "PACT-SEAL-P256"
SUITE_X25519 = "PACT-SEAL-X25519"
SUITES = (SUITE_P256, SUITE_X25519)
HPKE_INFO = b"PACT-SEAL-v1"
VERSION = 1

#: The four wire members of an envelope, and the nine of its protected header.
ENVELOPE_MEMBERS = frozenset({"protected", "enc", "ct", "sig"})
HEADER_MEMBERS = frozenset({"v", "suite", "cty", "from", "to", "kid", "msg_id", "ts", "exp"})

#: |now - ts| bound for directly delivered envelopes (spec §13.3).
MAX_CLOCK_SKEW = 300
#: exp - ts bound: 30 days, matching the relay retention cap of spec §9.
MAX_LIFETIME = 30 * 24 * 3600
#: Cap on the encoded protected header. Eight of its nine members are short (three
#: 50-char fingerprints, two ints, two fixed strings); only msg_id is free-form, and a
#: UUID-sized key needs ~40 bytes. 8 KiB of base64url (6 KiB decoded) leaves over 5 KiB
#: for msg_id while bounding the JSON parse the edge does on unauthenticated input.
MAX_PROTECTED_CHARS = 8 * 1024

#: ts and exp are Unix seconds in [0, 2**53): every JSON implementation holds such an
#: integer exactly, and arithmetic with a float clock cannot overflow (10**309 would).
MAX_TIME = 2**53

_ED25519_P = 2**255 - 19


class EnvelopeInvalid(RemoteProtocolError):
    """An envelope was malformed, misdirected, mis-signed, expired or mismatched.

    `reason` is a short human explanation, safe to return to the envelope's sender;
    `code` is the spec §12 error code.
    """

    code = "envelope_invalid"

    def __init__(self, reason: str) -> None:
        super().__init__(f"envelope_invalid: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Header:
    """A decoded protected header. `sender` is the wire member ``from``."""

    v: int
    suite: str
    cty: str
    sender: str
    to: str
    kid: str
    msg_id: str
    ts: int
    exp: int
    protected: bytes  # the exact decoded bytes: the AAD and the start of the signed data

    def members(self) -> dict[str, Any]:
        """The header as its wire members (``from``, not ``sender``)."""
        return {
            "v": self.v, "suite": self.suite, "cty": self.cty, "from": self.sender,
            "to": self.to, "kid": self.kid, "msg_id": self.msg_id, "ts": self.ts,
            "exp": self.exp,
        }


@dataclass(frozen=True)
class Opened:
    """An envelope that opened and verified."""

    header: Header
    plaintext: bytes
    payload: dict[str, Any]
    sender_fingerprint: str


# --- canonical JSON ----------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """PACT canonical JSON: UTF-8, sorted keys, no whitespace, no HTML/ASCII escaping."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# --- Ed25519 → X25519 (RFC 7748 §4.1, RFC 8032 §5.1.5) -----------------------------------


def x25519_public_from_ed25519(public_key: ed25519.Ed25519PublicKey) -> x25519.X25519PublicKey:
    """Map an Ed25519 public key to its X25519 twin: u = (1 + y) / (1 - y) mod p."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)  # drop the sign bit of x
    if y >= _ED25519_P or y == 1:  # non-canonical, or the identity point (1 - y = 0)
        raise ValueError("Ed25519 public key has no X25519 equivalent")
    u = (1 + y) * pow(1 - y, _ED25519_P - 2, _ED25519_P) % _ED25519_P
    return x25519.X25519PublicKey.from_public_bytes(u.to_bytes(32, "little"))


def x25519_private_from_ed25519(private_key: ed25519.Ed25519PrivateKey) -> x25519.X25519PrivateKey:
    """The X25519 scalar of an Ed25519 key: SHA-512(seed)[:32], clamped."""
    seed = private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    scalar = bytearray(hashlib.sha512(seed).digest()[:32])
    scalar[0] &= 248
    scalar[31] &= 127
    scalar[31] |= 64
    return x25519.X25519PrivateKey.from_private_bytes(bytes(scalar))


# --- suites ------------------------------------------------------------------------------

_CIPHER_SUITES = {
    SUITE_P256: CipherSuite.new(
        KEMId.DHKEM_P256_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES128_GCM
    ),
    SUITE_X25519: CipherSuite.new(
        KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.CHACHA20_POLY1305
    ),
}


def suite_for(key: PublicKey | PrivateKey) -> str:
    """The seal suite a recipient key implies (spec §13.1: chosen by the recipient)."""
    if isinstance(key, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey)):
        return SUITE_X25519
    if isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)) and isinstance(
        key.curve, ec.SECP256R1
    ):
        return SUITE_P256
    raise TypeError("PACT identities are ECDSA P-256 or Ed25519 keys")


def _hpke_public(key: PublicKey) -> Any:
    if isinstance(key, ed25519.Ed25519PublicKey):
        return KEMKey.from_pyca_cryptography_key(x25519_public_from_ed25519(key))
    return KEMKey.from_pyca_cryptography_key(key)


def _hpke_private(key: PrivateKey) -> Any:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return KEMKey.from_pyca_cryptography_key(x25519_private_from_ed25519(key))
    return KEMKey.from_pyca_cryptography_key(key)


def _sign(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def _verify(key: PublicKey, sig: bytes, data: bytes) -> bool:
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(sig, data)
        else:
            key.verify(sig, data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


# --- sealing -----------------------------------------------------------------------------


def seal(
    payload: Mapping[str, Any] | bytes,
    *,
    sender_key: PrivateKey,
    recipient_public_key: PublicKey,
    msg_id: str,
    ts: int,
    exp: int,
    cty: str = CALL_CTY,
    kid: str | None = None,
) -> dict[str, str]:
    """Seal `payload` to `recipient_public_key`, signed by `sender_key` (spec §13.1).

    `from` is the sender's fingerprint, `to` the recipient's; `kid` defaults to `to` (one
    key per identity; the seam for a later dedicated encryption key). A mapping payload
    is serialised as canonical JSON; bytes are sealed as given.
    """
    suite_for(sender_key)  # reject non-PACT sender keys before doing any work
    if not isinstance(msg_id, str) or not msg_id:
        raise ValueError("msg_id must be a non-empty string")
    if not all(_is_int(x) and 0 <= x < MAX_TIME for x in (ts, exp)):
        raise ValueError("ts and exp must be integers in [0, 2**53)")
    to = fingerprint(recipient_public_key)
    suite = suite_for(recipient_public_key)
    header = {
        "v": VERSION, "suite": suite, "cty": cty, "from": fingerprint(sender_key.public_key()),
        "to": to, "kid": kid if kid is not None else to, "msg_id": msg_id, "ts": ts, "exp": exp,
    }
    protected = canonical_json(header)
    plaintext = payload if isinstance(payload, bytes) else canonical_json(dict(payload))
    enc, context = _CIPHER_SUITES[suite].create_sender_context(
        _hpke_public(recipient_public_key), info=HPKE_INFO
    )
    ct = context.seal(plaintext, aad=protected)
    sig = _sign(sender_key, protected + enc + ct)
    wire = {"protected": protected, "enc": enc, "ct": ct, "sig": sig}
    return {name: b64url(value) for name, value in wire.items()}


# --- structural decoding (no keys needed) ------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decode_member(envelope: Mapping[str, Any], name: str) -> bytes:
    try:
        return b64url_decode(envelope[name])
    except ValueError as exc:
        raise EnvelopeInvalid(f"{name} is not unpadded base64url") from exc


def _check_shape(envelope: object) -> Mapping[str, Any]:
    if not isinstance(envelope, Mapping):
        raise EnvelopeInvalid("envelope is not a JSON object")
    if set(envelope) != ENVELOPE_MEMBERS:
        raise EnvelopeInvalid("envelope must have exactly the members protected, enc, ct, sig")
    for name in sorted(ENVELOPE_MEMBERS):
        if not isinstance(envelope[name], str):
            raise EnvelopeInvalid(f"{name} is not a string")
    if len(envelope["protected"]) > MAX_PROTECTED_CHARS:
        raise EnvelopeInvalid("protected header too large")
    return envelope


def _parse_canonical(protected: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(protected.decode("utf-8"))
        canonical = canonical_json(obj)
    except (ValueError, RecursionError) as exc:  # UnicodeError and JSONDecodeError included
        raise EnvelopeInvalid("protected is not UTF-8 JSON") from exc
    if not isinstance(obj, dict):
        raise EnvelopeInvalid("protected is not a JSON object")
    if canonical != protected:
        raise EnvelopeInvalid("protected is not canonical JSON")
    return obj


def _header_from(members: dict[str, Any], protected: bytes) -> Header:
    if set(members) != HEADER_MEMBERS:
        raise EnvelopeInvalid("protected must have exactly v suite cty from to kid msg_id ts exp")
    if not _is_int(members["v"]) or members["v"] != VERSION:
        raise EnvelopeInvalid("unsupported version v")
    if members["suite"] not in SUITES:
        raise EnvelopeInvalid("unsupported suite")
    if not isinstance(members["cty"], str):
        raise EnvelopeInvalid("cty is not a string")
    for name in ("from", "to", "kid"):
        if not _known_pin(members[name]):
            raise EnvelopeInvalid(f"{name} is not a sha256: fingerprint")
    if not isinstance(members["msg_id"], str) or not members["msg_id"]:
        raise EnvelopeInvalid("msg_id must be a non-empty string")
    if not _is_int(members["ts"]) or not _is_int(members["exp"]):
        raise EnvelopeInvalid("ts and exp must be integers")
    if not (0 <= members["ts"] < MAX_TIME and 0 <= members["exp"] < MAX_TIME):
        raise EnvelopeInvalid("ts and exp must be Unix seconds in [0, 2**53)")
    return Header(
        v=members["v"], suite=members["suite"], cty=members["cty"], sender=members["from"],
        to=members["to"], kid=members["kid"], msg_id=members["msg_id"], ts=members["ts"],
        exp=members["exp"], protected=protected,
    )


#: Fingerprints `is_pin` accepted lately: a relay or node sees the same few senders and
#: recipients over and over, and each header names three. Bounded (cleared when full).
_PINS_SEEN: set[str] = set()
_PINS_SEEN_MAX = 4096


def _known_pin(text: object) -> bool:
    # a hostile header may name a list or an object here: unhashable, so the type is
    # checked before the set is asked (only strings that passed are ever in it)
    if type(text) is str and text in _PINS_SEEN:
        return True
    if not is_pin(text):
        return False
    if len(_PINS_SEEN) >= _PINS_SEEN_MAX:
        _PINS_SEEN.clear()
    _PINS_SEEN.add(text)  # type: ignore[arg-type]
    return True


def canonical_envelope(envelope: Mapping[str, Any]) -> bytes:
    """`canonical_json` of the four wire members, for an envelope `decode_signed`
    accepted: each member is then unpadded base64url, which JSON never escapes, so the
    canonical form is the members in key order, quoted as they are."""
    return (f'{{"ct":"{envelope["ct"]}","enc":"{envelope["enc"]}",'
            f'"protected":"{envelope["protected"]}","sig":"{envelope["sig"]}"}}').encode()


def decode_header(envelope: object) -> Header:
    """Structural checks only: shape, encodings, canonical header, members, v, suite.

    `from`, `to` and `kid` must have fingerprint shape: `kid` must resolve to a key and
    `from` must equal a key's hash, so no other shape can ever open or verify.
    """
    return decode_signed(envelope)[0]


def decode_signed(envelope: object) -> tuple[Header, bytes, bytes]:
    """`decode_header`, also returning what the signature covers and the signature: a
    relay verifies with them without decoding the members a second time."""
    env = _check_shape(envelope)
    protected = _decode_member(env, "protected")
    header = _header_from(_parse_canonical(protected), protected)
    signed = protected + _decode_member(env, "enc") + _decode_member(env, "ct")
    return header, signed, _decode_member(env, "sig")


def check_time(header: Header, *, now: float, direct: bool = True) -> None:
    """Freshness (spec §13.3): now < exp always; |now − ts| ≤ 300 s when direct."""
    if header.exp - header.ts > MAX_LIFETIME:
        raise EnvelopeInvalid("exp - ts exceeds 30 days")
    if not now < header.exp:
        raise EnvelopeInvalid("envelope expired")
    if direct and abs(now - header.ts) > MAX_CLOCK_SKEW:
        raise EnvelopeInvalid("ts is more than 300 s from now")


def _check_cty(header: Header, expected_cty: str) -> None:
    if header.cty != expected_cty:
        raise EnvelopeInvalid(f"cty must be {expected_cty}")


def check_header(
    envelope: object,
    *,
    now: float,
    recipient_pins: Collection[str],
    direct: bool = True,
    expected_cty: str = CALL_CTY,
) -> Header:
    """Everything an edge can check without a private key; returns the header.

    Raises EnvelopeInvalid on the first failure. A passing envelope may still fail to
    open at the node (wrong ciphertext, bad signature): the edge cannot know.
    """
    header = decode_header(envelope)
    _check_cty(header, expected_cty)
    if header.to not in recipient_pins:
        raise EnvelopeInvalid("to is not this recipient")
    check_time(header, now=now, direct=direct)
    return header


# --- opening (spec §13.3) ----------------------------------------------------------------


def _resolve_kid(header: Header, keys: tuple[PrivateKey, ...]) -> PrivateKey:
    local = {fingerprint(k.public_key()): k for k in keys}
    if header.to not in local:
        raise EnvelopeInvalid("to is not a local identity")
    key = local.get(header.kid)
    if key is None:
        raise EnvelopeInvalid("kid does not name a held key")
    if suite_for(key) != header.suite:
        raise EnvelopeInvalid("suite does not match the key named by kid")
    return key


def _hpke_open(header: Header, env: Mapping[str, Any], key: PrivateKey) -> bytes:
    enc, ct = _decode_member(env, "enc"), _decode_member(env, "ct")
    try:
        context = _CIPHER_SUITES[header.suite].create_recipient_context(
            enc, _hpke_private(key), info=HPKE_INFO
        )
        return context.open(ct, aad=header.protected)
    except (PyHPKEError, ValueError) as exc:
        raise EnvelopeInvalid("cannot be opened with the key named by kid") from exc


def _parse_payload(plaintext: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(plaintext.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise EnvelopeInvalid("plaintext is not UTF-8 JSON") from exc
    if not isinstance(payload, dict):
        raise EnvelopeInvalid("plaintext is not a JSON object")
    return payload


def _key_from_spk(header: Header, payload: Mapping[str, Any]) -> PublicKey:
    spk = payload.get("spk")
    if spk is None:
        raise EnvelopeInvalid("from is not pinned and the payload carries no spk")
    try:
        der = b64url_decode(spk)
    except ValueError as exc:
        raise EnvelopeInvalid("spk is not unpadded base64url") from exc
    if fingerprint_of_spki(der) != header.sender:
        raise EnvelopeInvalid("SHA-256(spk) does not equal from")
    try:
        key = serialization.load_der_public_key(der)
        suite_for(key)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise EnvelopeInvalid("spk is not a P-256 or Ed25519 public key") from exc
    return key  # type: ignore[return-value]


def _sender_key(
    header: Header, payload: Mapping[str, Any], pinned: PublicKey | None
) -> PublicKey:
    if pinned is None:
        return _key_from_spk(header, payload)
    if fingerprint(pinned) != header.sender:
        raise EnvelopeInvalid("from is not the pinned sender")
    spk = payload.get("spk")
    if spk is not None and not (isinstance(spk, str) and _spk_matches(spk, header.sender)):
        raise EnvelopeInvalid("spk does not match the pinned sender")
    return pinned


def _spk_matches(spk: str, pin: str) -> bool:
    try:
        return fingerprint_of_spki(b64url_decode(spk)) == pin
    except ValueError:
        return False


def open_envelope(
    envelope: object,
    *,
    recipient_key: PrivateKey | Iterable[PrivateKey],
    now: float,
    sender_public_key: PublicKey | None = None,
    expected_cty: str = CALL_CTY,
    direct: bool = True,
) -> Opened:
    """Open and verify an envelope in spec §13.3's order; raise EnvelopeInvalid on failure.

    `recipient_key` is the local identity key, or several during a rotation (spec §2;
    `kid` picks one). `sender_public_key` is the pinned key of `from` when the sender is
    pinned; without it the payload's `spk` must hash to `from`. Idempotency (msg_id) and
    dispatch are the caller's next steps.
    """
    keys = (recipient_key,) if not isinstance(recipient_key, Iterable) else tuple(recipient_key)
    header = decode_header(envelope)
    assert isinstance(envelope, Mapping)  # decode_header checked the shape
    _check_cty(header, expected_cty)
    key = _resolve_kid(header, keys)
    plaintext = _hpke_open(header, envelope, key)
    payload = _parse_payload(plaintext)
    sender = _sender_key(header, payload, sender_public_key)
    signed = header.protected + _decode_member(envelope, "enc") + _decode_member(envelope, "ct")
    if not _verify(sender, _decode_member(envelope, "sig"), signed):
        raise EnvelopeInvalid("signature does not verify")
    check_time(header, now=now, direct=direct)
    return Opened(header, plaintext, payload, header.sender)


def verify_signature(envelope: object, sender_public_key: PublicKey, *,
                     header: Header | None = None) -> Header:
    """Verify without opening (what a relay does, spec §9): shape + sig by `from`'s key.

    `header` is this envelope's `decode_header` result when the caller has it already
    (the relay decodes first to check cty and from; decoding again would double the cost).
    """
    header = header if header is not None else decode_header(envelope)
    assert isinstance(envelope, Mapping)
    signed = header.protected + _decode_member(envelope, "enc") + _decode_member(envelope, "ct")
    verify_decoded(header, signed, _decode_member(envelope, "sig"), sender_public_key)
    return header


def verify_decoded(header: Header, signed: bytes, sig: bytes,
                   sender_public_key: PublicKey, *, key_fingerprint: str | None = None
                   ) -> None:
    """The signature check on `decode_signed`'s output: `from` is this key's, and the
    signature verifies under it. `key_fingerprint`: the key's fingerprint when the caller
    computed it already (a relay connection's, once per certificate)."""
    if (key_fingerprint or fingerprint(sender_public_key)) != header.sender:
        raise EnvelopeInvalid("from is not the given sender key")
    if not _verify(sender_public_key, sig, signed):
        raise EnvelopeInvalid("signature does not verify")
