"""Prefect tasks of the train flow (composed by flows/train.py).

The trainer and the gate run as their own processes (`python -m training.job`), started by the launcher
`trainer.launcher` names (training/launch/: a local subprocess or a Kubernetes Job, one code path); nothing
here imports torch. A crashed trainer is retried and resumes from its last checkpoint; a bad dataset or a
diverged run is not retried (the next attempt would fail the same way).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from data_contracts.dataset import read_manifest, read_parquet
from data_contracts.manifest import DatasetManifest
from data_contracts.suggestion_filter import describe
from tidal import lineage
from tidal.procs import tail
from tidal.registry import Registry, VersionInfo, code_revision, publish
from tidal.section import PROJECT_ROOT, SettingsError
from tidal.settings import TidalSettings
from tidal.store import ObjectStore, download_dir, get_json
from tidal.strategy import model_mismatch
from tidal.tokens import admin_token
from training import run_metrics
from training.job_spec import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
    GateReport,
    TrainJob,
    TrainResult,
    run_key,
)
from training.launch import StopSignal, TrainerLauncher, launcher_for
from training.reward_data import DatasetError, latest_dataset_id
from training.train_settings import LaunchSettings


class TrainerCrashed(RuntimeError):
    """The trainer process died (killed, out of memory, ...): worth a retry, which resumes from its checkpoint."""


class TrainerPreempted(RuntimeError):
    """The trainer gave its capacity back on request (exit EXIT_PREEMPTED, or any end after a stop request): no
    failure; running it again resumes from the iteration it checkpointed and reaches the same weights."""


class TrainerRejected(RuntimeError):
    """The trainer refused its input or diverged: a retry would fail the same way."""


class GateFailed(RuntimeError):
    """The candidate failed the offline gate; it is registered with the reason but gets no traffic."""


@dataclass(frozen=True)
class LeaseTerms:
    """Under `capacity.mode: tidal`: where the capacity scheduler answers and what the run asks of it."""

    url: str
    token: str = field(repr=False)  # the admin token: never in a log line
    units: int  # the same every attempt: a resumed run must compute with the threads it started with
    grace_s: float
    heartbeat_s: float


@dataclass
class TrainPlan:
    spec: TrainJob
    champion: VersionInfo
    manifest: DatasetManifest
    spec_path: Path
    log_path: Path
    launch: LaunchSettings  # where the trainer runs (not part of the spec: it changes nothing the trainer computes)
    leases: LeaseTerms | None = None  # None: the trainer runs when the flow starts it (capacity.mode static)


@task(cache_policy=NO_CACHE)
def resolve_champion(registry: Registry, model: str) -> VersionInfo:
    champion = registry.by_alias(model, "champion")
    if champion is None:
        raise LookupError(f"{model} has no champion to train from: run `tidal bootstrap {model}` first")
    return champion


@task(cache_policy=NO_CACHE)
def resolve_dataset(store: ObjectStore, model: str, dataset_id: str | None) -> DatasetManifest:
    """The manifest of the dataset to train on (the latest collected one when none is named)."""
    ds_id = dataset_id or latest_dataset_id(store, model)
    if not store.exists(f"datasets/model={model}/{ds_id}/manifest.json"):
        known = sorted({k.split("/")[2] for k in store.list(f"datasets/model={model}/")})
        raise DatasetError(f"dataset {ds_id} of {model} not found; datasets: {known or 'none'}")
    return read_manifest(store, model, ds_id)


@task(cache_policy=NO_CACHE)
def plan_run(
    settings: TidalSettings, store: ObjectStore, model: str, champion: VersionInfo, manifest: DatasetManifest
) -> TrainPlan:
    """The run's key, its MLflow run (found again by a retried or resubmitted flow) and the trainer's spec file."""
    cfg, strategy = settings.train, settings.model(model).update_strategy
    if problem := model_mismatch(model, strategy, cfg.ppo.lora, "train.ppo.lora"):  # before training: it could never serve
        raise SettingsError(problem)
    corpus = settings.model(model).corpus
    key = run_key(model, manifest.digest, champion.version, cfg, settings.bootstrap.heldout_fraction, corpus)
    tracking = settings.mlflow.tracking_uri
    mlflow.set_tracking_uri(tracking)
    experiment = mlflow.set_experiment(f"{model}/train")
    runs = mlflow.search_runs([experiment.experiment_id], f"tags.`tidal.train_run` = '{key}'", output_format="list")
    if runs:
        run_id = runs[0].info.run_id
    else:
        with mlflow.start_run(run_name=key) as run:
            run_id = run.info.run_id
            mlflow.set_tags(
                {
                    lineage.TRAIN_RUN: key,
                    lineage.PARENT_VERSION: str(champion.version),
                    lineage.DATASET_ID: manifest.dataset_id,
                    lineage.DATASET_DIGEST: manifest.digest,
                    lineage.CODE_REVISION: code_revision(PROJECT_ROOT),
                }
            )
            mlflow.log_params(hyper_parameters(settings))
            data = mlflow.data.from_pandas(
                read_parquet(store, manifest.data_key).to_pandas(),
                source=manifest.data_uri,
                name=manifest.dataset_id,
                digest=manifest.digest.removeprefix("sha256:")[:16],
            )
            mlflow.log_input(data, context="train")
    spec = TrainJob(
        model=model,
        run_key=key,
        dataset_id=manifest.dataset_id,
        dataset_digest=manifest.digest,
        champion_version=champion.version,
        tracking_uri=tracking,
        mlflow_run_id=run_id,
        train=cfg,
        corpus_heldout_fraction=settings.bootstrap.heldout_fraction,
        corpus=corpus,
        torch_threads=trainer_threads(settings),
        pushgateway_url=settings.prometheus.pushgateway_url,
    )
    spec_path = settings.run_dir / f"train-{model}-{key}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(spec.model_dump_json(indent=2))
    return TrainPlan(
        spec, champion, manifest, spec_path, settings.train_log(model), settings.trainer, lease_terms(settings, spec)
    )


def lease_terms(settings: TidalSettings, spec: TrainJob) -> LeaseTerms | None:
    """A lease of the trainer's cores (its torch threads), or of its GPUs or its node on Kubernetes."""
    cap = settings.capacity
    if cap.mode != "tidal":
        return None
    if cap.unit == "core":
        units = spec.torch_threads
    elif cap.unit == "gpu":
        units = max(1, settings.trainer.kubernetes.gpus_per_node if settings.trainer.launcher == "kubernetes" else 1)
    else:
        units = 1
    return LeaseTerms(f"http://{cap.host}:{cap.port}", admin_token(settings), units, cap.lease.grace_s, cap.lease.heartbeat_s)


