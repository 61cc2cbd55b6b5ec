"""What the collect flow set aside: the quarantined rows of a model, by reason, read back from the store.

    quarantine/model=M/<dataset-id>/completions.parquet   rows with `reason` (every reason, comma-joined), `source_key`
    quarantine/model=M/<dataset-id>/feedback.parquet
    quarantine/model=M/<dataset-id>/files/<log key>       log objects quarantined whole (wrong schema, unreadable)

The row files are the source of truth (a run that failed after quarantining wrote no manifest); a dataset's
manifest, when there is one, adds the run's time and the details of whole files. Shown rows have their text
redacted (secrets, e-mail addresses) unless the caller asks for it as stored: a quarantined row is often
quarantined for carrying one.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from data_contracts.dataset import dataset_prefix, quarantine_prefix, read_manifest, read_parquet
from data_contracts.secrets import redact
from tidal.store import ObjectStore

KINDS = ("completions", "feedback")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReasonCount(_Record):
    """Rows of one kind quarantined for one reason by one collection (a row with several reasons counts under each)."""

    dataset_id: str
    kind: str = Field(description="completions | feedback")
    reason: str
    rows: int
    created_ms: int | None = Field(description="The collection's as-of time; None when it wrote no manifest.")


class QuarantinedFile(_Record):
    """A log object quarantined whole: its copy's key, and what the manifest says about it (if any)."""

    dataset_id: str
    key: str = Field(description="Key of the copy under quarantine/.")
    kind: str | None = None
    rows: int | None = None
    detail: str | None = None


class QuarantineIndex(_Record):
    """Everything quarantined for one model (the reply of `tidal quarantine list MODEL --json`)."""

    model: str
    counts: list[ReasonCount]
    files: list[QuarantinedFile]

    def by_reason(self) -> dict[str, int]:
        """Rows per reason over every collection and kind, largest first."""
        total: Counter[str] = Counter()
        for c in self.counts:
            total[c.reason] += c.rows
        return dict(total.most_common())


def _dataset_ids(store: ObjectStore, model: str) -> list[str]:
    root = f"quarantine/model={model}/"
    return sorted({key[len(root) :].split("/", 1)[0] for key in store.list(root)})


def _reasons(column: pa.ChunkedArray) -> list[list[str]]:
    """Each row's reasons (write_quarantine stores them comma-joined)."""
    return [[r for r in (joined or "").split(",") if r] for joined in column.to_pylist()]


def index(store: ObjectStore, model: str) -> QuarantineIndex:
    """The model's quarantine, per collection, kind and reason, with the files quarantined whole."""
    counts, files = [], []
    for ds in _dataset_ids(store, model):
        prefix = quarantine_prefix(model, ds)
        manifest = read_manifest(store, model, ds) if store.exists(f"{dataset_prefix(model, ds)}/manifest.json") else None
        created = manifest.created_ms if manifest else None
        for kind in KINDS:
            key = f"{prefix}/{kind}.parquet"
            if store.exists(key):
                reasons = Counter(r for row in _reasons(read_parquet(store, key).column("reason")) for r in row)
                counts += [
                    ReasonCount(dataset_id=ds, kind=kind, reason=r, rows=n, created_ms=created)
                    for r, n in sorted(reasons.items())
                ]
        bad = {f"{prefix}/files/{b.key}": b for b in manifest.schema_quarantined_files} if manifest else {}
        for key in sorted(k for k in store.list(f"{prefix}/files/")):
            b = bad.get(key)
            files.append(
                QuarantinedFile(
                    dataset_id=ds, key=key, kind=b.kind if b else None, rows=b.rows if b else None, detail=b.detail if b else None
                )
            )
    return QuarantineIndex(model=model, counts=counts, files=files)


def rows(
    store: ObjectStore, model: str, reason: str, dataset_id: str | None = None, kind: str | None = None, reveal: bool = False
) -> dict[str, pa.Table]:
    """{kind: table} of the rows quarantined for `reason` (among others), from one collection or all (in order), with
    `dataset_id` as the first column. Text columns are redacted unless `reveal`. Unknown names are refused."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    known = _dataset_ids(store, model)
    if dataset_id is not None and dataset_id not in known:
        raise ValueError(f"no quarantine for dataset {dataset_id!r} of model {model!r}; known: {', '.join(known) or 'none'}")
    out: dict[str, list[pa.Table]] = {}
    for ds in [dataset_id] if dataset_id else known:
        for k in [kind] if kind else KINDS:
            key = f"{quarantine_prefix(model, ds)}/{k}.parquet"
            if not store.exists(key):
                continue
            table = read_parquet(store, key)
            hit = pa.array([reason in row for row in _reasons(table.column("reason"))], pa.bool_())
            table = table.filter(hit)
            if table.num_rows:
                out.setdefault(k, []).append(table.add_column(0, "dataset_id", pa.array([ds] * table.num_rows, pa.string())))
    tables = {k: pa.concat_tables(ts, promote_options="default") for k, ts in out.items()}
    return tables if reveal else {k: _redacted(t) for k, t in tables.items()}


def _redacted(table: pa.Table) -> pa.Table:
    """Every string column's secrets and e-mail addresses replaced by [REDACTED:<kind>] (the keys and reasons too:
    they hold none, and redact leaves them as they are)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            values = [None if v is None else redact(v)[0] for v in table.column(i).to_pylist()]
            table = table.set_column(i, field, pa.array(values, field.type))
    return table
