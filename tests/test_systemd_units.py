"""The shipped systemd units: `systemd-analyze verify` is clean, exposure ≤ 3.0, and the
unit settings match what our own process needs (capabilities, notify, W+X memory).

`systemd-analyze verify` only warns ("…, ignoring") about most mistakes and still exits
0, so a clean unit here means exit 0 *and* no output; the negative tests prove each kind
of breakage is noticed. verify needs ExecStart's binary to exist, so tests check a copy
whose ExecStart points at the installed entry point (or this interpreter with -m).
Needs Debian's `systemd` package (systemd-analyze); no running systemd is required.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require

UNITS_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNITS = ("pact-ingress.service", "pact-connect.service")
INSTALLED_BIN = "/usr/local/bin/pact-ingress"

#: The exposure `systemd-analyze security` may report at most (0 = locked down, 10 = none).
MAX_EXPOSURE = 3.0

#: A deadline for each systemd-analyze run (it takes well under a second here).
ANALYZE_TIMEOUT = 60

def _exec_start() -> str:
    found = shutil.which("pact-ingress")
    return found if found else f"{sys.executable} -m pact_ingress"


def _copy(unit: str, dest: Path, mutate: tuple[str, str] | None = None) -> Path:
    """A copy of the unit with ExecStart on an existing binary (and an optional edit)."""
    text = (UNITS_DIR / unit).read_text()
    assert INSTALLED_BIN in text
    text = text.replace(INSTALLED_BIN, _exec_start())
    if mutate is not None:
        pattern, replacement = mutate
        text, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
        assert count == 1, f"mutation {pattern!r} did not apply"
    path = dest / unit
    path.write_text(text)
    return path


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("systemd-analyze"), *args], capture_output=True, text=True,
                          timeout=ANALYZE_TIMEOUT, check=False)


def _settings(unit: str) -> dict[str, list[str]]:
    """`Section.Key` → every value assigned (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (UNITS_DIR / unit).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


@pytest.mark.parametrize("unit", UNITS)
def test_verify_is_clean(unit: str, tmp_path: Path) -> None:
    result = _analyze("verify", str(_copy(unit, tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == "", "verify printed warnings"


@pytest.mark.parametrize(("pattern", "replacement", "complaint"), [
    (r"^ExecStart=\S+", "ExecStart=/nonexistent/pact-ingress", "is not executable"),
    (r"^Type=notify$", "Type=notifyy", "Failed to parse service type"),
    (r"^WatchdogSec=30$", "WatchdogSec=soon", "Failed to parse sec value"),
    (r"^ProtectSystem=strict$", "ProtectSytem=strict", "Unknown key"),
    (r"^\[Service\]$", "[Servise]", "Unknown section"),
    (r"^RestrictAddressFamilies=.*$", "RestrictAddressFamilies=AF_BOGUS",
     "Failed to parse address family"),
    (r"^SystemCallFilter=@system-service$", "SystemCallFilter=@bogus",
     "Unknown system call group"),
])
def test_verify_notices_broken_units(
    pattern: str, replacement: str, complaint: str, tmp_path: Path
) -> None:
    broken = _copy("pact-ingress.service", tmp_path, (pattern, replacement))
    result = _analyze("verify", str(broken))
    output = result.stdout + result.stderr
    assert complaint in output
    assert result.returncode != 0 or output != ""  # i.e. test_verify_is_clean would fail


def _exposure(unit_path: Path) -> float:
    result = _analyze("security", "--offline=true", str(unit_path))
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, result.stdout[-500:]
    return float(match.group(1))


@pytest.mark.parametrize("unit", UNITS)
def test_security_exposure(unit: str, tmp_path: Path) -> None:
    exposure = _exposure(_copy(unit, tmp_path))
    print(f"{unit}: overall exposure {exposure}")
    assert exposure <= MAX_EXPOSURE


def test_exposure_parser_sees_a_weak_unit(tmp_path: Path) -> None:
    """The same parse on a unit without hardening reports a high number (sanity check)."""
    weak = tmp_path / "weak.service"
    weak.write_text(f"[Service]\nExecStart={sys.executable} -c pass\n")
    assert _exposure(weak) > 8.0


def test_ingress_unit_settings() -> None:
    s = _settings("pact-ingress.service")
    assert s["Service.Type"] == ["notify"]
    assert s["Service.ExecStart"] == [f"{INSTALLED_BIN} serve -c /etc/pact-ingress/ingress.yaml"]
    assert s["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["Service.WatchdogSec"] == ["30"]
    assert s["Service.AmbientCapabilities"] == ["CAP_NET_BIND_SERVICE"]
    assert s["Service.CapabilityBoundingSet"] == ["CAP_NET_BIND_SERVICE"]
    assert s["Service.PrivateUsers"] == ["no"]  # the capability must act in the host userns
    for key in ("StateDirectory", "ConfigurationDirectory", "RuntimeDirectory"):
        assert s[f"Service.{key}"] == ["pact-ingress"]
    assert "IPAddressDeny" not in {k.split(".", 1)[1] for k in s}  # it is an edge


def test_connect_unit_settings() -> None:
    s = _settings("pact-connect.service")
    assert s["Service.Type"] == ["notify"]
    assert s["Service.ExecStart"] == [
        f"{INSTALLED_BIN} connect -c /etc/pact-ingress/connect.yaml"]
    assert s["Service.CapabilityBoundingSet"] == [""]
    assert s["Service.AmbientCapabilities"] == [""]
    assert s["Service.PrivateUsers"] == ["yes"]
    assert s["Service.LoadCredential"] == ["node.key:/var/lib/pact/node.key"]


_MDWE_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN (Linux >= 6.3)
    sys.exit(3)
from OpenSSL import SSL
ctx = SSL.Context(SSL.TLS_METHOD)
try:
    ctx.set_verify(SSL.VERIFY_PEER, lambda *args: True)
except MemoryError:
    sys.exit(4)
"""


def test_memory_deny_write_execute_matches_what_pyopenssl_needs() -> None:
    """MemoryDenyWriteExecute is off because pyOpenSSL callbacks need W+X memory.

    The kernel's PR_SET_MDWE refuses the same mappings systemd's seccomp filter does. If
    a future cffi/pyOpenSSL no longer needs them, this fails: then turn the setting on.
    """
    probe = subprocess.run([sys.executable, "-c", _MDWE_PROBE], capture_output=True,
                           text=True, timeout=ANALYZE_TIMEOUT, check=False)
    if probe.returncode == 3:
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
    assert probe.returncode in (0, 4), probe.stderr
    expected = "yes" if probe.returncode == 0 else "no"
    for unit in UNITS:
        assert _settings(unit)["Service.MemoryDenyWriteExecute"] == [expected], unit