def trainer_threads(settings: TidalSettings) -> int:
    """train.torch_threads; under capacity.mode tidal (cores) the units a lease can get beside serving's minimum;
    else the trainer pod's CPU limit, else the cores a local CPU fleet leaves free (CPU replicas each hold
    engine.cpu_threads)."""
    if settings.train.torch_threads:
        return settings.train.torch_threads
    cap = settings.capacity
    if cap.mode == "tidal" and cap.unit == "core":  # the cores serving's minimum leaves (the run's lease size)
        lendable = cap.usable_units - sum(m.capacity.min_replicas for m in settings.models) * cap.units_per_replica
        return max(1, min(lendable, cap.lease.max_units or lendable))
    if settings.trainer.launcher == "kubernetes":
        return max(1, int(settings.trainer.kubernetes.cpu_limit))
    engine = 0 if settings.engine.flavor == "cuda" else sum(m.replicas for m in settings.models) * settings.engine.cpu_threads
    return max(1, (os.cpu_count() or 1) - engine)


def hyper_parameters(settings: TidalSettings) -> dict[str, str]:
    cfg = settings.train
    flat = {f"ppo.{k}": v for k, v in cfg.ppo.model_dump(mode="json").items()}
    flat.update({f"gate.{k}": v for k, v in cfg.gate.model_dump(mode="json").items()})
    flat.update({"heldout_fraction": cfg.heldout_fraction, "checkpoint_every": cfg.checkpoint_every})
    return {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in flat.items()}


