"""The trainer's Kubernetes launcher without a cluster: the Job manifest and the Prefect work pool template, validated
with the kubernetes client's own models; the exit-code mapping from real pod status objects; the launcher against a
minimal API double; its RBAC role against the calls it makes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from serving.kube_settings import KubernetesFleetSettings
from tests.unit.k8s_fixtures import as_model, round_trips
from tests.unit.terraform_hcl import CHART, ROOT, TF, load_dir
from tests.unit.trainer_fixtures import IMAGE, clean_env, spec  # noqa: F401  (clean_env: autouse fixture)
from tidal.store import LocalStore
from training.job_spec import EXIT_BAD_INPUT, EXIT_PREEMPTED, TrainJob
from training.launch import EXIT_NOT_RUN, STORE_REF, spec_key
from training.launch.base import StopSignal
from training.launch.k8s_manifest import CONTAINER, job_labels, job_name, outcome, render_job, trainer_command
from training.launch.kubernetes import KubernetesLauncher
from training.train_settings import KubernetesJobSettings

WORK_POOL = ROOT / "infra" / "prefect" / "kubernetes-work-pool.json"
RBAC = ROOT / "infra" / "prefect" / "trainer-launcher-rbac.yaml"


def trainer_job(gpus: int = 1, **cfg) -> dict:
    s = spec()
    return render_job(
        KubernetesJobSettings(image=IMAGE, gpus_per_node=gpus, **cfg),
        name=job_name("train", s),
        command="train",
        spec_ref=STORE_REF + spec_key(s),
        labels=job_labels("train", s),
    )


# ---- the trainer Job ------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_the_trainer_job_is_a_valid_v1_job(gpus):
    manifest = trainer_job(gpus, env={"NCCL_DEBUG": "WARN"}, env_from_secrets=["hf-token"], cpu_request=0.5)
    assert round_trips(manifest, "V1Job")
    job = as_model(manifest, "V1Job")
    assert (job.api_version, job.kind, job.metadata.namespace) == ("batch/v1", "Job", "tidal")
    assert job.spec.backoff_limit == 0 and job.spec.template.spec.restart_policy == "Never"  # retries belong to the flow
    assert job.spec.active_deadline_seconds and job.spec.ttl_seconds_after_finished is not None
    [c] = job.spec.template.spec.containers
    assert c.name == CONTAINER and c.image == IMAGE and c.resources.requests["cpu"] == "500m"
    assert {e.name: e.value for e in c.env}["TIDAL_CONFIG"] == "/etc/tidal/tidal.yaml"
    name = job.metadata.name
    assert len(name) <= 63 and name.startswith("tidal-train-tab-01234567-")
    assert name != job_name("train", spec())  # each attempt its own Job
    # preemptible: below serving, and a preempted pod (evicted, or exit 75 after its checkpoint) is no failure
    assert job.spec.template.spec.priority_class_name == "tidal-training"
    rules = job.spec.pod_failure_policy.rules
    assert [(r.action, r.on_pod_conditions[0].type) for r in rules if r.on_pod_conditions] == [("Ignore", "DisruptionTarget")]
    [codes] = [r.on_exit_codes for r in rules if r.on_exit_codes]
    assert (codes.container_name, codes.operator, codes.values) == (CONTAINER, "In", [EXIT_PREEMPTED])


def test_gpu_requests_and_limits_tolerations_and_node_selector():
    pod = as_model(trainer_job(1), "V1Job").spec.template.spec
    res = pod.containers[0].resources
    assert res.requests["nvidia.com/gpu"] == res.limits["nvidia.com/gpu"] == "1"
    assert {"cpu", "memory"} <= set(res.limits) and {"cpu", "memory"} <= set(res.requests)
    assert k8s.ApiClient().sanitize_for_serialization(pod.tolerations) == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    ]
    assert pod.node_selector == {"tidal.dev/pool": "training"}
    cpu_only = as_model(trainer_job(0), "V1Job").spec.template.spec.containers[0].resources
    assert "nvidia.com/gpu" not in cpu_only.requests and "nvidia.com/gpu" not in cpu_only.limits


def test_defaults_match_the_cluster_and_the_chart():
    """The training node group's label and taint (infra/terraform), the chart's trainer service account,
    settings ConfigMap, data_dir and uid."""
    cluster = load_dir(TF / "modules" / "cluster")["locals"]
    training = cluster["pools"]["training"]
    assert training["taints"] == "${local.gpu_taint}"
    [taint] = cluster["gpu_taint"].values()
    cfg = KubernetesJobSettings()
    [tol] = cfg.tolerations
    assert (tol.key, tol.value, tol.effect) == (taint["key"], taint["value"], "NoSchedule") and taint["effect"] == "NO_SCHEDULE"
    assert cfg.node_selector.items() <= training["labels"].items()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert cfg.service_account == values["serviceAccounts"]["trainer"]["name"]
    assert cfg.data_dir == values["settings"]["data_dir"]
    classes = values["priorityClasses"]
    assert cfg.priority_class == classes["training"]["name"] and classes["training"]["preemptionPolicy"] == "Never"
    assert KubernetesFleetSettings().priority_class == classes["serving"]["name"]
    assert classes["serving"]["value"] > classes["training"]["value"]
    template = (CHART / "templates" / "priorityclasses.yaml").read_text()
    assert "kind: PriorityClass" in template and "{{ $pc.name }}" in template
    assert f"name: {cfg.settings_configmap}" in (CHART / "templates" / "configmap.yaml").read_text()
    assert f'"uid" {cfg.run_as_user}' in (CHART / "templates" / "gateway-statefulset.yaml").read_text()


def test_the_trainer_container_is_locked_down():
    pod = as_model(trainer_job(1), "V1Job").spec.template.spec
    sc = pod.containers[0].security_context
    assert sc.run_as_non_root and sc.run_as_user and sc.run_as_user > 0
    assert sc.privileged is False and sc.allow_privilege_escalation is False and sc.read_only_root_filesystem
    assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add and sc.seccomp_profile.type == "RuntimeDefault"
    assert pod.security_context.run_as_non_root and not pod.host_network and not pod.host_pid
    assert pod.service_account_name == "tidal-trainer" and pod.automount_service_account_token is False
    mounts = {m.mount_path: m for m in pod.containers[0].volume_mounts}
    assert mounts["/etc/tidal"].read_only and {"/tmp", "/var/lib/tidal", "/dev/shm"} <= set(mounts)  # writable scratch only
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["settings"].config_map.name == "tidal-settings"
    assert all(v.empty_dir.size_limit for v in pod.volumes if v.empty_dir)  # scratch cannot fill the node's disk


def test_one_gpu_runs_python_several_run_torchrun():
    ref = STORE_REF + spec_key(spec())
    assert trainer_command(1, "gate", ref) == ["python", "-m", "training.job", "gate", ref]
    assert trainer_command(0, "train", ref)[0] == "python"
    job = as_model(trainer_job(4), "V1Job")
    c = job.spec.template.spec.containers[0]
    assert c.command == ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "4", "-m", "training.job", "train", ref]
    assert c.resources.limits["nvidia.com/gpu"] == "4"


# ---- exit codes from the pod ----------------------------------------------------------------------


def pod(state: k8s.V1ContainerState | None, phase: str = "Failed", conditions=None) -> k8s.V1Pod:
    statuses = (
        None
        if state is None
        else [k8s.V1ContainerStatus(name=CONTAINER, image=IMAGE, image_id="", ready=False, restart_count=0, state=state)]
    )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="p"),
        status=k8s.V1PodStatus(phase=phase, container_statuses=statuses, conditions=conditions),
    )


def job(kind: str, reason: str | None = None, message: str | None = None) -> k8s.V1Job:
    return k8s.V1Job(
        status=k8s.V1JobStatus(conditions=[k8s.V1JobCondition(type=kind, status="True", reason=reason, message=message)])
    )


def exited(code: int, reason: str = "Error") -> k8s.V1ContainerState:
    return k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=code, reason=reason))


@pytest.mark.parametrize("code", [0, 2, 3, 1, 137])
def test_the_containers_exit_code_is_the_trainers(code):
    got, why = outcome(job("Complete" if code == 0 else "Failed"), pod(exited(code, "OOMKilled" if code == 137 else "Error")))
    assert got == code and (why is None) == (code == 0)
    if code == 137:
        assert "OOMKilled" in why


def test_a_trainer_that_never_ran_is_a_crash_with_the_reason():
    waiting = k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason="ImagePullBackOff", message="not found"))
    code, why = outcome(
        job("Failed", "DeadlineExceeded", "Job was active longer than specified deadline"), pod(waiting, "Pending")
    )
    assert code == EXIT_NOT_RUN and "DeadlineExceeded" in why and "ImagePullBackOff" in why
    unschedulable = k8s.V1PodCondition(
        type="PodScheduled",
        status="False",
        reason="Unschedulable",
        message="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    )
    code, why = outcome(job("Failed", "DeadlineExceeded"), pod(None, "Pending", [unschedulable]))
    assert code == EXIT_NOT_RUN and "Insufficient nvidia.com/gpu" in why
    assert outcome(job("Failed", "BackoffLimitExceeded"), None)[0] == EXIT_NOT_RUN


# ---- the Kubernetes launcher against a minimal API double ------------------------------------------


class FakeApi:
    """The five BatchV1Api/CoreV1Api methods the launcher calls, answering with real client models: the Job's
    one pod has already ended with `code`, having printed `log` (code None: it runs forever; status_error: every
    status read fails as an API server restart would)."""

    def __init__(self, code: int | None, log: str, status_error: int | None = None):
        self.code, self.log, self.status_error, self.calls, self.jobs = code, log, status_error, [], {}

    def create_namespaced_job(self, namespace, body):
        self.calls.append("create_namespaced_job")
        self.jobs[body.metadata.name] = body
        return body

    def read_namespaced_job_status(self, name, namespace):
        self.calls.append("read_namespaced_job_status")
        if self.status_error:
            raise k8s.ApiException(status=self.status_error, reason="Service Unavailable")
        if self.code is None:
            return k8s.V1Job(status=k8s.V1JobStatus(active=1))
        return job("Complete" if self.code == 0 else "Failed")

    def list_namespaced_pod(self, namespace, label_selector):
        self.calls.append("list_namespaced_pod")
        assert label_selector.startswith("job-name=") and label_selector[9:] in self.jobs
        running = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning())
        return k8s.V1PodList(items=[pod(running, "Running") if self.code is None else pod(exited(self.code))])

    def read_namespaced_pod_log(self, name, namespace, container):
        self.calls.append("read_namespaced_pod_log")
        return self.log

    def patch_namespaced_job(self, name, namespace, body):
        self.calls.append("patch_namespaced_job")
        assert body == {"spec": {"suspend": True}} and name in self.jobs
        if self.code is None:  # its pod gets SIGTERM: the trainer checkpoints and exits
            self.code, self.log = EXIT_PREEMPTED, self.log + "stop requested; checkpointed iteration 3, exiting 75\n"

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.calls.append("delete_namespaced_job")
        assert propagation_policy in ("Background", "Foreground")  # the API's default orphans the pod
        del self.jobs[name]


def test_kubernetes_launcher_uploads_the_spec_runs_the_job_and_returns_its_exit_code(tmp_path):
    store, api, s = LocalStore(tmp_path / "store"), FakeApi(EXIT_BAD_INPUT, "error: dataset ds-1 has no rows\n"), spec()
    spec_path, log_path = tmp_path / "spec.json", tmp_path / "logs" / "train-tab.log"
    spec_path.write_text(s.model_dump_json())
    launcher = KubernetesLauncher(KubernetesJobSettings(image=IMAGE), store, apis=(api, api), sleep=lambda s: None)
    assert launcher.run("train", s, spec_path, log_path) == EXIT_BAD_INPUT
    assert TrainJob.model_validate_json((tmp_path / "store" / spec_key(s)).read_text()) == s  # where the pod reads it
    assert api.jobs == {} and api.calls[0] == "create_namespaced_job" and api.calls[-1] == "delete_namespaced_job"
    log = log_path.read_text()
    assert log.startswith(f"--- train {s.run_key}\n") and "store:training/model=tab/" in log
    assert "error: dataset ds-1 has no rows" in log and "exited 2" in log


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def launch(tmp_path: Path, api: FakeApi, stop: StopSignal | None = None, **cfg) -> tuple[int, str]:
    s, clock = spec(), Clock()
    (tmp_path / "spec.json").write_text(s.model_dump_json())
    launcher = KubernetesLauncher(
        KubernetesJobSettings(image=IMAGE, **cfg), LocalStore(tmp_path / "store"), apis=(api, api), clock=clock, sleep=clock.sleep
    )
    code = launcher.run("train", s, tmp_path / "spec.json", tmp_path / "train.log", stop)
    return code, (tmp_path / "train.log").read_text()


def test_a_job_kubernetes_never_ends_is_stopped_and_counts_as_a_crash(tmp_path):
    api = FakeApi(None, "iteration 1/40\n")
    code, log = launch(tmp_path, api, active_deadline_s=600, poll_s=30)
    assert code == EXIT_NOT_RUN and "not finished after" in log and "iteration 1/40" in log
    assert api.jobs == {} and api.calls.count("read_namespaced_job_status") > 600 // 30


def test_a_stop_request_suspends_the_job_and_returns_the_trainers_preempted_code(tmp_path):
    api = FakeApi(None, "iteration 3/40\n")  # runs until stopped
    stop = StopSignal(threading.Event(), grace_s=30)
    stop.event.set()
    code, log = launch(tmp_path, api, stop, poll_s=5)
    assert code == EXIT_PREEMPTED and "job tidal-train-tab-" in log and "suspended" in log
    assert "exiting 75" in log  # the pod's own log, copied
    assert api.calls.index("patch_namespaced_job") < api.calls.index("list_namespaced_pod") and api.jobs == {}


def test_losing_the_api_while_waiting_fails_without_retry_and_names_the_job(tmp_path):
    from training.launch import LaunchError

    api = FakeApi(0, "", status_error=503)
    with pytest.raises(LaunchError, match=r"kubectl get job tidal-train-tab-"):
        launch(tmp_path, api)
    assert api.calls[-1] == "delete_namespaced_job"  # tried to stop it all the same


def test_the_rbac_role_allows_exactly_what_the_launcher_calls(tmp_path):
    role, binding = yaml.safe_load_all(RBAC.read_text())
    assert round_trips(role, "V1Role") and round_trips(binding, "V1RoleBinding")
    api, s = FakeApi(0, "done\n"), spec()
    (tmp_path / "spec.json").write_text(s.model_dump_json())
    KubernetesLauncher(KubernetesJobSettings(image=IMAGE), LocalStore(tmp_path), apis=(api, api)).run(
        "gate", s, tmp_path / "spec.json", tmp_path / "log"
    )
    stopped, stop = FakeApi(None, ""), StopSignal(threading.Event(), 30)  # and a trainer stopped on request
    stop.event.set()
    assert launch(tmp_path, stopped, stop)[0] == EXIT_PREEMPTED
    api.calls += stopped.calls
    needs = {
        "patch_namespaced_job": ("batch", "jobs", "patch"),
        "create_namespaced_job": ("batch", "jobs", "create"),
        "read_namespaced_job_status": ("batch", "jobs/status", "get"),
        "list_namespaced_pod": ("", "pods", "list"),
        "read_namespaced_pod_log": ("", "pods/log", "get"),
        "delete_namespaced_job": ("batch", "jobs", "delete"),
    }
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert {needs[c] for c in api.calls} == granted
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert [(x["kind"], x["name"]) for x in binding["subjects"]] == [("ServiceAccount", KubernetesJobSettings().service_account)]


# ---- the Prefect work pool ------------------------------------------------------------------------


def render_pool(job_variables: dict) -> dict:
    """The flow-run Job the worker builds: variable defaults overlaid by a deployment's job variables,
    substituted into job_configuration by Prefect's own templating."""
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.templating import apply_values, find_placeholders

    template = json.loads(WORK_POOL.read_text())
    validate_base_job_template(template)  # what `prefect work-pool create` checks: every placeholder declared
    props = template["variables"]["properties"]
    values = {k: p["default"] for k, p in props.items() if p.get("default") is not None}  # as the worker takes them
    assert template["variables"]["required"] == ["image"] and "image" not in values  # every deployment names its image
    config = apply_values(template["job_configuration"], {**values, **job_variables})
    assert not find_placeholders(config)
    return config


