"""Letting quarantined rows back in: `tidal quarantine release` writes them here, the next collection takes them.

    released/model=M/<release-id>/release.json          ReleaseRecord: who, why, the one reason waived, rows per kind
    released/model=M/<release-id>/completions.parquet   rows in the stored schema + dataset_id, source_key (first read)
    released/model=M/<release-id>/feedback.parquet      feedback chosen, plus the verdicts of released completions
                                                        read back from their collection's log files (that run
                                                        filtered them as `completion_quarantined`: never stored)
    released/model=M/<release-id>/consumed.json         ReleaseConsumed: the collection run that took them

The next collection appends a pending release's rows to the rows it owns, past the ownership windows (their hours
were collected long ago), and validates them like any other row: the reason the release waives is dropped, any
other reason quarantines the row again. A release is consumed once, by the run whose dataset took it; a run that
fails before its watermark moves is redone from the same watermark and takes the same releases again.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from data_contracts import quarantine
from data_contracts.dataset import dataset_prefix, parquet_bytes, put_bytes, quarantine_prefix, read_manifest, read_parquet
from data_contracts.logs import Batch, append_rows
from data_contracts.records import SCHEMAS, with_added_columns
from data_contracts.scope import Watermark
from tidal.store import ObjectStore, get_json, put_json


class ReleaseError(ValueError):
    """A release that cannot be made as asked; the message says what to change."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReleaseRecord(_Record):
    """`release.json`: one operator's decision to let quarantined rows back in."""

    release_id: str
    model: str
    waived_reason: str = Field(description="The one quarantine reason waived; any other still quarantines the row.")
    by: str = Field(description="Who released them.")
    why: str = Field(description="Why (required: the record is the audit trail).")
    created_ms: int
    datasets: list[str] = Field(description="The collections whose quarantine the rows come from.")
    rows: dict[str, int] = Field(description="Rows released per kind (completions, feedback).")
    verdicts_from_logs: int = Field(description="Feedback rows read back from the logs for released completions.")
    skipped_already_released: int = Field(0, description="Chosen rows left out: an earlier release holds them.")
    other_reasons: dict[str, int] = Field(
        default_factory=dict, description="Other reasons the rows broke, with counts: those rows are quarantined again."
    )


class ReleaseConsumed(_Record):
    """`consumed.json`: the collection run that took a release."""

    release_id: str
    dataset_id: str
    watermark_before: Watermark = Field(description="The watermark that run started from (a redo starts from it too).")
    consumed_ms: int


def release_prefix(model: str, release_id: str) -> str:
    return f"released/model={model}/{release_id}"


def releases(store: ObjectStore, model: str) -> list[tuple[ReleaseRecord, ReleaseConsumed | None]]:
    """Every release of the model, oldest first, with the run that consumed it (None: pending)."""
    root = f"released/model={model}/"
    ids = sorted({key[len(root) :].split("/", 1)[0] for key in store.list(root)})
    out = []
    for rid in ids:
        prefix = release_prefix(model, rid)
        if not store.exists(f"{prefix}/release.json"):  # a release being written (its record goes last)
            continue
        consumed = f"{prefix}/consumed.json"
        out.append(
            (
                ReleaseRecord.model_validate(get_json(store, f"{prefix}/release.json")),
                ReleaseConsumed.model_validate(get_json(store, consumed)) if store.exists(consumed) else None,
            )
        )
    return out


def pending(store: ObjectStore, model: str, wm: Watermark) -> list[ReleaseRecord]:
    """The releases a run starting from `wm` takes: not consumed, or consumed by a run that started from the same
    watermark and never moved it (this run redoes it)."""

    def same(a: Watermark, b: Watermark) -> bool:
        keys = ("completions_through_ms", "feedback_through_ms", "dataset_id")
        return all(getattr(a, k) == getattr(b, k) for k in keys)

    return [r for r, used in releases(store, model) if used is None or same(used.watermark_before, wm)]


def attach(store: ObjectStore, batch: Batch, chosen: list[ReleaseRecord]) -> Batch:
    """The batch with each release's rows appended (in the stored schema, not late, joinable) and the reason each
    row's release waives (KindRows.waived)."""
    for kind in ("completions", "feedback"):
        for r in chosen:
            key = f"{release_prefix(r.model, r.release_id)}/{kind}.parquet"
            if not r.rows.get(kind) or not store.exists(key):
                continue
            table = with_added_columns(kind, read_parquet(store, key)).select(SCHEMAS[kind].names).cast(SCHEMAS[kind])
            append_rows(batch, kind, key, table, r.waived_reason)
    batch.releases = [r.release_id for r in chosen]
    return batch


def mark_consumed(store: ObjectStore, model: str, release_ids: list[str], ds_id: str, wm: Watermark, now_ms: int) -> None:
    """Each release taken by the dataset `ds_id`, written once the dataset is (before the watermark moves)."""
    for rid in release_ids:
        done = ReleaseConsumed(release_id=rid, dataset_id=ds_id, watermark_before=wm, consumed_ms=now_ms)
        put_json(store, f"{release_prefix(model, rid)}/consumed.json", done.model_dump(mode="json"))


def _released_keys(store: ObjectStore, model: str) -> set[tuple[str, str, str]]:
    """(kind, dataset id, request id) of every row an earlier release holds."""
    held = set()
    for r, _ in releases(store, model):
        for kind in quarantine.KINDS:
            key = f"{release_prefix(model, r.release_id)}/{kind}.parquet"
            if store.exists(key):
                t = read_parquet(store, key).select(["dataset_id", "request_id"]).to_pylist()
                held |= {(kind, row["dataset_id"], row["request_id"]) for row in t}
    return held


