"""Re-scoring flow: a stored dataset's logs → a new dataset version under another reward rule, nothing re-served.

    datasets/model=M/<source>/manifest.json  →  its log objects, range, versions  →  datasets/model=M/<new id>/

The watermark stays where it is and nothing is released again; the counts must match the source's (rows in and
quarantined), and the manifest and MLflow run name the source and its rule beside the new one
(data_contracts/rescore.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow

from data_contracts.pipeline import contract_params
from data_contracts.rescore import rescore_id, resolve_rule, source_settings, source_versions
from data_contracts.suites import CONTRACT_VERSION
from tasks.collect import assemble_samples, load_encoder, log_to_mlflow, validate_logs
from tasks.rescore import load_source_logs, read_source, replay_plan, write_rescored_version
from tidal.judge_settings import judge_of
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="rescore", log_prints=True)
def rescore(model: str, rule: str, source: str | None = None) -> str:
    """Returns the new dataset's id. rule: NAME@VERSION or a rule as JSON; source: a dataset id (default the latest)."""
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    store, registry = open_store(settings), Registry(settings.mlflow.tracking_uri)
    new_rule = resolve_rule(rule, settings.collect.rule_for(model))

    src = read_source(store, model, source)
    cfg, versions = source_settings(src), source_versions(src)
    plan = replay_plan(store, src, cfg)
    batch = load_source_logs(store, plan, src, judge_of(settings.model(model)))
    params = contract_params(model, versions, cfg, src.created_ms, settings.model(model).feedback)
    encoder = load_encoder(registry, store, settings.data_path / "cache", model, versions, cfg.pii_policy_for(model))
    ds_id = rescore_id(store, src, plan, batch, new_rule, CONTRACT_VERSION)
    with tempfile.TemporaryDirectory(prefix="rescore-docs-") as docs:
        work = validate_logs(batch, params, cfg.pii_policy_for(model), encoder, Path(docs))
    work, samples = assemble_samples(work, new_rule, versions, cfg.max_stale_versions, params)
    manifest = write_rescored_version(store, plan, work, samples, new_rule, cfg, versions, src, ds_id)
    log_to_mlflow(settings.mlflow.tracking_uri, manifest, samples)

    total, was = manifest.counts.total, src.counts.total
    print(
        f"{model}: dataset {ds_id} re-scores {src.dataset_id} ({src.reward_rule.id} → {new_rule.id}): {manifest.rows} "
        f"samples (source {src.rows}); rows in {total.in_} = kept {total.kept} + quarantined {total.quarantined} + "
        f"filtered {total.filtered} (source: {was.in_} = {was.kept} + {was.quarantined} + {was.filtered})"
    )
    return ds_id
