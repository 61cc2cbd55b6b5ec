"""A replica: one engine process serving one full checkpoint plus the LoRA versions loaded on it."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from serving import engine
from serving.engine import EngineClient
from serving.probe import ProbeReport, verify
from tidal.procs import ProcInfo, stop_group
from tidal.registry import CheckpointCache, VersionInfo
from tidal.settings import TidalSettings
from training.probe import load_probe

State = Literal["starting", "ready", "unhealthy", "crashed", "draining", "stopped", "failed"]


@dataclass
class Replica:
    model: str
    index: int  # stable within its model: names its log file and port slot
    port: int
    host: str
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
        return self.proc is None or self.proc.poll() is not None

    def status(self) -> dict:
        return {"name": self.name, "state": self.state, "url": self.url, "pid": self.pid,
                "base_version": self.base.version, "served": self.served(), "restarts": self.restarts,
                "last_error": self.last_error}


def boot(replica: Replica, settings: TidalSettings, checkpoints: CheckpointCache, enable_lora: bool) -> None:
    """Start the engine, wait for readiness, load adapters, probe every served version.

    Raises (and leaves no process behind) if any step fails: a replica is either fully verified or gone.
    """
    replica.state, replica.probes = "starting", []
    log = settings.log_dir / f"replica-{replica.name}.log"
    atol = settings.fleet.probe_atol
    try:
        base_dir = checkpoints.local_dir(replica.base)
        replica.proc, replica.info = engine.launch(
            settings.engine, replica.name, base_dir, [replica.base.served_name], replica.host, replica.port, enable_lora, log)
        engine.wait_ready(replica.url, settings.fleet.ready_timeout_s, replica.proc, str(log), f"replica {replica.name}",
                          replica.base.served_name)
        with replica.client() as client:
            replica.probes.append(verify(client, replica.base.served_name, base_dir, atol, replica.name))
            for info in list(replica.adapters.values()):
                path = checkpoints.local_dir(info)
                client.load_lora(info.served_name, path)
                replica.probes.append(verify(client, info.served_name, path, atol, replica.name))
        warm_up(replica, base_dir, settings.fleet.warmup_bursts)
    except BaseException:
        kill(replica)
        replica.state = "failed"
        raise
    replica.state, replica.health_failures, replica.last_error = "ready", 0, ""


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


def kill(replica: Replica, timeout: float = 10.0) -> None:
    if replica.proc is not None:
        stop_group(replica.proc.pid, timeout=timeout)
        replica.proc.wait(timeout=5)


def drain(replica: Replica, grace_s: float) -> None:
    """Leave rotation, let in-flight requests finish (the gateway stops picking a draining replica)."""
    replica.state = "draining"
    time.sleep(grace_s)
