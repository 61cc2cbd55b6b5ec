"""Re-scoring: a dataset's stored logs, collected again under another reward rule, as a new dataset version, without
re-serving anything (`tidal collect MODEL --rule NAME@VERSION`).

The run replays its source dataset's collection exactly: the same log objects (its manifest's source files), the
same range and watermark, the same known versions, the same as-of time, the same collect settings and the same
released rows; only the rule differs. So every row the source read is read again, the contracts quarantine the same
rows (the new dataset points at the source's quarantine instead of copying it) and the counts must reconcile with
the source's: rows in, and quarantined, equal; kept and filtered may differ only where the rule decides (rows
without an event the rule reads). The model's judge's scores are attached anew (a judge may have run since the
source was collected: data_contracts/judgements.py) and counted apart. The watermark does not move, nothing is
released again, and the manifest and the collection's MLflow run name the source dataset and its rule beside the
new rule.
"""

from __future__ import annotations

import json

import pyarrow as pa

from data_contracts import dataset, judgements, pipeline, release
from data_contracts.assemble import Work, build_withheld
from data_contracts.collect_settings import CollectSettings
from data_contracts.logs import Batch, find_log_files, load_batch
from data_contracts.manifest import DatasetManifest
from data_contracts.pipeline import Plan, Versions
from data_contracts.reward_rules import BaseRewardRule, RuleError, build_rule, installed_rules
from data_contracts.scope import Range


class RescoreError(ValueError):
    """A re-scoring that cannot reproduce its source: names what differs and what to do."""


def resolve_rule(spec: str, configured: BaseRewardRule) -> BaseRewardRule:
    """The rule `spec` names: the model's configured rule when its id is `spec`; an installed plugin whose defaults
    have that id (`feedback-blend@1`); or a JSON mapping of a rule ({"plugin": ..., its fields})."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            return build_rule(json.loads(text))
        except json.JSONDecodeError as e:
            raise RuleError(f"--rule {spec!r}: not valid JSON ({e.msg} at column {e.colno})") from None
    if text == configured.id:
        return configured
    found = []
    for plugin in installed_rules():
        try:
            rule = build_rule({"plugin": plugin})
        except RuleError:
            continue  # a plugin without defaults for every field is selected by JSON
        found.append(rule.id)
        if rule.id == text:
            return rule
    raise RuleError(
        f"--rule {spec!r}: no rule with that id; the model's rule is {configured.id}, installed plugins' defaults are "
        f'{sorted(found)}; or pass the rule as JSON (\'{{"plugin": "feedback-blend", "score_weight": 2}}\')'
    )


def source_settings(source: DatasetManifest) -> CollectSettings:
    """The collect settings the source was built under (its manifest's, reward rules aside)."""
    try:
        return CollectSettings.model_validate(source.collect_settings)
    except ValueError as e:
        raise RescoreError(
            f"dataset {source.dataset_id}: its recorded collect settings no longer validate ({str(e)[:300]}); it cannot "
            "be re-scored exactly"
        ) from None


def source_plan(store, source: DatasetManifest, cfg: CollectSettings) -> Plan:
    """The source run's plan: its range (watermark before → after), its log objects as its listing saw them."""
    before, after = source.watermark_before, source.watermark_after
    rng = Range(
        before.completions_through_ms,
        after.completions_through_ms,
        before.feedback_through_ms,
        after.feedback_through_ms,
        source.created_ms,
        source.created_ms + int(cfg.max_clock_skew_s * 1000),
        int(cfg.feedback_timeout_s * 1000),
    )
    # the log objects it read (its source files also name the releases and judgements it attached)
    wanted = {k for k in source.source_files if k.startswith("logs/")} | {b.key for b in source.schema_quarantined_files}
    listing = find_log_files(store, source.model, rng, before, after.listed_from_ms or source.created_ms)
    files = [f for f in listing.files if f.key in wanted]
    missing = sorted(wanted - {f.key for f in files})
    if missing:
        raise RescoreError(
            f"dataset {source.dataset_id}: {len(missing)} of its {len(wanted)} log objects are gone from the store "
            f"(first: {missing[0]}); restore them to re-score it"
        )
    return Plan(source.model, before, rng, files)


def load_source_logs(store, plan: Plan, source: DatasetManifest, judge_id: str | None = None) -> Batch:
    """The rows the source owned, with the releases it took (and no other: pending ones belong to the next run), and
    the scores the model's judge (`judge_id`) has given its completions by now (the judge may have run since)."""
    batch = load_batch(store, plan.model, plan.rng, plan.watermark, plan.files)
    taken = [r for r, _ in release.releases(store, plan.model) if r.release_id in set(source.releases)]
    if len(taken) != len(source.releases):
        raise RescoreError(f"dataset {source.dataset_id}: releases {source.releases} are not all in the store any more")
    return judgements.attach(store, release.attach(store, batch, taken), plan.model, judge_id)


def check_same_rows(work: Work, source: DatasetManifest) -> None:
    """The replay read and quarantined what the source did, kind by kind (judges' rows aside: a judge may have run
    since); raises RescoreError naming the difference."""
    counts = pipeline.reconcile(work)
    for kind in ("completions", "feedback"):
        was = getattr(source.counts, kind)
        now = counts[kind]
        judged = (sum(work.batch.judged.values()), sum(source.judged.values())) if kind == "feedback" else (0, 0)
        if (now["in"] - judged[0], now["quarantined"]) != (was.in_ - judged[1], was.quarantined):
            raise RescoreError(
                f"dataset {source.dataset_id}: re-reading its {kind} gave {now['in']} rows in, {now['quarantined']} "
                f"quarantined; the source had {was.in_} and {was.quarantined} (its log objects or the contracts changed "
                "since): collect anew instead"
            )


def write_rescored(
    store, plan: Plan, work: Work, samples: pa.Table, rule: BaseRewardRule, cfg: CollectSettings, versions: Versions,
    source: DatasetManifest, ds_id: str,
) -> DatasetManifest:  # fmt: skip
    """The new dataset version: the source's watermarks and quarantine, this rule, and where it came from."""
    check_same_rows(work, source)
    record = pipeline.collect_record(
        plan, work.batch, work, samples, rule, cfg, versions, source.watermark_after, source.quarantine, source.created_ms
    )
    record = record.model_copy(update={"rescored_from": source.dataset_id, "rescored_from_rule": source.reward_rule})
    return dataset.write_dataset(store, plan.model, ds_id, samples, record, build_withheld(work))


def rescore_id(store, source: DatasetManifest, plan: Plan, batch: Batch, rule: BaseRewardRule, contract_version: str) -> str:
    """The new dataset's id (the source's inputs under the new rule's id); refused if that dataset exists already."""
    if rule.id == source.reward_rule.id:
        raise RescoreError(f"dataset {source.dataset_id} is already under {rule.id}: name another rule (or version)")
    ds_id = dataset.dataset_id(source.model, plan.watermark, batch.partitions, rule.id, contract_version)
    if store.exists(f"{dataset.dataset_prefix(source.model, ds_id)}/manifest.json"):
        raise RescoreError(
            f"dataset {source.dataset_id} was re-scored under {rule.id} already (dataset {ds_id}): a rule with other "
            "constants needs another version"
        )
    return ds_id


def source_versions(source: DatasetManifest) -> Versions:
    if source.versions.champion is None:
        raise RescoreError(f"dataset {source.dataset_id} recorded no champion; it cannot be re-scored exactly")
    return Versions(list(source.versions.known), source.versions.champion)