@task(cache_policy=NO_CACHE)
def find_registered(registry: Registry, model: str, key: str) -> VersionInfo | None:
    """The version an earlier attempt of this run already registered, if any (registration happens once)."""
    return registry.find_by_tag(model, lineage.TRAIN_RUN, key)


def _job(
    plan: TrainPlan, command: str, store: ObjectStore, stop: StopSignal | None = None, launcher: TrainerLauncher | None = None
) -> None:
    """Run `python -m training.job <command>` to completion (or until `stop` ends it) with the configured launcher;
    its output goes to the model's train log, its exit code decides between success, TrainerPreempted,
    TrainerRejected and TrainerCrashed. Any end after a stop request is a preemption (torchrun exits 1 whatever
    its workers' codes; a trainer killed past the grace period resumes from its last periodic checkpoint).
    `launcher`: the configured one (trainer.launcher) unless given."""
    started = time.monotonic()
    launcher = launcher or launcher_for(plan.launch, store)
    code = launcher.run(command, plan.spec, plan.spec_path, plan.log_path, stop)
    spec = plan.spec
    preempted = code != 0 and (code == EXIT_PREEMPTED or (stop is not None and stop.event.is_set()))
    if command == "train" and spec.pushgateway_url:
        outcome = "preempted" if preempted else run_metrics.outcome_of(code)
        if error := run_metrics.push_outcome(spec.pushgateway_url, spec.model, spec.run_key, outcome, time.monotonic() - started):
            get_run_logger().warning("%s: the attempt's outcome (%s) is not in Prometheus: %s", spec.run_key, outcome, error)
    if code == 0:
        return
    last = tail(str(plan.log_path), 8)
    if preempted:
        raise TrainerPreempted(f"{command} of {plan.spec.model} stopped on request (exit {code}); it resumes from its checkpoint")
    if code in (EXIT_BAD_INPUT, EXIT_DIVERGED):
        raise TrainerRejected(f"{command} of {plan.spec.model} refused to run (exit {code}):\n{last}")
    raise TrainerCrashed(f"{command} process of {plan.spec.model} died (exit {code}); log {plan.log_path}:\n{last}")


def _retry_only_crashes(task, task_run, state) -> bool:
    try:
        state.result()
    except (TrainerCrashed, TrainerPreempted):  # both resume from the run's last checkpoint
        return True
    except Exception:  # noqa: BLE001  any other failure is final
        return False
    return False


@task(cache_policy=NO_CACHE, retry_condition_fn=_retry_only_crashes)
def run_trainer(plan: TrainPlan, store: ObjectStore) -> TrainResult:
    """The PPO job, in its own process (on leases under capacity.mode tidal); each retry resumes from the run's
    last checkpoint."""
    if plan.leases is None:
        _job(plan, "train", store)
    else:
        _train_on_leases(plan, store, plan.leases, get_run_logger().info)
    result = TrainResult.model_validate(get_json(store, f"{plan.spec.prefix}/result.json"))
    get_run_logger().info(
        "%s: %d iterations on %d rows (resumed after %s), %.0f tokens/s",
        plan.spec.run_key,
        result.iterations,
        result.train_rows,
        result.resumed_from,
        result.tokens_per_s,
    )
    return result


