"""`restart`: versions are full checkpoints, each served by engines started on it.

    deploy(candidate)      one surge replica boots on the candidate beside the group's replicas, which
                           keep serving the champion: the canary arm has its own engine, the control arm
                           keeps its capacity (surge 1, like a Kubernetes rolling update's maxSurge).
    retire(candidate)      its surge replicas drain and stop (a rollback).
    retire(group's base)   a rolling replacement onto the newest deployed version (a promotion's unload
                           step): a replica on it boots and passes the probe before an old one drains,
                           so capacity never drops; the surge replica counts towards the group's size.

A version that no replica runs cannot be served: with nothing else deployed, the base cannot retire.
"""

from __future__ import annotations

from serving.probe import ProbeReport
from serving.weight_sync.base import StrategyUnavailable, WeightSync
from tidal.registry import VersionInfo


class RestartSync(WeightSync):
    name = "restart"

    def deploy(self, fleet, group, info: VersionInfo) -> list[ProbeReport]:
        if info.kind != "full":
            raise StrategyUnavailable(
                f"{info.served_name} is a LoRA adapter; use the 'lora' strategy or fold it into a full checkpoint"
            )
        running = [r for r in group.live_replicas() if r.base.version == info.version]
        if running:  # already served (the base, or a surge replica): nothing to boot
            return [p for r in running for p in r.probes]
        new = fleet.boot_replica(group, base=info, adapters={})  # raises (and stops it): the others keep serving
        group.surge[info.version] = info
        return list(new.probes)

    def retire(self, fleet, group, info: VersionInfo) -> None:
        if info.version != group.base.version:
            group.surge.pop(info.version, None)
            for r in [r for r in group.replicas if r.base.version == info.version]:
                fleet.retire_replica(group, r)
            return
        if not group.surge:
            raise StrategyUnavailable(f"{info.served_name} is what the replicas run; deploy another version first")
        new = group.surge[max(group.surge)]
        for old in [r for r in group.replicas if r.base.version == info.version]:
            if len([r for r in group.replicas if r.base.version == new.version]) < max(group.desired, 1):
                fleet.boot_replica(group, base=new, adapters={})  # raises: the remaining old replicas keep serving
            fleet.retire_replica(group, old)
        group.surge.pop(new.version)
        group.base, group.adapters, group.serving = new, {}, new.version
