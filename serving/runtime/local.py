"""Engines as local subprocesses of the supervisor, one port each from fleet.base_port (the default runtime)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from serving import engine
from serving.runtime.base import EngineRuntime
from tidal.procs import PortInUse, port_free, stop_group

if TYPE_CHECKING:
    from serving.replica import Replica
    from serving.settings import ServingSettings


def kill(replica: Replica, timeout: float = 10.0) -> None:
    """Stop the engine's whole process group (its EngineCore and workers outlive a killed API server)."""
    if replica.proc is not None:
        stop_group(replica.proc.pid, timeout=timeout)
        replica.proc.wait(timeout=5)


class LocalRuntime(EngineRuntime):
    name = "local"

    def __init__(self, settings: ServingSettings):
        self.settings = settings
        self._ports: set[int] = set()
        self._lock = threading.Lock()

    def flavor(self) -> str:
        return engine.engine_flavor(self.settings.engine)  # fails fast when the engine environment is missing

    def address(self) -> tuple[str, int]:
        f = self.settings.fleet
        with self._lock:
            for port in range(f.base_port, f.base_port + f.port_range):
                if port not in self._ports and port_free(f.host, port):
                    self._ports.add(port)
                    return f.host, port
        raise PortInUse(
            f"no free replica port in [{f.base_port}, {f.base_port + f.port_range}); raise fleet.port_range or move fleet.base_port"
        )

    def start(self, replica: Replica, model_dir: Path, enable_lora: bool) -> None:
        log = self.settings.log_dir / f"replica-{replica.name}.log"
        strategy = next((m.update_strategy for m in self.settings.models if m.name == replica.model), "")
        replica.proc, replica.info = engine.launch(
            self.settings.engine,
            replica.name,
            model_dir,
            [replica.base.served_name],
            replica.host,
            replica.port,
            enable_lora,
            log,
            update_strategy=strategy,
        )  # nccl: the weight-transfer flag; reload/nccl: any version's served name
        engine.wait_ready(
            replica.url,
            self.settings.fleet.ready_timeout_s,
            replica.proc,
            str(log),
            f"replica {replica.name}",
            replica.base.served_name,
        )

    def lost(self, replica: Replica) -> str | None:
        if not replica.exited():
            return None
        return f"engine exited with code {replica.proc.returncode if replica.proc else '?'}"

    def discard(self, replica: Replica) -> None:
        kill(replica)

    def stop(self, replica: Replica) -> None:
        kill(replica)
        with self._lock:
            self._ports.discard(replica.port)

    def shutdown(self, replicas: list[Replica]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
            list(pool.map(kill, replicas))
