"""Test-wide settings.

Tests that drive a real external tool (haproxy, pebble, named, chromium, gnutls-cli,
systemd-analyze) call `tests.tools.require(name)`: on a developer machine without the
tool the test skips with the apt command that installs it; under `.ci/run`
(`PACT_REQUIRE_TOOLS=1`) a missing tool is a failure, so CI can never go green by
skipping the real peers.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("default")


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
