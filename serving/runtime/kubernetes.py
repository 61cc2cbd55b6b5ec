"""Engines as pods: one Deployment per (model, base version) (k8s_manifest.render_deployment), whose pods the
supervisor binds to its replicas, one pod per replica.

    start      the replica joins its Deployment (spec.replicas = the replicas that belong to it; the Deployment is
               created, or replaced when its template changed), then claims a pod of it that no other replica holds
               and whose engine answers /health; the replica's URL is the pod's IP. Adapters the pod serves from an
               earlier supervisor are unloaded. The fleet then probes it, loads and probes adapters, warms it up.
    publish    the pod's readiness gate follows the replica: True only while it is 'ready' (verified).
    lost       the pod is gone or terminating (deleted, evicted, node lost: Kubernetes makes another), or its engine
               container restarted (the kubelet's liveness restart): that engine serves none of the adapters and was
               never probed. The replica leaves rotation and boots again on the pod Kubernetes made or restarted.
    discard    deletes the replica's pod (a probe failure, a stuck engine): Kubernetes makes a fresh one.
    stop       marks the replica's pod as the one a scale-down removes (pod-deletion-cost), lowers spec.replicas;
               the Deployment goes once no replica belongs to it.
    shutdown   nothing: engines keep serving while the supervisor restarts; the next one adopts their pods.

The supervisor needs the Role of infra/helm/tidal/templates/fleet-supervisor-rbac.yaml (exactly these calls) and
must reach pod IPs (it runs in the cluster; outside, fleet.kubernetes.kube_context names the cluster).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_contracts.probe import PROBE_FILE
from serving.engine import EngineError
from serving.runtime.base import ClusterError, EngineRuntime
from serving.runtime.k8s_manifest import (
    DELETION_COST,
    DIGEST,
    GATE,
    engine_ready,
    engine_restarts,
    gate_value,
    render_deployment,
    selector,
    selector_text,
    terminating,
    trouble,
)
from serving.runtime.weights import fetch_remote
from tidal.kube import api_client
from tidal.procs import NotReady

if TYPE_CHECKING:
    from serving.replica import Replica
    from serving.settings import ServingSettings
    from tidal.registry import CheckpointCache, VersionInfo

log = logging.getLogger("tidal.fleet")
MERGE, STRATEGIC = "application/merge-patch+json", "application/strategic-merge-patch+json"


@dataclass
class Binding:
    pod: str
    uid: str
    restarts: int  # the engine container's restart count when the replica was verified on it
    epoch: int  # observe() passes begun before the binding: later snapshots may judge it


class ProbeFiles:
    """The supervisor's view of checkpoints when engines are pods: of a full checkpoint only its probe.json (the
    pod fetches the weights and checks them against the registered digest; a probe.json that does not belong to
    them fails the probe, so a mismatch means no traffic, never unverified traffic); an adapter whole, since
    refuse_non_finite reads its tensors before any pod loads it."""

    def __init__(self, cache: CheckpointCache):
        self.cache, self.store = cache, cache.store

    def local_dir(self, info: VersionInfo) -> Path:
        if info.kind != "full":
            return self.cache.local_dir(info)
        path = self.cache.cache_dir / info.key
        if not (path / PROBE_FILE).is_file():
            part = path / f".{PROBE_FILE}.{uuid.uuid4().hex}.part"  # replicas boot in parallel
            self.store.get_file(f"{info.key}/{PROBE_FILE}", part)
            part.replace(path / PROBE_FILE)
        return path


class KubernetesRuntime(EngineRuntime):
    name = "kubernetes"

    def __init__(
        self,
        settings: ServingSettings,
        apis: tuple[Any, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        fetcher: Callable[[str, VersionInfo], str] = fetch_remote,
    ):
        """`apis`: (AppsV1Api, CoreV1Api); None = connect on first use (in-cluster, else kubeconfig)."""
        self.settings, self.cfg = settings, settings.fleet.kubernetes
        self._apis, self.clock, self.sleep, self.fetcher = apis, clock, sleep, fetcher
        self._lock = threading.RLock()
        self._members: dict[str, set[str]] = {}  # Deployment → replicas that belong to it
        self._home: dict[str, str] = {}  # replica → its Deployment
        self._bound: dict[str, Binding] = {}  # replica → the pod it runs on
        self._synced: dict[str, str] = {}  # Deployment → template digest this process has made sure of
        self._scale: dict[str, int] = {}  # Deployment → spec.replicas as last read or set
        self._gates: dict[str, bool] = {}  # pod → gate value last set
        self._epochs = itertools.count(1)
        self._epoch = 0  # of the latest observe() that began
        self._pods: dict[str, Any] | None = None  # that pass's pods by name; None = unknown (API unreachable)
        self._pods_epoch = 0

    # ---- the API ---------------------------------------------------------------------------------
    @property
    def apis(self) -> tuple[Any, Any]:
        if self._apis is None:
            from kubernetes import client

            api = api_client(
                self.cfg.kube_context,
                ClusterError,
                "fleet.runtime 'kubernetes'",
                "run the supervisor in a pod whose service account mounts its token (the chart's fleet "
                "supervisor), or point KUBECONFIG/fleet.kubernetes.kube_context at the cluster",
            )
            self._apis = client.AppsV1Api(api), client.CoreV1Api(api)
        return self._apis

    def _call(self, what: str, fn: Callable, *args, missing_ok: bool = False, **kw) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kw)
        except ApiException as e:
            if missing_ok and e.status == 404:
                return None
            hint = (
                (
                    f"; the supervisor's service account may not do this in namespace {self.cfg.namespace} (the chart's "
                    "fleet-supervisor Role grants exactly what it calls)"
                )
                if e.status in (401, 403)
                else ""
            )
            raise ClusterError(f"{what}: {e.status} {e.reason}{hint}") from e
        except (HTTPError, OSError) as e:
            raise ClusterError(f"{what}: Kubernetes API unreachable ({e!r})") from e

    def _list_pods(self, labels: dict[str, str]) -> list[Any]:
        return self._call(
            "list engine pods", self.apis[1].list_namespaced_pod, self.cfg.namespace, label_selector=selector_text(labels)
        ).items

    # ---- EngineRuntime ---------------------------------------------------------------------------
    def flavor(self) -> str:
        return self.cfg.flavor(self.settings.engine.flavor)

    def checkpoints(self, cache: CheckpointCache) -> ProbeFiles:
        return ProbeFiles(cache)

    def prepare(self, model: str, base_version: int, replicas: int) -> None:
        """Deployments of the model an earlier supervisor left on other versions (a surge or an unfinished
        roll-out) serve nothing this one knows of: they go. The base's keeps at most `replicas` pods, which start()
        adopts."""
        apps, ns = self.apis[0], self.cfg.namespace
        found = self._call(
            "list engine Deployments",
            apps.list_namespaced_deployment,
            ns,
            label_selector=selector_text(selector(self.cfg.instance, model)),
        ).items
        for d in found:
            if (d.metadata.labels or {}).get("tidal.dev/version") == str(base_version):
                if (d.spec.replicas or 0) > replicas:
                    with self._lock:
                        self._patch_replicas(d.metadata.name, replicas)
            else:
                log.warning(
                    "deleting engine Deployment %s: left by an earlier supervisor, %s serves v%d",
                    d.metadata.name,
                    model,
                    base_version,
                )
                self._call(
                    f"delete Deployment {d.metadata.name}",
                    apps.delete_namespaced_deployment,
                    d.metadata.name,
                    ns,
                    propagation_policy="Background",
                    missing_ok=True,
                )

    def start(self, replica: Replica, model_dir: Path, enable_lora: bool) -> None:
        manifest = render_deployment(
            self.cfg, self.settings.engine, model=replica.model, base=replica.base, enable_lora=enable_lora, replicas=0
        )
        dep = manifest["metadata"]["name"]
        with self._lock:
            self._unbind(replica)
            home = self._home.get(replica.name)
            if home != dep:  # new, or restarted onto the group's new base
                self._home[replica.name] = dep
                self._members.setdefault(dep, set()).add(replica.name)
                if home:
                    self._members[home].discard(replica.name)
                    self._shrink(home)
            self._grow(dep, manifest)
        self._claim(replica, dep, selector(self.cfg.instance, replica.model, replica.base.version))
        with replica.client() as client:
            served = client.models()
            if replica.base.served_name not in served:
                raise EngineError(f"pod {replica.pod} serves {served}, not {replica.base.served_name}")
            for name in set(served) - {replica.base.served_name}:  # loaded by an earlier supervisor: unverified here
                log.info("replica %s: unloading %s, left on pod %s", replica.name, name, replica.pod)
                client.unload_lora(name)

    def engine_path(self, replica: Replica, info: VersionInfo, local_dir: Path) -> str:
        return self.fetcher(f"http://{replica.host}:{self.cfg.weights_port}", info)

    def observe(self) -> None:
        with self._lock:
            self._epoch = epoch = next(self._epochs)
        try:
            pods = self._list_pods(selector(self.cfg.instance))
        except ClusterError as e:  # /health checks go on; nothing is judged lost on no information
            log.warning("cannot read engine pods: %s", e)
            with self._lock:
                self._pods = None
            return
        with self._lock:
            self._pods, self._pods_epoch = {p.metadata.name: p for p in pods}, epoch
            self._gates = {k: v for k, v in self._gates.items() if k in self._pods}

    def lost(self, replica: Replica) -> str | None:
        with self._lock:
            b, pods = self._bound.get(replica.name), self._pods
            if b is None:
                return "its pod is no longer known"
            if pods is None or b.epoch >= self._pods_epoch:  # no snapshot, or one older than the binding
                return None
            pod = pods.get(b.pod)
            if pod is None or pod.metadata.uid != b.uid:
                why = f"pod {b.pod} is gone (deleted, evicted or its node lost)"
            elif terminating(pod):
                why = f"pod {b.pod} is terminating (phase {pod.status.phase if pod.status else '?'})"
            elif engine_restarts(pod) > b.restarts:
                why = f"the engine container of pod {b.pod} restarted: the new engine is unverified and serves no adapter"
            else:
                return None
            self._unbind(replica)
        if pod is not None and pod.metadata.uid == b.uid and not terminating(pod):
            self._set_gate(b.pod, False, "EngineRestarted", why)
        return why

    def discard(self, replica: Replica) -> None:
        with self._lock:
            b = self._unbind(replica)
        if b is not None:
            self._set_gate(b.pod, False, "Discarded", replica.last_error or "the supervisor no longer trusts this engine")
            log.info("replica %s: deleting pod %s; its Deployment makes a fresh one", replica.name, b.pod)
            self._call(f"delete pod {b.pod}", self.apis[1].delete_namespaced_pod, b.pod, self.cfg.namespace, missing_ok=True)

    def stop(self, replica: Replica) -> None:
        with self._lock:
            b = self._unbind(replica)
            if b is not None:  # the scale-down removes this pod rather than a verified one
                self._set_gate(b.pod, False, "Retired", "scaled down or version retired")
                self._call(
                    f"mark pod {b.pod} for removal",
                    self.apis[1].patch_namespaced_pod,
                    b.pod,
                    self.cfg.namespace,
                    {"metadata": {"annotations": {DELETION_COST: "-1000000"}}},
                    _content_type=MERGE,
                    missing_ok=True,
                )
            home = self._home.pop(replica.name, None)
            if home is not None:
                self._members[home].discard(replica.name)
                self._shrink(home)

    def publish(self, replica: Replica) -> None:
        b = self._bound.get(replica.name)
        if b is not None:
            ready = replica.state == "ready"
            self._set_gate(
                b.pod,
                ready,
                "ProbePassed" if ready else replica.state.capitalize(),
                f"replica {replica.name}: " + ("served weights verified" if ready else replica.last_error or replica.state),
            )

    def shutdown(self, replicas: list[Replica]) -> None:
        log.info("supervisor stopping: %d engine pods keep serving; the next supervisor adopts them", len(self._bound))

    # ---- Deployments and pods --------------------------------------------------------------------
    def _unbind(self, replica: Replica) -> Binding | None:
        replica.pod = ""  # the replica's engine is gone for the fleet (Replica.exited)
        return self._bound.pop(replica.name, None)

    def _grow(self, dep: str, manifest: dict) -> None:
        """Make the Deployment exist with this template and at least one pod per replica that belongs to it (under
        self._lock). Never fewer: replicas joining one by one must not remove the pods others are about to adopt."""
        apps, ns = self.apis[0], self.cfg.namespace
        want, digest = len(self._members[dep]), manifest["metadata"]["annotations"][DIGEST]
        if self._synced.get(dep) != digest:
            from kubernetes.client import V1Deployment

            current = self._call(f"read Deployment {dep}", apps.read_namespaced_deployment, dep, ns, missing_ok=True)
            self._synced[dep] = digest
            have = (current.spec.replicas or 0) if current is not None else 0
            if current is None or (current.metadata.annotations or {}).get(DIGEST) != digest:
                manifest["spec"]["replicas"] = self._scale[dep] = max(want, have)
                if current is None:
                    self._call(
                        f"create Deployment {dep}", apps.create_namespaced_deployment, ns, V1Deployment.from_dict(manifest)
                    )
                else:
                    log.warning("engine Deployment %s: template changed; its pods are replaced one at a time", dep)
                    self._call(
                        f"replace Deployment {dep}", apps.replace_namespaced_deployment, dep, ns, V1Deployment.from_dict(manifest)
                    )
                return
            self._scale[dep] = have
        if want > self._scale.get(dep, 0):
            self._patch_replicas(dep, want)

    def _shrink(self, dep: str) -> None:
        """One pod per replica that still belongs to the Deployment; none left: it goes (under self._lock)."""
        want = len(self._members.get(dep, ()))
        if want:
            self._patch_replicas(dep, want)
            return
        self._synced.pop(dep, None)
        self._scale.pop(dep, None)
        self._call(
            f"delete Deployment {dep}",
            self.apis[0].delete_namespaced_deployment,
            dep,
            self.cfg.namespace,
            propagation_policy="Background",
            missing_ok=True,
        )

    def _patch_replicas(self, dep: str, n: int) -> None:
        self._call(
            f"scale Deployment {dep}",
            self.apis[0].patch_namespaced_deployment,
            dep,
            self.cfg.namespace,
            {"spec": {"replicas": n}},
            _content_type=MERGE,
        )
        self._scale[dep] = n

    def _claim(self, replica: Replica, dep: str, labels: dict[str, str]) -> None:
        """Bind the replica to a ready pod of its Deployment that no other replica holds; wait for one."""
        start, pods = self.clock(), []
        while True:
            pods = self._list_pods(labels)
            with self._lock:
                taken = {b.pod for b in self._bound.values()}
                free = sorted(
                    (p for p in pods if engine_ready(p) and p.metadata.name not in taken),
                    key=lambda p: (p.metadata.creation_timestamp or datetime.min.replace(tzinfo=UTC), p.metadata.name),
                )
                if free:
                    pod = free[0]
                    self._bound[replica.name] = Binding(pod.metadata.name, pod.metadata.uid, engine_restarts(pod), self._epoch)
                    replica.host, replica.port, replica.pod = pod.status.pod_ip, self.cfg.port, pod.metadata.name
                    break
            if self.clock() - start >= self.cfg.ready_timeout_s:
                waiting = [trouble(p) for p in pods if p.metadata.name not in taken] or ["no pod of it exists"]
                raise NotReady(
                    f"replica {replica.name}: no pod of Deployment {self.cfg.namespace}/{dep} ready after "
                    f"{self.cfg.ready_timeout_s:.0f} s (fleet.kubernetes.ready_timeout_s): {'; '.join(waiting[:4])}; "
                    f"see `kubectl -n {self.cfg.namespace} describe deployment {dep}`"
                )
            self.sleep(self.cfg.poll_s)
        if (pod.metadata.annotations or {}).get(DELETION_COST):  # marked by an earlier stop(): it serves again
            self._call(
                f"unmark pod {pod.metadata.name}",
                self.apis[1].patch_namespaced_pod,
                pod.metadata.name,
                self.cfg.namespace,
                {"metadata": {"annotations": {DELETION_COST: None}}},
                _content_type=MERGE,
                missing_ok=True,
            )
        if gate_value(pod):  # verified by an earlier supervisor or engine: not by this one, yet
            self._gates[pod.metadata.name] = True
            self._set_gate(pod.metadata.name, False, "Verifying", f"replica {replica.name}: served-weight probe running")

    def _set_gate(self, pod: str, value: bool, reason: str, message: str) -> None:
        """The pod's readiness gate; failures are logged, not raised (the next publish() tries again)."""
        if self._gates.get(pod) == value:
            return
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "status": {
                "conditions": [
                    {"type": GATE, "status": str(value), "reason": reason, "message": message[:500], "lastTransitionTime": now}
                ]
            }
        }
        try:
            self._call(
                f"set {GATE} on pod {pod}",
                self.apis[1].patch_namespaced_pod_status,
                pod,
                self.cfg.namespace,
                body,
                _content_type=STRATEGIC,
                missing_ok=True,
            )
        except ClusterError as e:
            log.warning("%s", e)
            return
        self._gates[pod] = value
