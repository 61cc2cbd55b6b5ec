"""The collection steps as plain functions.

flows/collect.py is the one sequence: it runs these steps as Prefect tasks (tasks/collect.py); tests
and the benchmark call them directly. Registry access is one small interface (VersionSource), which tidal.registry.Registry
satisfies.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from data_contracts import dataset, judgements, release, secrets
from data_contracts.assemble import (
    Work,
    assign_rewards,
    build_samples,
    build_withheld,
    dedupe,
    drop_stale,
    drop_withheld,
    join_feedback,
    settle_feedback,
)
from data_contracts.collect_settings import CollectSettings, PiiPolicy
from data_contracts.derive import completion_frame, feedback_frame, sample_frame
from data_contracts.ledger import Ledger, ReconciliationError
from data_contracts.logs import Batch, LogFile, find_log_files, load_batch
from data_contracts.manifest import CollectRecord, DatasetManifest
from data_contracts.reward_rules import BaseRewardRule
from data_contracts.scope import Range, Watermark, advance, initial_watermark, next_range
from data_contracts.suites import CONTRACT_VERSION, ContractParams, completion_suite, feedback_suite, reward_sample_suite
from data_contracts.validate import ContractError, validate_frames
from tidal.model_settings import FeedbackPolicy
from tidal.store import ObjectStore

log = logging.getLogger("tidal.collect")
Encoder = Callable[[str], list[int]]  # prompt text → token ids, as the engine tokenizes it


class VersionSource(Protocol):
    """What collection needs from the registry (tidal.registry.Registry has both)."""

    def versions(self, model: str) -> list[int]: ...
    def aliases(self, model: str) -> dict[str, int]: ...


class CollectError(RuntimeError):
    """Collection cannot run as configured; the message says what is missing."""


@dataclass
class Plan:
    model: str
    watermark: Watermark  # where the run starts (the stored one, or the window's start)
    rng: Range
    files: list[LogFile]
    listed_from_ms: int | None = None  # recorded in the watermark this run writes (data_contracts/scope.py)
    listed_recent: list[str] = field(default_factory=list)


@dataclass
class Versions:
    known: list[int]
    champion: int


def find_partitions(store: ObjectStore, model: str, cfg: CollectSettings, as_of_ms: int, include_open_hour: bool) -> Plan:
    wm = dataset.read_watermark(store, model) or initial_watermark(model, as_of_ms, cfg.window_s)
    rng = next_range(wm, as_of_ms, include_open_hour, cfg.feedback_timeout_s, cfg.upload_grace_s, cfg.max_clock_skew_s)
    listing = find_log_files(store, model, rng, wm, as_of_ms - int(cfg.max_clock_skew_s * 1000))
    return Plan(model, wm, rng, listing.files, listing.listed_from_ms, listing.listed_recent)


def load_logs(store: ObjectStore, plan: Plan, judge_id: str | None = None) -> Batch:
    """The rows the run owns, plus the rows of pending releases (`tidal quarantine release`) and the scores the
    model's judge (`judge_id`, None: no judge) gave its completions."""
    batch = load_batch(store, plan.model, plan.rng, plan.watermark, plan.files)
    batch = release.attach(store, batch, release.pending(store, plan.model, plan.watermark))
    return judgements.attach(store, batch, plan.model, judge_id)


def registry_versions(source: VersionSource, model: str) -> Versions:
    known = sorted(source.versions(model))
    if not known:
        raise CollectError(f"{model} has no registered versions: bootstrap it first (tidal bootstrap {model})")
    champion = source.aliases(model).get("champion")
    if champion is None:
        log.warning("%s has no 'champion' alias; staleness is measured from the newest version, v%d", model, known[-1])
    return Versions(known, champion if champion is not None else known[-1])


def contract_params(
    model: str, versions: Versions, cfg: CollectSettings, as_of_ms: int, feedback: FeedbackPolicy | None = None
) -> ContractParams:
    """feedback: the model's `models[].feedback` (None: Tab's events)."""
    return ContractParams(
        model,
        tuple(versions.known),
        cfg.max_model_len,
        as_of_ms - int(cfg.window_s * 1000),
        as_of_ms + int(cfg.max_clock_skew_s * 1000),
        feedback or FeedbackPolicy(),
    )


