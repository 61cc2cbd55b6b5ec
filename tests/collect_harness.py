"""flows/collect.py's data steps in the flow's order, without Prefect, MLflow, Data Docs upload or events:
what the unit tests of collection run against a real local store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data_contracts import dataset, pipeline, rescore
from data_contracts.assemble import Work
from data_contracts.collect_settings import CollectSettings
from data_contracts.manifest import DatasetManifest
from data_contracts.pipeline import Encoder, VersionSource
from data_contracts.reward_rules import BaseRewardRule
from data_contracts.suites import CONTRACT_VERSION
from tidal.model_settings import FeedbackPolicy
from tidal.store import ObjectStore


@dataclass
class CollectResult:
    dataset_id: str  # the new dataset, or the previous one when there was nothing new
    new: bool
    manifest: DatasetManifest | None = None
    samples: pa.Table | None = None
    work: Work | None = None


def collect_once(
    store: ObjectStore,
    registry: VersionSource,
    model: str,
    cfg: CollectSettings,
    as_of_ms: int,
    include_open_hour: bool = False,
    encoder: Encoder | None = None,
    docs_dir: Path | None = None,
    feedback: FeedbackPolicy | None = None,
    judge_id: str | None = None,
) -> CollectResult:
    """feedback: the model's `models[].feedback` (None: Tab's events); judge_id: its judge's id (None: no judge)."""
    plan = pipeline.find_partitions(store, model, cfg, as_of_ms, include_open_hour)
    batch = pipeline.load_logs(store, plan, judge_id)
    if batch.empty:
        return CollectResult(plan.watermark.dataset_id or "", new=False)
    versions = pipeline.registry_versions(registry, model)
    rule, params = cfg.rule_for(model), pipeline.contract_params(model, versions, cfg, as_of_ms, feedback)
    ds_id = dataset.dataset_id(model, plan.watermark, batch.partitions, rule.id, CONTRACT_VERSION)
    work = pipeline.validate_logs(batch, params, cfg.pii_policy_for(model), encoder, docs_dir)
    quarantine = dataset.write_quarantine(store, batch, {"completions": work.completions, "feedback": work.feedback}, ds_id)
    work, samples = pipeline.assemble_samples(work, rule, versions, cfg.max_stale_versions, params)
    manifest, watermark = pipeline.write_version(store, plan, work, samples, rule, cfg, versions, quarantine, ds_id, as_of_ms)
    dataset.write_watermark(store, watermark)  # only once the dataset is complete
    return CollectResult(ds_id, True, manifest, samples, work)


def rescore_once(
    store: ObjectStore,
    model: str,
    source_id: str,
    rule_spec: str,
    configured: BaseRewardRule,
    feedback: FeedbackPolicy | None = None,
    judge_id: str | None = None,
) -> CollectResult:
    """flows/rescore.py's data steps: dataset `source_id` re-scored under `rule_spec`."""
    src = dataset.read_manifest(store, model, source_id)
    rule = rescore.resolve_rule(rule_spec, configured)
    cfg, versions = rescore.source_settings(src), rescore.source_versions(src)
    plan = rescore.source_plan(store, src, cfg)
    batch = rescore.load_source_logs(store, plan, src, judge_id)
    params = pipeline.contract_params(model, versions, cfg, src.created_ms, feedback)
    ds_id = rescore.rescore_id(store, src, plan, batch, rule, CONTRACT_VERSION)
    work = pipeline.validate_logs(batch, params, cfg.pii_policy_for(model))
    work, samples = pipeline.assemble_samples(work, rule, versions, cfg.max_stale_versions, params)
    manifest = rescore.write_rescored(store, plan, work, samples, rule, cfg, versions, src, ds_id)
    return CollectResult(ds_id, True, manifest, samples, work)
