"""The trainer's batch/v1 Job as a plain dict, and what a finished Job's pod says about how it ended.

Pure functions over settings and kubernetes client models (attribute reads only): the launcher creates what
`render_job` returns, the tests validate it with the client's models, no cluster needed.

One pod per Job (`backoffLimit: 0`): retries belong to the flow, which resumes from the run's checkpoint and
knows which failures are worth retrying; `restartPolicy: Never` keeps a failed container's exit code.
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Any

from tidal.kube import GPU_RESOURCE
from training.job_spec import EXIT_PREEMPTED
from training.launch.base import EXIT_NOT_RUN
from training.train_settings import KubernetesJobSettings

if TYPE_CHECKING:
    from kubernetes.client import V1Job, V1Pod

    from training.job_spec import TrainJob

CONTAINER = "trainer"
SETTINGS_DIR = "/etc/tidal"  # where the chart's ConfigMap is mounted (TIDAL_CONFIG points into it)


def trainer_command(gpus_per_node: int, command: str, spec_ref: str) -> list[str]:
    """`python -m training.job ...`, or under torchrun for several GPUs on the node: one process per GPU, which
    train data parallel (training/job.py, training/distributed.py)."""
    job = ["-m", "training.job", command, spec_ref]
    if gpus_per_node > 1:
        return ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(gpus_per_node), *job]
    return ["python", *job]


def _dns_label(text: str, limit: int) -> str:
    """Lowercase letters, digits and '-', starting and ending alphanumeric (RFC 1123 label), at most `limit` long."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())[:limit].strip("-")


def job_name(command: str, spec: TrainJob) -> str:
    """tidal-train-tab-1a2b3c4d-9f8e7d: command, model, run key, and a suffix so every attempt gets its own Job."""
    key = spec.run_key.removeprefix("run-")[:8]
    return f"tidal-{command}-{_dns_label(spec.model, 24)}-{key}-{secrets.token_hex(3)}"


def job_labels(command: str, spec: TrainJob) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tidal",
        "app.kubernetes.io/component": "trainer",
        "tidal.dev/model": _dns_label(spec.model, 63),
        "tidal.dev/run": spec.run_key,
        "tidal.dev/command": command,
    }


def _cores(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{round(n * 1000)}m"


def render_job(cfg: KubernetesJobSettings, *, name: str, command: str, spec_ref: str, labels: dict[str, str]) -> dict[str, Any]:
    """The Job manifest (camelCase keys, as the API and `kubectl apply` take it)."""
    requests: dict[str, str] = {"cpu": _cores(cfg.cpu_request), "memory": cfg.memory_request}
    limits: dict[str, str] = {"cpu": _cores(cfg.cpu_limit), "memory": cfg.memory_limit}
    if cfg.gpus_per_node:  # extended resources: request must equal limit
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(cfg.gpus_per_node)
    env = [
        {"name": "TIDAL_CONFIG", "value": f"{SETTINGS_DIR}/tidal.yaml"},
        {"name": "HOME", "value": "/tmp"},  # caches of torch/transformers: the root filesystem is read-only
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},  # lines reach the pod log as they are printed
        *({"name": k, "value": v} for k, v in sorted(cfg.env.items())),
    ]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": trainer_command(cfg.gpus_per_node, command, spec_ref),
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cfg.run_as_user,
            "runAsGroup": cfg.run_as_user,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "settings", "mountPath": SETTINGS_DIR, "readOnly": True},
            {"name": "data", "mountPath": cfg.data_dir},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if cfg.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in cfg.env_from_secrets]
    pod: dict[str, Any] = {
        "serviceAccountName": cfg.service_account,
        "automountServiceAccountToken": False,  # the trainer never calls the Kubernetes API (IRSA is projected apart)
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "fsGroup": cfg.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [
            {"name": "settings", "configMap": {"name": cfg.settings_configmap}},
            {"name": "data", "emptyDir": {"sizeLimit": cfg.scratch_size}},
            {"name": "tmp", "emptyDir": {"sizeLimit": cfg.scratch_size}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}},
        ],
    }
    if cfg.node_selector:
        pod["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in cfg.tolerations]
    if cfg.priority_class:
        pod["priorityClassName"] = cfg.priority_class
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": cfg.namespace, "labels": dict(labels)},
        "spec": {
            "backoffLimit": 0,
            # A trainer preempted (its pod evicted for serving's, or stopped with SIGTERM: exit EXIT_PREEMPTED after a
            # checkpoint, training/preemption.py) is no failure: the Job starts a new pod, which waits for capacity
            # and resumes. Any other failure ends the Job (backoffLimit 0: retries belong to the flow).
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "Ignore",
                        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [EXIT_PREEMPTED]},
                    },
                ]
            },
            "activeDeadlineSeconds": cfg.active_deadline_s,
            "ttlSecondsAfterFinished": cfg.ttl_seconds_after_finished,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }


def job_finished(job: V1Job) -> bool:
    """True once the Job carries a Complete or Failed condition (set after its pod has terminated)."""
    conditions = (job.status and job.status.conditions) or []
    return any(c.type in ("Complete", "Failed") and c.status == "True" for c in conditions)


def outcome(job: V1Job | None, pod: V1Pod | None) -> tuple[int, str | None]:
    """(exit code, why) of a Job's trainer: the container's own exit code when it terminated, else EXIT_NOT_RUN
    with what stopped it (a Job condition such as DeadlineExceeded, a waiting reason such as ImagePullBackOff, an
    unschedulable pod). `why` is None for a clean exit."""
    state = None
    for s in (pod and pod.status and pod.status.container_statuses) or []:
        if s.name == CONTAINER:
            state = s.state
    if state is not None and state.terminated is not None:
        t = state.terminated
        if t.exit_code == 0:
            return 0, None
        detail = f"{t.reason or 'no reason given'}{': ' + t.message if t.message else ''}"
        return t.exit_code, f"trainer container exited {t.exit_code} ({detail})"
    reasons = []
    for c in (job and job.status and job.status.conditions) or []:
        if c.type == "Failed" and c.status == "True":
            reasons.append(f"job failed: {c.reason}: {c.message}")
    if state is not None and state.waiting is not None:
        reasons.append(f"container waiting: {state.waiting.reason}: {state.waiting.message}")
    if pod is None:
        reasons.append("no pod was created for the job")
    elif pod.status is not None:
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status != "True":
                reasons.append(f"pod not scheduled: {c.reason}: {c.message}")
        if not reasons:
            reasons.append(f"pod phase {pod.status.phase}: {pod.status.reason or ''} {pod.status.message or ''}".strip())
    return EXIT_NOT_RUN, "the trainer never ran to its end: " + "; ".join(reasons)
