"""Test-wide settings.

Tests that drive a real external tool (haproxy, pebble, named, chromium, gnutls-cli,
systemd-analyze) call `tests.tools.require(name)`: on a developer machine without the
tool the test skips with the apt command that installs it; under `.ci/run`
(`PACT_REQUIRE_TOOLS=1`) a missing tool is a failure, so CI can never go green by
skipping the real peers.
"""

from __future__ import annotations

import compileall
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("default")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite starts `serve`, its workers, the connector and the CLI as real processes
    many hundreds of times, each importing the package afresh. Where bytecode is not
    written (PYTHONDONTWRITEBYTECODE, as in containers), every one of them would compile
    the package's sources again (up to half a second of CPU each): compile them once
    here, and each process reads the bytecode. A source changed since is compiled again
    as usual, so what runs is the same code either way; a package that cannot be written
    to is left as it is."""
    spec = importlib.util.find_spec("pact_ingress")
    if sys.dont_write_bytecode and spec is not None and spec.origin is not None:
        with contextlib.suppress(OSError):
            compileall.compile_dir(Path(spec.origin).parent, quiet=2, workers=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("PACT_REQUIRE_TOOLS") == "1":
        reason = str(report.longrepr)
        if "tool not installed" in reason:
            report.outcome = "failed"


@pytest.fixture(autouse=True)
def _package_logger_restored() -> object:
    """Tests of the log module call `logs.setup`, which takes the package logger off
    propagation; tests that read logs through `caplog` rely on how it was before."""
    from pact_ingress import logs

    logger = logs._LOGGER
    saved = (logger.handlers[:], logger.propagate, logger.level, logs._direct)
    yield
    logs.log.flush()
    handlers, logger.propagate, level, logs._direct = saved
    logger.handlers[:] = handlers
    logger.setLevel(level)  # not `.level =`: setLevel also clears logging's level cache
