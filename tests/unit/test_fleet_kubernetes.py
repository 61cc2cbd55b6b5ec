"""The fleet's Kubernetes runtime without a cluster: engine Deployments validated with the kubernetes client's own
models; the settings checks; the chart's RBAC and settings against the code; and the real Fleet driving the runtime
against a fake of the API objects it calls (tests/unit/fake_cluster.py): scaling, a pod Kubernetes replaced or
restarted being probed again before it serves, a failed probe keeping a pod out of rotation."""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from serving.engine import engine_command
from serving.fleet import Fleet
from serving.fleet_replies import FleetState, ReplicaStatus
from serving.probe import ProbeFailed
from serving.replica import drain
from serving.runtime import runtime_for
from serving.runtime.k8s_manifest import DIGEST, ENGINE, FETCH, GATE, WEIGHTS, deployment_name, model_label, render_deployment
from serving.runtime.kubernetes import KubernetesRuntime, ProbeFiles
from serving.runtime.local import LocalRuntime
from serving.upstream import ReplicaPool
from tests.unit.fake_cluster import PROBE, FakeCluster, client_factory
from tests.unit.terraform_hcl import CHART, TF, load_dir
from tidal.procs import NotReady
from tidal.registry import DIGEST_TAG, CheckpointCache, VersionInfo, checkpoint_digest, checkpoint_files, checkpoint_key
from tidal.section import SettingsError
from tidal.settings import load_settings
from tidal.store import LocalStore
from training.probe import save_probe

VLLM = "vllm/vllm-openai:v0.32.0"
TIDAL = "123456789012.dkr.ecr.us-east-1.amazonaws.com/tidal:0.1.0"
RULES = CHART / "files" / "fleet-supervisor-rules.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def settings(tmp_path: Path, models: list[dict] | None = None, flavor: str = "cuda", **cfg):
    return load_settings(
        data_dir=str(tmp_path / ".tidal"), store={"url": "s3://b/t"}, mlflow={"host": "tidal-mlflow"},
        engine={"flavor": flavor, "dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": False},
        fleet={"runtime": "kubernetes", "warmup_bursts": [], "restart_backoff_s": 0,
               "kubernetes": {"image": VLLM, "weights_image": TIDAL, **cfg}},
        models=models or [{"name": "tab", "replicas": 2, "update_strategy": "lora"}])


def as_model(manifest: dict, kind: str):
    return k8s.ApiClient()._ApiClient__deserialize(copy.deepcopy(manifest), kind)


def round_trips(manifest: dict, kind: str) -> bool:
    """Equal after model and back: every key is a real field of `kind` (a misspelt key would vanish)."""
    return k8s.ApiClient().sanitize_for_serialization(as_model(manifest, kind)) == manifest


V1 = VersionInfo("tab", 1, "full", 1, "s3://b/t/checkpoints/model=tab/version=1", {DIGEST_TAG: "sha256:" + "1" * 64})


def deployment(tmp_path: Path, lora: bool = True, **cfg) -> dict:
    s = settings(tmp_path, **cfg)
    return render_deployment(s.fleet.kubernetes, s.engine, model="tab", base=V1, enable_lora=lora, replicas=2)


# ---- the engine Deployment ----------------------------------------------------------------------

@pytest.mark.parametrize("gpus", [0, 1, 2])
@pytest.mark.parametrize("lora", [True, False])
def test_the_engine_deployment_is_a_valid_v1_deployment(tmp_path, gpus, lora):
    manifest = deployment(tmp_path, lora, gpus=gpus, flavor="cuda" if gpus else "cpu", env={"NCCL_DEBUG": "WARN"},
                          env_from_secrets=["hf-token"], cpu_request=0.5)
    assert round_trips(manifest, "V1Deployment")
    d = as_model(manifest, "V1Deployment")
    assert (d.api_version, d.kind, d.metadata.name, d.metadata.namespace) == ("apps/v1", "Deployment", "tidal-engine-tab-v1", "tidal")
    assert d.spec.replicas == 2 and d.spec.selector.match_labels.items() <= d.spec.template.metadata.labels.items()
    assert d.spec.selector.match_labels["tidal.dev/model"] == "tab" and d.spec.selector.match_labels["tidal.dev/version"] == "1"
    assert d.metadata.labels["app.kubernetes.io/managed-by"] == "tidal-fleet-supervisor" and d.metadata.annotations[DIGEST]
    assert d.spec.strategy.rolling_update.max_surge == 0  # a surge pod would belong to no replica: never verified
    pod = d.spec.template.spec
    vllm, sidecar = pod.containers
    assert (vllm.name, vllm.image, sidecar.name, sidecar.image, pod.init_containers[0].image) == (ENGINE, VLLM, WEIGHTS, TIDAL, TIDAL)
    res = vllm.resources
    if gpus:
        assert res.requests["nvidia.com/gpu"] == res.limits["nvidia.com/gpu"] == str(gpus)
    else:
        assert "nvidia.com/gpu" not in res.requests and "nvidia.com/gpu" not in res.limits
    assert res.requests["cpu"] == "500m" and res.limits == {"cpu": "8", "memory": "64Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    assert ("--tensor-parallel-size" in vllm.args) == (gpus > 1) and ("--enable-lora" in vllm.args) == lora
    env = {e.name: e.value for e in vllm.env}
    assert env["NCCL_DEBUG"] == "WARN" and vllm.env_from[0].secret_ref.name == "hf-token"
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in env) == lora and "VLLM_SERVER_DEV_MODE" not in env
    assert ("VLLM_CPU_KVCACHE_SPACE" in env) == (gpus == 0)