def validate_logs(
    batch: Batch,
    params: ContractParams,
    pii_policy: PiiPolicy = "quarantine",
    encoder: Encoder | None = None,
    docs_dir: Path | None = None,
) -> Work:
    """Run the contracts; failing rows go to their kind's ledger with every reason; then the PII policy."""
    c_frame, c_replay = completion_frame(batch.completions.table)
    f_frame, f_replay = feedback_frame(
        batch.feedback.table, batch.feedback.joinable, batch.completions.table, tuple(params.feedback.events)
    )
    outcomes = validate_frames([(completion_suite(params), c_frame), (feedback_suite(params), f_frame)], docs_dir)
    ledgers = {}
    for kind in ("completions", "feedback"):
        ledger = Ledger(kind, getattr(batch, kind).table.num_rows)
        ledger.quarantine(outcomes[kind].reasons)
        late = getattr(batch, kind).late
        if late is not None and late.any():  # no run's range holds them any more (data_contracts/scope.py)
            ledger.quarantine({int(i): ["late_arrival"] for i in np.flatnonzero(late)})
        ledger.schema_rows = sum(b.rows for b in batch.bad_files if b.kind == kind)
        if getattr(batch, kind).waived is not None:  # released rows: their release's reason no longer counts
            ledger.waive(getattr(batch, kind).waived)
        ledgers[kind] = ledger
    work = Work(batch, ledgers["completions"], ledgers["feedback"], c_frame, f_frame, c_replay, f_replay, outcomes)
    if pii_policy == "scrub":
        scrub_prompts(work, encoder)
        scrub_edits(work)
    return work


def scrub_edits(work: Work) -> Work:
    """Edit events quarantined only for secrets in their text: redact it (work.edits holds the new text) and release
    the row, as scrub_prompts does for prompts (an edit has no tokens to re-encode)."""
    frame, ledger = work.f_frame, work.feedback
    for row, reasons in list(ledger.quarantined.items()):
        kinds = [k for k in frame["edit_secrets"].iat[row].split(",") if k]
        if not kinds or set(reasons) != {secrets.reason(k) for k in kinds}:
            continue
        text, counts = secrets.redact(work.batch.feedback.table["edit_text"][row].as_py())
        work.edits[row] = text
        work.scrubbed.update(counts)
        del ledger.quarantined[row]
    return work


def scrub_prompts(work: Work, encoder: Encoder | None) -> Work:
    """Rows quarantined only for secrets in the prompt: redact it, re-encode it, release the row.
    A completion with a secret stays quarantined (its tokens and log-probs cannot be rewritten)."""
    frame, ledger = work.c_frame, work.completions
    for row, reasons in list(ledger.quarantined.items()):
        kinds = [k for k in frame["prompt_secrets"].iat[row].split(",") if k]
        if not kinds or frame["completion_secrets"].iat[row] or set(reasons) != {secrets.reason(k) for k in kinds}:
            continue
        if encoder is None:
            log.warning("pii_policy 'scrub' needs the model's tokenizer to re-encode a redacted prompt; quarantining instead")
            break
        text, counts = secrets.redact(work.batch.completions.table["prompt_text"][row].as_py())
        work.prompt_ids[row] = encoder(text)
        work.scrubbed.update(counts)
        del ledger.quarantined[row]
    return work


def check_samples(samples: pa.Table, params: ContractParams, rule: BaseRewardRule) -> None:
    """The dataset about to be written must meet the RewardSample contract (else a bug: nothing is written)."""
    outcome = validate_frames([(reward_sample_suite(params, rule), sample_frame(samples))])["reward_samples"]
    if outcome.reasons:
        raise ContractError(
            f"RewardSample contract broken by {len(outcome.reasons)} rows: {dict(outcome.counts())}; the dataset was not written"
        )


def reconcile(work: Work) -> dict:
    """Counts per kind and in total; raises ReconciliationError unless in = kept + quarantined + filtered."""
    counts = {"completions": work.completions.counts(), "feedback": work.feedback.counts()}
    total = {k: sum(c[k] for c in counts.values()) for k in ("in", "kept", "quarantined", "filtered")}
    if total["in"] != total["kept"] + total["quarantined"] + total["filtered"]:
        raise ReconciliationError(f"rows in {total['in']} != kept + quarantined + filtered: {total}")
    return {**counts, "total": total}


