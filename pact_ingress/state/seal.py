"""Sealing secrets that are kept in shared state: AES-256-GCM with the cluster's key.

Every instance holds the same 32-byte key (`state.encryption_key_file`); Redis holds only
sealed blobs, so a copy of Redis (a dump, a replica, a backup) gives no private key.

A blob is ``MAGIC | key id (8) | nonce (12) | ciphertext+tag``. The key id is the first
8 bytes of SHA-256 over the key: an instance given another key (a rotation half done, a
typo) is told "sealed with another key" instead of a bare authentication failure, and
the id is not enough to learn anything about the key. The associated data is the name
the blob is stored under, so a blob copied to another name (host B's key moved under
host A's) fails authentication like any other tampering. Nonces are random: 96 bits per
seal, far from a collision at the few seals a cluster makes in its life.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pact_ingress.errors import PactIngressError

#: Format version of a sealed blob; a later format gets a new magic.
MAGIC = b"PIS1"
KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12


class SealError(PactIngressError):
    """A blob that cannot be opened: another key, tampered with, or not a blob at all."""


def read_key_file(path: Path) -> bytes:
    """The 32 raw bytes of a key file (base64, as `openssl rand -base64 32` writes it)."""
    try:
        text = path.read_bytes().strip()
    except OSError as exc:
        raise SealError(f"{path}: cannot read the encryption key: {exc.strerror}") from exc
    try:
        key = base64.b64decode(text.replace(b"-", b"+").replace(b"_", b"/"), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise SealError(f"{path}: must hold {KEY_BYTES} random bytes in base64")
    return key


class Sealer:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SealError(f"an encryption key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)
        self.key_id = hashlib.sha256(key).digest()[:KEY_ID_BYTES]

    def seal(self, plaintext: bytes, name: str) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + self.key_id + nonce + self._aead.encrypt(nonce, plaintext, name.encode())

    def open(self, blob: bytes, name: str) -> bytes:
        head = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
        if len(blob) <= head or not blob.startswith(MAGIC):
            raise SealError(f"{name}: not a sealed blob of a known format")
        key_id = blob[len(MAGIC):len(MAGIC) + KEY_ID_BYTES]
        if key_id != self.key_id:
            raise SealError(f"{name}: sealed with another encryption key (id {key_id.hex()}, "
                            f"this instance holds {self.key_id.hex()})")
        nonce = blob[len(MAGIC) + KEY_ID_BYTES:head]
        try:
            return self._aead.decrypt(nonce, blob[head:], name.encode())
        except InvalidTag:
            raise SealError(f"{name}: does not authenticate (altered, or stored under "
                            "another name)") from None
