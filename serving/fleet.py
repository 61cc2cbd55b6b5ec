"""The fleet: per model, N verified vLLM replicas; health checks, crash restarts with back-off, scaling,
and version deployment through the model's own weight-update strategy.

Where engines run is the runtime's business (serving/runtime/: local subprocesses or Kubernetes pods); everything
here is the same code path for both."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from data_contracts.suggestion_filter import from_tags
from serving.fleet_replies import FleetState, ModelStatus
from serving.probe import ProbeReport
from serving.replica import Replica, boot, drain
from serving.runtime import EngineRuntime, runtime_for
from serving.settings import ServingSettings
from serving.weight_sync import WeightSync, strategy_for
from tidal.model_settings import ModelSettings
from tidal.procs import write_json
from tidal.registry import CheckpointCache, Registry, RegistryError, VersionInfo
from tidal.section import SettingsError

log = logging.getLogger("tidal.fleet")
AWAIT_MODEL_S = 15.0  # how often a model with no version under its serve alias is looked up again


class NoServedVersion(RegistryError):
    """A configured model has no version under its serve alias yet (a new install before `tidal import`)."""


class ModelGroup:
    """One model's replicas and the versions they should serve."""

    def __init__(
        self, settings: ModelSettings, base: VersionInfo, adapters: dict[int, VersionInfo], strategy: WeightSync, serving: int
    ):
        self.settings, self.base, self.adapters, self.strategy = settings, base, adapters, strategy
        self.serving = serving  # the serve-alias version at start: the gateway's default control arm
        self.surge: dict[int, VersionInfo] = {}  # `restart`: versions on extra replicas beside the base (a canary)
        self.replicas: list[Replica] = []
        self.desired = 0
        self.next_index = 0
        self.lock = threading.RLock()  # one scale/deploy/restart at a time per model

    def ready_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "ready"]

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if not r.exited()]

    def base_replicas(self) -> list[Replica]:
        """Replicas running the group's base (what `desired` counts; surge replicas come on top)."""
        return [r for r in self.replicas if r.base.version == self.base.version]

    def status(self) -> ModelStatus:
        return ModelStatus(
            strategy=self.strategy.name,
            base_version=self.base.version,
            serving_version=self.serving,
            adapters=sorted(self.adapters),
            surge_versions=sorted(self.surge),
            desired_replicas=self.desired,
            replicas=[r.status() for r in self.replicas],
            suggestion_filters={
                info.version: f.min_first_logprob
                for info in (self.base, *self.adapters.values(), *self.surge.values())
                if (f := from_tags(info.tags)) is not None and f.min_first_logprob is not None
            },
        )