def test_the_engine_command_is_the_one_a_local_replica_runs(tmp_path):
    s = settings(tmp_path)
    vllm = as_model(deployment(tmp_path), "V1Deployment").spec.template.spec.containers[0]
    local = engine_command(s.engine, Path("/models") / V1.key, [V1.served_name], "0.0.0.0", 8000, enable_lora=True)
    assert vllm.command == ["python3", "-m", local[2]] and vllm.args == local[3:]
    for flag, value in [("--dtype", "bfloat16"), ("--max-model-len", "4096"), ("--max-lora-rank", "8"), ("--served-model-name", "tab@v1")]:
        assert vllm.args[vllm.args.index(flag) + 1] == value
    assert "--enforce-eager" not in vllm.args


def test_readiness_means_verified_weights(tmp_path):
    pod = as_model(deployment(tmp_path), "V1Deployment").spec.template.spec
    vllm, sidecar = pod.containers
    assert [g.condition_type for g in pod.readiness_gates] == [GATE]  # set by the supervisor after the probe
    for probe in (vllm.liveness_probe, vllm.readiness_probe, vllm.startup_probe):
        assert probe.http_get.path == "/health" and probe.http_get.port == "http"
    assert vllm.startup_probe.period_seconds * vllm.startup_probe.failure_threshold == 1800
    [fetch] = pod.init_containers
    assert fetch.name == FETCH and fetch.command[:6] == ["python", "-m", "serving.runtime.weights", "fetch", "--into", "/models"]
    version = json.loads(fetch.command[fetch.command.index("--version") + 1])
    assert VersionInfo(**version) == V1  # the digest the pod checks the download against
    assert vllm.args[vllm.args.index("--model") + 1] == f"/models/{V1.key}"
    assert sidecar.command[3:] == ["serve", "--into", "/models", "--port", "8001"] and sidecar.ports[0].container_port == 8001
    assert fetch.termination_message_policy == "FallbackToLogsOnError"


def test_engine_pods_are_locked_down(tmp_path):
    pod = as_model(deployment(tmp_path), "V1Deployment").spec.template.spec
    assert pod.service_account_name == "tidal-fleet" and pod.automount_service_account_token is False
    assert pod.security_context.run_as_non_root and not pod.host_network and not pod.host_pid and pod.enable_service_links is False
    for c in [*pod.init_containers, *pod.containers]:
        sc = c.security_context
        assert sc.run_as_non_root and sc.run_as_user == 10001 and sc.read_only_root_filesystem, c.name
        assert sc.privileged is False and sc.allow_privilege_escalation is False and sc.capabilities.drop == ["ALL"]
        assert sc.seccomp_profile.type == "RuntimeDefault" and c.resources.limits["memory"]
    mounts = {m.name: m for m in pod.containers[0].volume_mounts}
    assert mounts["models"].read_only and {"cache", "tmp", "shm"} <= set(mounts)  # only the fetchers write weights
    assert all(v.empty_dir.size_limit for v in pod.volumes if v.empty_dir)
    assert {v.name: v.config_map.name for v in pod.volumes if v.config_map} == {"settings": "tidal-settings"}


