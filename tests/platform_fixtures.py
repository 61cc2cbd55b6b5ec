"""One real platform per test session (integration and chaos tests): Prefect and MLflow servers, the
bootstrap flow, a vLLM fleet, the gateway.

Everything binds to 127.0.0.1 on free ports and lives in a temporary data directory; the session's
last step is `tidal down`, and teardown checks nothing is left running.
"""

from __future__ import annotations

import os

import pytest

from tests.llama_checkpoint import build_llama_checkpoint
from tidal.registry import CheckpointCache, Registry, VersionInfo, publish
from tidal.sandbox import write_config
from tidal.settings import TidalSettings, load_settings
from tidal.store import open_store


@pytest.fixture(scope="session")
def settings(tmp_path_factory) -> TidalSettings:
    root = tmp_path_factory.mktemp("tidal")
    # byo is a team's own chat model (tests/llama_checkpoint.py: a Llama with a tokenizer of another kind), imported as
    # its champion by the `champion` fixture; it serves nothing until a test scales it up (tests/integration/test_own_model.py).
    models = [
        {
            "name": "tab",
            "replicas": 2,
            "update_strategy": "lora",
            # scores and thumbs beside the Tab verdicts (test_collect.py sends both; its rule reads only the verdicts)
            "feedback": {"events": ["accepted", "rejected", "partial", "score", "thumbs"], "score_range": [1, 5]},
            # a judge on the fleet (tab judging itself): the small code model answers with code, so its score is the
            # first digit it writes, on a 0-9 scale (test_collect.py runs the judge stage)
            "judge": {"name": "critic", "model": "tab", "pattern": r"(\d)", "scale": [0, 9], "max_tokens": 12},
        },
        {"name": "tabfull", "replicas": 1, "update_strategy": "restart"},
        {
            "name": "byo",
            "replicas": 0,
            "update_strategy": "lora",
            "checkpoint": str(build_llama_checkpoint(root / "llama")),
            # a chat model: thumbs and scores; its canary decides on the reward with thumbs-down guarded (absolute
            # margin: a few dozen outcomes per arm), scores and answer lengths watched. It takes Tab verdicts too, so
            # that the platform's rule for it can stay the Tab rule: the session's demo trains with Tab-only aids,
            # which start-up refuses beside a model under another rule (training settings are platform-wide);
            # test_own_model installs and selects its team's rule for its own processes.
            "feedback": {"events": ["accepted", "rejected", "partial", "thumbs", "score"], "score_range": [1, 5]},
            "canary": {
                "primary": "reward",
                "guardrails": [{"metric": "thumbs_down", "margin": 0.2, "relative": False}],
                "watch": ["score", "shown_chars"],
            },
        },
    ]
    # Training sized for a test: a short run that checkpoints often (so it can be killed mid-run), a KL penalty
    # strong enough to keep the 25-second base's code modelling within the gate, whose bits/byte tolerance is
    # widened for this fragile base (a run at lr 2e-3, kl_coef 0.05 cost it 0.28 bits/byte).
    train = {
        "ppo": {
            "learning_rate": 1.5e-3,
            "critic_learning_rate": 1e-2,
            "batch_size": 32,
            "minibatch_size": 8,
            "passes": 4,
            "epochs": 2,
            "kl_coef": 0.2,
        },
        "checkpoint_every": 2,
        "retry_delay_s": 0.0,
        "gate": {"eval_bytes": 20_000, "bpb_tolerance": 0.2},
    }
    # Canary sized for a test: quick looks (feedback arrives within a second here), a first step long enough to
    # judge the degraded candidate of test_promote (~15–30 canary outcomes at a few requests/s on two cores), and
    # the mSPRT mixture tuned to that large effect; a step advances once a 0.5-sd regression is excluded, and the
    # accepted-characters margin is 50% (a few hundred outcomes per arm cannot show 5%).
    canary = {
        "min_samples": 150,
        "poll_s": 2.0,
        "feedback_wait_s": 5.0,
        "max_step_s": 900.0,
        "unload_grace_s": 0.0,
        "mixture_sd": 0.5,
        "detect_regression_sd": 0.5,
        "margins": {"accepted_chars": 0.5},
    }
    # The tests drive every stage themselves: with the default 'chained' loop, a test's collect would start a
    # train run of the deployed train-tab through its event trigger, beside the test's own.
    # A hung replica (test_gateway) is failed over after 15 s instead of the production 30 s. A fixed gateway secret
    # keys the canary assignment the same way every session: it puts 25 of test_promote's 400 users (6.25%) in a 5%
    # canary, enough outcomes for its first step to judge (a generated secret gives 14 to 30 of them).
    path = write_config(
        root,
        models,
        train=train,
        canary=canary,
        flywheel={"loop": "manual"},
        gateway={"first_byte_timeout_s": 15.0, "secret": "tidal-test-session-secret-0010"},
        pushgateway=True,  # every training run of the session pushes (tests/integration/test_monitoring.py reads them)
    )
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("TIDAL_")]:
            mp.delenv(key)
        mp.setenv("TIDAL_CONFIG", str(path))
        yield load_settings()


@pytest.fixture(scope="session")
def platform(settings):
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform

    use_platform_env(settings)
    p = Platform(settings)
    try:
        p.up_servers()
        p.up_pushgateway()
        yield p
    finally:
        p.down()


@pytest.fixture(scope="session")
def registry(settings, platform) -> Registry:
    return Registry(settings.mlflow.tracking_uri)


@pytest.fixture(scope="session")
def checkpoints(settings) -> CheckpointCache:
    return CheckpointCache(open_store(settings), settings.data_path / "cache")


@pytest.fixture(scope="session")
def champion(settings, platform, registry) -> VersionInfo:
    """tab v1 from the real bootstrap flow; tabfull v1 is the same checkpoint registered again; byo v1 imported from
    the checkpoint its settings name, as `tidal up` does."""
    from flows.bootstrap import bootstrap
    from tidal.cli import ensure_champions

    assert bootstrap(model="tab") == 1
    info = registry.get("tab", 1)
    base_dir = CheckpointCache(open_store(settings), settings.data_path / "cache").local_dir(info)
    full = publish(registry, open_store(settings), "tabfull", base_dir, "full", None, {"tidal.origin": "copy of tab v1"})
    registry.set_alias("tabfull", "champion", full.version)
    ensure_champions(settings)
    return info


@pytest.fixture(scope="session")
def fleet(platform, champion):
    platform.up_fleet()
    return platform.fleet_client()


@pytest.fixture(scope="session")
def gateway(platform, fleet, settings) -> str:
    """The gateway in front of the fleet; returns its base URL. Clients: alice and bob (tidal.sandbox)."""
    platform.up_gateway()
    return f"http://{settings.gateway.host}:{settings.gateway.port}"


@pytest.fixture(scope="session")
def keys(settings) -> dict[str, str]:
    return {c.client_id: c.key for c in settings.gateway.clients}
