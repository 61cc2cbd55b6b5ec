"""The trainer as a Kubernetes Job: the flow uploads the spec to the object store, creates a batch/v1 Job
(k8s_manifest.render_job) that runs `python -m training.job <command> store:<key>` on a training node, waits for
it, copies its pod's log into the train log, maps the pod's exit code back, and deletes the Job.

The flow needs Kubernetes credentials: its pod's service account (in-cluster, bound to
infra/prefect/trainer-launcher-rbac.yaml) or, outside the cluster, a kubeconfig (trainer.kubernetes.kube_context).
The pod's log is copied once the Job has finished; follow it live with `kubectl logs -f job/<name>`.

A stop request (the run's lease revoked) suspends the Job, as Kueue preempts one: Kubernetes deletes its pod,
whose trainer gets SIGTERM, checkpoints and exits EXIT_PREEMPTED (training/preemption.py); the pod's
terminationGracePeriodSeconds bounds how long it may take before the kill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from tidal.kube import api_client
from training.job_spec import EXIT_PREEMPTED
from training.launch.base import EXIT_NOT_RUN, STORE_REF, LaunchError, StopSignal, TrainerLauncher, note, spec_key
from training.launch.k8s_manifest import CONTAINER, job_finished, job_labels, job_name, outcome, render_job

if TYPE_CHECKING:
    from tidal.store import ObjectStore
    from training.job_spec import TrainJob
    from training.train_settings import KubernetesJobSettings

WAIT_GRACE_S = 300  # past activeDeadlineSeconds, time for Kubernetes to stop the pod and mark the Job Failed
MAX_API_ERRORS = 6  # consecutive failed status reads (an API server restart) before the wait gives up
STOP_SLACK_S = 60  # past a stop's grace period, time for Kubernetes to report the pod's end


class KubernetesLauncher(TrainerLauncher):
    name = "kubernetes"

    def __init__(
        self,
        cfg: KubernetesJobSettings,
        store: ObjectStore,
        apis: tuple[Any, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """`apis`: (BatchV1Api, CoreV1Api); None = connect on first use (in-cluster, else kubeconfig)."""
        self.cfg, self.store, self._apis, self.clock, self.sleep = cfg, store, apis, clock, sleep

    def _connect(self) -> tuple[Any, Any]:
        from kubernetes import client

        api = api_client(
            self.cfg.kube_context,
            LaunchError,
            "trainer.launcher 'kubernetes'",
            "run the flow in a pod with a service account token, or point "
            "KUBECONFIG/trainer.kubernetes.kube_context at the cluster",
        )
        return client.BatchV1Api(api), client.CoreV1Api(api)

    def _run(self, command: str, spec: TrainJob, spec_path: Path, log: BinaryIO, stop: StopSignal | None) -> int:
        from kubernetes.client import V1Job
        from kubernetes.client.exceptions import ApiException

        key = spec_key(spec)
        self.store.put_file(spec_path, key)  # the pod reads its spec where it reads everything else
        name, ns = job_name(command, spec), self.cfg.namespace
        manifest = render_job(self.cfg, name=name, command=command, spec_ref=STORE_REF + key, labels=job_labels(command, spec))
        if self._apis is None:
            self._apis = self._connect()
        batch, core = self._apis
        try:
            batch.create_namespaced_job(ns, V1Job.from_dict(manifest))
        except ApiException as e:
            raise LaunchError(
                f"could not create trainer Job {ns}/{name}: {e.status} {e.reason}: {_message(e)}. "
                "Check the namespace exists and the flow's service account may create Jobs there "
                "(infra/prefect/trainer-launcher-rbac.yaml)"
            ) from e
        note(log, f"job {ns}/{name}: {' '.join(manifest['spec']['template']['spec']['containers'][0]['command'])}")
        try:
            job, waited = self._wait(batch, name, stop)
            if stop is not None and stop.event.is_set() and not (job is not None and job_finished(job)):
                return self._stop(batch, core, name, stop, log)
            pod = self._pod(core, name)
            self._copy_log(core, pod, log)
            code, why = outcome(job, pod)
            if job is None or not job_finished(job):  # Kubernetes never ended it: stop it here (finally) and retry
                code, why = (
                    EXIT_NOT_RUN,
                    (
                        f"job {name} not finished after {waited:.0f} s (activeDeadlineSeconds "
                        f"{self.cfg.active_deadline_s} + {WAIT_GRACE_S}); {why or 'its pod exited 0'}"
                    ),
                )
            if why:
                note(log, why)
            return code
        finally:
            self._delete(batch, name, log)

    def _wait(self, batch: Any, name: str, stop: StopSignal | None = None) -> tuple[Any, float]:
        """The Job once finished (or when the wait gives up, or a stop is requested), and the seconds waited."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        start, errors, job = self.clock(), 0, None
        while True:
            try:
                job, errors = batch.read_namespaced_job_status(name, self.cfg.namespace), 0
            except (ApiException, HTTPError, OSError) as e:
                errors += 1
                if errors >= MAX_API_ERRORS:
                    raise LaunchError(
                        f"lost the Kubernetes API while waiting for trainer Job {self.cfg.namespace}/{name} "
                        f"({e}); check `kubectl get job {name}` before running the flow again, so that "
                        "two trainers never write the same run"
                    ) from e
            if job is not None and job_finished(job):
                return job, self.clock() - start
            if stop is not None and stop.event.is_set():
                return job, self.clock() - start
            if self.clock() - start > self.cfg.active_deadline_s + WAIT_GRACE_S:
                return job, self.clock() - start
            self.sleep(self.cfg.poll_s)

    def _stop(self, batch: Any, core: Any, name: str, stop: StopSignal, log: BinaryIO) -> int:
        """Suspend the Job and wait for its pod to end: the trainer's exit code, or EXIT_PREEMPTED for a pod gone
        (or still ending past the grace period, when the Job's deletion finishes it) before its code was read."""
        note(log, f"stop requested: job {name} suspended (SIGTERM to its pod; its grace period bounds the checkpoint)")
        batch.patch_namespaced_job(name, self.cfg.namespace, {"spec": {"suspend": True}})
        deadline = self.clock() + stop.grace_s + STOP_SLACK_S
        while self.clock() < deadline:
            pod = self._pod(core, name)
            if pod is None:
                return EXIT_PREEMPTED
            code, _ = outcome(None, pod)
            if code != EXIT_NOT_RUN:  # its container terminated
                self._copy_log(core, pod, log)
                return code
            self.sleep(self.cfg.poll_s)
        note(log, f"the pod of job {name} still ran {stop.grace_s + STOP_SLACK_S:g} s after the stop; deleted with the Job")
        return EXIT_PREEMPTED

    def _pod(self, core: Any, name: str) -> Any:
        """The Job's pod (the newest, should Kubernetes have replaced one), or None."""
        pods = core.list_namespaced_pod(self.cfg.namespace, label_selector=f"job-name={name}").items
        return max(pods, key=lambda p: p.metadata.creation_timestamp) if pods else None

    def _copy_log(self, core: Any, pod: Any, log: BinaryIO) -> None:
        from kubernetes.client.exceptions import ApiException

        if pod is None:
            return
        try:
            text = core.read_namespaced_pod_log(pod.metadata.name, self.cfg.namespace, container=CONTAINER)
        except ApiException as e:  # a container that never started has no log
            note(log, f"no log from pod {pod.metadata.name}: {e.status} {e.reason}")
            return
        if text:
            log.write(text.encode(errors="replace") + (b"" if text.endswith("\n") else b"\n"))
            log.flush()

    def _delete(self, batch: Any, name: str, log: BinaryIO) -> None:
        """Delete the Job and its pod (Background: the API's default for Jobs would orphan the pod)."""
        from kubernetes.client.exceptions import ApiException

        try:
            batch.delete_namespaced_job(name, self.cfg.namespace, propagation_policy="Background")
        except ApiException as e:
            if e.status != 404:
                note(log, f"job {name} not deleted ({e.status} {e.reason}); ttlSecondsAfterFinished removes it")


def _message(e: Exception) -> str:
    """The API server's own message (JSON body of a Status object) when there is one."""
    import json

    try:
        return json.loads(getattr(e, "body", "") or "{}").get("message") or str(e)
    except ValueError:
        return str(e)
