"""The engine Deployment of one (model, base version) as a plain dict, and what a pod's status says.

Pure functions over settings and kubernetes client models (attribute reads only): the runtime creates what
`render_deployment` returns, the tests validate it with the client's models, no cluster needed.

The pod:
    init container `fetch-weights`  (Tidal image) downloads the base checkpoint from the object store into the
                                    pod's `models` volume and checks it against the digest registered with the
                                    version (serving/runtime/weights.py: the supervisor's own CheckpointCache code)
    container `vllm`                the vLLM OpenAI server on that directory, the command line serving/engine.py
                                    builds for a local replica; liveness/startup/readiness = vLLM's /health
    container `weights`             (Tidal image) the same fetcher as a small HTTP service: adapters deployed later
                                    are fetched into the same volume, and vLLM loads them from there
    readiness gate `tidal.dev/weights-verified`
                                    set True by the supervisor only after the served-weight probe passed against
                                    this pod (and its adapters loaded and passed); False when it leaves rotation

Why a readiness gate rather than an exec/HTTP probe: the probe compares greedy log-probs with the trainer's for
every version the pod serves, including adapters loaded after start; the kubelet knows neither the versions nor
the expected log-probs, and running completions every few seconds would compete with traffic. The supervisor
already runs that probe before any traffic; the gate makes Kubernetes see the same verdict, so `kubectl get
pods`, rollouts (maxUnavailable) and disruption budgets count only pods that serve verified weights. The
gateway's rotation itself comes from the supervisor (GET /fleet), as with local replicas.

No Service: the gateway reaches replicas at the pod IPs the supervisor reports.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from serving.engine import ENGINE_MODULE, engine_args, engine_env
from tidal.kube import GPU_RESOURCE

if TYPE_CHECKING:
    from kubernetes.client import V1Pod

    from serving.kube_settings import KubernetesFleetSettings
    from serving.settings import EngineSettings
    from tidal.registry import VersionInfo

ENGINE, FETCH, WEIGHTS = "vllm", "fetch-weights", "weights"  # container names
MODELS_DIR = "/models"  # the pod's checkpoint volume: <MODELS_DIR>/<checkpoint key>
SETTINGS_DIR = "/etc/tidal"  # the chart's ConfigMap (the store the fetchers read)
GATE = "tidal.dev/weights-verified"  # readiness gate the supervisor sets
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # which pod a scale-down removes first
DIGEST = "tidal.dev/template-digest"
MANAGER = "tidal-fleet-supervisor"
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$")


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def model_label(model: str) -> str:
    """The model name as a label value; a name a label cannot hold gets a hash, so selectors never overlap."""
    return model if _LABEL.match(model) else f"{model.rstrip('_-')[:55]}-{_tag(model)}"


def deployment_name(instance: str, model: str, version: int) -> str:
    """<instance>-engine-<model>-v<version>, a DNS label; a model name that had to change gets a hash."""
    short = model.replace("_", "-").rstrip("-")
    if short != model or len(short) > 24:
        short = f"{short[:17].rstrip('-')}-{_tag(model)}"
    return f"{instance[:20].rstrip('-.')}-engine-{short}-v{version}"


def selector(instance: str, model: str | None = None, version: int | None = None) -> dict[str, str]:
    """Labels of the fleet's engine pods; with model (and version) those of one model (one Deployment)."""
    out = {"app.kubernetes.io/name": "tidal", "app.kubernetes.io/instance": instance, "app.kubernetes.io/component": "engine"}
    if model is not None:
        out["tidal.dev/model"] = model_label(model)
    if version is not None:
        out["tidal.dev/version"] = str(version)
    return out