def test_defaults_match_the_fleet_node_group_and_the_chart(tmp_path):
    cluster = load_dir(TF / "modules" / "cluster")["locals"]
    fleet_pool = cluster["pools"]["fleet"]
    [taint] = cluster["gpu_taint"].values()
    pod = as_model(deployment(tmp_path), "V1Deployment").spec.template.spec
    assert pod.node_selector.items() <= fleet_pool["labels"].items() and fleet_pool["taints"] == "${local.gpu_taint}"
    [tol] = pod.tolerations
    assert (tol.key, tol.operator, tol.value, tol.effect) == (taint["key"], "Equal", taint["value"], "NoSchedule")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    cfg = settings(tmp_path).fleet.kubernetes
    assert cfg.service_account == values["serviceAccounts"]["fleet"]["name"] and cfg.port == values["vllm"]["port"]
    assert cfg.node_selector == values["vllm"]["nodeSelector"] and [t.model_dump() for t in cfg.tolerations] == values["vllm"]["tolerations"]
    from serving.kube_settings import ModelPod

    s = settings(tmp_path)
    per_model = s.fleet.kubernetes.model_copy(update={"models": {"tab": ModelPod(gpus=4, instance_type="p5.48xlarge")}})
    typed = as_model(render_deployment(per_model, s.engine, model="tab", base=V1, enable_lora=True, replicas=1), "V1Deployment").spec.template.spec
    assert typed.node_selector["node.kubernetes.io/instance-type"] == "p5.48xlarge" and typed.containers[0].resources.limits["nvidia.com/gpu"] == "4"


@pytest.mark.parametrize("model", ["tab", "code_v2", "tab-", "a" * 63, "x_" * 20 + "y"])
def test_names_and_labels_are_valid_kubernetes_names(model):
    name = deployment_name("tidal", model, 12)
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) and len(name) <= 52
    label = model_label(model)
    assert re.fullmatch(r"[a-z0-9]([a-z0-9_.-]*[a-z0-9])?", label) and len(label) <= 63
    assert model_label("tab") != model_label("tab-") and deployment_name("tidal", "tab", 1) != deployment_name("tidal", "tab-", 1)


# ---- settings -------------------------------------------------------------------------------------

def test_kubernetes_runtime_settings_are_checked_at_start_up(tmp_path):
    with pytest.raises(SettingsError) as e:
        load_settings(fleet={"runtime": "kubernetes", "kubernetes": {"image": "vllm/vllm-openai:latest", "gpus": 0,
                                                                     "models": {"other": {"gpus": 1}}}},
                      engine={"flavor": "cuda"})
    msg = str(e.value)
    assert "fleet.kubernetes.image 'vllm/vllm-openai:latest' has no fixed tag" in msg and "set fleet.kubernetes.weights_image" in msg
    assert "s3://bucket/prefix" in msg and "mlflow.host '127.0.0.1'" in msg and "['other']" in msg and "asks no GPU" in msg
    with pytest.raises(SettingsError, match="memory_request 8Gi > memory_limit 4Gi"):
        load_settings(fleet={"kubernetes": {"memory_request": "8Gi", "memory_limit": "4Gi"}})
    with pytest.raises(SettingsError, match="engine.flavor 'cpu' but model 'tab' asks 1 GPU"):
        settings(tmp_path, flavor="cpu")
    assert settings(tmp_path, flavor="cpu", gpus=0).fleet.kubernetes.gpus == 0  # a vllm-cpu image
    with pytest.raises(SettingsError, match="model 'tab' uses update_strategy 'reload'.*use 'lora' or 'restart'"):
        settings(tmp_path, models=[{"name": "tab", "replicas": 2, "update_strategy": "reload"}])
    ok = settings(tmp_path)
    assert ok.fleet.runtime == "kubernetes" and runtime_for(ok).flavor() == "cuda"
    assert load_settings().fleet.runtime == "local" and isinstance(runtime_for(load_settings()), LocalRuntime)