def collect_record(
    plan: Plan,
    batch: Batch,
    work: Work,
    samples: pa.Table,
    rule: BaseRewardRule,
    cfg: CollectSettings,
    versions: Versions,
    wm_after: Watermark,
    quarantine: dict,
    as_of_ms: int,
) -> CollectRecord:
    """What the run records in its dataset's manifest, besides what writing the data fixes."""
    return CollectRecord.model_validate(
        {
            "model": plan.model,
            "contract_version": CONTRACT_VERSION,
            "created_ms": as_of_ms,
            "reward_rule": {
                "id": rule.id,
                "rule": rule.model_dump(mode="json"),
                "plugin": rule.plugin,
                "package": rule.package(),
            },
            "collect_settings": cfg.model_dump(mode="json", exclude={"reward_rule", "reward_rules"}),
            "source_partitions": batch.partitions,
            "source_files": batch.files,
            "schema_quarantined_files": [
                {"key": b.key, "kind": b.kind, "rows": b.rows, "detail": b.detail} for b in batch.bad_files
            ],
            "watermark_before": plan.watermark,
            "watermark_after": wm_after,
            "late_arrivals": {
                k: int(getattr(batch, k).late.sum()) if getattr(batch, k).late is not None else 0
                for k in ("completions", "feedback")
            },
            "counts": reconcile(work),
            "reconciled": True,
            "scrubbed": dict(work.scrubbed),
            "quarantine": quarantine,
            "versions": {"known": versions.known, "champion": versions.champion, "max_stale_versions": cfg.max_stale_versions},
            "summary": summarize(samples, rule),
            "withheld_by_version": withheld_by_version(work),
            "releases": batch.releases,
            "judged": batch.judged,
        }
    )


def withheld_by_version(work: Work) -> dict[int, int]:
    """{version: completions filtered as withheld}: requests a version answered with nothing its user saw, which
    its served figures count though they are no samples (tasks/flywheel.py served_metrics)."""
    rows = np.flatnonzero(work.completions.filtered == "withheld")
    versions = np.nan_to_num(work.c_frame["version"].to_numpy(dtype=np.float64)[rows], nan=0).astype(np.int64)
    return {int(v): int((versions == v).sum()) for v in np.unique(versions)}


def assemble_samples(
    work: Work, rule: BaseRewardRule, versions: Versions, max_stale: int, params: ContractParams
) -> tuple[Work, pa.Table]:
    """Validated logs → RewardSample rows: join verdicts → reward → drop stale → dedupe and settle →
    samples (a withheld completion is never one), which must meet the RewardSample contract (else nothing is written)."""
    work = drop_withheld(assign_rewards(join_feedback(work, params.feedback), rule))
    work = settle_feedback(dedupe(drop_stale(work, versions.known, versions.champion, max_stale)))
    samples = build_samples(work, rule)
    check_samples(samples, params, rule)
    return work, samples


def write_version(
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
    """Dataset + manifest; returns the manifest and the watermark to set once everything else succeeded."""
    wm_after = advance(plan.watermark, plan.rng, work.batch.future, ds_id, as_of_ms, plan.listed_from_ms, plan.listed_recent)
    record = collect_record(plan, work.batch, work, samples, rule, cfg, versions, wm_after, quarantine, as_of_ms)
    manifest = dataset.write_dataset(store, plan.model, ds_id, samples, record, build_withheld(work))
    release.mark_consumed(store, plan.model, work.batch.releases, ds_id, plan.watermark, as_of_ms)  # before the watermark
    return manifest, wm_after


def summarize(samples: pa.Table, rule: BaseRewardRule) -> dict:
    """Reward distribution and accept rate by (version, arm), for reports and the manifest."""
    df = samples.select(["version", "arm", "event", "reward"]).to_pandas()
    low, high = rule.bounds()
    counts, edges = np.histogram(df["reward"].to_numpy(), bins=8, range=(low, high if high > low else low + 1))
    out = {
        "rows": len(df),
        "events": dict(sorted(Counter(df["event"].tolist()).items())),
        "reward_mean": float(df["reward"].mean()) if len(df) else None,
        "reward_histogram": [
            {"from": float(a), "to": float(b), "rows": int(n)} for a, b, n in zip(edges[:-1], edges[1:], counts)
        ],
        "by_version_arm": [],
    }
    for (version, arm), g in df.groupby(["version", "arm"], sort=True):
        verdicts = int(g["event"].isin(["accepted", "rejected", "partial"]).sum())
        accepted = int(g["event"].isin(["accepted", "partial"]).sum())
        out["by_version_arm"].append(
            {
                "version": int(version),
                "arm": arm,
                "rows": len(g),
                "verdicts": verdicts,
                "accept_rate": accepted / verdicts if verdicts else None,
                "mean_reward": float(g["reward"].mean()),
            }
        )
    return out