def _verdicts_from_logs(store: ObjectStore, model: str, ds_id: str, request_ids: set[str]) -> pa.Table | None:
    """The feedback rows of these completions in their collection's feedback log files (that run filtered them as
    `completion_quarantined`), less any it quarantined (those need their own release); None when the collection
    wrote no manifest to name its files. A log file deleted since (retention) gives nothing."""
    if not store.exists(f"{dataset_prefix(model, ds_id)}/manifest.json"):
        return None
    manifest = read_manifest(store, model, ds_id)
    q_key = f"{quarantine_prefix(model, ds_id)}/feedback.parquet"
    q_rows = read_parquet(store, q_key).select(IDENTITY).to_pylist() if store.exists(q_key) else []
    skip = {json.dumps(r) for r in q_rows}
    found = []
    for key in manifest.source_files:
        if not key.startswith("logs/feedback/") or not store.exists(key):
            continue
        t = with_added_columns("feedback", read_parquet(store, key))
        t = t.filter(pc.is_in(t["request_id"], pa.array(sorted(request_ids), pa.string())))
        t = t.filter(pa.array([json.dumps(r) not in skip for r in t.select(IDENTITY).to_pylist()], pa.bool_()))
        if t.num_rows:
            ds, src = pa.array([ds_id] * t.num_rows, pa.string()), pa.array([key] * t.num_rows, pa.string())
            found.append(t.append_column("dataset_id", ds).append_column("source_key", src))
    return pa.concat_tables(found).select(["dataset_id", *SCHEMAS["feedback"].names, "source_key"]) if found else None


IDENTITY = ["request_id", "time_ms", "event"]  # a feedback row as the quarantine and the logs both hold it


@dataclass
class ReleasePlan:
    """What a release would write."""

    rows: dict[str, pa.Table]  # kind → rows in the stored schema + dataset_id (their collection), source_key
    verdicts_from_logs: int  # feedback rows read back from the logs for released completions
    skipped: int  # chosen rows an earlier release already holds
    other_reasons: dict[str, int]  # reasons besides the waived one the rows also broke: they will be quarantined again


def plan_release(
    store: ObjectStore,
    model: str,
    reason: str,
    dataset_id: str | None = None,
    kind: str | None = None,
    request_ids: list[str] | None = None,
) -> ReleasePlan:
    """The rows quarantined for `reason` (among others), from one collection or all, of one kind or both, optionally
    only those request ids; with the verdicts of the completions chosen. Raises ReleaseError when nothing matches."""
    found = quarantine.rows(store, model, reason, dataset_id, kind, reveal=True)
    held, wanted = _released_keys(store, model), set(request_ids or [])
    rows: dict[str, pa.Table] = {}
    skipped, others = 0, Counter()
    for k, table in found.items():
        ids = table.select(["dataset_id", "request_id"]).to_pylist()
        chosen = np.array([not wanted or r["request_id"] in wanted for r in ids], bool)
        free = np.array([(k, r["dataset_id"], r["request_id"]) not in held for r in ids], bool)
        skipped += int((chosen & ~free).sum())
        table = table.filter(pa.array(chosen & free))
        others.update(r for joined in table.column("reason").to_pylist() for r in joined.split(",") if r and r != reason)
        if table.num_rows:
            rows[k] = with_added_columns(k, table).select(["dataset_id", *SCHEMAS[k].names, "source_key"])
    from_logs = 0
    if "completions" in rows:
        by_ds: dict[str, set[str]] = {}
        for r in rows["completions"].select(["dataset_id", "request_id"]).to_pylist():
            by_ds.setdefault(r["dataset_id"], set()).add(r["request_id"])
        extra = [t for ds, ids in sorted(by_ds.items()) if (t := _verdicts_from_logs(store, model, ds, ids)) is not None]
        if extra:
            logs = pa.concat_tables(extra)
            from_logs = logs.num_rows
            rows["feedback"] = pa.concat_tables([rows["feedback"], logs]) if "feedback" in rows else logs
    if not rows:
        what = f"quarantined for {reason!r}" + (f" with request ids {sorted(wanted)}" if wanted else "")
        held_note = f" ({skipped} already released)" if skipped else ""
        raise ReleaseError(f"{model}: no rows {what} to release{held_note}; `tidal quarantine list {model}` shows the reasons")
    return ReleasePlan(rows, from_logs, skipped, dict(others.most_common()))


def write_release(
    store: ObjectStore, model: str, reason: str, by: str, why: str, now_ms: int, plan: ReleasePlan
) -> ReleaseRecord:
    """Write a planned release; the next collection takes it. Its record goes last: until then it does not exist."""
    if not why.strip():
        raise ReleaseError("a release needs a reason (--why): it is the audit trail of the rows let back in")
    rid = f"rel-{now_ms:013d}-{secrets.token_hex(3)}"
    prefix = release_prefix(model, rid)
    for k, table in plan.rows.items():
        put_bytes(store, f"{prefix}/{k}.parquet", parquet_bytes(table))
    record = ReleaseRecord(
        release_id=rid,
        model=model,
        waived_reason=reason,
        by=by,
        why=why,
        created_ms=now_ms,
        datasets=sorted({d for t in plan.rows.values() for d in t.column("dataset_id").to_pylist()}),
        rows={k: plan.rows[k].num_rows if k in plan.rows else 0 for k in quarantine.KINDS},
        verdicts_from_logs=plan.verdicts_from_logs,
        skipped_already_released=plan.skipped,
        other_reasons=plan.other_reasons,
    )
    put_json(store, f"{prefix}/release.json", record.model_dump(mode="json"))
    return record
