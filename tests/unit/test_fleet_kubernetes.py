"""The fleet's Kubernetes runtime without a cluster: the real Fleet driving the runtime against a fake of the API
objects it calls (tests/unit/fake_cluster.py): scaling, a pod Kubernetes replaced or restarted being probed again
before it serves, a failed probe keeping a pod out of rotation; the chart's RBAC against the calls; the checkpoint
fetcher in the pod. The engine Deployment itself: tests/unit/test_k8s_deployment.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from serving.fleet import Fleet
from serving.fleet_replies import FleetState, ReplicaStatus
from serving.probe import ProbeFailed
from serving.replica import drain
from serving.runtime.kubernetes import KubernetesRuntime, ProbeFiles
from serving.upstream import ReplicaPool
from tests.unit.fake_cluster import PROBE, FakeCluster, client_factory
from tests.unit.k8s_fixtures import clean_env, round_trips, settings  # noqa: F401  (clean_env: autouse fixture)
from tests.unit.terraform_hcl import CHART
from tidal.procs import NotReady
from tidal.registry import DIGEST_TAG, CheckpointCache, VersionInfo, checkpoint_digest, checkpoint_files, checkpoint_key
from tidal.store import LocalStore
from training.probe import save_probe

RULES = CHART / "files" / "fleet-supervisor-rules.yaml"


# ---- the runtime, through the real Fleet, against the fake cluster ----------------------------------


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class Registry:
    def __init__(self, *versions: VersionInfo, champion: int = 1):
        self.versions = {(v.model, v.version): v for v in versions}
        self.champion = champion

    def get(self, model, version):
        return self.versions[(model, version)]

    def by_alias(self, model, alias):
        return self.get(model, self.champion) if alias == "champion" and self.champion is not None else None

    def resolve(self, model, ref):
        return self.get(model, int(str(ref).lstrip("v")))


def version(store: LocalStore, model: str, v: int, kind: str = "full", base: int | None = None) -> VersionInfo:
    save_probe(PROBE, store.root / checkpoint_key(model, v))
    return VersionInfo(model, v, kind, base or v, f"s3://b/t/{checkpoint_key(model, v)}")


class World:
    def __init__(self, tmp_path: Path, monkeypatch, models: list[dict] | None = None, cluster: FakeCluster | None = None, **cfg):
        self.cluster, self.clock, self.fetched = cluster or FakeCluster(), Clock(), []
        monkeypatch.setattr("serving.replica.EngineClient", client_factory(self.cluster))
        monkeypatch.setattr("serving.fleet.drain", lambda r, grace, runtime=None: drain(r, 0, runtime))
        self.store = LocalStore(tmp_path / "store")
        self.registry = Registry(
            version(self.store, "tab", 1), version(self.store, "tab", 2, "lora", 1), version(self.store, "tab", 3)
        )
        self.settings = settings(tmp_path, models, **cfg)
        self.runtime = KubernetesRuntime(
            self.settings, apis=(self.cluster, self.cluster), clock=self.clock, sleep=self.clock.sleep, fetcher=self.fetch
        )
        self.fleet = Fleet(self.settings, self.registry, CheckpointCache(self.store, tmp_path / "cache"), runtime=self.runtime)

    def fetch(self, url: str, info: VersionInfo) -> str:
        self.fetched.append((url, info.served_name))
        return f"/models/{info.key}"

    def start(self):
        for m in self.settings.models:
            self.fleet.add_model(m)
        return self

    def replicas(self, model: str = "tab") -> list[ReplicaStatus]:
        return self.fleet.status().models[model].replicas

    def in_rotation(self, served: str) -> list[str]:
        """What the gateway would route `served` to, from the supervisor's status."""
        pool = ReplicaPool("http://fleet", "token", 1.0)
        pool.apply(FleetState.model_validate_json(self.fleet.status().model_dump_json()))  # as the gateway reads it
        return sorted(e.replica for e in pool.snapshot.by_served_name.get(served, []))

    def heal(self) -> None:
        """Two health passes (the first notices, the second restarts) and the restarts they started."""
        self.fleet.check_health()
        self.fleet.check_health()
        for t in threading.enumerate():
            if t.name.startswith("restart-"):
                t.join(10)


