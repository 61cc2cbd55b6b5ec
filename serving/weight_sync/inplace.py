"""What `reload` and `nccl` share: a replica's engine changes its weights in place, verified before traffic.

Mapped onto the fleet's version model the way `restart` is, so canaries, promotions and rollbacks work alike:

    deploy(candidate)      one ready replica of the group's base leaves rotation and moves to the candidate in
                           place; the others keep serving the champion (so a group needs >= 2 ready replicas).
    retire(candidate)      its replicas move back to the base, in place (a rollback).
    retire(group's base)   every replica still on it moves to the newest deployed version, one at a time (a
                           promotion): capacity drops by at most one replica, never to zero.

One replica's move:  leave rotation (drain) → /pause?mode=wait → swap the weights (the strategy's own step)
→ /reset_prefix_cache → /resume → served-weight probe of the new version → back in rotation. Any failure
moves it back: pause → collective_rpc reload_weights(old checkpoint) → reset → resume → probe of the old
version; if that fails too, the engine is not trusted and the fleet restarts it on its recorded (old) version.
The replica's recorded version changes only after the new probe passed, so a crash at any point restarts it
on weights that were verified.

An engine answers every version it moves to under the name it was launched with, so engines of these models
run with VLLM_SKIP_MODEL_NAME_VALIDATION (serving/engine.py): the gateway only sends a replica the names the
fleet lists for it, and those change only after a probe passed.

Written against vLLM 0.32's routes (vllm/entrypoints/rl/online/api_router.py, serve/dev/) and not run on a
GPU here: bench/gpu_check.sh and tests/integration/test_gpu_weight_sync.py are what must pass on one.
"""

from __future__ import annotations

import json
import logging
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from serving.engine import EngineClient, EngineError
from serving.probe import ProbeFailed, ProbeReport, verify
from serving.weight_sync.base import StrategyUnavailable, WeightSync
from tidal.registry import VersionInfo

log = logging.getLogger("tidal.fleet")

# config.json keys that may differ between two checkpoints one engine can serve in turn.
_FREE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_note"}


@dataclass(frozen=True)
class Call:
    """One HTTP call to an engine; `swap` is the strategy's own step (path then names the checkpoint)."""

    method: str
    path: str
    body: dict | None = None
    tolerate: tuple[int, ...] = ()  # status codes that do not fail the step (older vLLMs lack the route)


@dataclass
class MovePlan:
    forward: list[Call] = field(default_factory=list)
    rollback: list[Call] = field(default_factory=list)


def paused(swap: list[Call]) -> list[Call]:
    """The frame around any weight swap: nothing scheduled while the weights change, no cached prefix of
    the old weights afterwards. mode=wait: the replica is already drained, nothing in flight is aborted."""
    return [Call("POST", "/pause?mode=wait"), *swap, Call("POST", "/reset_prefix_cache"), Call("POST", "/resume")]


def reload_calls(weights_path: str, weight_version: str, timeout_s: float) -> list[Call]:
    """vLLM's in-place reload of a checkpoint directory (worker.reload_weights(weights_path=...), through the
    dev-mode /collective_rpc route, whose kwargs must be strings), then the version label /weight_info shows."""
    return [
        Call(
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": weights_path}, "timeout": timeout_s},
        ),
        Call("POST", "/update_weight_version", {"new_version": weight_version}, tolerate=(404,)),
    ]


def move_plan(swap: list[Call], old_path: str, old_version: str, timeout_s: float) -> MovePlan:
    """Forward: the strategy's swap inside the pause frame. Rollback: the old checkpoint reloaded from disk,
    whatever the strategy (a failed NCCL transfer leaves nothing to send back from)."""
    return MovePlan(paused(swap), paused(reload_calls(old_path, old_version, timeout_s)))


def inplace_refusal(old_dir: Path, new_dir: Path) -> str | None:
    """Why one engine cannot serve new_dir after old_dir in place (None: it can). The engine keeps its
    architecture, shapes and API-side tokenizer across a weight swap; only the weights may change."""

    def config(d: Path) -> dict:
        return {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k not in _FREE_CONFIG_KEYS}

    try:
        old, new = config(old_dir), config(new_dir)
    except (OSError, ValueError) as e:
        return f"cannot read config.json ({e})"
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if differ:
        return f"the model configuration differs ({', '.join(differ[:8])})"
    if tokenizer_identity(old_dir) != tokenizer_identity(new_dir):
        return "the tokenizer differs (vocabulary, merges or added tokens)"
    return None


