"""The interface between the fleet and where its engines run.

The fleet (serving/fleet.py) owns what is common: which versions each replica must serve, the served-weight
probe, adapter loading, health checks, crash back-off, scaling and the weight-update strategies. A runtime only
creates, replaces and removes a replica's engine and says where it answers:

    local        a vLLM subprocess of the supervisor on a port of fleet.base_port.. (local.py)
    kubernetes   a pod of one Deployment per (model, base version) (kubernetes.py, k8s_manifest.py)

A replica's life, whatever the runtime:  address() → start() → [probe, adapters, warm-up] → publish() (in
rotation) → ... lost()/discard() → start() again (a restart) ... → stop() (scaled down or retired).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.replica import Replica
    from tidal.registry import CheckpointCache, VersionInfo


class EngineRuntime(ABC):
    name: str = ""

    @abstractmethod
    def flavor(self) -> str:
        """'cpu' or 'cuda': the engine build replicas run (fails fast when it cannot be known)."""

    def checkpoints(self, cache: CheckpointCache) -> CheckpointCache:
        """What the supervisor reads checkpoints through: probe files, adapters it checks before loading."""
        return cache

    def address(self) -> tuple[str, int]:
        """(host, port) of a new replica, before its engine exists; ('', 0) when start() finds it."""
        return "", 0

    def prepare(self, model: str, base_version: int, replicas: int) -> None:
        """Once per model at fleet start, before its `replicas` replicas boot: clear what an earlier supervisor left."""

    @abstractmethod
    def start(self, replica: Replica, model_dir: Path, enable_lora: bool) -> None:
        """Give the replica an engine serving replica.base (model_dir: the supervisor's verified copy of it) and
        return once it answers /v1/models with the base's served name; sets replica.host/port. Raises on failure.
        The engine may not be fresh (a pod that outlived a supervisor): it serves only the base on return."""

    def engine_path(self, replica: Replica, info: VersionInfo, local_dir: Path) -> str:
        """The path of `info`'s checkpoint as the replica's engine reads it (for /v1/load_lora_adapter);
        local_dir is the supervisor's verified copy."""
        return str(local_dir)

    @abstractmethod
    def lost(self, replica: Replica) -> str | None:
        """Why the engine the replica was verified on is gone (exited, pod replaced, container restarted), or None.
        A lost engine serves nothing the fleet verified: the replica leaves rotation and boots again."""

    @abstractmethod
    def discard(self, replica: Replica) -> None:
        """The replica's current engine can no longer be trusted: make sure it serves nothing. The replica stays
        (a restart gives it a new engine); capacity is not given back."""

    @abstractmethod
    def stop(self, replica: Replica) -> None:
        """The replica goes for good (scale-down, a retired version, a failed first boot): its engine and the
        capacity it held are given back."""

    def observe(self) -> None:
        """Once per health pass, before lost() is asked for each replica (one read of the platform's state)."""

    def publish(self, replica: Replica) -> None:
        """Tell the platform whether the replica is in rotation (state 'ready'); called after state changes and
        once per health pass. Must not raise: the gateway's rotation is the fleet's, this is a mirror."""

    @abstractmethod
    def shutdown(self, replicas: list[Replica]) -> None:
        """The supervisor is stopping: what happens to the engines (local: stopped; kubernetes: they keep serving)."""


class ClusterError(RuntimeError):
    """The platform refused or could not answer a call the runtime needs (permissions, an unreachable API
    server); the message names the fix."""
