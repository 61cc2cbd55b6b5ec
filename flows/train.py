"""Train flow: the latest reward dataset → PPO from the champion → offline gate → a registered candidate.

    champion + dataset  →  trainer process (retried; resumes)  →  gate process  →  version (+ alias `candidate`)

The run's key digests model, dataset, champion and settings: a retried or resubmitted flow finds the
same checkpoints and the version it may already have registered, so one run registers one version.
A candidate that fails the gate is registered with the failing checks as tags, gets no alias, and the
flow fails with the reason.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from tasks import events
from tasks.events import Driver
from tasks.train import (
    GateFailed,
    find_registered,
    plan_run,
    promote_to_candidate,
    publish_train_report,
    register_candidate,
    resolve_champion,
    resolve_dataset,
    run_offline_gate,
    run_trainer,
)
from tidal.flywheel_pause import ensure_running
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="train", log_prints=True)
def train(model: str = "tab", dataset_id: str | None = None, driver: Driver = "standalone") -> int:
    """Returns the candidate's version; emits `tidal.candidate.registered` (which starts `promote-<model>`
    for standalone runs)."""
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    cfg, store, registry = settings.train, open_store(settings), Registry(settings.mlflow.tracking_uri)
    ensure_running(store, model, "train")  # a paused model trains nothing (`tidal resume`)

    champion = resolve_champion(registry, model)
    manifest = resolve_dataset(store, model, dataset_id)
    plan = plan_run(settings, store, model, champion, manifest)
    info = find_registered(registry, model, plan.spec.run_key)
    if info is None:
        result = run_trainer.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)(plan, store)
        gate = run_offline_gate.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_s)(plan, store)
        info = register_candidate(registry, store, settings.data_path / "cache", plan, result, gate)
        publish_train_report(plan, info, result, gate)
    else:
        get_run_logger().info("%s: run %s already registered v%d", model, plan.spec.run_key, info.version)
    if info.gate_passed is not True:
        raise GateFailed(f"{model} v{info.version} failed the offline gate: {info.gate_reason or 'unknown'}")
    promote_to_candidate(registry, info)
    events.candidate_registered(model, info.version, manifest.dataset_id, driver)
    print(f"{model} v{info.version} trained from v{champion.version} on {manifest.dataset_id}: gate passed, alias 'candidate'")
    return info.version