def test_the_work_pool_renders_a_valid_job():
    config = render_pool({"image": IMAGE})
    manifest = config["job_manifest"]
    pod_spec = manifest["spec"]["template"]["spec"]
    # The Prefect worker refuses a manifest without these two (its own convention); the API server ignores them.
    assert (pod_spec.pop("parallelism"), pod_spec.pop("completions")) == (1, 1)
    assert manifest["metadata"]["generateName"] == "-"  # the worker puts the flow run's name in front
    assert round_trips(manifest, "V1Job")
    job = as_model(manifest, "V1Job")
    pod = job.spec.template.spec
    [c] = pod.containers
    assert c.name == "prefect-job" and c.image == IMAGE and pod.restart_policy == "Never" and job.spec.backoff_limit == 0
    assert job.metadata.namespace == "tidal" and pod.service_account_name == "tidal-flows"
    assert pod.automount_service_account_token is False and pod.node_selector == {"tidal.dev/pool": "cpu"}
    assert c.resources.limits == {"cpu": "2", "memory": "4Gi"} and c.resources.requests == {"cpu": "500m", "memory": "1Gi"}
    sc = c.security_context
    assert (
        sc.run_as_non_root and sc.read_only_root_filesystem and sc.privileged is False and sc.allow_privilege_escalation is False
    )
    assert {v.name: v.config_map.name for v in pod.volumes if v.config_map} == {"settings": "tidal-settings"}
    env = {e.name: e for e in c.env}
    assert env["TIDAL_CONFIG"].value == "/etc/tidal/tidal.yaml"
    assert env["TIDAL_ADMIN_TOKEN"].value_from.secret_key_ref.name == "tidal-gateway"
    assert config["namespace"] == "tidal" and config["env"] == {}


def test_a_train_deployment_gets_its_service_account_and_api_token():
    config = render_pool(
        {
            "image": IMAGE,
            "service_account_name": "tidal-trainer",
            "automount_service_account_token": True,
            "env": {"TIDAL_TRAINER__LAUNCHER": "kubernetes"},
            "memory_limit": "8Gi",
        }
    )
    pod = config["job_manifest"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tidal-trainer" and pod["automountServiceAccountToken"] is True
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "8Gi"
    assert config["env"] == {"TIDAL_TRAINER__LAUNCHER": "kubernetes"}  # the worker adds these to the container's env
