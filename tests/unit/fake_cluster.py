"""A small stand-in for the cluster and the engines behind the fleet's Kubernetes runtime (tests only).

FakeCluster answers the AppsV1Api/CoreV1Api methods the runtime calls with real kubernetes client models and
plays the Deployment controller: it keeps spec.replicas pods per Deployment, removes the lowest
pod-deletion-cost first on a scale-down, and replaces a deleted pod. FakeEngine plays one pod's vLLM server: the
base it was started on, adapters loaded at runtime, greedy completions that reproduce the probe (or not, for an
engine that serves wrong weights). Everything that happens lands in `events`, in order.
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
import uuid
from datetime import UTC, datetime, timedelta

from kubernetes import client as k8s

from data_contracts.probe import ProbeItem, ProbeSet
from serving.engine import EngineError
from serving.runtime.k8s_manifest import DELETION_COST, ENGINE, GATE
from serving.runtime.kubernetes import MERGE, STRATEGIC

PROBE = ProbeSet(
    max_new_tokens=3,
    items=[
        ProbeItem(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6], logprobs=[-0.1, -0.2, -0.3]),
        ProbeItem(prompt_token_ids=[7, 8], completion_token_ids=[9, 9, 9], logprobs=[-1.0, -0.5, -0.25]),
    ],
)
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def matches(labels: dict | None, selector: str) -> bool:
    want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
    return want.items() <= (labels or {}).items()


def not_found() -> k8s.ApiException:
    return k8s.ApiException(status=404, reason="Not Found")


class FakeEngine:
    def __init__(self, events: list, ip: str, base: str, wrong: bool):
        self.events, self.ip, self.base, self.wrong = events, ip, base, wrong
        self.loaded: dict[str, str] = {base: ""}  # served name → path it was loaded from
        self.healthy = True

    def complete(self, model: str, ids: list[int]) -> tuple[list[int], list[float]]:
        if model not in self.loaded:
            raise EngineError(f"POST http://{self.ip}:8000/v1/completions -> 404: model {model} does not exist")
        self.events.append(("complete", self.ip, model))
        item = next(i for i in PROBE.items if i.prompt_token_ids == ids)
        return list(item.completion_token_ids), [x + (0.5 if self.wrong else 0.0) for x in item.logprobs]


class FakeCluster:
    def __init__(self, ready: bool = True):
        self.deployments: dict[str, k8s.V1Deployment] = {}
        self.pods: dict[str, k8s.V1Pod] = {}
        self.engines: dict[str, FakeEngine] = {}  # by pod IP
        self.owner: dict[str, str] = {}  # pod → Deployment
        self.calls: list[str] = []
        self.events: list[tuple] = []
        self.ready = ready  # False: new pods stay Pending, unschedulable
        self.wrong_weights = 0  # the next N pods created serve wrong weights
        self._n, self._ips = itertools.count(1), itertools.count(10)
        self.lock = threading.RLock()  # replicas boot in parallel threads: one API call at a time, as a server's store

    # ---- AppsV1Api ----
    def read_namespaced_deployment(self, name, namespace):
        self.calls.append("read_namespaced_deployment")
        if name not in self.deployments:
            raise not_found()
        return copy.deepcopy(self.deployments[name])

    def create_namespaced_deployment(self, namespace, body):
        self.calls.append("create_namespaced_deployment")
        assert isinstance(body, k8s.V1Deployment) and body.metadata.name not in self.deployments
        self.deployments[body.metadata.name] = copy.deepcopy(body)
        self.events.append(("create", body.metadata.name, body.spec.replicas))
        self._reconcile(body.metadata.name)
        return body

    def replace_namespaced_deployment(self, name, namespace, body):
        self.calls.append("replace_namespaced_deployment")
        assert isinstance(body, k8s.V1Deployment) and name in self.deployments
        self.deployments[name] = copy.deepcopy(body)
        self.events.append(("replace", name, body.spec.replicas))
        self._reconcile(name)
        return body

    def patch_namespaced_deployment(self, name, namespace, body, _content_type=None):
        self.calls.append("patch_namespaced_deployment")
        assert _content_type == MERGE and set(body) == {"spec"} and set(body["spec"]) == {"replicas"}
        if name not in self.deployments:
            raise not_found()
        self.deployments[name].spec.replicas = body["spec"]["replicas"]
        self.events.append(("scale", name, body["spec"]["replicas"]))
        self._reconcile(name)

    def delete_namespaced_deployment(self, name, namespace, propagation_policy=None):
        self.calls.append("delete_namespaced_deployment")
        assert propagation_policy == "Background"
        if self.deployments.pop(name, None) is None:
            raise not_found()
        self.events.append(("delete", name))
        for pod in [p for p, d in self.owner.items() if d == name]:
            self._remove(pod)

    def list_namespaced_deployment(self, namespace, label_selector):
        self.calls.append("list_namespaced_deployment")
        return k8s.V1DeploymentList(
            items=[copy.deepcopy(d) for d in self.deployments.values() if matches(d.metadata.labels, label_selector)]
        )

    # ---- CoreV1Api ----
    def list_namespaced_pod(self, namespace, label_selector):
        self.calls.append("list_namespaced_pod")
        return k8s.V1PodList(items=[copy.deepcopy(p) for p in self.pods.values() if matches(p.metadata.labels, label_selector)])

    def patch_namespaced_pod(self, name, namespace, body, _content_type=None):
        self.calls.append("patch_namespaced_pod")
        assert _content_type == MERGE and set(body) == {"metadata"}
        if name not in self.pods:
            raise not_found()
        meta = self.pods[name].metadata
        meta.annotations = {
            k: v for k, v in {**(meta.annotations or {}), **body["metadata"]["annotations"]}.items() if v is not None
        }

    def delete_namespaced_pod(self, name, namespace):
        self.calls.append("delete_namespaced_pod")
        if name not in self.pods:
            raise not_found()
        self.events.append(("delete-pod", name))
        dep = self.owner.get(name)
        self._remove(name)
        if dep in self.deployments:
            self._reconcile(dep)  # the ReplicaSet makes another

    def patch_namespaced_pod_status(self, name, namespace, body, _content_type=None):
        self.calls.append("patch_namespaced_pod_status")
        assert _content_type == STRATEGIC  # merges conditions by type; a JSON merge patch would drop the kubelet's
        if name not in self.pods:
            raise not_found()
        [cond] = body["status"]["conditions"]
        assert cond["type"] == GATE and cond["status"] in ("True", "False") and cond["reason"] and cond["lastTransitionTime"]
        status = self.pods[name].status
        others = [c for c in status.conditions or [] if c.type != GATE]
        status.conditions = [
            *others,
            k8s.V1PodCondition(type=GATE, status=cond["status"], reason=cond["reason"], message=cond["message"]),
        ]
        self.events.append(("gate", name, cond["status"] == "True"))

    # ---- what Kubernetes does on its own ----
    def _reconcile(self, dep: str) -> None:
        d = self.deployments[dep]
        mine = [p for p, owner in self.owner.items() if owner == dep]
        while len(mine) > d.spec.replicas:  # the ReplicaSet's choice: lowest deletion cost first, then newest

            def cost(p):
                meta = self.pods[p].metadata
                return int((meta.annotations or {}).get(DELETION_COST, 0)), -meta.creation_timestamp.timestamp()

            victim = min(mine, key=cost)
            mine.remove(victim)
            self._remove(victim)
        while len(mine) < d.spec.replicas:
            mine.append(self._new_pod(dep, d))

    def _new_pod(self, dep: str, d: k8s.V1Deployment) -> str:
        n = next(self._n)
        name, ip = f"{dep}-5d8f7c9b6-{n:05d}", f"10.0.0.{next(self._ips)}"
        wrong = self.wrong_weights > 0
        self.wrong_weights -= wrong
        if self.ready:
            status = k8s.V1PodStatus(
                phase="Running",
                pod_ip=ip,
                conditions=[],
                container_statuses=[
                    k8s.V1ContainerStatus(
                        name=ENGINE, image=d.spec.template.spec.containers[0].image, image_id="", ready=True, restart_count=0
                    )
                ],
            )
            self.engines[ip] = FakeEngine(self.events, ip, d.metadata.annotations["tidal.dev/served-name"], wrong)
        else:
            status = k8s.V1PodStatus(
                phase="Pending",
                conditions=[
                    k8s.V1PodCondition(
                        type="PodScheduled",
                        status="False",
                        reason="Unschedulable",
                        message="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    )
                ],
            )
        self.pods[name] = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(
                name=name,
                uid=str(uuid.uuid4()),
                labels=dict(d.spec.template.metadata.labels),
                creation_timestamp=T0 + timedelta(seconds=n),
            ),
            status=status,
        )
        self.owner[name] = dep
        self.events.append(("pod", name))
        return name

    def _remove(self, pod: str) -> None:
        p = self.pods.pop(pod)
        self.owner.pop(pod, None)
        self.engines.pop(p.status.pod_ip or "", None)

    # ---- test helpers ----
    def replace_pod(self, name: str) -> str:
        """The pod's node went away: Kubernetes deletes it and its Deployment makes another (returned)."""
        dep, before = self.owner[name], set(self.pods)
        self._remove(name)
        self._reconcile(dep)
        [new] = set(self.pods) - before
        return new

    def restart_engine(self, name: str) -> None:
        """The kubelet restarted the engine container in place (liveness): same pod, fresh engine."""
        pod = self.pods[name]
        pod.status.container_statuses[0].restart_count += 1
        old = self.engines[pod.status.pod_ip]
        self.engines[pod.status.pod_ip] = FakeEngine(self.events, old.ip, old.base, old.wrong)

    def of(self, dep: str) -> list[str]:
        return sorted(p for p, d in self.owner.items() if d == dep)

    def gate(self, pod: str) -> bool | None:
        for c in self.pods[pod].status.conditions or []:
            if c.type == GATE:
                return c.status == "True"
        return None