def tokenizer_identity(d: Path) -> tuple | None:
    """What decides token ids in a tokenizer.json: vocabulary, merges, added tokens. A tokenizer saved again
    (a trainer's candidate) differs in cosmetic fields (tokenizer class, empty affixes), which do not count."""
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text())
    model = t.get("model") or {}
    added = sorted((a.get("id"), a.get("content")) for a in t.get("added_tokens") or [])
    return json.dumps(model.get("vocab"), sort_keys=True), json.dumps(model.get("merges")), tuple(added)


def pick_canary(group) -> object:
    """The replica a deploy moves: the newest ready one on the group's base, leaving at least one serving it."""
    on_base = [r for r in group.ready_replicas() if r.base.version == group.base.version]
    if len(on_base) < 2:
        raise StrategyUnavailable(
            f"'{group.strategy.name}' moves one of {group.settings.name}'s replicas to the candidate while the others "
            f"keep serving {group.base.served_name}, but {len(on_base)} ready replica(s) serve it: scale the model to "
            "2 or more replicas, or use 'restart' (it boots a surge replica instead)"
        )
    return max(on_base, key=lambda r: r.index)


class InPlaceSync(WeightSync):
    gpu_only = True
    drain_grace_s = 1.0  # in-flight requests of a replica leaving rotation finish meanwhile

    @abstractmethod
    def swap(self, fleet, group, replica, client: EngineClient, info: VersionInfo, path: str) -> list[Call]:
        """Run (or return as calls, run by the caller) what puts `info`'s weights into the paused engine."""

    # ---- fleet-level semantics (as `restart`, in place) ---------------------------------------------------
    def deploy(self, fleet, group, info: VersionInfo) -> list[ProbeReport]:
        if info.kind != "full":
            raise StrategyUnavailable(
                f"{info.served_name} is a LoRA adapter; '{self.name}' swaps full checkpoints. "
                "Use the 'lora' strategy, or fold it into a full checkpoint"
            )
        running = [r for r in group.live_replicas() if r.base.version == info.version]
        if running:  # the base, or already deployed
            return [p for r in running for p in r.probes]
        report = self.move(fleet, group, pick_canary(group), info)
        group.surge[info.version] = info  # crash restarts boot it on its own version while deployed
        return [report]

    def retire(self, fleet, group, info: VersionInfo) -> None:
        if info.version != group.base.version:  # a rollback: its replicas go back to the base
            group.surge.pop(info.version, None)
            for r in [r for r in group.replicas if r.base.version == info.version and r.state == "ready"]:
                self.move(fleet, group, r, group.base)
            return
        if not group.surge:
            raise StrategyUnavailable(f"{info.served_name} is what the replicas run; deploy another version first")
        new = group.surge[max(group.surge)]
        for r in [r for r in group.replicas if r.base.version == info.version and r.state == "ready"]:
            self.move(fleet, group, r, new)  # raises: the replicas not moved yet keep serving the old base
        group.surge.pop(new.version)
        group.base, group.adapters, group.serving = new, {}, new.version

    # ---- one replica -------------------------------------------------------------------------------------------
    def move(self, fleet, group, replica, new: VersionInfo) -> ProbeReport:
        refuse_runtime(fleet, self.name)
        old = replica.base
        old_dir, new_dir = fleet.checkpoints.local_dir(old), fleet.checkpoints.local_dir(new)
        why = inplace_refusal(old_dir, new_dir)
        if why:
            raise StrategyUnavailable(
                f"{new.served_name} cannot replace {old.served_name} in place: {why}; deploy it with 'restart'"
            )
        timeout = fleet.settings.engine.weight_update_timeout_s
        plan = move_plan([Call("SWAP", str(new_dir))], str(old_dir), old.served_name, timeout)
        t0 = time.monotonic()
        leave_rotation(fleet, replica, self.drain_grace_s)
        try:
            with EngineClient(replica.url, timeout=timeout) as client:
                run_calls(client, plan.forward, lambda path: self.swap(fleet, group, replica, client, new, path))
                report = verify(
                    client, new.served_name, new_dir, fleet.settings.fleet.probe_tolerance(fleet.settings.engine), replica.name
                )
        except Exception as e:
            note = self.roll_back(fleet, group, replica, plan, old, old_dir)
            if isinstance(e, ProbeFailed):
                raise ProbeFailed(f"{e}\n  {note}") from e
            raise EngineError(f"{self.name} update of {replica.name} to {new.served_name} failed: {e}; {note}") from e
        replica.base, replica.adapters, replica.probes = new, {}, [report]
        join_rotation(fleet, replica)
        log.info(
            "replica %s moved %s -> %s in place (%s, %.1f s)",
            replica.name,
            old.served_name,
            new.served_name,
            self.name,
            time.monotonic() - t0,
        )
        return report

    def roll_back(self, fleet, group, replica, plan: MovePlan, old: VersionInfo, old_dir: Path) -> str:
        """Put the old weights back and prove it; an engine that cannot is restarted. Says what happened."""
        try:
            with EngineClient(replica.url, timeout=fleet.settings.engine.weight_update_timeout_s) as client:
                run_calls(client, plan.rollback, lambda path: [])
                replica.probes = [
                    verify(
                        client,
                        old.served_name,
                        old_dir,
                        fleet.settings.fleet.probe_tolerance(fleet.settings.engine),
                        replica.name,
                    )
                ]
        except Exception as e:  # noqa: BLE001  any failure: the engine's weights are unknown
            log.warning("replica %s could not roll back to %s (%s); restarting it", replica.name, old.served_name, e)
            fleet.restart_replica(group, replica, f"in-place rollback to {old.served_name} failed: {e}")
            return f"{replica.name} could not roll back to {old.served_name} ({e}) and is restarting on it"
        join_rotation(fleet, replica)
        return f"{replica.name} rolled back to {old.served_name} and verified"


