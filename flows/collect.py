"""Collection flow: the gateway's logs since the watermark → validated, rewarded dataset version.

    logs/{completions,feedback}/...  →  quarantine/model=M/<id>/  +  datasets/model=M/<id>/  →  watermark

Every row it owns ends kept, quarantined (with all its reasons) or filtered (with one reason), and the
counts reconcile exactly. A run that fails before the watermark moves is redone under the same
dataset id. `include_open_hour` also takes the hour still in progress (tests, manual runs); scheduled
runs take an hour once it ended and its verdicts had time to arrive.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow, get_run_logger

from data_contracts.dataset import dataset_id
from data_contracts.pipeline import contract_params
from data_contracts.suites import CONTRACT_VERSION
from tasks import events
from tasks.collect import (
    advance_watermark,
    assemble_samples,
    find_new_partitions,
    load_encoder,
    load_logs,
    log_to_mlflow,
    publish_data_docs,
    publish_reports,
    quarantine_failures,
    read_versions,
    validate_logs,
    write_dataset_version,
)
from tasks.events import Driver
from tidal.clock import now_ms
from tidal.flywheel_pause import ensure_running
from tidal.judge_settings import judge_of
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="collect", log_prints=True)
def collect(model: str = "tab", include_open_hour: bool = False, driver: Driver = "standalone") -> str:
    """Returns the id of the dataset written, or of the last one when nothing new was stored. A new dataset
    emits `tidal.dataset.ready` (which starts `train-<model>` for standalone runs)."""
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    cfg, store, registry = settings.collect, open_store(settings), Registry(settings.mlflow.tracking_uri)
    ensure_running(store, model, "collect")  # a paused model collects nothing (`tidal resume`)
    rule, as_of_ms = cfg.rule_for(model), now_ms()

    plan = find_new_partitions(store, model, cfg, as_of_ms, include_open_hour)
    batch = load_logs(store, plan, judge_of(settings.model(model)))
    if batch.empty:
        get_run_logger().info(
            "%s: nothing new since the watermark (%s); latest dataset %s", model, plan.watermark.hour, plan.watermark.dataset_id
        )
        return plan.watermark.dataset_id or ""
    versions = read_versions(registry, model)
    params = contract_params(model, versions, cfg, as_of_ms, settings.model(model).feedback)
    encoder = load_encoder(registry, store, settings.data_path / "cache", model, versions, cfg.pii_policy_for(model))
    ds_id = dataset_id(model, plan.watermark, batch.partitions, rule.id, CONTRACT_VERSION)
    with tempfile.TemporaryDirectory(prefix="collect-docs-") as docs:
        work = validate_logs(batch, params, cfg.pii_policy_for(model), encoder, Path(docs))
        quarantine = quarantine_failures(store, work, ds_id)
        docs_uri = publish_data_docs(store, Path(docs), model, ds_id)
    work, samples = assemble_samples(work, rule, versions, cfg.max_stale_versions, params)
    manifest, watermark = write_dataset_version(store, plan, work, samples, rule, cfg, versions, quarantine, ds_id, as_of_ms)
    run_id = log_to_mlflow(settings.mlflow.tracking_uri, manifest, samples)
    publish_reports(manifest, docs_uri, run_id, store)
    advance_watermark(store, watermark)  # only after the dataset is written and logged
    events.dataset_ready(model, ds_id, manifest.rows, driver)

    total = manifest.counts.total
    print(
        f"{model}: dataset {ds_id}: {manifest.rows} samples; rows in {total.in_} = kept {total.kept} + "
        f"quarantined {total.quarantined} + filtered {total.filtered}"
    )
    return ds_id
