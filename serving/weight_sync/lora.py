"""`lora`: versions are adapters on the replicas' base checkpoint, loaded and unloaded at runtime.

Champion and candidate live side by side on the same replicas under names `MODEL@vN`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from serving.finite_weights import first_non_finite
from serving.probe import ProbeFailed, ProbeReport, verify
from serving.weight_sync.base import StrategyUnavailable, WeightSync
from tidal.registry import VersionInfo

log = logging.getLogger("tidal.fleet")


class LoraSync(WeightSync):
    name = "lora"

    def deploy(self, fleet, group, info: VersionInfo) -> list[ProbeReport]:
        if info.kind != "lora":
            raise StrategyUnavailable(
                f"{info.served_name} is a full checkpoint; the 'lora' strategy loads adapters only. "
                "Deploy full checkpoints with 'restart'."
            )
        if info.base_version != group.base.version:
            raise StrategyUnavailable(
                f"{info.served_name} is an adapter on v{info.base_version}, but the replicas run "
                f"v{group.base.version}; restart them on v{info.base_version} first"
            )
        path = fleet.checkpoints.local_dir(info)
        refuse_non_finite(info, path)
        tried, done, reports = [], [], []
        try:
            for replica in group.ready_replicas():
                tried.append(replica)
                with replica.client() as client:
                    client.load_lora(info.served_name, fleet.runtime.engine_path(replica, info, path))
                    done.append(replica)
                    atol = fleet.settings.fleet.probe_tolerance(fleet.settings.engine)
                    reports.append(verify(client, info.served_name, path, atol, replica.name))
                replica.adapters[info.version] = info
        except BaseException:
            for replica in tried:
                if replica in done:  # unverified weights must not stay loaded anywhere
                    replica.adapters.pop(info.version, None)
                    try:
                        with replica.client() as client:
                            client.unload_lora(info.served_name)
                    except Exception as e:  # noqa: BLE001  still_sound restarts an engine that cannot unload
                        log.warning("replica %s could not unload %s: %s", replica.name, info.served_name, e)
                still_sound(fleet, group, replica)  # a load that failed inside the engine may have broken it too
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


def refuse_non_finite(info: VersionInfo, path: Path) -> None:
    """Refuse an adapter holding NaN/inf before any engine loads it: on vLLM's CPU LoRA kernels such an
    adapter poisoned the replica's base outputs even after it was unloaded (measured)."""
    for f in sorted(path.glob("*.safetensors")):
        name = first_non_finite(f)
        if name is not None:
            raise ProbeFailed(
                f"{info.served_name}: adapter weights hold non-finite values ({f.name}: {name}); "
                "refused before loading: retrain it, or check the trainer's output"
            )


def still_sound(fleet, group, replica) -> None:
    """After a failed load, the replica must still serve its base exactly; if not, it is restarted clean."""
    try:
        with replica.client() as client:
            verify(
                client,
                group.base.served_name,
                fleet.checkpoints.local_dir(group.base),
                fleet.settings.fleet.probe_tolerance(fleet.settings.engine),
                replica.name,
            )
    except Exception as e:  # noqa: BLE001  any failure: the engine is not trusted any more
        log.warning("replica %s failed its base probe after a failed load (%s); restarting it", replica.name, e)
        fleet.restart_replica(group, replica, f"base probe failed after a failed load: {e}")
