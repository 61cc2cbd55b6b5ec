"""The suite's time budget, a plugin of the whole suite: pytest-timeout's `session_timeout` (pyproject.toml)
stops a run between tests once it is spent; here each test's own timeout is also cut to what the budget has
left, so a run that overruns fails at the budget, with its slowest-tests report, instead of running on until
CI's hard limit kills it with no report. `--long` runs have no budget unless `--session-timeout` gives one."""

from __future__ import annotations

import time

import pytest
import pytest_timeout


@pytest.hookimpl(trylast=True)  # after pytest-timeout's own configure, which reads the budget
def pytest_configure(config):
    if config.getoption("--long", False) and config.getoption("session_timeout", None) is None:
        config.stash[pytest_timeout.SESSION_EXPIRE_KEY] = 0


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    expires = item.config.stash.get(pytest_timeout.SESSION_EXPIRE_KEY, 0)
    if not expires or not settings.timeout:
        return None  # pytest-timeout's own timer, unchanged
    left = max(1.0, expires - time.time())
    if settings.timeout <= left:
        return None
    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=left))
