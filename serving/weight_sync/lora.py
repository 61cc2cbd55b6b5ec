"""`lora`: versions are adapters on the replicas' base checkpoint, loaded and unloaded at runtime.

Champion and candidate live side by side on the same replicas under names `MODEL@vN`.
"""

from __future__ import annotations

from serving.probe import ProbeReport, verify
from serving.weight_sync.base import StrategyUnavailable, WeightSync
from tidal.registry import VersionInfo


class LoraSync(WeightSync):
    name = "lora"

    def deploy(self, fleet, group, info: VersionInfo) -> list[ProbeReport]:
        if info.kind != "lora":
            raise StrategyUnavailable(f"{info.served_name} is a full checkpoint; the 'lora' strategy loads adapters only. "
                                      "Deploy full checkpoints with 'restart'.")
        if info.base_version != group.base.version:
            raise StrategyUnavailable(f"{info.served_name} is an adapter on v{info.base_version}, but the replicas run "
                                      f"v{group.base.version}; restart them on v{info.base_version} first")
        path = fleet.checkpoints.local_dir(info)
        done, reports = [], []
        try:
            for replica in group.ready_replicas():
                with replica.client() as client:
                    client.load_lora(info.served_name, path)
                    done.append(replica)
                    reports.append(verify(client, info.served_name, path, fleet.settings.fleet.probe_atol, replica.name))
                replica.adapters[info.version] = info
        except BaseException:
            for replica in done:  # unverified weights must not stay loaded anywhere
                replica.adapters.pop(info.version, None)
                with replica.client() as client:
                    client.unload_lora(info.served_name)
            raise
        group.adapters[info.version] = info
        return reports

    def retire(self, fleet, group, info: VersionInfo) -> None:
        if info.version == group.base.version:
            raise StrategyUnavailable(f"{info.served_name} is the base the replicas run; it cannot be unloaded")
        group.adapters.pop(info.version, None)
        for replica in group.live_replicas():
            if replica.adapters.pop(info.version, None) is not None:
                with replica.client() as client:
                    client.unload_lora(info.served_name)
