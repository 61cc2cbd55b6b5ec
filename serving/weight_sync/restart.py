"""`restart`: rolling replacement of replicas by new engines started on the new full checkpoint.

One extra replica at a time (surge 1, like a Kubernetes rolling update): the new replica boots and
passes the probe before an old one is drained and stopped, so capacity never drops.
"""

from __future__ import annotations

from serving.probe import ProbeReport
from serving.weight_sync.base import StrategyUnavailable, WeightSync
from tidal.registry import VersionInfo


class RestartSync(WeightSync):
    name = "restart"

    def deploy(self, fleet, group, info: VersionInfo) -> list[ProbeReport]:
        if info.kind != "full":
            raise StrategyUnavailable(f"{info.served_name} is a LoRA adapter; use the 'lora' strategy or fold it into a full checkpoint")
        reports = []
        for old in list(group.replicas):
            new = fleet.boot_replica(group, base=info, adapters={})  # raises: old replicas keep serving
            reports += new.probes
            fleet.retire_replica(group, old)
        group.base, group.adapters, group.serving = info, {}, info.version
        return reports

    def retire(self, fleet, group, info: VersionInfo) -> None:
        if info.version == group.base.version:
            raise StrategyUnavailable(f"{info.served_name} is what the replicas run; deploy another version first")
        # Nothing is resident: with `restart`, only the running checkpoint is served.
