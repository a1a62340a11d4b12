"""Changes made inside a `pact-ingress serve` subprocess as its modules load, for what a
test cannot provoke from outside: a bug (an exception where none is expected), or a
constant shortened so a test does not wait out the product's real figure.

`inject(tmp_path, monkeypatch, patches)` writes a `sitecustomize.py` that, when a module
named in `patches` is imported, runs it and then the patch: source text of a function
`def patch(module): ...`. The directory goes first on `PYTHONPATH`, so every Python
process the test starts from then on (the serve and its workers) loads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_HOOK = '''\
import importlib.abc, importlib.machinery, sys

_PATCHES = {{}}
{patches}

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module, run=run, name=name):
            run(module)
            _PATCHES[name](module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Hook())
'''


def inject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patches: dict[str, str]) -> None:
    """`patches`: module name → the source of `def patch(module): ...` for it."""
    site = tmp_path / "site"
    site.mkdir()
    parts = []
    for k, (name, source) in enumerate(patches.items()):
        parts.append(source.replace("def patch(", f"def _patch{k}(", 1))
        parts.append(f"_PATCHES[{name!r}] = _patch{k}")
    (site / "sitecustomize.py").write_text(_HOOK.format(patches="\n".join(parts)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