def test_the_chart_fills_only_real_settings():
    """The chart's helper builds fleet.kubernetes from supervisor.kubernetes plus the keys it sets: all must be
    fields the supervisor accepts (a typo would stop it at start-up), and the result must load."""
    from serving.kube_settings import KubernetesFleetSettings

    helper = (CHART / "templates" / "_helpers.tpl").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    filled = set(re.findall(r'set \$k "(\w+)"', helper))
    fields = set(KubernetesFleetSettings.model_fields)
    assert filled and filled <= fields and set(values["supervisor"]["kubernetes"]) <= fields
    v = values["vllm"]
    chart = {**values["supervisor"]["kubernetes"], "namespace": "tidal", "instance": "tidal", "image": f"{v['image']['repository']}:{v['image']['tag']}",
             "weights_image": TIDAL, "image_pull_policy": v["image"]["pullPolicy"], "service_account": values["serviceAccounts"]["fleet"]["name"],
             "node_selector": v["nodeSelector"], "tolerations": v["tolerations"], "cpu_request": v["resources"]["requests"]["cpu"],
             "cpu_limit": v["resources"]["limits"]["cpu"], "memory_request": v["resources"]["requests"]["memory"],
             "memory_limit": v["resources"]["limits"]["memory"], "shm_size": v["shmSizeLimit"], "port": v["port"],
             "startup_timeout_s": v["startupTimeoutSeconds"], "models": {"tab": {"gpus": 1}}}
    assert set(chart) - set(values["supervisor"]["kubernetes"]) == filled
    s = load_settings(**{**values["settings"], "store": {"url": "s3://b/t"}, "models": [{"name": "tab"}],
                         "fleet": {**values["settings"]["fleet"], "runtime": "kubernetes", "kubernetes": chart}})
    assert s.fleet.kubernetes.cpu_limit == 8.0 and s.fleet.kubernetes.image == VLLM


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
        return self.get(model, self.champion) if alias == "champion" else None

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
        self.registry = Registry(version(self.store, "tab", 1), version(self.store, "tab", 2, "lora", 1), version(self.store, "tab", 3))
        self.settings = settings(tmp_path, models, **cfg)
        self.runtime = KubernetesRuntime(self.settings, apis=(self.cluster, self.cluster), clock=self.clock, sleep=self.clock.sleep,
                                         fetcher=self.fetch)
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
    assert c.deployments[dep].spec.replicas == 3 and len(c.of(dep)) == 3 and w.in_rotation("tab@v1") == ["tab-0", "tab-1", "tab-2"]
    keep = w.replicas()[0].pod
    w.fleet.scale("tab", 1)
    assert c.deployments[dep].spec.replicas == 1 and c.of(dep) == [keep]  # the retired replicas' own pods went
    assert [r.name for r in w.replicas()] == ["tab-0"] and w.in_rotation("tab@v1") == ["tab-0"]
    w.fleet.scale("tab", 0)
    assert dep not in c.deployments and not c.pods


def test_lora_versions_are_fetched_into_the_pod_loaded_and_verified(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch).start()
    reports = w.fleet.deploy("tab", 2)
    assert len(reports) == 2 and all(r.ok for r in reports)
    pods = {r.pod: r for r in w.replicas()}
    assert sorted(w.fetched) == sorted((f"http://{w.cluster.pods[p].status.pod_ip}:8001", "tab@v2") for p in pods)
    assert all(w.cluster.engines[w.cluster.pods[p].status.pod_ip].loaded["tab@v2"] == "/models/checkpoints/model=tab/version=2" for p in pods)
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
    assert "Insufficient nvidia.com/gpu" in msg and "ready after 600 s" in msg and "kubectl -n tidal describe deployment tidal-engine-tab-v1" in msg
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
    assert set(first.cluster.pods) == pods and not {"delete_namespaced_pod", "delete_namespaced_deployment"} & set(first.cluster.calls[calls:])
    second = World(tmp_path, monkeypatch, cluster=first.cluster).start()
    c = second.cluster
    assert set(c.deployments) == {"tidal-engine-tab-v1"} and {r.pod for r in second.replicas()} == set(c.of("tidal-engine-tab-v1"))
    assert set(c.of("tidal-engine-tab-v1")) < pods and c.deployments["tidal-engine-tab-v1"].spec.replicas == 2  # adopted, not restarted
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
    needs = {"read_namespaced_deployment": ("apps", "deployments", "get"), "list_namespaced_deployment": ("apps", "deployments", "list"),
             "create_namespaced_deployment": ("apps", "deployments", "create"), "replace_namespaced_deployment": ("apps", "deployments", "update"),
             "patch_namespaced_deployment": ("apps", "deployments", "patch"), "delete_namespaced_deployment": ("apps", "deployments", "delete"),
             "list_namespaced_pod": ("", "pods", "list"), "patch_namespaced_pod": ("", "pods", "patch"),
             "delete_namespaced_pod": ("", "pods", "delete"), "patch_namespaced_pod_status": ("", "pods/status", "patch")}
    rules = yaml.safe_load(RULES.read_text())
    assert round_trips({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "r"}, "rules": rules}, "V1Role")
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