class Fleet:
    def __init__(
        self, settings: ServingSettings, registry: Registry, checkpoints: CheckpointCache, runtime: EngineRuntime | None = None
    ):
        self.settings, self.registry = settings, registry
        self.runtime = runtime or runtime_for(settings)
        self.checkpoints = self.runtime.checkpoints(checkpoints)
        self.flavor = self.runtime.flavor()  # fails fast when the engine build cannot be known
        self.groups: dict[str, ModelGroup] = {}
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()  # boots in parallel threads save state; one writer of the file at a time
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.waiting: dict[str, str] = {}  # model → why it serves nothing yet (no version under its serve alias)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Serve each configured model's `serve_alias` version on its replicas; start the health monitor. A model
        with no such version yet is waited for (`waiting`, looked up again every AWAIT_MODEL_S) while the others
        serve: on a new install the supervisor starts before anyone imported a checkpoint."""
        for m in self.settings.models:
            self._add_or_wait(m)
        self._monitor = threading.Thread(target=self._monitor_loop, name="fleet-monitor", daemon=True)
        self._monitor.start()
        if self.waiting:
            threading.Thread(target=self._await_models, name="fleet-await-models", daemon=True).start()

    def _add_or_wait(self, m: ModelSettings) -> bool:
        try:
            self.add_model(m)
        except NoServedVersion as e:
            if m.name not in self.waiting:
                log.warning("%s", e)
            self.waiting[m.name] = str(e)
            return False
        self.waiting.pop(m.name, None)
        return True

    def add_waiting(self) -> list[str]:
        """Serve each waiting model that has a version under its serve alias now; returns the ones added."""
        return [m.name for m in self.settings.models if m.name in self.waiting and self._add_or_wait(m)]

    def _await_models(self) -> None:
        while self.waiting and not self._stop.wait(AWAIT_MODEL_S):
            try:
                for name in self.add_waiting():
                    log.info("%s has a version under its serve alias now: serving it", name)
            except Exception:  # a registry outage: look again next time
                log.exception("looking up the waiting models failed")

    def add_model(self, m: ModelSettings) -> ModelGroup:
        strategy = strategy_for(m.update_strategy)
        strategy.check_engine(self.flavor)
        info = self.registry.by_alias(m.name, m.serve_alias)
        if info is None:
            raise NoServedVersion(
                f"model {m.name!r} has no version with alias {m.serve_alias!r} yet: import one (`tidal import {m.name} "
                f"CHECKPOINT --champion`) or make one (`tidal bootstrap {m.name}`); it is served once it has one"
            )
        base = info if info.kind == "full" else self.registry.get(m.name, info.base_version)
        if info.kind == "lora" and m.update_strategy != "lora":
            raise SettingsError(
                f"{info.served_name} is a LoRA adapter but model {m.name!r} uses '{m.update_strategy}'; set update_strategy: lora"
            )
        group = ModelGroup(m, base, {} if info.kind == "full" else {info.version: info}, strategy, info.version)
        self.groups[m.name] = group
        self.runtime.prepare(m.name, base.version, m.replicas)
        self.scale(m.name, m.replicas)
        return group

    def stop(self) -> None:
        self._stop.set()
        replicas = [r for g in self.groups.values() for r in g.replicas]
        self.runtime.shutdown(replicas)
        for r in replicas:
            r.state = "stopped"
        self._save_state()

    # ---- operations --------------------------------------------------------------------------
    def group(self, model: str) -> ModelGroup:
        if model not in self.groups:
            raise RegistryError(f"unknown model {model!r}; the fleet serves {sorted(self.groups)}")
        return self.groups[model]

    def scale(self, model: str, replicas: int) -> list[Replica]:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        group = self.group(model)
        with group.lock:
            group.desired = replicas
            current = len(group.base_replicas())
            if replicas > current:
                with ThreadPoolExecutor(max_workers=replicas - current) as pool:
                    futures = [
                        pool.submit(self.boot_replica, group, group.base, group.adapters) for _ in range(replicas - current)
                    ]
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:
                    group.desired = len(group.base_replicas())
                    raise errors[0]
            for r in sorted(group.base_replicas(), key=lambda r: r.index, reverse=True)[: max(0, current - replicas)]:
                self.retire_replica(group, r)
            return list(group.replicas)

    def deploy(self, model: str, ref: str | int) -> list[ProbeReport]:
        group = self.group(model)
        info = self.registry.resolve(model, ref)
        with group.lock:
            reports = group.strategy.deploy(self, group, info)
        self._save_state()
        return reports

    def undeploy(self, model: str, ref: str | int) -> None:
        group = self.group(model)
        info = self.registry.resolve(model, ref)
        with group.lock:
            group.strategy.retire(self, group, info)
        self._save_state()

    def set_serving(self, model: str, ref: str | int) -> int:
        """The version the gateway falls back to for this model while it has no routes (it follows the routes'
        control arm: release/live_state.py). It must be served already: the base, a loaded adapter or a surge version."""
        group = self.group(model)
        info = self.registry.resolve(model, ref)
        with group.lock:
            served = {group.base.version, *group.adapters, *group.surge}
            if info.version not in served:
                raise ValueError(f"{info.served_name} is not served by the fleet (serving {sorted(served)}); deploy it first")
            group.serving = info.version
        self._save_state()
        return info.version

    # ---- replicas (used by strategies) ---------------------------------------------------------
    def boot_replica(self, group: ModelGroup, base: VersionInfo, adapters: dict[int, VersionInfo]) -> Replica:
        host, port = self.runtime.address()
        with self._lock:
            index, group.next_index = group.next_index, group.next_index + 1
            replica = Replica(group.settings.name, index, port, host, base, dict(adapters))
            group.replicas.append(replica)
        try:
            boot(replica, self.settings, self.checkpoints, enable_lora=group.strategy.name == "lora", runtime=self.runtime)
        except BaseException:
            with self._lock:
                group.replicas.remove(replica)
            self.runtime.stop(replica)
            raise
        finally:
            self._save_state()
        log.info("replica %s ready on %s serving %s", replica.name, replica.url, replica.served())
        return replica

    def retire_replica(self, group: ModelGroup, replica: Replica, grace_s: float = 1.0) -> None:
        drain(replica, grace_s, self.runtime)
        self.runtime.stop(replica)
        replica.state = "stopped"
        with self._lock:
            group.replicas.remove(replica)
        self._save_state()

    # ---- health --------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.settings.fleet.health_interval_s):
            try:
                self.check_health()
            except Exception:  # the monitor must outlive any one bad pass
                log.exception("health pass failed")

    def check_health(self) -> None:
        f = self.settings.fleet
        self.runtime.observe()
        for group in list(self.groups.values()):
            for r in list(group.replicas):
                seen = r.state
                if seen in ("ready", "unhealthy"):
                    why = self.runtime.lost(r)  # exited, or (kubernetes) pod replaced / container restarted
                    if why:
                        self.runtime.discard(r)  # local: the engine's children (EngineCore, workers) outlive its API server
                        self._crashed(r, why)
                    elif self._healthy(r):  # (an HTTP call, without the lock: the state may change meanwhile)
                        if not r.move(seen, "ready"):
                            continue  # drained (or retired) during the check: its mover owns it now
                        r.health_failures = 0
                    else:
                        if not r.move(seen, "unhealthy"):  # out of rotation until healthy again
                            continue
                        r.health_failures += 1
                        if r.health_failures >= f.health_failures:
                            self.runtime.discard(r)
                            self._crashed(r, f"{r.health_failures} failed health checks")
                    self.runtime.publish(r)
                elif r.state == "crashed" and time.monotonic() >= r.restart_at:
                    r.state = "starting"
                    threading.Thread(target=self._restart, args=(group, r), name=f"restart-{r.name}", daemon=True).start()

    def restart_replica(self, group: ModelGroup, r: Replica, why: str) -> None:
        """Discard an engine that can no longer be trusted; the health monitor boots it again, verified."""
        self.runtime.discard(r)
        self._crashed(r, why)

    @staticmethod
    def _healthy(r: Replica) -> bool:
        with r.client() as client:
            return client.healthy()

    def _crashed(self, r: Replica, why: str) -> None:
        f = self.settings.fleet
        delay = min(f.restart_backoff_s * 2 ** min(r.restarts, 16), f.restart_backoff_max_s)
        r.state, r.last_error, r.restart_at = "crashed", why, time.monotonic() + delay
        self.runtime.publish(r)
        log.warning("replica %s %s; restarting in %.1f s", r.name, why, delay)
        self._save_state()

    def _restart(self, group: ModelGroup, r: Replica) -> None:
        with group.lock:
            if r not in group.replicas:
                return
            r.restarts += 1
            if r.base.version not in group.surge:  # a surge replica comes back on its own version while deployed
                r.base, r.adapters = group.base, dict(group.adapters)  # the others: what the group serves now
            try:
                boot(r, self.settings, self.checkpoints, enable_lora=group.strategy.name == "lora", runtime=self.runtime)
                log.info("replica %s restarted (%d restarts)", r.name, r.restarts)
            except Exception as e:
                self._crashed(r, f"restart failed: {e}")
            self._save_state()

    # ---- state -----------------------------------------------------------------------------------
    def status(self) -> FleetState:
        return FleetState(
            engine_flavor=self.flavor, runtime=self.runtime.name, models={name: g.status() for name, g in self.groups.items()}
        )

    def _save_state(self) -> None:
        # Read by `tidal status`/`tidal down` even when this process is gone.
        with self._state_lock:
            write_json(self.settings.run_dir / "replicas.json", self.status().model_dump())
