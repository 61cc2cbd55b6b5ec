"""Prefect tasks of the collection flow (composed by flows/collect.py): one per step.

The steps themselves are plain functions in data_contracts/ (unit-tested without Prefect); the tasks
here add what only a platform run does: the tokenizer for scrubbing, Data Docs, MLflow, artifacts, and a line
per step with its figures (what `tidal collect` shows while it runs: `<model>: read 1,204 completion and 980
feedback rows from 14 log files`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pyarrow as pa
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from data_contracts import dataset, pipeline
from data_contracts.assemble import Work
from data_contracts.collect_settings import CollectSettings, PiiPolicy
from data_contracts.logs import Batch
from data_contracts.manifest import DatasetManifest
from data_contracts.pipeline import Encoder, Plan, Versions
from data_contracts.report import quarantine_rows, report_markdown
from data_contracts.reward_rules import BaseRewardRule
from data_contracts.scope import Watermark
from data_contracts.suites import CONTRACT_VERSION, ContractParams
from tidal import lineage
from tidal.registry import CheckpointCache, Registry
from tidal.store import ObjectStore, upload_dir


@task(cache_policy=NO_CACHE)
def find_new_partitions(store: ObjectStore, model: str, cfg: CollectSettings, as_of_ms: int, include_open_hour: bool) -> Plan:
    plan = pipeline.find_partitions(store, model, cfg, as_of_ms, include_open_hour)
    new = sum(f.new for f in plan.files)
    get_run_logger().info("%s: %d log files to read (%d new since the last listing)", model, len(plan.files), new)
    return plan


@task(cache_policy=NO_CACHE)
def load_logs(store: ObjectStore, plan: Plan, judge_id: str | None = None) -> Batch:
    batch = pipeline.load_logs(store, plan, judge_id)
    get_run_logger().info(
        "%s: read %s completion and %s feedback rows from %d log files (%d unreadable, quarantined whole)",
        plan.model,
        f"{batch.completions.table.num_rows:,}",
        f"{batch.feedback.table.num_rows:,}",
        len(batch.files),
        len(batch.bad_files),
    )
    return batch


@task(cache_policy=NO_CACHE)
def read_versions(registry: Registry, model: str) -> Versions:
    return pipeline.registry_versions(registry, model)


@task(cache_policy=NO_CACHE)
def load_encoder(
    registry: Registry, store: ObjectStore, cache_dir: Path, model: str, versions: Versions, policy: PiiPolicy
) -> Encoder | None:
    """The champion's tokenizer, to re-encode scrubbed prompts (only needed for pii_policy 'scrub')."""
    if policy != "scrub":
        return None
    from transformers import AutoTokenizer  # heavy, and only for scrubbing

    info = registry.get(model, versions.champion)
    base = info if info.base_version == info.version else registry.get(model, info.base_version)
    tokenizer = AutoTokenizer.from_pretrained(CheckpointCache(store, cache_dir).local_dir(base))

    def encode(prompt: str) -> list[int]:
        try:  # chat requests are logged as the JSON of their messages; the engine applied the chat template
            messages = json.loads(prompt)
            if isinstance(messages, list) and all(isinstance(m, dict) and "content" in m for m in messages):
                return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        except ValueError:
            pass
        return tokenizer(prompt)["input_ids"]

    return encode


@task(cache_policy=NO_CACHE)
def validate_logs(batch: Batch, params: ContractParams, policy: PiiPolicy, encoder: Encoder | None, docs_dir: Path) -> Work:
    work = pipeline.validate_logs(batch, params, policy, encoder, docs_dir)
    get_run_logger().info(
        "%s: contracts checked: %d completion and %d feedback rows fail a check; %d secrets or PII redacted",
        batch.model,
        len(work.completions.quarantined),
        len(work.feedback.quarantined),
        sum(work.scrubbed.values()),
    )
    return work


@task(cache_policy=NO_CACHE)
def quarantine_failures(store: ObjectStore, work: Work, ds_id: str) -> dict:
    written = dataset.write_quarantine(store, work.batch, {"completions": work.completions, "feedback": work.feedback}, ds_id)
    get_run_logger().info(
        "%s: quarantine of %s written: %s", work.batch.model, ds_id, ", ".join(sorted(written)) or "nothing to keep"
    )
    return written


