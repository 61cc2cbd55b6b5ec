"""Prefect tasks of the flywheel flow (composed by flows/flywheel.py): what one cycle did and how users
fared under each version, read back from the platform's own records (dataset, registry tags)."""

from __future__ import annotations

import numpy as np
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from data_contracts.rewards import kept_chars
from data_contracts.suggestion_filter import describe, from_tags
from release.report import CanaryRecord, canary_key
from tasks.cycle_report import CycleReport, Decision
from tidal import lineage
from tidal.registry import Registry
from tidal.store import ObjectStore, get_json, put_json
from training.reward_data import load_dataset


def served_metrics(samples, withheld: dict[int, int] | None = None, empty_reward: float = 0.0) -> dict[int, dict[str, float]]:
    """Per behaviour version: requests, share with a suggestion shown, accepts per suggestion, reward and
    characters kept per request. Kept characters follow the reward rule's reading of a verdict: an
    accept without a count kept the whole suggestion. `withheld`: {version: completions its suggestion filter
    withheld} (the manifest's), requests answered with nothing shown, each earning the rule's `empty_reward`."""
    withheld = withheld or {}
    out: dict[int, dict[str, float]] = {}
    for v in sorted({s.version for s in samples} | set(withheld)):
        rows = [s for s in samples if s.version == v]
        n = len(rows) + withheld.get(v, 0)
        shown = [s for s in rows if s.completion_text]
        kept = kept_chars(
            np.array([s.event for s in rows], dtype=object),
            np.array([np.nan if s.accepted_chars is None else s.accepted_chars for s in rows], dtype=float),
            np.array([len(s.completion_text) for s in rows]),
        )
        out[v] = {
            "requests": float(n),
            "suggestion_rate": len(shown) / n,
            "accept_rate": sum(s.event == "accepted" for s in shown) / max(1, len(shown)),
            "reward_per_request": (sum(s.reward for s in rows) + withheld.get(v, 0) * empty_reward) / n,
            "accepted_chars_per_request": float(kept.sum()) / n,
        }
    return out


@task(cache_policy=NO_CACHE)
def open_cycle(registry: Registry, store: ObjectStore, model: str, cycle: int, dataset_id: str) -> CycleReport:
    """The cycle's starting point, with how users fared under each version in its dataset;
    `no_new_data` when the champion already learned from this dataset."""
    champion = registry.by_alias(model, "champion")
    if not dataset_id:  # collect found nothing, and no earlier collection wrote a dataset either
        return CycleReport(
            model=model,
            cycle=cycle,
            champion_before=champion.version,
            dataset_id="",
            rows=0,
            champion_after=champion.version,
            decision="no_new_data",
            reason=(
                "no dataset yet: the collection found no records it may take (a record is collected once it is "
                "older than collect.upload_grace_s and its verdicts had feedback_timeout_s to arrive); waiting for logs"
            ),
        )
    ds = load_dataset(store, model, dataset_id)
    report = CycleReport(
        model=model,
        cycle=cycle,
        champion_before=champion.version,
        dataset_id=dataset_id,
        rows=len(ds.samples),
        served=served_metrics(ds.samples, ds.withheld, ds.rule.empty if ds.rule else 0.0),
        champion_after=champion.version,
    )
    trained = registry.find_by_tag(model, lineage.DATASET_ID, dataset_id)
    if trained is not None and trained.parent_version == champion.version:
        report.decision, report.candidate = "no_new_data", trained.version
        report.reason = f"v{champion.version} already trained on {dataset_id} (v{trained.version}); waiting for new logs"
    return report


@task(cache_policy=NO_CACHE)
def close_cycle(
    registry: Registry, report: CycleReport, decision: Decision, reason: str = "", store: ObjectStore | None = None
) -> CycleReport:
    """Records the decision and the champion after it; a release's reason comes from the candidate's audit tags,
    its canary's step table from the store."""
    report.decision = decision
    if store is not None and report.candidate is not None and store.exists(key := canary_key(report.model, report.candidate)):
        report.canary = CanaryRecord.model_validate(get_json(store, key))
    if report.candidate is not None:
        info = registry.get(report.model, report.candidate)
        report.suggestion_filter = describe(from_tags(info.tags))
        if not reason:
            audit = info.release_event(decision)
            reason = audit.get("reason", "") if audit else ""
    report.reason = reason
    report.champion_after = registry.by_alias(report.model, "champion").version
    return report


@task(cache_policy=NO_CACHE)
def close_failed_training(registry: Registry, report: CycleReport, message: str) -> CycleReport:
    """A train subflow that did not complete: `gate_failed` (the candidate is registered with the failing
    checks) or `train_failed` (no candidate; the message says why)."""
    registered = registry.find_by_tag(report.model, lineage.DATASET_ID, report.dataset_id)
    if registered is not None and registered.parent_version == report.champion_before:
        report.candidate = registered.version
    gate_failed = report.candidate is not None and registered.gate_passed is False
    return close_cycle.fn(registry, report, "gate_failed" if gate_failed else "train_failed", message or "no message")


@task(cache_policy=NO_CACHE)
def publish_cycles(model: str, reports: list[CycleReport]) -> None:
    create_table_artifact(
        key=f"{model}-flywheel",
        table=[r.row() for r in reports],
        description=f"{model}: flywheel cycles (metrics: the champion's served traffic in each cycle's dataset)",
    )


def cycle_key(model: str, cycle: int) -> str:
    return f"state/flywheel/model={model}/cycle-{cycle:05d}.json"


@task(cache_policy=NO_CACHE)
def record_cycle(store: ObjectStore, report: CycleReport) -> None:
    """The cycle's report, kept in the object store: the loop's history, whoever ran the cycle."""
    put_json(store, cycle_key(report.model, report.cycle), report.model_dump(mode="json"))


def load_cycles(store: ObjectStore, model: str) -> list[CycleReport]:
    """Every recorded cycle of the model, in order."""
    reports = [CycleReport.model_validate(get_json(store, key)) for key in store.list(f"state/flywheel/model={model}/")]
    return sorted(reports, key=lambda r: r.cycle)
