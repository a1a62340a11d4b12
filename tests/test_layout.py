"""The sans-I/O core stays sans-I/O: nothing under `pact_ingress/proto/` imports trio,
sockets, YAML or the config loader (it reads the model, `pact_ingress.model`); and the
tunnel's two ends share the protocol and its helpers, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "pact_ingress" / "proto"
FORBIDDEN = ("trio", "socket", "yaml", "pact_ingress.config")


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module `path` (in `package`) imports, with relative imports made absolute,
    and each imported name as `module.name` too (``from pact_ingress import config``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


@pytest.mark.parametrize(
    "path", sorted(PROTO.rglob("*.py")), ids=lambda p: str(p.relative_to(PROTO))
)
def test_proto_imports_no_io_and_no_loader(path: Path) -> None:
    package = ".".join(path.parent.relative_to(ROOT).parts)
    bad = [f"{path.name}:{line}: {module}" for line, module in imported_modules(path, package)
           if forbidden(module)]  # fmt: skip
    assert not bad, "proto/ must stay sans-I/O and read pact_ingress.model: " + ", ".join(bad)


@pytest.mark.parametrize(
    "source",
    ["import trio", "import socket", "from yaml import safe_load", "import yaml.nodes",
     "from pact_ingress.config import Route", "from pact_ingress import config",
     "from ..config import Route", "from ..config.loader import load_config"],
)  # fmt: skip
def test_the_check_catches(source: str, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(source + "\n")
    modules = imported_modules(probe, "pact_ingress.proto")
    assert any(forbidden(module) for _, module in modules)



def test_the_check_allows_the_model(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from pact_ingress.model import Route\nfrom ..model import Limits\n"
                     "from pact_ingress.proto import tls_alert\nimport struct\n")  # fmt: skip
    modules = imported_modules(probe, "pact_ingress.proto")
    assert not any(forbidden(module) for _, module in modules)


# --- the tunnel: two ends that share a protocol, not each other ------------------------

TUNNEL = ROOT / "pact_ingress" / "net" / "tunnel"


def tunnel_imports(name: str) -> set[str]:
    path = TUNNEL / f"{name}.py"
    return {module for _, module in imported_modules(path, "pact_ingress.net.tunnel")}


@pytest.mark.parametrize("end, other", [("connector", "server"), ("server", "connector")])
def test_a_tunnel_end_does_not_import_the_other(end: str, other: str) -> None:
    modules = tunnel_imports(end)
    other_module = f"pact_ingress.net.tunnel.{other}"
    assert not any(m == other_module or m.startswith(other_module + ".") for m in modules)
    assert "pact_ingress.net.tunnel.common" in modules  # what both ends share
    assert "pact_ingress.proto.tunnel.constants" in modules


@pytest.mark.parametrize("name", ["common", "transport", "stream_job"])
def test_shared_tunnel_modules_import_neither_end(name: str) -> None:
    modules = tunnel_imports(name)
    for end in ("server", "connector"):
        assert not any(m.startswith(f"pact_ingress.net.tunnel.{end}") for m in modules)


def test_the_router_takes_the_tunnel_alpns_from_the_protocol() -> None:
    router = ROOT / "pact_ingress" / "net" / "router.py"
    assert "pact-tunnel" not in router.read_text()
    modules = {m for _, m in imported_modules(router, "pact_ingress.net")}
    assert "pact_ingress.proto.tunnel.constants.TUNNEL_ALPNS" in modules