@task(cache_policy=NO_CACHE)
def publish_data_docs(store: ObjectStore, docs_dir: Path, model: str, ds_id: str) -> str:
    """Upload the Data Docs site; returns the store URI of its index page."""
    prefix = dataset.data_docs_prefix(model, ds_id)
    upload_dir(store, docs_dir, prefix)
    return store.uri(f"{prefix}/index.html")


@task(cache_policy=NO_CACHE)
def assemble_samples(
    work: Work, rule: BaseRewardRule, versions: Versions, max_stale: int, params: ContractParams
) -> tuple[Work, pa.Table]:
    work, samples = pipeline.assemble_samples(work, rule, versions, max_stale, params)
    get_run_logger().info("%s: %s reward samples under rule %s", work.batch.model, f"{samples.num_rows:,}", rule.id)
    return work, samples


@task(cache_policy=NO_CACHE)
def write_dataset_version(
    store: ObjectStore,
    plan: Plan,
    work: Work,
    samples: pa.Table,
    rule: BaseRewardRule,
    cfg: CollectSettings,
    versions: Versions,
    quarantine: dict,
    ds_id: str,
    as_of_ms: int,
) -> tuple[DatasetManifest, Watermark]:
    return pipeline.write_version(store, plan, work, samples, rule, cfg, versions, quarantine, ds_id, as_of_ms)


@task(cache_policy=NO_CACHE)
def log_to_mlflow(tracking_uri: str, manifest: DatasetManifest, samples: pa.Table) -> str:
    """A run in experiment `<model>/collect` with the dataset as its input; returns the run id."""
    model, counts = manifest.model, manifest.counts.total.model_dump(by_alias=True)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(f"{model}/collect")
    with mlflow.start_run(run_name=manifest.dataset_id) as run:
        mlflow.set_tags(
            {
                lineage.DATASET_ID: manifest.dataset_id,
                lineage.DATASET_DIGEST: manifest.digest,
                lineage.REWARD_RULE: manifest.reward_rule.id,
                lineage.REWARD_RULE_PLUGIN: lineage.rule_plugin_tag(manifest.reward_rule.plugin, manifest.reward_rule.package),
                lineage.CONTRACT_VERSION: CONTRACT_VERSION,
                **lineage.rescore_tags(manifest.rescored_from, manifest.rescored_from_rule),
            }
        )
        mlflow.log_params(
            {
                "model": model,
                "reward_rule": manifest.reward_rule.id,
                "contract_version": CONTRACT_VERSION,
                "source_partitions": len(manifest.source_partitions),
                "watermark_after": manifest.watermark_after.hour or "none",
            }
        )
        metrics = {f"rows_{k}": v for k, v in counts.items()}
        if manifest.summary.reward_mean is not None:
            metrics["reward_mean"] = manifest.summary.reward_mean
        mlflow.log_metrics(metrics)
        mlflow.log_dict(manifest.stored(), "manifest.json")
        data = mlflow.data.from_pandas(
            samples.to_pandas(),
            source=manifest.data_uri,
            name=manifest.dataset_id,
            digest=manifest.digest.removeprefix("sha256:")[:16],
        )
        mlflow.log_input(data, context="collect")
        return run.info.run_id


@task(cache_policy=NO_CACHE)
def publish_reports(manifest: DatasetManifest, docs_uri: str | None, run_id: str, store: ObjectStore) -> None:
    model = manifest.model
    create_markdown_artifact(
        key=f"{_key(model)}-collect",
        description=f"Collection {manifest.dataset_id}",
        markdown=report_markdown(manifest, docs_uri, run_id, store),
    )
    create_table_artifact(
        key=f"{_key(model)}-collect-quarantine",
        table=quarantine_rows(manifest) or [{"kind": "-", "reason": "none", "rows": 0}],
        description=f"Quarantine reasons of {manifest.dataset_id}",
    )


@task(cache_policy=NO_CACHE)
def advance_watermark(store: ObjectStore, wm: Watermark) -> None:
    dataset.write_watermark(store, wm)
    get_run_logger().info("watermark of %s now at %s (dataset %s)", wm.model, wm.hour, wm.dataset_id)


def _key(model: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return "".join(ch if ch.isalnum() else "-" for ch in model.lower())
