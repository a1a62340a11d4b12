"""Benchmarks (not collected by pytest: `norecursedirs` in pyproject). See README.md."""
