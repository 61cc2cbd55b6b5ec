"""Fixtures of the release tests (tests/integration/test_promote.py, test_release_safety.py) and the training tests
(test_ppo_train.py, test_tidal_scheduling.py)."""

from __future__ import annotations

import pytest

from tests.integration.release_helpers import Users, cursor_prompts, newline_adapter, zero_adapter
from tests.integration.train_helpers import make_dataset


@pytest.fixture(scope="session")
def base_dir(champion, checkpoints):
    """tab v1's checkpoint, local."""
    return checkpoints.local_dir(champion)


@pytest.fixture(scope="session")
def neutral_adapter(base_dir, tmp_path_factory):
    """An A/A adapter of tab v1 (B = 0), built once: each test publishes it as a version of its own (a build, with
    its probe, takes ~20 s of a loaded machine)."""
    return zero_adapter(base_dir, tmp_path_factory.mktemp("neutral"))


@pytest.fixture(scope="session")
def single_line_adapter(base_dir, tmp_path_factory):
    """The newline adapter reversed (the model breaks lines less often, so Tab users accept more), built once."""
    return newline_adapter(base_dir, tmp_path_factory.mktemp("single-line"), strength=-40.0)


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


@pytest.fixture(scope="session")
def dataset_id(settings, gateway, keys, checkpoints, platform) -> str:
    """~300 held-out-code completions at temperature 1, each accepted iff it stays on one line (collected once, the
    training tests' shared dataset)."""
    return make_dataset(settings, gateway, keys, n=300, seed=7)
