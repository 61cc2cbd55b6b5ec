"""The re-scoring flow's steps (flows/rescore.py): find the source dataset, replay its collection's reading, write
the new version beside it. Validation, assembly and the MLflow run are the collection's own tasks."""

from __future__ import annotations

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from data_contracts import dataset, rescore
from data_contracts.assemble import Work
from data_contracts.collect_settings import CollectSettings
from data_contracts.logs import Batch
from data_contracts.manifest import DatasetManifest
from data_contracts.pipeline import Plan, Versions
from data_contracts.reward_rules import BaseRewardRule
from tidal.store import ObjectStore


@task(cache_policy=NO_CACHE)
def read_source(store: ObjectStore, model: str, source: str | None) -> DatasetManifest:
    """The dataset to re-score: `source`, or the latest one collected (the watermark's)."""
    if source is None:
        wm = dataset.read_watermark(store, model)
        if wm is None or not wm.dataset_id:
            raise rescore.RescoreError(f"{model} has no dataset yet: collect one first (tidal collect {model})")
        source = wm.dataset_id
    return dataset.read_manifest(store, model, source)


@task(cache_policy=NO_CACHE)
def replay_plan(store: ObjectStore, source: DatasetManifest, cfg: CollectSettings) -> Plan:
    plan = rescore.source_plan(store, source, cfg)
    get_run_logger().info("%s: replaying %d log files of dataset %s", source.model, len(plan.files), source.dataset_id)
    return plan


@task(cache_policy=NO_CACHE)
def load_source_logs(store: ObjectStore, plan: Plan, source: DatasetManifest, judge_id: str | None) -> Batch:
    return rescore.load_source_logs(store, plan, source, judge_id)


@task(cache_policy=NO_CACHE)
def write_rescored_version(
    store: ObjectStore, plan: Plan, work: Work, samples: pa.Table, rule: BaseRewardRule, cfg: CollectSettings,
    versions: Versions, source: DatasetManifest, ds_id: str,
) -> DatasetManifest:  # fmt: skip
    return rescore.write_rescored(store, plan, work, samples, rule, cfg, versions, source, ds_id)
