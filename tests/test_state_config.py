"""The `state:` block: local by default, redis with its URL and secret files, strictly
checked (FILE:LINE for every complaint), and the password never shown."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from pact_ingress.config import load_config
from pact_ingress.errors import ConfigError
from pact_ingress.model import RedisTLS, Secret, State

PASSWORD = "correct-horse-battery-staple"
PEER = "sha256:rAGyIJ6GNU-4UyN7XeD0-rE8f8v0M6YcAZNpYX_s8Qs"
BASE = """\
state_dir: ./state
listen:
  tls: ["127.0.0.1:8443"]
"""


def _secret(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    _secret(tmp_path / "redis.pass", PASSWORD.encode() + b"\n")
    _secret(tmp_path / "state.key", base64.b64encode(os.urandom(32)) + b"\n")
    return tmp_path


def _load(tmp: Path, state: str) -> object:
    path = tmp / "ingress.yaml"
    path.write_text(BASE + state)
    return load_config(path)


def _errors(tmp: Path, state: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load(tmp, state)
    return info.value.messages


def test_default_is_local(tmp_path: Path) -> None:
    assert _load(tmp_path, "").state == State()  # type: ignore[attr-defined]
    assert _load(tmp_path, "state: {backend: local}\n").state == State()  # type: ignore[attr-defined]


def test_redis_full(secrets: Path) -> None:
    config = _load(secrets, """\
state:
  backend: redis
  url: redis://ops@10.0.0.5:6380/3
  password_file: redis.pass
  key_prefix: "edge1:"
  encryption_key_file: state.key
  deadline: 20ms
""")
    redis = config.state.redis  # type: ignore[attr-defined]
    assert config.state.backend == "redis"  # type: ignore[attr-defined]
    assert (redis.host, redis.port, redis.db, redis.username) == ("10.0.0.5", 6380, 3, "ops")
    assert redis.password.reveal() == PASSWORD
    assert redis.key_prefix == "edge1:" and redis.tls is None and redis.deadline == 0.02
    assert redis.encryption_key_file == secrets / "state.key"
    assert PASSWORD not in repr(config) and PASSWORD not in str(redis)
    assert str(redis) == "redis://ops@10.0.0.5:6380/3"


def test_redis_defaults_and_tls(secrets: Path) -> None:
    config = _load(secrets, "state: {backend: redis, url: 'rediss://cache.example',"
                   " encryption_key_file: state.key}\n")
    redis = config.state.redis  # type: ignore[attr-defined]
    assert (redis.host, redis.port, redis.db, redis.password) == ("cache.example", 6379, 0, None)
    assert redis.tls == RedisTLS() and redis.key_prefix == "pact-ingress:"
    assert redis.deadline == 0.05
    ca = secrets / "ca.pem"
    ca.write_text("x")
    config = _load(secrets, "state: {backend: redis, url: 'redis://127.0.0.1',"
                   " encryption_key_file: state.key, tls: {ca_file: ca.pem}}\n")
    assert config.state.redis.tls == RedisTLS(ca_file=ca)  # type: ignore[attr-defined]


def test_secret_repr_and_equality() -> None:
    assert repr(Secret(PASSWORD)) == "Secret('********')" == str(Secret(PASSWORD))
    assert Secret("a") == Secret("a") and Secret("a") != Secret("b")
    assert hash(Secret("a")) == hash(Secret("b"))


@pytest.mark.parametrize("state, line, wanted", [
    ("state: {backend: redis, url: 'redis://127.0.0.1', encryption_key_file: state.key,"
     " colour: blue}\n", 4, "unknown key 'colour' in state"),
    ("state:\n  backend: local\n  url: redis://127.0.0.1\n", 6, "applies to backend: redis only"),
    ("state:\n  backend: memcached\n", 5, "state.backend must be one of local, redis"),
    ("state:\n  backend: redis\n  url: redis://127.0.0.1\n", 5,
     "needs 'encryption_key_file'"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n", 5, "needs 'url'"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     f"  url: redis://:{PASSWORD}@127.0.0.1\n", 7, "must not hold a password"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: http://127.0.0.1\n", 7, "redis:// or rediss://"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1/cache\n", 7, "database number"),
    ("state:\n  backend: redis\n  encryption_key_file: missing.key\n"
     "  url: redis://127.0.0.1\n", 6, "cannot read"),
    ("state:\n  backend: redis\n  encryption_key_file: redis.pass\n"
     "  url: redis://127.0.0.1\n", 6, "must hold 32 random bytes in base64"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1\n  password_file: nope\n", 8, "cannot read"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1\n  key_prefix: 'a b'\n", 8, "state.key_prefix"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: rediss://127.0.0.1\n  tls: false\n", 8, "contradicts a rediss:// url"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1\n  tls: {cert_file: state.key}\n", 8, "go together"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1\n  deadline: 5s\n", 8, "state.deadline must be at most 1s"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     "  url: redis://127.0.0.1\n  peers:\n    - sha256:short\n", 9, "state.peers: 'sha256:short'"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     f"  url: redis://127.0.0.1\n  peers: [{PEER}, {PEER}]\n", 8, "the same fingerprint twice"),
    ("state:\n  backend: redis\n  encryption_key_file: state.key\n"
     f"  url: redis://127.0.0.1\n  peers: {PEER}\n", 8, "state.peers"),
    ("state:\n  backend: local\n"
     f"  peers: [{PEER}]\n", 6, "applies to backend: redis only"),
])  # fmt: skip
def test_redis_errors_name_their_line(secrets: Path, state: str, line: int, wanted: str) -> None:
    errors = _errors(secrets, state)
    assert len(errors) == 1, errors
    assert f"ingress.yaml:{line}: " in errors[0] and wanted in errors[0], errors
    assert PASSWORD not in errors[0]


def test_secret_files_must_not_be_world_readable(secrets: Path) -> None:
    os.chmod(secrets / "redis.pass", 0o644)
    errors = _errors(secrets, "state:\n  backend: redis\n  encryption_key_file: state.key\n"
                     "  url: redis://127.0.0.1\n  password_file: redis.pass\n")
    assert len(errors) == 1 and "ingress.yaml:8: " in errors[0]
    assert "readable by every user" in errors[0]
    os.chmod(secrets / "redis.pass", 0o640)  # the service's group may read it
    _load(secrets, "state:\n  backend: redis\n  encryption_key_file: state.key\n"
          "  url: redis://127.0.0.1\n  password_file: redis.pass\n")


def test_peers(secrets: Path) -> None:
    base = "state: {backend: redis, url: 'redis://127.0.0.1', encryption_key_file: state.key"
    assert _load(secrets, base + "}\n").state.redis.peers == ()  # type: ignore[attr-defined]
    config = _load(secrets, base + f", peers: [{PEER}]}}\n")
    assert config.state.redis.peers == (PEER,)  # type: ignore[attr-defined]
