"""The supervisor's /metrics: replicas per state (zeros included), restarts per replica, what each model serves."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serving.fleet_metrics import STATES, render
from serving.fleet_replies import FleetState, ModelStatus, ReplicaStatus


def replica(name: str, state: str, restarts: int) -> ReplicaStatus:
    return ReplicaStatus(
        name=name, state=state, url="http://127.0.0.1:1", pid=None, base_version=1, served={}, restarts=restarts, last_error=""
    )


def test_replica_states_and_restarts_per_model() -> None:
    group = ModelStatus(
        strategy="lora",
        base_version=1,
        serving_version=3,
        adapters=[3],
        surge_versions=[],
        desired_replicas=3,
        replicas=[replica("tab-0", "ready", 0), replica("tab-1", "ready", 2), replica("tab-2", "crashed", 5)],
    )
    text = render(FleetState(engine_flavor="cpu", runtime="local", models={"tab": group}), ready=False).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }
    states = {dict(k[1])["state"]: v for k, v in samples.items() if k[0] == "fleet_replicas"}
    assert states == {s: {"ready": 2.0, "crashed": 1.0}.get(s, 0.0) for s in STATES}
    assert samples[("fleet_replica_restarts_total", (("model", "tab"), ("replica", "tab-2")))] == 5
    assert samples[("fleet_desired_replicas", (("model", "tab"),))] == 3
    assert samples[("fleet_serving_version", (("model", "tab"),))] == 3
    assert samples[("fleet_ready", ())] == 0
