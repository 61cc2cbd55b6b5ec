"""Settings of the fleet's Kubernetes runtime (`fleet.kubernetes`): the engine pods the supervisor creates, one
Deployment per (model, base version), rendered by serving/runtime/k8s_manifest.py. Defaults match infra/: the
chart's service account and settings ConfigMap, the `fleet` GPU node group's label and taint."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tidal.kube import GPU_RESOURCE, QUANTITY, Toleration, gpu_toleration, quantity_bytes, unpinned
from tidal.section import Section

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
POD_STRATEGIES = ("lora", "restart")  # the update strategies engine pods support


class ModelPod(Section):
    """Per-model overrides of the engine pod (the chart's models[].gpus and models[].instanceType)."""

    gpus: int | None = Field(None, ge=0, le=16, description="GPUs per pod of this model; None = fleet.kubernetes.gpus.")
    instance_type: str | None = Field(
        None, description="node.kubernetes.io/instance-type the pods must run on; None = any of the pool."
    )


class KubernetesFleetSettings(Section):
    namespace: str = Field("tidal", description="Namespace of the engine Deployments (the chart's release namespace).")
    instance: str = Field(
        "tidal",
        pattern=r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$",
        description=(
            "app.kubernetes.io/instance label of the engine pods (the chart's release name). The supervisor only touches "
            "Deployments and pods carrying it: two fleets in one namespace need different values."
        ),
    )
    image: str = Field(
        "",
        description=(
            "The vLLM OpenAI server image (e.g. vllm/vllm-openai:v0.32.0); required with runtime 'kubernetes'. An untagged "
            "or 'latest' image is refused: a pod Kubernetes recreates must run the same engine."
        ),
    )
    weights_image: str = Field(
        "",
        description=(
            "The Tidal image; it fetches and verifies checkpoints in each engine pod (init container, and a sidecar for "
            "adapters loaded later). Required with runtime 'kubernetes', pinned like `image`."
        ),
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of every container."
    )
    service_account: str = Field(
        "tidal-fleet",
        description=("Service account of the engine pods: its IAM role (IRSA) reads checkpoints. The pods mount no API token."),
    )
    priority_class: str | None = Field(
        "tidal-serving",
        description=(
            "priorityClassName of the engine pods: above training's (the chart's priorityClasses), so that a replica "
            "the scheduler adds preempts a trainer pod on a full node. None: the cluster's default priority."
        ),
    )
    gpus: int = Field(
        1,
        ge=0,
        le=16,
        description=(
            f"{GPU_RESOURCE} per engine pod (request = limit); above 1 the engine runs with --tensor-parallel-size N; "
            "0 = a CPU engine (a vllm-cpu image)."
        ),
    )
    cpu_request: float = Field(4.0, gt=0, description="CPU cores requested by the engine container.")
    cpu_limit: float = Field(8.0, gt=0, description="CPU cores limit of the engine container.")
    memory_request: str = Field("32Gi", pattern=QUANTITY, description="Memory requested by the engine container.")
    memory_limit: str = Field("64Gi", pattern=QUANTITY, description="Memory limit of the engine container.")
    shm_size: str = Field("8Gi", pattern=QUANTITY, description="Size of /dev/shm (NCCL, engine worker processes).")
    models_size: str = Field(
        "150Gi",
        pattern=QUANTITY,
        description=("Size limit of the pod's checkpoint volume (base checkpoint and every adapter fetched into it)."),
    )
    cache_size: str = Field("20Gi", pattern=QUANTITY, description="Size limit of the engine's compile caches (/cache).")
    fetch_cpu: float = Field(1.0, gt=0, description="CPU cores (request = limit) of the checkpoint fetcher containers.")
    fetch_memory: str = Field(
        "4Gi", pattern=QUANTITY, description="Memory (request = limit) of the checkpoint fetcher containers."
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"tidal.dev/pool": "fleet"},
        description=("Node labels the engine pods must match; the default is infra/terraform's fleet GPU node group."),
    )
    tolerations: list[Toleration] = Field(
        default_factory=gpu_toleration,
        description=(
            "Taints the engine pods tolerate; the default tolerates the GPU node groups' nvidia.com/gpu=true:NoSchedule."
        ),
    )
    models: dict[str, ModelPod] = Field(
        default_factory=dict, description="Per-model overrides (gpus, instance_type), by model name."
    )
    settings_configmap: str = Field(
        "tidal-settings",
        description=(
            "ConfigMap holding tidal.yaml (the chart's), mounted at /etc/tidal in the fetcher containers: the store they read."
        ),
    )
    port: int = Field(8000, ge=1, le=65535, description="Engine port in the pod (the supervisor and gateway reach pod IP:port).")
    weights_port: int = Field(8001, ge=1, le=65535, description="Port of the checkpoint fetcher sidecar in the pod.")
    run_as_user: int = Field(10001, ge=1, description="Non-root uid (and gid) of every container, as in the chart.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the engine container.")
    env_from_secrets: list[str] = Field(
        default_factory=list, description="Secrets whose keys become environment variables of the engine container."
    )
    startup_timeout_s: int = Field(
        1800,
        ge=60,
        description=(
            "Budget of the engine's startupProbe (weights loaded into GPU memory, graphs captured) before the kubelet restarts it."
        ),
    )
    ready_timeout_s: float = Field(
        3600.0,
        gt=0,
        description=(
            "How long the supervisor waits for a ready pod for a replica: scheduling (a GPU node may have to join), image "
            "pull, checkpoint download and engine start. Past it the replica fails with what its pods are waiting on."
        ),
    )
    termination_grace_s: int = Field(
        60, ge=0, description="terminationGracePeriodSeconds of the engine pods (in-flight requests finish)."
    )
    poll_s: float = Field(5.0, gt=0, description="How often the supervisor reads pod state while it waits for a pod.")
    kube_context: str | None = Field(
        None,
        description=(
            "kubeconfig context when the supervisor runs outside the cluster (it must still reach pod IPs); in a pod its "
            "service account is used."
        ),
    )

    @model_validator(mode="after")
    def _requests_within_limits(self):
        if self.cpu_request > self.cpu_limit:
            raise ValueError(f"cpu_request {self.cpu_request} > cpu_limit {self.cpu_limit}: raise cpu_limit or lower cpu_request")
        if quantity_bytes(self.memory_request) > quantity_bytes(self.memory_limit):
            raise ValueError(f"memory_request {self.memory_request} > memory_limit {self.memory_limit}: raise memory_limit")
        if self.port == self.weights_port:
            raise ValueError(f"port and weights_port are both {self.port}: they share the pod's network namespace")
        return self

    def gpus_for(self, model: str) -> int:
        pod = self.models.get(model)
        return self.gpus if pod is None or pod.gpus is None else pod.gpus

    def flavor(self, engine_flavor: str, model: str | None = None) -> str:
        """The engine build the pods run: engine.flavor, or with 'auto' what the GPU request implies."""
        if engine_flavor != "auto":
            return engine_flavor
        gpus = self.gpus_for(model) if model else self.gpus
        return "cuda" if gpus else "cpu"

    def problems(self, checkpoints_store: str, mlflow_host: str, engine_flavor: str, models: dict[str, str]) -> list[str]:
        """What stops the supervisor from running engines as pods, each with its fix. `models`: name → update strategy."""
        out = [
            p
            for p in (
                unpinned("fleet.kubernetes.image", self.image),
                unpinned("fleet.kubernetes.weights_image", self.weights_image),
            )
            if p
        ]
        if not checkpoints_store.startswith("s3://"):
            out.append(
                f"engine pods fetch checkpoints from the object store, but the checkpoints area is "
                f"{checkpoints_store or 'local disk'}: set store.url (or store.routes.checkpoints) to s3://bucket/prefix"
            )
        if mlflow_host in LOOPBACK or mlflow_host.startswith("127."):
            out.append(
                f"MLflow's host {mlflow_host!r} (mlflow.url or mlflow.host) is the loopback; the supervisor runs in the cluster beside its pods: "
                "use the MLflow service's address (e.g. tidal-mlflow.tidal.svc.cluster.local)"
            )
        unknown = sorted(set(self.models) - set(models))
        if unknown:
            out.append(f"fleet.kubernetes.models names {unknown}, which are not configured models {sorted(models)}")
        for m, strategy in models.items():
            if strategy not in POD_STRATEGIES:
                out.append(
                    f"model {m!r} uses update_strategy {strategy!r}, which swaps weights inside running engines "
                    "through vLLM's development routes and checkpoint paths on the supervisor's disk; engine pods "
                    "run without those routes and read checkpoints from their own volume: use 'lora' or 'restart'"
                )
            gpus = self.gpus_for(m)
            if engine_flavor == "cpu" and gpus:
                out.append(
                    f"engine.flavor 'cpu' but model {m!r} asks {gpus} GPU(s) per pod: set fleet.kubernetes.gpus "
                    "(or models.<name>.gpus) to 0 for a vllm-cpu image, or engine.flavor to cuda"
                )
            if engine_flavor == "cuda" and not gpus:
                out.append(f"engine.flavor 'cuda' but model {m!r} asks no GPU: set fleet.kubernetes.gpus to 1 or more")
        return out
