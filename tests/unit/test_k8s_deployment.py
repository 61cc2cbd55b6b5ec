"""The engine Deployment the fleet's Kubernetes runtime renders, without a cluster: validated with the kubernetes
client's own models, locked down, matching a local replica's command and the chart's defaults; and the settings checks
of the Kubernetes runtime against the chart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from serving.engine import engine_command
from serving.runtime import runtime_for
from serving.runtime.k8s_manifest import DIGEST, ENGINE, FETCH, GATE, WEIGHTS, deployment_name, model_label, render_deployment
from serving.runtime.local import LocalRuntime
from tests.unit.k8s_fixtures import TIDAL, VLLM, as_model, clean_env, round_trips, settings  # noqa: F401  (clean_env: autouse fixture)
from tests.unit.terraform_hcl import CHART, TF, load_dir
from tidal.registry import DIGEST_TAG, VersionInfo
from tidal.section import SettingsError
from tidal.settings import load_settings

V1 = VersionInfo("tab", 1, "full", 1, "s3://b/t/checkpoints/model=tab/version=1", {DIGEST_TAG: "sha256:" + "1" * 64})


def deployment(tmp_path: Path, lora: bool = True, **cfg) -> dict:
    s = settings(tmp_path, **cfg)
    return render_deployment(s.fleet.kubernetes, s.engine, model="tab", base=V1, enable_lora=lora, replicas=2)


# ---- the engine Deployment ----------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 1, 2])
@pytest.mark.parametrize("lora", [True, False])
def test_the_engine_deployment_is_a_valid_v1_deployment(tmp_path, gpus, lora):
    manifest = deployment(
        tmp_path,
        lora,
        gpus=gpus,
        flavor="cuda" if gpus else "cpu",
        env={"NCCL_DEBUG": "WARN"},
        env_from_secrets=["hf-token"],
        cpu_request=0.5,
    )
    assert round_trips(manifest, "V1Deployment")
    d = as_model(manifest, "V1Deployment")
    assert (d.api_version, d.kind, d.metadata.name, d.metadata.namespace) == (
        "apps/v1",
        "Deployment",
        "tidal-engine-tab-v1",
        "tidal",
    )
    assert d.spec.replicas == 2 and d.spec.selector.match_labels.items() <= d.spec.template.metadata.labels.items()
    assert d.spec.selector.match_labels["tidal.dev/model"] == "tab" and d.spec.selector.match_labels["tidal.dev/version"] == "1"
    assert d.metadata.labels["app.kubernetes.io/managed-by"] == "tidal-fleet-supervisor" and d.metadata.annotations[DIGEST]
    assert d.spec.strategy.rolling_update.max_surge == 0  # a surge pod would belong to no replica: never verified
    pod = d.spec.template.spec
    assert pod.priority_class_name == "tidal-serving"  # above training's: preempts a trainer pod on a full node
    vllm, sidecar = pod.containers
    assert (vllm.name, vllm.image, sidecar.name, sidecar.image, pod.init_containers[0].image) == (
        ENGINE,
        VLLM,
        WEIGHTS,
        TIDAL,
        TIDAL,
    )
    res = vllm.resources
    if gpus:
        assert res.requests["nvidia.com/gpu"] == res.limits["nvidia.com/gpu"] == str(gpus)
    else:
        assert "nvidia.com/gpu" not in res.requests and "nvidia.com/gpu" not in res.limits
    assert res.requests["cpu"] == "500m" and res.limits == {
        "cpu": "8",
        "memory": "64Gi",
        **({"nvidia.com/gpu": str(gpus)} if gpus else {}),
    }
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
    for flag, value in [
        ("--dtype", "bfloat16"),
        ("--max-model-len", "4096"),
        ("--max-lora-rank", "8"),
        ("--served-model-name", "tab@v1"),
    ]:
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
    assert (
        pod.security_context.run_as_non_root and not pod.host_network and not pod.host_pid and pod.enable_service_links is False
    )
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
    assert (
        cfg.node_selector == values["vllm"]["nodeSelector"]
        and [t.model_dump() for t in cfg.tolerations] == values["vllm"]["tolerations"]
    )
    from serving.kube_settings import ModelPod

    s = settings(tmp_path)
    per_model = s.fleet.kubernetes.model_copy(update={"models": {"tab": ModelPod(gpus=4, instance_type="p5.48xlarge")}})
    typed = as_model(
        render_deployment(per_model, s.engine, model="tab", base=V1, enable_lora=True, replicas=1), "V1Deployment"
    ).spec.template.spec
    assert (
        typed.node_selector["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        and typed.containers[0].resources.limits["nvidia.com/gpu"] == "4"
    )


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
        load_settings(
            fleet={
                "runtime": "kubernetes",
                "kubernetes": {"image": "vllm/vllm-openai:latest", "gpus": 0, "models": {"other": {"gpus": 1}}},
            },
            engine={"flavor": "cuda"},
        )
    msg = str(e.value)
    assert (
        "fleet.kubernetes.image 'vllm/vllm-openai:latest' has no fixed tag" in msg and "set fleet.kubernetes.weights_image" in msg
    )
    assert (
        "s3://bucket/prefix" in msg
        and "host '127.0.0.1' (mlflow.url or mlflow.host)" in msg
        and "['other']" in msg
        and "asks no GPU" in msg
    )
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
    chart = {
        **values["supervisor"]["kubernetes"],
        "namespace": "tidal",
        "instance": "tidal",
        "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "weights_image": TIDAL,
        "image_pull_policy": v["image"]["pullPolicy"],
        "service_account": values["serviceAccounts"]["fleet"]["name"],
        "node_selector": v["nodeSelector"],
        "tolerations": v["tolerations"],
        "cpu_request": v["resources"]["requests"]["cpu"],
        "cpu_limit": v["resources"]["limits"]["cpu"],
        "memory_request": v["resources"]["requests"]["memory"],
        "memory_limit": v["resources"]["limits"]["memory"],
        "shm_size": v["shmSizeLimit"],
        "port": v["port"],
        "startup_timeout_s": v["startupTimeoutSeconds"],
        "models": {"tab": {"gpus": 1}},
    }
    assert set(chart) - set(values["supervisor"]["kubernetes"]) == filled
    s = load_settings(
        **{
            **values["settings"],
            "store": {"url": "s3://b/t"},
            "models": [{"name": "tab"}],
            "fleet": {**values["settings"]["fleet"], "runtime": "kubernetes", "kubernetes": chart},
        }
    )
    assert s.fleet.kubernetes.cpu_limit == 8.0 and s.fleet.kubernetes.image == VLLM