def selector_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _cores(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{round(n * 1000)}m"


def _hardened(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _fetcher(cfg: KubernetesFleetSettings, name: str, args: list[str]) -> dict[str, Any]:
    """A container of the Tidal image running serving/runtime/weights.py (the init container and the sidecar)."""
    size = {"cpu": _cores(cfg.fetch_cpu), "memory": cfg.fetch_memory}
    return {
        "name": name,
        "image": cfg.weights_image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": ["python", "-m", "serving.runtime.weights", *args],
        "env": [
            {"name": "TIDAL_CONFIG", "value": f"{SETTINGS_DIR}/tidal.yaml"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "resources": {"requests": dict(size), "limits": dict(size)},
        "securityContext": _hardened(cfg.run_as_user),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # a failed fetch's last lines land in the pod status
        "volumeMounts": [
            {"name": "settings", "mountPath": SETTINGS_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODELS_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def _engine_env(cfg: KubernetesFleetSettings, engine: EngineSettings, gpus: int, enable_lora: bool) -> list[dict[str, str]]:
    env = engine_env(engine)
    # No dev-mode routes (/collective_rpc, /pause, ...) on a cluster network: no implemented strategy needs them.
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if not enable_lora:
        env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if gpus:
        env = {k: v for k, v in env.items() if not k.startswith("VLLM_CPU_") and k != "OMP_NUM_THREADS"}
    env.update(
        {"HOME": "/tmp/home", "XDG_CACHE_HOME": "/cache", "HF_HOME": "/cache/huggingface", "VLLM_CACHE_ROOT": "/cache/vllm"}
    )
    env.update(cfg.env)
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def render_deployment(
    cfg: KubernetesFleetSettings, engine: EngineSettings, *, model: str, base: VersionInfo, enable_lora: bool, replicas: int
) -> dict[str, Any]:
    """The Deployment manifest (camelCase keys, as the API and `kubectl apply` take it)."""
    gpus = cfg.gpus_for(model)
    labels = selector(cfg.instance, model, base.version)
    requests: dict[str, str] = {"cpu": _cores(cfg.cpu_request), "memory": cfg.memory_request}
    limits: dict[str, str] = {"cpu": _cores(cfg.cpu_limit), "memory": cfg.memory_limit}
    if gpus:  # extended resources: request must equal limit
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    health = {"httpGet": {"path": "/health", "port": "http"}}
    vllm: dict[str, Any] = {
        "name": ENGINE,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": ["python3", "-m", ENGINE_MODULE],
        "args": engine_args(
            engine, f"{MODELS_DIR}/{base.key}", [base.served_name], "0.0.0.0", cfg.port, enable_lora, tensor_parallel=max(gpus, 1)
        ),
        "env": _engine_env(cfg, engine, gpus, enable_lora),
        "ports": [{"name": "http", "containerPort": cfg.port, "protocol": "TCP"}],
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": max(1, cfg.startup_timeout_s // 10)},
        "livenessProbe": {**health, "periodSeconds": 15, "failureThreshold": 4},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},  # engine up; the gate says verified
        "resources": {"requests": requests, "limits": limits},
        "securityContext": _hardened(cfg.run_as_user),
        "volumeMounts": [
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
            {"name": "cache", "mountPath": "/cache"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if cfg.env_from_secrets:
        vllm["envFrom"] = [{"secretRef": {"name": s}} for s in cfg.env_from_secrets]
    sidecar = _fetcher(cfg, WEIGHTS, ["serve", "--into", MODELS_DIR, "--port", str(cfg.weights_port)])
    sidecar["ports"] = [{"name": "weights", "containerPort": cfg.weights_port, "protocol": "TCP"}]
    sidecar["readinessProbe"] = {"httpGet": {"path": "/health", "port": "weights"}, "periodSeconds": 10}
    version = json.dumps(asdict(base), sort_keys=True, separators=(",", ":"))
    node_selector = dict(cfg.node_selector)
    pod_cfg = cfg.models.get(model)
    if pod_cfg is not None and pod_cfg.instance_type:
        node_selector["node.kubernetes.io/instance-type"] = pod_cfg.instance_type
    pod: dict[str, Any] = {
        "serviceAccountName": cfg.service_account,
        "automountServiceAccountToken": False,  # engines never call the Kubernetes API (IRSA is projected apart)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": cfg.termination_grace_s,
        "readinessGates": [{"conditionType": GATE}],
        "securityContext": {"runAsNonRoot": True, "fsGroup": cfg.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [_fetcher(cfg, FETCH, ["fetch", "--into", MODELS_DIR, "--version", version])],
        "containers": [vllm, sidecar],
        "volumes": [
            {"name": "settings", "configMap": {"name": cfg.settings_configmap}},
            {"name": "models", "emptyDir": {"sizeLimit": cfg.models_size}},
            {"name": "cache", "emptyDir": {"sizeLimit": cfg.cache_size}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}},
        ],
    }
    if cfg.priority_class:  # above training: a replica added on a full node preempts a trainer pod
        pod["priorityClassName"] = cfg.priority_class
    if node_selector:
        pod["nodeSelector"] = node_selector
    if cfg.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in cfg.tolerations]
    template = {
        "metadata": {
            "labels": dict(labels),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(cfg.port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod,
    }
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(cfg.instance, model, base.version),
            "namespace": cfg.namespace,
            "labels": {**labels, "app.kubernetes.io/managed-by": MANAGER},
            "annotations": {"tidal.dev/model": model, "tidal.dev/served-name": base.served_name, DIGEST: digest},
        },
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": dict(labels)},
            # A template change (new engine image) replaces one pod at a time, old first: the replica that lost its
            # pod claims the new one and verifies it, whose gate lets the rollout go on. A surge pod would belong to
            # no replica and never be verified, so the rollout would stall.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": int(cfg.ready_timeout_s),
            "template": template,
        },
    }


# ---- reading pods ---------------------------------------------------------------------------------


def _status(pod: V1Pod, name: str, init: bool = False) -> Any:
    statuses = (pod.status and (pod.status.init_container_statuses if init else pod.status.container_statuses)) or []
    return next((s for s in statuses if s.name == name), None)


def engine_restarts(pod: V1Pod) -> int:
    s = _status(pod, ENGINE)
    return s.restart_count if s is not None and s.restart_count else 0


def terminating(pod: V1Pod) -> bool:
    return pod.metadata.deletion_timestamp is not None or (pod.status is not None and pod.status.phase in ("Failed", "Succeeded"))


def engine_ready(pod: V1Pod) -> bool:
    """The engine answers /health (its container is ready): the supervisor may probe it."""
    s = _status(pod, ENGINE)
    return not terminating(pod) and bool(pod.status and pod.status.pod_ip) and s is not None and bool(s.ready)


def gate_value(pod: V1Pod) -> bool | None:
    for c in (pod.status and pod.status.conditions) or []:
        if c.type == GATE:
            return c.status == "True"
    return None


def trouble(pod: V1Pod) -> str:
    """What a pod that is not ready is waiting on, in a line (for a replica that timed out)."""
    name, status = pod.metadata.name, pod.status
    if status is None:
        return f"{name}: no status yet"
    for c in status.conditions or []:
        if c.type == "PodScheduled" and c.status != "True":
            return f"{name}: not scheduled: {c.reason}: {c.message}"
    for init, cname in ((True, FETCH), (False, ENGINE), (False, WEIGHTS)):
        s = _status(pod, cname, init)
        state = s and s.state
        if state is not None and state.waiting is not None and state.waiting.reason not in (None, "PodInitializing"):
            return f"{name}: {cname} waiting: {state.waiting.reason}: {state.waiting.message or ''}".rstrip(": ")
        last = s and s.last_state and s.last_state.terminated
        if last is not None and last.exit_code:
            return f"{name}: {cname} exited {last.exit_code} ({last.reason}): {(last.message or '').strip()[-300:]}"
    return f"{name}: phase {status.phase}" + ("" if engine_ready(pod) else ", engine not answering /health yet")
