"""A replica: one engine (a local process or a pod, see serving/runtime/) serving one full checkpoint plus the LoRA
versions loaded on it, verified by the served-weight probe before it gets traffic."""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from data_contracts.probe import load_probe
from serving.engine import EngineClient
from serving.fleet_replies import ReplicaState, ReplicaStatus
from serving.probe import ProbeReport, verify
from serving.runtime.base import EngineRuntime
from serving.runtime.local import LocalRuntime, kill
from serving.settings import ServingSettings
from tidal.procs import ProcInfo
from tidal.registry import CheckpointCache, VersionInfo

State = ReplicaState  # serving/fleet_replies.py: the states the admin API reports


@dataclass
class Replica:
    model: str
    index: int  # stable within its model: names its log file and port slot
    port: int  # local: its own port; kubernetes: the engine port of the pod it is bound to (0 before)
    host: str  # local: fleet.host; kubernetes: the pod's IP ('' before)
    base: VersionInfo  # the full checkpoint the engine process was started on
    adapters: dict[int, VersionInfo] = field(default_factory=dict)  # LoRA versions loaded, by version
    state: State = "starting"
    proc: subprocess.Popen | None = None
    info: ProcInfo | None = None
    restarts: int = 0
    health_failures: int = 0
    restart_at: float = 0.0  # monotonic time of the next restart attempt after a crash
    last_error: str = ""
    probes: list[ProbeReport] = field(default_factory=list)
    pod: str = ""  # kubernetes: the pod the replica is bound to ('' while it has none)
    # guards state changes that depend on the state read before a slow step (a health check's HTTP call)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def move(self, expected: State, new: State) -> bool:
        """Set the state to `new` only if it is still `expected`: a health check that waited on the engine must
        not put back in rotation a replica that a weight move began draining meanwhile."""
        with self.lock:
            if self.state != expected:
                return False
            self.state = new
            return True

    def set_state(self, new: State) -> None:
        with self.lock:
            self.state = new

    @property
    def name(self) -> str:
        return f"{self.model}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def served(self) -> dict[str, int]:
        """Served model name → weight version; one name maps to exactly one version."""
        names = {self.base.served_name: self.base.version}
        names.update({v.served_name: v.version for v in self.adapters.values()})
        return names

    def client(self) -> EngineClient:
        return EngineClient(self.url)

    def exited(self) -> bool:
        if self.proc is None:
            return not self.pod  # a pod replica's engine runs while the replica is bound to its pod
        return self.proc.poll() is not None

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            name=self.name,
            state=self.state,
            url=self.url,
            pid=self.pid,
            base_version=self.base.version,
            served=self.served(),
            restarts=self.restarts,
            last_error=self.last_error,
            pod=self.pod,
        )


def boot(
    replica: Replica,
    settings: ServingSettings,
    checkpoints: CheckpointCache,
    enable_lora: bool,
    runtime: EngineRuntime | None = None,
) -> None:
    """Start the engine (through `runtime`, default a local subprocess), wait for readiness, load adapters, probe
    every served version, warm it up; only then is it 'ready' (in rotation).

    Raises (and leaves no engine serving) if any step fails: a replica is either fully verified or out of rotation.
    """
    runtime = runtime or LocalRuntime(settings)
    replica.state, replica.probes = "starting", []
    atol = settings.fleet.probe_tolerance(settings.engine)
    try:
        base_dir = checkpoints.local_dir(replica.base)
        runtime.start(replica, base_dir, enable_lora)
        with replica.client() as client:
            replica.probes.append(verify(client, replica.base.served_name, base_dir, atol, replica.name))
            for info in list(replica.adapters.values()):
                path = checkpoints.local_dir(info)
                client.load_lora(info.served_name, runtime.engine_path(replica, info, path))
                replica.probes.append(verify(client, info.served_name, path, atol, replica.name))
        warm_up(replica, base_dir, settings.fleet.warmup_bursts)
    except BaseException:
        runtime.discard(replica)
        replica.state = "failed"
        runtime.publish(replica)
        raise
    replica.state, replica.health_failures, replica.last_error = "ready", 0, ""
    runtime.publish(replica)


def warm_up(replica: Replica, base_dir, bursts: list[int], max_tokens: int = 16) -> None:
    """Sampled completions in concurrent bursts (sizes `bursts`) on the probe's prompts, cut to varied
    lengths, so the engine has seen batch and sequence shapes like traffic's before it gets any."""
    prompts = [item.prompt_token_ids for item in load_probe(base_dir).items]
    if not prompts or not bursts:
        return

    def one(i: int) -> None:
        ids = prompts[i % len(prompts)]
        with EngineClient(replica.url) as client:
            client.sample(replica.base.served_name, ids[: max(1, len(ids) - i % 7)], max_tokens)

    n = 0
    with ThreadPoolExecutor(max(bursts)) as pool:
        for size in bursts:
            list(pool.map(one, range(n, n + size)))
            n += size


def drain(replica: Replica, grace_s: float, runtime: EngineRuntime | None = None) -> None:
    """Leave rotation, let in-flight requests finish (the gateway stops picking a draining replica)."""
    replica.set_state("draining")
    if runtime is not None:
        runtime.publish(replica)
    time.sleep(grace_s)


__all__ = ["Replica", "boot", "drain", "kill", "warm_up"]
