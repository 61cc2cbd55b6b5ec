"""One shortened flywheel cycle on the real platform: simulated users (OpenAI SDK + feedback endpoint)
through the gateway and vLLM fleet, then collect → train → offline gate → canary → decision through the
Prefect and MLflow servers. Afterwards the registry, the route table, the events and the artifacts
agree with the cycle's report. (Runs after the release-plane tests: it may promote a new champion.)"""

from __future__ import annotations

import json

import httpx
import pytest

from sim.users import SimTraffic, SimUsersConfig
from tidal.store import get_json, open_store
from training.job_spec import TrainResult
from training.reward_data import load_dataset, split
from training.rollout import select_samples

pytestmark = pytest.mark.slow


def events_named(api: str, name: str) -> list[dict]:
    r = httpx.post(f"{api}/events/filter", json={"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}},
                                                 "limit": 50}, timeout=30)
    r.raise_for_status()
    return r.json()["events"]


@pytest.mark.timeout(2400)
def test_one_flywheel_cycle_end_to_end(settings, platform, registry, gateway, keys, monkeypatch):
    # A short PPO run (the users keep typing meanwhile, so the trainer shares two cores with three replicas),
    # and a short canary: one 50% step, decided (or inconclusive, then rolled back) within two minutes.
    monkeypatch.setenv("TIDAL_TRAIN__PPO__MAX_ITERATIONS", "6")
    # the opt-in learning aids, end to end: hindsight rows and split credit from partial verdicts, the code loss
    monkeypatch.setenv("TIDAL_TRAIN__PPO__HINDSIGHT_PARTIALS", "true")
    monkeypatch.setenv("TIDAL_TRAIN__PPO__PARTIAL_CREDIT", "kept_prefix")
    monkeypatch.setenv("TIDAL_TRAIN__PPO__PTX_COEF", "1.0")
    monkeypatch.setenv("TIDAL_CANARY", json.dumps({"steps": [0.5], "min_samples": 60, "max_step_s": 120, "poll_s": 2,
                                                   "feedback_wait_s": 5, "unload_grace_s": 0, "mixture_sd": 0.5}))
    from flows.flywheel import flywheel

    champion_before = registry.aliases("tab")["champion"]
    users = SimTraffic(SimUsersConfig(users=200, sites=400, seed=21, concurrency=2, think_s=(0.2, 0.4),
                                      feedback_delay_s=(0.1, 0.5)),
                       gateway, keys["alice"], "tab", settings.bootstrap.heldout_fraction)
    users.start()
    try:
        while users.sent < 300:
            assert users.is_alive(), users.tally.errors[-3:]
            users.stop.wait(1)
        users.stop.wait(3)  # the last verdicts and segments reach the store
        [report] = flywheel(model="tab", cycles=1, include_open_hour=True)
    finally:
        users.stop.set()
        users.join(timeout=120)
    print("cycle:", {k: v for k, v in report.items() if k != "served"})
    assert users.tally.errors == []
    seen = users.tally.snapshot()
    assert sum(c["requests"] for c in seen.values()) == users.sent and champion_before in seen

    # The report reads the cycle's dataset: the champion's traffic is in it.
    assert report["champion_before"] == champion_before and report["rows"] > 0
    assert report["served"][champion_before]["requests"] > 0
    assert report["decision"] in {"promoted", "rolled_back", "gate_failed"}, report
    cand = registry.get("tab", report["candidate"])
    assert cand.tags["tidal.dataset_id"] == report["dataset_id"] and cand.tags["tidal.parent_version"] == str(champion_before)

    # Every partial verdict among the training rows became a hindsight row and a credited row (or was counted as
    # skipped).
    data = load_dataset(open_store(settings), "tab", report["dataset_id"])
    train_rows, _ = split(data.samples, settings.train.heldout_fraction)
    kept = select_samples(train_rows, champion_before, settings.train.ppo.max_stale_versions).kept
    partials = sum(s.event == "partial" for s in kept)
    result = TrainResult.model_validate(get_json(open_store(settings), f"training/model=tab/{cand.tags['tidal.train_run']}/result.json"))
    assert result.hindsight_rows + sum(result.hindsight_skipped.values()) == partials, (result, partials)
    assert partials == 0 or result.hindsight_rows > 0, result
    no_chars = sum(s.event == "partial" and not s.accepted_chars for s in kept)
    assert result.credited_partials == partials - no_chars, (result, partials, no_chars)
    assert result.final["ppo/ptx_loss"] > 0, result.final  # the trainer took the code loss

    # Registry and routes agree with the decision; no canary is left behind.
    aliases = registry.aliases("tab")
    arms = platform.routes_client().show()["routes"]["tab"]["arms"]
    assert [(a["name"], a["weight"]) for a in arms] == [("control", 1.0)]
    if report["decision"] == "promoted":
        assert aliases["champion"] == cand.version == report["champion_after"] == arms[0]["version"]
        assert "tidal.release.promoted" in cand.tags
    else:
        assert aliases["champion"] == champion_before == report["champion_after"] == arms[0]["version"]
        assert report["reason"]
        if report["decision"] == "rolled_back":
            assert json.loads(cand.tags["tidal.release.rolled_back"])["reason"] == report["reason"]

    # Stages announce themselves as the flywheel's, so the chained deployments' triggers stay quiet.
    api = settings.prefect.api_url
    ready = [e for e in events_named(api, "tidal.dataset.ready") if e["payload"]["dataset_id"] == report["dataset_id"]]
    assert [e["resource"]["tidal.driver"] for e in ready] == ["flywheel"]
    if report["decision"] != "gate_failed":
        registered = [e for e in events_named(api, "tidal.candidate.registered") if e["payload"]["version"] == cand.version]
        assert [e["resource"]["tidal.driver"] for e in registered] == ["flywheel"]
    runs = httpx.post(f"{api}/flow_runs/filter", json={"deployments": {"name": {"any_": ["train-tab", "promote-tab"]}}},
                      timeout=30).json()
    assert runs == []

    # The cycle table is a Prefect artifact.
    arts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["tab-flywheel"]}}}, timeout=30).json()
    assert arts and arts[0]["type"] == "table" and report["dataset_id"] in json.dumps(arts[0]["data"])
