"""Fixtures of the release tests (tests/integration/test_promote.py, test_release_safety.py)."""

from __future__ import annotations

import pytest

from tests.integration.release_helpers import Users, cursor_prompts


@pytest.fixture(scope="module")
def base_dir(registry, checkpoints):
    return checkpoints.local_dir(registry.get("tab", 1))


@pytest.fixture()
def no_canary(platform):
    """tab routed to its champion alone: a release test starts from no canary (another module may have left one)."""
    from release.operations import roll_back_canary

    roll_back_canary(platform.routes_client(), "tab", by="test", reason="clean start")


@pytest.fixture()
def users(settings, gateway, keys, no_canary):
    """Tab users, not yet typing: a test starts them once its candidate is built and published, so the traffic
    does not slow that work down on a small machine; stopped after the test."""
    u = Users(gateway, keys["alice"], cursor_prompts(settings, 300, seed=11))
    yield u
    u.stop.set()
    if u.is_alive():
        u.join(timeout=120)
