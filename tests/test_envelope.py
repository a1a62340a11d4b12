"""PACT sealed envelopes (spec §13): the Appendix B vectors, round trips, tampering, and
every rejection of the edge's header check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress import envelope as E
from pact_ingress.errors import RemoteProtocolError
from pact_ingress.identity import b64url, b64url_decode, fingerprint, generate_key, spki_der

#: The spec's Appendix B test vectors, copied verbatim into the repository so a clone of it
#: checks them with nothing beside it.
VECTORS_PATH = Path(__file__).parent / "vectors" / "seal-vectors.json"
#: SHA-256 of that copy as taken from the spec: a changed vector file is a changed spec.
VECTORS_SHA256 = "b4fb087c26db2fe0e3c32991fd09b25b21a7ffec87763fed2abdb97169c7e9fa"
VECTORS: list[dict[str, str]] = json.loads(VECTORS_PATH.read_text())
VECTOR_NOW = 1756000000 + 10  # the vectors' ts is 1756000000, exp 1756000600
T0 = 1_800_000_000


def _key(hex_der: str) -> Any:
    return serialization.load_der_private_key(bytes.fromhex(hex_der), None)


def _wire(vector: dict[str, str]) -> dict[str, str]:
    return {name: vector[name] for name in ("protected", "enc", "ct", "sig")}


# --- Appendix B vectors ------------------------------------------------------------------


def test_vector_file_is_the_spec_copy() -> None:
    assert hashlib.sha256(VECTORS_PATH.read_bytes()).hexdigest() == VECTORS_SHA256


def test_there_are_four_vectors_one_per_pairing() -> None:
    assert [v["name"] for v in VECTORS] == [
        "p256-to-p256", "p256-to-ed25519", "ed25519-to-p256", "ed25519-to-ed25519",
    ]


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_vector_opens_and_verifies(vector: dict[str, str]) -> None:
    sender = _key(vector["sender_key_pkcs8_hex"])
    recipient = _key(vector["recipient_key_pkcs8_hex"])
    opened = E.open_envelope(
        _wire(vector), recipient_key=recipient, sender_public_key=sender.public_key(),
        now=VECTOR_NOW,
    )
    assert opened.plaintext.hex() == vector["plaintext_hex"]
    assert opened.payload["method"] == "tools/call"
    assert opened.header.suite == vector["suite"]
    assert opened.sender_fingerprint == fingerprint(sender.public_key())
    assert opened.header.to == opened.header.kid == fingerprint(recipient.public_key())


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_vector_passes_the_edge_header_check_and_relay_verification(vector: dict[str, str]) -> None:
    recipient = _key(vector["recipient_key_pkcs8_hex"])
    sender = _key(vector["sender_key_pkcs8_hex"])
    pins = [fingerprint(recipient.public_key())]
    header = E.check_header(_wire(vector), now=VECTOR_NOW, recipient_pins=pins)
    assert header.protected == b64url_decode(vector["protected"])
    assert E.canonical_json(header.members()) == header.protected
    assert E.verify_signature(_wire(vector), sender.public_key()) == header


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"])
def test_vector_without_pinned_sender_needs_spk(vector: dict[str, str]) -> None:
    recipient = _key(vector["recipient_key_pkcs8_hex"])
    with pytest.raises(E.EnvelopeInvalid, match="spk"):
        E.open_envelope(_wire(vector), recipient_key=recipient, now=VECTOR_NOW)


# --- Ed25519 → X25519 --------------------------------------------------------------------


def test_ed25519_maps_agree_between_private_and_public() -> None:
    for _ in range(16):
        key = ed25519.Ed25519PrivateKey.generate()
        via_private = E.x25519_private_from_ed25519(key).public_key().public_bytes_raw()
        via_public = E.x25519_public_from_ed25519(key.public_key()).public_bytes_raw()
        assert via_private == via_public


def test_ed25519_identity_point_has_no_x25519_twin() -> None:
    identity = ed25519.Ed25519PublicKey.from_public_bytes(b"\x01" + b"\x00" * 31)
    with pytest.raises(ValueError):
        E.x25519_public_from_ed25519(identity)


# --- round trips -------------------------------------------------------------------------

PAIRINGS = [(False, False), (False, True), (True, False), (True, True)]
PAYLOAD = {"method": "tools/call", "params": {"name": "send_message", "arguments": {"text": "hé"}}}


def _ids(pair: tuple[bool, bool]) -> str:
    return f"{'ed25519' if pair[0] else 'p256'}-to-{'ed25519' if pair[1] else 'p256'}"


def _seal(sender: Any, recipient: Any, payload: Any = PAYLOAD, **kw: Any) -> dict[str, str]:
    args: dict[str, Any] = {"msg_id": "m-1", "ts": T0, "exp": T0 + 600}
    args.update(kw)
    return E.seal(payload, sender_key=sender, recipient_public_key=recipient.public_key(), **args)


@pytest.mark.parametrize("pair", PAIRINGS, ids=_ids)
def test_round_trip_with_pinned_sender(pair: tuple[bool, bool]) -> None:
    sender, recipient = generate_key(ed25519_key=pair[0]), generate_key(ed25519_key=pair[1])
    env = _seal(sender, recipient)
    assert set(env) == E.ENVELOPE_MEMBERS
    opened = E.open_envelope(
        env, recipient_key=recipient, sender_public_key=sender.public_key(), now=T0
    )
    assert opened.payload == PAYLOAD
    assert opened.header.suite == (E.SUITE_X25519 if pair[1] else E.SUITE_P256)
    assert opened.header.msg_id == "m-1"


@pytest.mark.parametrize("pair", PAIRINGS, ids=_ids)
def test_round_trip_with_spk_for_unpinned_sender(pair: tuple[bool, bool]) -> None:
    sender, recipient = generate_key(ed25519_key=pair[0]), generate_key(ed25519_key=pair[1])
    payload = dict(PAYLOAD, spk=b64url(spki_der(sender.public_key())))
    opened = E.open_envelope(_seal(sender, recipient, payload), recipient_key=recipient, now=T0)
    assert opened.sender_fingerprint == fingerprint(sender.public_key())
    assert opened.payload == payload


def test_result_direction_round_trip_and_mismatch() -> None:
    sender, recipient = generate_key(), generate_key(ed25519_key=True)
    env = _seal(sender, recipient, cty=E.RESULT_CTY)
    kw: dict[str, Any] = {"recipient_key": recipient, "sender_public_key": sender.public_key()}
    opened = E.open_envelope(env, now=T0, expected_cty=E.RESULT_CTY, **kw)
    assert opened.header.cty == E.RESULT_CTY
    with pytest.raises(E.EnvelopeInvalid, match="cty"):
        E.open_envelope(env, now=T0, **kw)  # a result is never dispatched as a call


def test_rotation_kid_selects_among_held_keys() -> None:
    sender, old, new = generate_key(), generate_key(), generate_key(ed25519_key=True)
    env = _seal(sender, new)
    opened = E.open_envelope(
        env, recipient_key=[old, new], sender_public_key=sender.public_key(), now=T0
    )
    assert opened.header.kid == fingerprint(new.public_key())


def test_seal_refuses_bad_local_arguments() -> None:
    sender, recipient = generate_key(), generate_key()
    with pytest.raises(ValueError):
        _seal(sender, recipient, msg_id="")
    with pytest.raises(ValueError):
        _seal(sender, recipient, ts=True)


def test_envelope_invalid_is_a_remote_protocol_error_with_reason() -> None:
    exc = E.EnvelopeInvalid("why")
    assert isinstance(exc, RemoteProtocolError)
    assert (exc.reason, exc.code) == ("why", "envelope_invalid")


# --- open failures -----------------------------------------------------------------------


def _flip(text: str, index: int = 0) -> str:
    raw = bytearray(b64url_decode(text))
    raw[index] ^= 0x01
    return b64url(bytes(raw))


@pytest.fixture
def sealed() -> tuple[Any, Any, dict[str, str]]:
    sender, recipient = generate_key(), generate_key(ed25519_key=True)
    return sender, recipient, _seal(sender, recipient)


def _open(recipient: Any, sender: Any, env: Any, now: int = T0) -> E.Opened:
    return E.open_envelope(
        env, recipient_key=recipient, sender_public_key=sender.public_key(), now=now
    )


@pytest.mark.parametrize("member", ["enc", "ct", "sig"])
@pytest.mark.parametrize("where", [0, -1])
def test_tampering_any_binary_member_fails(sealed: Any, member: str, where: int) -> None:
    sender, recipient, env = sealed
    with pytest.raises(E.EnvelopeInvalid):
        _open(recipient, sender, dict(env, **{member: _flip(env[member], where)}))


def test_tampering_the_header_breaks_the_aad(sealed: Any) -> None:
    sender, recipient, env = sealed
    members = json.loads(b64url_decode(env["protected"]))
    members["msg_id"] = "m-2"  # still canonical, still well-formed: only the AAD changes
    forged = dict(env, protected=b64url(E.canonical_json(members)))
    E.check_header(forged, now=T0, recipient_pins=[fingerprint(recipient.public_key())])
    with pytest.raises(E.EnvelopeInvalid, match="opened"):
        _open(recipient, sender, forged)


def test_tampering_protected_bytes_fails(sealed: Any) -> None:
    sender, recipient, env = sealed
    with pytest.raises(E.EnvelopeInvalid):
        _open(recipient, sender, dict(env, protected=_flip(env["protected"], 2)))


def test_resigned_by_someone_else_fails(sealed: Any) -> None:
    sender, recipient, env = sealed
    mallory = generate_key()
    signed = b64url_decode(env["protected"]) + b64url_decode(env["enc"]) + b64url_decode(env["ct"])
    forged = dict(env, sig=b64url(E._sign(mallory, signed)))
    with pytest.raises(E.EnvelopeInvalid, match="signature"):
        _open(recipient, sender, forged)
    with pytest.raises(E.EnvelopeInvalid, match="signature"):
        E.verify_signature(forged, sender.public_key())


def test_wrong_pinned_sender_fails(sealed: Any) -> None:
    _, recipient, env = sealed
    with pytest.raises(E.EnvelopeInvalid, match="pinned sender"):
        _open(recipient, generate_key(), env)


def test_spk_not_hashing_to_from_fails() -> None:
    sender, recipient, other = generate_key(), generate_key(), generate_key()
    env = _seal(sender, recipient, dict(PAYLOAD, spk=b64url(spki_der(other.public_key()))))
    with pytest.raises(E.EnvelopeInvalid, match="SHA-256"):
        E.open_envelope(env, recipient_key=recipient, now=T0)
    with pytest.raises(E.EnvelopeInvalid, match="spk does not match"):
        _open(recipient, sender, env)  # a present spk from a pinned sender must match


def test_not_addressed_here_or_unknown_kid_fails() -> None:
    sender, recipient, stranger = generate_key(), generate_key(), generate_key()
    env = _seal(sender, recipient)
    with pytest.raises(E.EnvelopeInvalid, match="local identity"):
        _open(stranger, sender, env)
    odd_kid = _seal(sender, recipient, kid=fingerprint(stranger.public_key()))
    with pytest.raises(E.EnvelopeInvalid, match="kid"):
        _open(recipient, sender, odd_kid)


def test_suite_not_matching_the_key_fails(sealed: Any) -> None:
    sender, recipient, env = sealed  # recipient is Ed25519: suite X25519
    forged = _with_header(env, suite=E.SUITE_P256)
    with pytest.raises(E.EnvelopeInvalid, match="suite"):
        _open(recipient, sender, forged)


def test_non_object_plaintext_fails() -> None:
    sender, recipient = generate_key(), generate_key()
    with pytest.raises(E.EnvelopeInvalid, match="JSON object"):
        _open(recipient, sender, _seal(sender, recipient, b"[1,2]"))
    with pytest.raises(E.EnvelopeInvalid, match="JSON"):
        _open(recipient, sender, _seal(sender, recipient, b"\xff"))


def test_time_is_enforced_after_the_signature(sealed: Any) -> None:
    sender, recipient, env = sealed
    with pytest.raises(E.EnvelopeInvalid, match="expired"):
        _open(recipient, sender, env, now=T0 + 600)
    with pytest.raises(E.EnvelopeInvalid, match="300"):
        _open(recipient, sender, env, now=T0 + 301)
    relayed = E.open_envelope(
        env, recipient_key=recipient, sender_public_key=sender.public_key(), now=T0 + 599,
        direct=False,
    )
    assert relayed.header.msg_id == "m-1"


# --- the edge's header check: one test per rejection -------------------------------------


def _with_header(env: dict[str, str], **changes: Any) -> dict[str, str]:
    members = json.loads(b64url_decode(env["protected"]))
    for name, value in changes.items():
        name = "from" if name == "from_" else name
        if value is _DROP:
            del members[name]
        else:
            members[name] = value
    return dict(env, protected=b64url(E.canonical_json(members)))


_DROP = object()


@pytest.fixture
def edge() -> tuple[dict[str, str], list[str]]:
    sender, recipient = generate_key(ed25519_key=True), generate_key()
    return _seal(sender, recipient), [fingerprint(recipient.public_key())]


def _check(env: object, pins: list[str], now: int = T0) -> E.Header:
    return E.check_header(env, now=now, recipient_pins=pins)


def _rejects(env: object, pins: list[str], match: str, now: int = T0) -> None:
    with pytest.raises(E.EnvelopeInvalid, match=match):
        _check(env, pins, now)


def test_valid_header_passes(edge: Any) -> None:
    env, pins = edge
    header = _check(env, pins)
    assert (header.v, header.cty, header.to, header.ts) == (1, E.CALL_CTY, pins[0], T0)


@pytest.mark.parametrize("value", [None, [], "x", 3])
def test_rejects_non_object_envelope(value: object) -> None:
    _rejects(value, [], "not a JSON object")


def test_rejects_missing_and_extra_members(edge: Any) -> None:
    env, pins = edge
    _rejects({k: v for k, v in env.items() if k != "sig"}, pins, "exactly")
    _rejects(dict(env, spk="AAAA"), pins, "exactly")


@pytest.mark.parametrize("member", ["protected", "enc", "ct", "sig"])
def test_rejects_non_string_members(edge: Any, member: str) -> None:
    env, pins = edge
    _rejects(dict(env, **{member: 12}), pins, f"{member} is not a string")


@pytest.mark.parametrize("member", ["protected", "enc", "ct", "sig"])
@pytest.mark.parametrize("bad", ["padded", "plus", "slash", "bang", "impossible-length"])
def test_rejects_non_base64url_members(edge: Any, member: str, bad: str) -> None:
    env, pins = edge
    value = {
        "padded": env[member] + "=" * (-len(env[member]) % 4 or 4),
        "plus": "+" + env[member][1:],
        "slash": "/" + env[member][1:],
        "bang": env[member][:-1] + "!",
        "impossible-length": "AAAAA",  # 4k+1 characters cannot be base64
    }[bad]
    _rejects(dict(env, **{member: value}), pins, f"{member} is not unpadded base64url")


def test_rejects_oversized_protected(edge: Any) -> None:
    env, pins = edge
    big = _with_header(env, msg_id="m" * E.MAX_PROTECTED_CHARS)
    _rejects(big, pins, "too large")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xff\xfe{}", "UTF-8 JSON"),
        (b"not json", "UTF-8 JSON"),
        ('{"v":1}'.encode("utf-16"), "UTF-8 JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"v":NaN}', "exactly"),  # parses, but is no header
        (b"[" * 5_000, "UTF-8 JSON"),  # nesting deeper than the parser's recursion limit
    ],
    ids=["bad-utf8", "not-json", "utf16", "array", "nan-member", "deep-nesting"],
)
def test_rejects_protected_that_is_not_a_json_object(
    edge: Any, raw: bytes, match: str
) -> None:
    env, pins = edge
    _rejects(dict(env, protected=b64url(raw)), pins, match)


def _recode(env: dict[str, str], transform: Any) -> dict[str, str]:
    text = b64url_decode(env["protected"]).decode()
    return dict(env, protected=b64url(transform(text).encode()))


@pytest.mark.parametrize(
    "transform",
    [
        lambda t: t.replace(",", ", ", 1),  # insignificant whitespace
        lambda t: json.dumps(json.loads(t)),  # default separators
        lambda t: json.dumps(  # keys in reverse order
            dict(reversed(json.loads(t).items())), separators=(",", ":"), ensure_ascii=False
        ),
        lambda t: "{" + t[1:-1].split(",", 1)[1] + "," + t[1:-1].split(",", 1)[0] + "}",
        lambda t: t.replace("m-1", "m-\\u0031"),  # needless escape
        lambda t: t[:-1] + ',"v":1}',  # duplicate member: re-serialising drops it
        lambda t: t + "\n",
    ],
)
def test_rejects_non_canonical_protected(edge: Any, transform: Any) -> None:
    env, pins = edge
    changed = _recode(env, transform)
    assert changed != env
    _rejects(changed, pins, "canonical")


def test_non_ascii_msg_id_is_canonical_unescaped(edge: Any) -> None:
    env, pins = edge
    assert _check(_with_header(env, msg_id="é-✓"), pins).msg_id == "é-✓"
    _rejects(_recode(_with_header(env, msg_id="é"), lambda t: t.replace("é", "\\u00e9")),
             pins, "canonical")


def test_rejects_extra_and_missing_header_members(edge: Any) -> None:
    env, pins = edge
    _rejects(_with_header(env, spk="x"), pins, "exactly v suite")
    _rejects(_with_header(env, kid=_DROP), pins, "exactly v suite")


@pytest.mark.parametrize("v", [2, 0, True, "1", 1.0, None])
def test_rejects_other_versions(edge: Any, v: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, v=v), pins, "version")


@pytest.mark.parametrize("suite", ["PACT-SEAL-P384", "pact-seal-p256", "", None, 1])
def test_rejects_unknown_suites(edge: Any, suite: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, suite=suite), pins, "suite")


@pytest.mark.parametrize("cty", [E.RESULT_CTY, "application/json", "", 7])
def test_rejects_wrong_direction_or_content_type(edge: Any, cty: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, cty=cty), pins, "cty")


def test_result_direction_is_a_parameter(edge: Any) -> None:
    env, pins = edge
    result = _with_header(env, cty=E.RESULT_CTY)
    assert E.check_header(result, now=T0, recipient_pins=pins, expected_cty=E.RESULT_CTY)
    with pytest.raises(E.EnvelopeInvalid, match="cty"):
        E.check_header(env, now=T0, recipient_pins=pins, expected_cty=E.RESULT_CTY)


def test_rejects_recipient_not_among_pins(edge: Any) -> None:
    env, pins = edge
    _rejects(env, [], "to is not")
    _rejects(env, [fingerprint(generate_key().public_key())], "to is not")
    other = fingerprint(generate_key().public_key())
    assert _check(env, [other, pins[0]]).to == pins[0]  # two pins while a rotation runs


@pytest.mark.parametrize("name", ["from_", "to", "kid"])
@pytest.mark.parametrize("value", ["alice", "sha256:short", 5, None, "sha1:" + "A" * 43,
                                   ["sha256:" + "A" * 43], {"pin": 1}])
def test_rejects_fingerprint_members_of_wrong_shape(edge: Any, name: str, value: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, **{name: value}), pins, "fingerprint")


@pytest.mark.parametrize("msg_id", ["", 5, None, ["m"]])
def test_rejects_empty_or_non_string_msg_id(edge: Any, msg_id: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, msg_id=msg_id), pins, "msg_id")


@pytest.mark.parametrize("name", ["ts", "exp"])
@pytest.mark.parametrize("value", [True, 1.5, "1800000000", None])
def test_rejects_non_integer_times(edge: Any, name: str, value: object) -> None:
    env, pins = edge
    _rejects(_with_header(env, **{name: value}), pins, "integers")



@pytest.mark.parametrize("name", ["ts", "exp"])
@pytest.mark.parametrize("value", [10**309, -(10**309), 2**53, -1, 2**64],
                         ids=["huge", "huge-negative", "2**53", "negative", "2**64"])
def test_rejects_times_outside_sane_range(edge: Any, name: str, value: int) -> None:
    """Out-of-range times are EnvelopeInvalid, never an arithmetic error (a float clock
    minus 10**309 overflows)."""
    env, pins = edge
    bad = _with_header(env, **{name: value})
    for now in (T0 + 0.5, 0.0):  # the edge's clock is a float
        with pytest.raises(E.EnvelopeInvalid, match="Unix seconds"):
            E.check_header(bad, now=now, recipient_pins=pins)
    with pytest.raises(E.EnvelopeInvalid, match="Unix seconds"):
        E.decode_header(bad)


@pytest.mark.parametrize("value", [1e308, 1.8e9, float(2**53)])
def test_rejects_float_times_even_when_integral(edge: Any, value: float) -> None:
    env, pins = edge
    _rejects(_with_header(env, ts=value), pins, "integers")


def test_seal_refuses_times_it_would_not_accept() -> None:
    sender, recipient = generate_key(), generate_key()
    for ts in (-1, 2**53, 10**309):
        with pytest.raises(ValueError):
            E.seal({"x": 1}, sender_key=sender, recipient_public_key=recipient.public_key(),
                   msg_id="m", ts=ts, exp=T0)

def test_time_boundaries(edge: Any) -> None:
    env, pins = edge  # ts = T0, exp = T0 + 600
    assert _check(env, pins, now=T0 + 300)
    assert _check(env, pins, now=T0 - 300)
    _rejects(env, pins, "300 s", now=T0 + 301)
    _rejects(env, pins, "300 s", now=T0 - 301)
    late = _with_header(env, exp=T0 + 300)
    _rejects(late, pins, "expired", now=T0 + 300)  # now < exp is strict


def test_lifetime_cap(edge: Any) -> None:
    env, pins = edge
    assert _check(_with_header(env, exp=T0 + E.MAX_LIFETIME), pins)
    _rejects(_with_header(env, exp=T0 + E.MAX_LIFETIME + 1), pins, "30 days")


def test_relay_delivered_is_bounded_by_exp_alone(edge: Any) -> None:
    env, pins = edge
    header = E.check_header(env, now=T0 + 599, recipient_pins=pins, direct=False)
    assert header.exp == T0 + 600


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_arbitrary_json_only_ever_raises_envelope_invalid(value: object) -> None:
    with pytest.raises(E.EnvelopeInvalid):
        E.check_header(value, now=T0, recipient_pins=["x"])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.sampled_from(["protected", "enc", "ct", "sig"]))
def test_arbitrary_member_bytes_only_ever_raise_envelope_invalid(data: bytes, member: str) -> None:
    sender, recipient = VECTORS[0]["sender_key_pkcs8_hex"], VECTORS[0]["recipient_key_pkcs8_hex"]
    env = dict(_wire(VECTORS[0]), **{member: b64url(data)})
    with pytest.raises(E.EnvelopeInvalid):
        E.open_envelope(
            env, recipient_key=_key(recipient), sender_public_key=_key(sender).public_key(),
            now=VECTOR_NOW,
        )


class _Pin(str):
    """A str subclass (never a JSON value): answered as `is_pin` answers it."""


def test_the_seen_pins_set_never_changes_a_verdict() -> None:
    """`_known_pin` answers as `is_pin` does, before and after the set remembers the
    pins, for near-misses of remembered pins (case, padding bits, lengths, whitespace,
    other types) and after the set was overfilled and cleared."""
    from pact_ingress.identity import is_pin

    pins = [fingerprint(generate_key().public_key()) for _ in range(4)]
    for pin in pins:
        assert E._known_pin(pin) and E._known_pin(pin)  # cold, then remembered

    def near(pin: str) -> list[object]:
        body = pin[7:]
        last = body[-1]
        flipped = b64url(b64url_decode(body))[:-1] + chr(ord(last) ^ 1)
        return [pin, pin.upper(), pin.lower(), "SHA256:" + body, pin + "=", pin + " ",
                " " + pin, pin[:-1], pin + "A", "sha256:" + flipped, pin.encode(),
                bytearray(pin.encode()), [pin], {pin: 1}, None, 1, pin + "\n",
                pin.replace("sha256:", "sha384:"), _Pin(pin), _Pin(pin + "A")]

    for rounds in range(2):
        for pin in pins:
            for probe in near(pin):
                assert E._known_pin(probe) is is_pin(probe), (rounds, probe)
        for i in range(E._PINS_SEEN_MAX + 3):  # overfilled: cleared, then refilled
            E._known_pin("sha256:" + b64url(hashlib.sha256(b"%d" % i).digest()))
        assert len(E._PINS_SEEN) <= E._PINS_SEEN_MAX