def run_calls(client: EngineClient, calls: list[Call], swap) -> None:
    """Execute a plan; `swap(path)` runs the strategy's step and returns more calls to make. The pause frame
    always ends with /resume, even when a step inside it failed (the replica is out of rotation either way)."""
    resumed = False
    try:
        for call in calls:
            if call.method == "SWAP":
                for extra in swap(call.path):
                    _call(client, extra)
            elif call.path == "/reset_prefix_cache":
                reset_prefix_cache(client)
            else:
                _call(client, call)
                resumed = resumed or call.path == "/resume"
    finally:
        if not resumed and any(c.path == "/resume" for c in calls):
            try:
                client.post("/resume")
            except Exception as e:  # noqa: BLE001  the original failure is the one to report
                log.warning("could not resume %s after a failed update: %s", client.url, e)


def _call(client: EngineClient, call: Call) -> None:
    r = client.http.request(call.method, call.path, json=call.body)
    if not r.is_success and r.status_code not in call.tolerate:
        raise EngineError(f"{call.method} {client.url}{call.path} -> {r.status_code}: {r.text[:300]}")


def reset_prefix_cache(client: EngineClient, tries: int = 5) -> None:
    """vLLM answers success=false while blocks are held; a paused, drained engine holds none, but retry briefly."""
    for i in range(tries):
        if client.post("/reset_prefix_cache").json().get("success", True):
            return
        time.sleep(0.2 * (i + 1))
    raise EngineError(f"{client.url} kept refusing to reset its prefix cache: cached prefixes of the old weights would be served")


def refuse_runtime(fleet, strategy: str) -> None:
    """In-place updates drive vLLM's dev-mode routes, which only local engines serve (pods run without them on a
    cluster network), and `nccl`'s sender runs beside the supervisor."""
    runtime = getattr(fleet, "runtime", None)
    if runtime is not None and runtime.name != "local":
        raise StrategyUnavailable(
            f"'{strategy}' updates engines in place through vLLM's dev-mode routes, which engines of "
            f"runtime '{runtime.name}' do not serve; use 'restart' or 'lora' there"
        )


def leave_rotation(fleet, replica, grace_s: float) -> None:
    replica.state = "draining"  # the gateway stops picking it; the health monitor leaves it alone
    _publish(fleet, replica)
    time.sleep(grace_s)


def join_rotation(fleet, replica) -> None:
    replica.state, replica.health_failures, replica.last_error = "ready", 0, ""
    _publish(fleet, replica)


def _publish(fleet, replica) -> None:
    runtime = getattr(fleet, "runtime", None)
    if runtime is not None:
        runtime.publish(replica)
