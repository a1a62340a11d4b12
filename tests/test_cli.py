"""The `pact-ingress` command as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pact_ingress.identity import is_pin

CONFIGS = Path(__file__).parents[1] / "configs"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pact_ingress", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, check=False)


@pytest.mark.parametrize("ed25519", [False, True], ids=["p256", "ed25519"])
def test_keygen_writes_0600_key_and_cert_with_same_fingerprint(tmp_path: Path, ed25519: bool):
    key = tmp_path / "node.key"
    result = run("keygen", *(["--ed25519"] if ed25519 else []), "-o", str(key))
    assert result.returncode == 0, result.stderr
    printed = result.stdout.strip()
    assert is_pin(printed)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    for path in (key, tmp_path / "node.crt"):
        fp = run("fingerprint", str(path))
        assert fp.returncode == 0 and fp.stdout.strip() == printed
    assert b"PRIVATE KEY" in key.read_bytes()
    assert "PRIVATE" not in result.stdout + result.stderr  # never printed
    again = run("keygen", "-o", str(key))
    assert again.returncode == 1 and "exists" in again.stderr  # no silent overwrite


def test_fingerprint_of_spki_der(tmp_path: Path):
    from cryptography.hazmat.primitives import serialization

    from pact_ingress.identity import keygen, spki_der

    ident = keygen(tmp_path / "a.key")
    (tmp_path / "a.spki").write_bytes(spki_der(ident.key.public_key()))
    (tmp_path / "a.pub").write_bytes(ident.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for name in ("a.spki", "a.pub"):
        assert run("fingerprint", str(tmp_path / name)).stdout.strip() == ident.fingerprint


def test_fingerprint_of_garbage_is_one_line_error(tmp_path: Path):
    (tmp_path / "x").write_text("hello")
    result = run("fingerprint", str(tmp_path / "x"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_check_config_ok_and_errors(tmp_path: Path):
    ok = run("check-config", "-c", str(CONFIGS / "ingress.example.yaml"))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("state_dir: /tmp/x\nlisten: {tls: ['127.0.0.1:8443']}\nbogus: 1\n")
    result = run("check-config", "-c", str(bad))
    assert result.returncode == 2
    assert f"{bad}:3: unknown key 'bogus'" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_error_exit_2():
    result = run("keygen")
    assert result.returncode == 2


def test_pin_with_padding_bits_is_refused_with_the_canonical_spelling(tmp_path: Path):
    """`…pbJ` decodes to the same digest as `…pbI` but can never match a fingerprint."""
    from pact_ingress.identity import b64url, b64url_decode, is_pin, keygen

    pin = keygen(tmp_path / "n.key").fingerprint
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twisted = pin[:-1] + alphabet[alphabet.index(pin[-1]) + 1]
    assert is_pin(pin) and not is_pin(twisted)
    assert b64url(b64url_decode(twisted[7:])) == pin[7:]  # same digest bytes
    config = tmp_path / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen: {{tls: ["127.0.0.1:8443"]}}
tenants:
  - name: a
    pins: ["{twisted}"]
""")
    result = run("check-config", "-c", str(config))
    assert result.returncode == 2, result.stdout
    assert f"{config}:5: pin '{twisted}' is not canonical base64url" in result.stderr
    assert f"spelled with {pin[-1]!r}" in result.stderr



def test_check_config_checks_cert_files(tmp_path: Path):
    """Cert files that serve could not use are config errors on the route's line, not
    handshake failures discovered later; a pair that does not exist yet is fine."""
    from cryptography.hazmat.primitives import serialization

    from pact_ingress.identity import ensure_selfsigned_cert, generate_key

    ensure_selfsigned_cert("good.example", tmp_path / "good.crt", tmp_path / "good.key")
    ensure_selfsigned_cert("other.example", tmp_path / "other.crt", tmp_path / "other.key")
    (tmp_path / "garbage.crt").write_text("not a certificate\n")
    (tmp_path / "adir.crt").mkdir()
    (tmp_path / "afile").write_text("a file, not a directory\n")
    (tmp_path / "gone.key").symlink_to(tmp_path / "nowhere.key")  # cannot be opened
    (tmp_path / "locked.key").write_bytes((tmp_path / "good.key").read_bytes())
    (tmp_path / "locked.key").chmod(0)
    (tmp_path / "secret.key").write_bytes(generate_key().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw")))
    (tmp_path / "secret.key").chmod(0o600)
    (tmp_path / "public.key").write_bytes((tmp_path / "good.key").read_bytes())
    (tmp_path / "public.key").chmod(0o644)
    routes = [  # host, cert, key, (line that is wrong, message)
        ("ok", "good.crt", "good.key", None),
        ("fresh", "new/fresh.crt", "new/fresh.key", None),  # serve will create them
        ("notpem", "garbage.crt", "good.key", ("cert", "holds no PEM certificate")),
        ("dir", "adir.crt", "good.key", ("cert", "is a directory, not a PEM file")),
        ("mismatch", "good.crt", "other.key", ("key", "does not belong to the certificate")),
        ("gone", "good.crt", "gone.key", ("key", "cannot read: No such file or directory")),
        ("secret", "good.crt", "secret.key", ("key", "is encrypted")),
        ("public", "good.crt", "public.key", ("key", "is readable by every user")),
        ("blocked", "afile/x.crt", "good.key2", ("cert", "cannot be created: ")),
        ("half", "good.crt", "missing.key", ("key", "does not exist, but its partner does")),
    ]
    if os.geteuid() != 0:  # root reads any file: only an ordinary user sees EACCES
        routes.append(("locked", "good.crt", "locked.key",
                       ("key", "cannot read: Permission denied")))
    lines = ["state_dir: state", "listen: {tls: ['127.0.0.1:8443']}", "tenants:",
             "  - name: a", f"    pins: ['sha256:{'A' * 43}']", "    routes:"]
    expected = []
    for name, cert, key, problem in routes:
        lines += [f"      - host: {name}.example", "        mode: terminate",
                  "        backend: '127.0.0.1:9'", "        cert:",
                  f"          cert: {cert}", f"          key: {key}"]
        if problem is not None:
            field, why = problem
            expected.append((len(lines) - (field == "cert"), f"'{name}.example'", why))
    config = tmp_path / "ingress.yaml"
    config.write_text("\n".join(lines) + "\n")
    result = run("check-config", "-c", str(config))
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    errors = result.stderr.splitlines()
    for line, route, why in expected:
        assert any(e.startswith(f"{config}:{line}: ") and route in e and why in e
                   for e in errors), (line, route, why, errors)
    assert len(errors) == len(expected)
