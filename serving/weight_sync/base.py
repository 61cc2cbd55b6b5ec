"""The interface every weight-update strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from serving.probe import ProbeReport
from tidal.registry import VersionInfo

if TYPE_CHECKING:
    from serving.fleet import Fleet, ModelGroup


class StrategyUnavailable(RuntimeError):
    """The strategy cannot run here (wrong engine build, wrong version kind); the message says what to use."""


class WeightSync(ABC):
    name: str = ""
    gpu_only: bool = False
    cpu_reason: str = ""  # why a GPU-only strategy refuses CPU engines

    def check_engine(self, flavor: str) -> None:
        if self.gpu_only and flavor != "cuda":
            raise StrategyUnavailable(
                f"update strategy {self.name!r} needs a CUDA engine: {self.cpu_reason}. Use 'lora' or 'restart' with CPU engines."
            )

    @abstractmethod
    def deploy(self, fleet: Fleet, group: ModelGroup, info: VersionInfo) -> list[ProbeReport]:
        """Make `info` servable on every ready replica of the group; verified before it returns."""

    @abstractmethod
    def retire(self, fleet: Fleet, group: ModelGroup, info: VersionInfo) -> None:
        """Stop serving `info` (never the version the replicas' engines run)."""