def _train_on_leases(
    plan: TrainPlan, store: ObjectStore, terms: LeaseTerms, say: Callable[[str], None], launcher: TrainerLauncher | None = None
) -> int:
    """Wait for a lease, train on it until the run ends or the lease is revoked; after a revocation the trainer has
    checkpointed, and the run waits for the next lease and resumes (not a failure, no retry spent). Returns how many
    times it was preempted."""
    from capacity.api import LeaseRequest
    from capacity.client import LeaseClient, LeaseWatch

    client, preempted = LeaseClient(terms.url, terms.token), 0
    ask = LeaseRequest(holder=plan.spec.run_key, min_units=terms.units, max_units=terms.units)
    while True:
        lease = client.acquire(ask, say=say)
        stop = StopSignal(threading.Event(), terms.grace_s)
        try:
            with LeaseWatch(client, lease, stop.event, terms.heartbeat_s) as watch:
                _job(plan, "train", store, stop, launcher)
            return preempted
        except TrainerPreempted:
            preempted += 1
            say(f"{plan.spec.run_key}: preempted ({watch.revoked or 'stopped'}); it resumes on the next lease")
        finally:
            client.release(lease.id)


@task(cache_policy=NO_CACHE, retry_condition_fn=_retry_only_crashes)
def run_offline_gate(plan: TrainPlan, store: ObjectStore) -> GateReport:
    _job(plan, "gate", store)
    return GateReport.model_validate(get_json(store, f"{plan.spec.prefix}/gate.json"))


@task(cache_policy=NO_CACHE)
def register_candidate(
    registry: Registry, store: ObjectStore, cache_dir: Path, plan: TrainPlan, result: TrainResult, gate: GateReport
) -> VersionInfo:
    """Publish the run's checkpoint as the model's next version with its lineage and gate results."""
    spec, champion = plan.spec, plan.champion
    local = download_dir(store, f"{spec.prefix}/candidate", cache_dir / spec.prefix / "candidate")
    tags = {
        lineage.ORIGIN: "ppo",
        lineage.PARENT_VERSION: str(champion.version),
        lineage.TRAIN_RUN: spec.run_key,
        lineage.DATASET_ID: spec.dataset_id,
        lineage.DATASET_DIGEST: spec.dataset_digest,
        lineage.REWARD_RULE: plan.manifest.reward_rule.id,
        lineage.REWARD_RULE_PLUGIN: lineage.rule_plugin_tag(plan.manifest.reward_rule.plugin, plan.manifest.reward_rule.package),
        **lineage.rescore_tags(plan.manifest.rescored_from, plan.manifest.rescored_from_rule),
        lineage.CODE_REVISION: code_revision(PROJECT_ROOT),
        lineage.HPARAMS: spec.train.ppo.model_dump_json(),
        lineage.MLFLOW_RUN: spec.mlflow_run_id,
        lineage.TRAIN_ROWS: str(result.train_rows),
        **gate.tags(),
    }
    base = champion.base_version if result.kind == "lora" else None
    return publish(registry, store, spec.model, local, result.kind, base, tags, spec.mlflow_run_id)


@task(cache_policy=NO_CACHE)
def promote_to_candidate(registry: Registry, info: VersionInfo) -> None:
    registry.set_alias(info.model, "candidate", info.version)


@task(cache_policy=NO_CACHE)
def publish_train_report(plan: TrainPlan, info: VersionInfo, result: TrainResult, gate: GateReport) -> None:
    rows = "\n".join(f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.detail} |" for c in gate.checks)
    final = "\n".join(f"| `{k}` | {v:.4g} |" for k, v in sorted(result.final.items()))
    create_markdown_artifact(
        key=f"{info.model.replace('_', '-')}-train",
        description=f"Training run {plan.spec.run_key}",
        markdown=(
            f"# {info.model} v{info.version} from v{plan.champion.version}: gate {'passed' if gate.passed else 'FAILED'}\n\n"
            f"Dataset `{plan.spec.dataset_id}` ({result.train_rows} training rows, {result.hindsight_rows} of them "
            f"hindsight rows from partial verdicts, {result.heldout_rows} held out, dropped {result.dropped}); "
            f"{result.iterations} PPO iterations; MLflow run `{plan.spec.mlflow_run_id}`.\n\n"
            f"## Offline gate\n\n| check | result | detail |\n|---|---|---|\n{rows}\n\n"
            f"Suggestion filter: {describe(gate.suggestion_filter)}.\n\n"
            f"## Last iteration\n\n| metric | value |\n|---|---|\n{final}\n"
        ),
    )