def test_scale_up_and_down_patches_the_deployment_and_removes_the_retired_pods(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    c, dep = w.cluster, "tidal-engine-tab-v1"
    assert c.deployments[dep].spec.replicas == 2 and len(c.of(dep)) == 2
    replicas = w.replicas()
    assert [r.state for r in replicas] == ["ready", "ready"] and {r.pod for r in replicas} == set(c.of(dep))
    assert all(r.url == f"http://{c.pods[r.pod].status.pod_ip}:8000" and r.pid is None for r in replicas)
    assert all(c.gate(p) for p in c.of(dep)) and w.in_rotation("tab@v1") == ["tab-0", "tab-1"]
    w.fleet.scale("tab", 3)
    assert (
        c.deployments[dep].spec.replicas == 3 and len(c.of(dep)) == 3 and w.in_rotation("tab@v1") == ["tab-0", "tab-1", "tab-2"]
    )
    keep = w.replicas()[0].pod
    w.fleet.scale("tab", 1)
    assert c.deployments[dep].spec.replicas == 1 and c.of(dep) == [keep]  # the retired replicas' own pods went
    assert [r.name for r in w.replicas()] == ["tab-0"] and w.in_rotation("tab@v1") == ["tab-0"]
    w.fleet.scale("tab", 0)
    assert dep not in c.deployments and not c.pods


def test_a_model_with_no_champion_yet_waits_and_is_served_once_it_has_one(tmp_path, monkeypatch):
    """A new install: the supervisor starts before anyone imported a checkpoint. It serves nothing for the model,
    says why (and the fix) in GET /fleet, and serves it once the registry has its champion, without a restart."""
    w = World(tmp_path, monkeypatch)
    w.registry.champion = None
    w.fleet.start()
    try:
        assert "tab" not in w.fleet.status().models and "`tidal import tab CHECKPOINT --champion`" in w.fleet.waiting["tab"]
        assert w.fleet.add_waiting() == [] and not w.cluster.deployments
        w.registry.champion = 1  # `tidal import tab ... --champion` from an operator's machine
        assert w.fleet.add_waiting() == ["tab"] and w.fleet.waiting == {}
        assert [r.state for r in w.replicas()] == ["ready", "ready"] and w.in_rotation("tab@v1") == ["tab-0", "tab-1"]
    finally:
        w.fleet.stop()


def test_lora_versions_are_fetched_into_the_pod_loaded_and_verified(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    reports = w.fleet.deploy("tab", 2)
    assert len(reports) == 2 and all(r.ok for r in reports)
    pods = {r.pod: r for r in w.replicas()}
    assert sorted(w.fetched) == sorted((f"http://{w.cluster.pods[p].status.pod_ip}:8001", "tab@v2") for p in pods)
    assert all(
        w.cluster.engines[w.cluster.pods[p].status.pod_ip].loaded["tab@v2"] == "/models/checkpoints/model=tab/version=2"
        for p in pods
    )
    assert w.in_rotation("tab@v2") == ["tab-0", "tab-1"]
    w.fleet.undeploy("tab", 2)
    assert w.in_rotation("tab@v2") == [] and all("tab@v2" not in e.loaded for e in w.cluster.engines.values())


def test_a_pod_replaced_by_kubernetes_is_reprobed_before_it_serves(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    w.fleet.deploy("tab", 2)
    c, victim = w.cluster, w.replicas()[0]
    new = c.replace_pod(victim.pod)
    assert c.gate(new) is None  # Kubernetes alone never makes it Ready: the gate is the supervisor's
    w.fleet.check_health()
    r0 = w.replicas()[0]
    assert r0.state == "crashed" and "is gone" in r0.last_error
    assert w.in_rotation("tab@v2") == ["tab-1"] and w.in_rotation("tab@v1") == ["tab-1"]
    w.heal()
    r0 = w.replicas()[0]
    assert r0.state == "ready" and r0.pod == new and r0.restarts == 1 and r0.served == {"tab@v1": 1, "tab@v2": 2}
    ip = c.pods[new].status.pod_ip
    gate_on = c.events.index(("gate", new, True))
    probed = [i for i, e in enumerate(c.events) if e[:2] == ("complete", ip)]
    assert {c.events[i][2] for i in probed} == {"tab@v1", "tab@v2"} and max(probed) < gate_on  # verified, then Ready
    assert c.events.index(("load", ip, "tab@v2")) < gate_on
    assert w.in_rotation("tab@v2") == ["tab-0", "tab-1"]


def test_an_engine_restarted_in_place_is_reprobed_on_the_same_pod(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    w.fleet.deploy("tab", 2)
    c, pod = w.cluster, w.replicas()[1].pod
    c.restart_engine(pod)  # the kubelet's liveness restart: the fresh engine has no adapter
    w.fleet.check_health()
    assert w.replicas()[1].state == "crashed" and "restarted" in w.replicas()[1].last_error
    assert c.gate(pod) is False and pod in c.pods  # out of rotation, not deleted
    w.heal()
    r1 = w.replicas()[1]
    assert r1.state == "ready" and r1.pod == pod and c.gate(pod) is True
    assert c.engines[c.pods[pod].status.pod_ip].loaded.keys() == {"tab@v1", "tab@v2"}
    w.fleet.check_health()
    assert w.replicas()[1].state == "ready"  # the restart count it was verified at is the new one


def test_a_probe_failure_keeps_the_pod_out_of_rotation(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    c, dep = w.cluster, "tidal-engine-tab-v1"
    c.wrong_weights = 1
    with pytest.raises(ProbeFailed, match="probe FAIL for tab@v1"):
        w.fleet.scale("tab", 3)
    wrong = [e[1] for e in c.events if e[0] == "delete-pod"]
    assert len(wrong) == 1 and not any(e == ("gate", wrong[0], True) for e in c.events)  # never Ready
    assert c.deployments[dep].spec.replicas == 2 and len(c.of(dep)) == 2 and w.in_rotation("tab@v1") == ["tab-0", "tab-1"]
    # A replacement that serves wrong weights: the replica stays out of rotation until a pod passes.
    c.wrong_weights = 1
    victim = w.replicas()[0].pod
    bad = c.replace_pod(victim)
    w.heal()
    assert w.replicas()[0].state == "crashed" and "probe FAIL" in w.replicas()[0].last_error
    assert bad not in c.pods and not any(e == ("gate", bad, True) for e in c.events)
    assert w.in_rotation("tab@v1") == ["tab-1"]
    w.heal()
    assert w.replicas()[0].state == "ready" and w.in_rotation("tab@v1") == ["tab-0", "tab-1"]


def test_a_pod_that_never_becomes_ready_fails_with_what_it_waits_on(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch, cluster=FakeCluster(ready=False), ready_timeout_s=600)
    with pytest.raises(NotReady) as e:
        w.start()
    msg = str(e.value)
    assert (
        "Insufficient nvidia.com/gpu" in msg
        and "ready after 600 s" in msg
        and "kubectl -n tidal describe deployment tidal-engine-tab-v1" in msg
    )
    assert w.clock.t >= 600 and not w.cluster.deployments and not w.cluster.pods  # given back


def test_restart_strategy_serves_a_surge_deployment_then_rolls_onto_it(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch, models=[{"name": "tab", "replicas": 2, "update_strategy": "restart"}]).start()
    c = w.cluster
    assert "--enable-lora" not in c.deployments["tidal-engine-tab-v1"].spec.template.spec.containers[0].args
    w.fleet.deploy("tab", 3)
    assert c.deployments["tidal-engine-tab-v3"].spec.replicas == 1 and w.in_rotation("tab@v3") == ["tab-2"]
    w.fleet.undeploy("tab", 1)  # promotion: roll the group onto v3
    assert set(c.deployments) == {"tidal-engine-tab-v3"} and c.deployments["tidal-engine-tab-v3"].spec.replicas == 2
    assert w.in_rotation("tab@v3") == ["tab-2", "tab-3"] and w.in_rotation("tab@v1") == []


def test_a_new_supervisor_adopts_the_pods_and_clears_what_it_does_not_know(tmp_path, monkeypatch):
    first = World(tmp_path, monkeypatch).start()
    first.fleet.deploy("tab", 2)
    first.fleet.scale("tab", 3)  # more than the next supervisor's settings ask for
    first.fleet.boot_replica(first.fleet.group("tab"), first.registry.get("tab", 3), {})  # a Deployment of another version
    pods = set(first.cluster.pods)
    calls = len(first.cluster.calls)
    first.fleet.stop()
    assert set(first.cluster.pods) == pods and not {"delete_namespaced_pod", "delete_namespaced_deployment"} & set(
        first.cluster.calls[calls:]
    )
    second = World(tmp_path, monkeypatch, cluster=first.cluster).start()
    c = second.cluster
    assert set(c.deployments) == {"tidal-engine-tab-v1"} and {r.pod for r in second.replicas()} == set(
        c.of("tidal-engine-tab-v1")
    )
    assert (
        set(c.of("tidal-engine-tab-v1")) < pods and c.deployments["tidal-engine-tab-v1"].spec.replicas == 2
    )  # adopted, not restarted
    assert all(e.loaded.keys() == {"tab@v1"} for e in c.engines.values())  # its adapter was not verified by this one: unloaded
    assert [r.state for r in second.replicas()] == ["ready", "ready"]
    # A changed template (a new engine image) replaces the Deployment, which rolls its pods one at a time.
    third = World(tmp_path, monkeypatch, cluster=c, image="vllm/vllm-openai:v0.33.0").start()
    assert ("replace", "tidal-engine-tab-v1", 2) in c.events
    assert c.deployments["tidal-engine-tab-v1"].spec.template.spec.containers[0].image == "vllm/vllm-openai:v0.33.0"
    assert third.fleet.status().runtime == "kubernetes"


def test_the_rbac_rules_allow_exactly_what_the_runtime_calls(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    w.fleet.deploy("tab", 2)
    w.cluster.replace_pod(w.replicas()[0].pod)
    w.heal()
    w.fleet.restart_replica(w.fleet.group("tab"), w.fleet.group("tab").replicas[1], "test")
    w.heal()
    World(tmp_path, monkeypatch, cluster=w.cluster, image="vllm/vllm-openai:v0.33.0").start()
    w.fleet.scale("tab", 0)
    needs = {
        "read_namespaced_deployment": ("apps", "deployments", "get"),
        "list_namespaced_deployment": ("apps", "deployments", "list"),
        "create_namespaced_deployment": ("apps", "deployments", "create"),
        "replace_namespaced_deployment": ("apps", "deployments", "update"),
        "patch_namespaced_deployment": ("apps", "deployments", "patch"),
        "delete_namespaced_deployment": ("apps", "deployments", "delete"),
        "list_namespaced_pod": ("", "pods", "list"),
        "patch_namespaced_pod": ("", "pods", "patch"),
        "delete_namespaced_pod": ("", "pods", "delete"),
        "patch_namespaced_pod_status": ("", "pods/status", "patch"),
    }
    rules = yaml.safe_load(RULES.read_text())
    assert round_trips(
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "r"}, "rules": rules}, "V1Role"
    )
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert {needs[c] for c in w.cluster.calls} == granted  # every call granted, every grant used
    rbac = (CHART / "templates" / "fleet-supervisor-rbac.yaml").read_text()
    assert 'Files.Get "files/fleet-supervisor-rules.yaml"' in rbac and "serviceAccounts.fleet.name" in rbac


# ---- checkpoints in the pod, and the supervisor's own copies ---------------------------------------


class Remote:
    """A store that is not the local one, so CheckpointCache downloads (as from S3)."""

    def __init__(self, local: LocalStore):
        self.local, self.url = local, "s3://b/t"
        self.list, self.get_file = local.list, local.get_file


def test_the_fetcher_verifies_the_digest_and_refuses_other_keys(tmp_path):
    from fastapi.testclient import TestClient

    from serving.runtime.weights import build_app, fetch, version_from

    local = LocalStore(tmp_path / "store")
    info = version(local, "tab", 1)
    (local.root / info.key / "model.safetensors").write_bytes(b"weights")
    info.tags[DIGEST_TAG] = checkpoint_digest(checkpoint_files(local.root / info.key))
    path = fetch(Remote(local), info, tmp_path / "models")
    assert path == tmp_path / "models" / info.key and (path / "model.safetensors").read_bytes() == b"weights"
    app = TestClient(build_app(Remote(local), tmp_path / "pod"))
    (local.root / info.key / "model.safetensors").write_bytes(b"tampered")
    r = app.post("/fetch", json={"version": json.loads(json.dumps(info.__dict__))})
    assert r.status_code == 409 and "does not match the digest" in r.json()["detail"]
    assert app.post("/fetch", json={"version": {**info.__dict__, "model": "../etc"}}).status_code == 400
    with pytest.raises(ValueError, match="keys"):
        version_from({**info.__dict__, "extra": 1})


def test_the_supervisor_reads_only_the_probe_of_a_full_checkpoint(tmp_path):
    local = LocalStore(tmp_path / "store")
    full, adapter = version(local, "tab", 1), version(local, "tab", 2, "lora", 1)
    (local.root / full.key / "model.safetensors").write_bytes(b"x" * 1000)
    (local.root / adapter.key / "adapter_model.safetensors").write_bytes(b"a")
    copies = ProbeFiles(CheckpointCache(Remote(local), tmp_path / "cache"))
    got = copies.local_dir(full)
    assert sorted(p.name for p in got.iterdir()) == ["probe.json"]
    assert (copies.local_dir(adapter) / "adapter_model.safetensors").is_file()  # checked for NaN/inf before loading


def test_a_health_check_never_puts_back_a_replica_drained_while_it_waited(tmp_path, monkeypatch):
    """The check read `ready`, called the engine without the lock, then wrote `ready` over the `draining` that an
    in-place weight move had set meanwhile, sending traffic to a paused engine."""
    w = World(tmp_path, monkeypatch).start()
    replica = w.fleet.group("tab").replicas[0]

    def slow_check(r):  # the weight move begins while the check waits on the engine
        if r is replica:
            drain(r, 0, w.runtime)
        return True

    monkeypatch.setattr(w.fleet, "_healthy", slow_check)
    w.fleet.check_health()
    assert [r.state for r in w.replicas()] == ["draining", "ready"]
    assert w.in_rotation("tab@v1") == ["tab-1"]