def _serialized(method):
    @functools.wraps(method)
    def call(self, *args, **kw):
        with self.lock:
            return method(self, *args, **kw)

    return call


for _name in [n for n in vars(FakeCluster) if "_namespaced_" in n]:  # every API call the runtime makes
    setattr(FakeCluster, _name, _serialized(getattr(FakeCluster, _name)))


def client_factory(cluster: FakeCluster):
    """An EngineClient stand-in reaching the fake engines by pod IP."""

    class FakeClient:
        def __init__(self, url: str, timeout: float = 60.0):
            self.url, self.ip = url, url.split("//")[1].split(":")[0]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def close(self):
            return None

        def _engine(self) -> FakeEngine:
            if self.ip not in cluster.engines:
                raise EngineError(f"{self.url} unreachable")
            return cluster.engines[self.ip]

        def healthy(self) -> bool:
            return self.ip in cluster.engines and cluster.engines[self.ip].healthy

        def models(self) -> list[str]:
            return sorted(self._engine().loaded)

        def load_lora(self, name, path):
            assert str(path).startswith("/models/checkpoints/"), path  # the pod's path, not the supervisor's
            self._engine().loaded[name] = str(path)
            cluster.events.append(("load", self.ip, name))

        def unload_lora(self, name):
            self._engine().loaded.pop(name)
            cluster.events.append(("unload", self.ip, name))

        def complete(self, model, prompt_token_ids, max_tokens):
            return self._engine().complete(model, prompt_token_ids)

        def score(self, model, prompt_token_ids, completion_token_ids):
            ids, logprobs = self._engine().complete(model, prompt_token_ids)  # teacher-forced on the probe's own tokens
            assert ids == completion_token_ids, (ids, completion_token_ids)
            return logprobs

    return FakeClient
