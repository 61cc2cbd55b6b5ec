"""Reading the gateway's stored logs for one collection run: partitions → the rows this run owns.

Log objects are `logs/{kind}/model=M/date=YYYY-MM-DD/hour=HH/part-<segment>.parquet`, written by the
gateway's uploader (serving/uploader.py) in the schemas of data_contracts/records.py. A file whose
schema differs (or that is not Parquet) is not read row by row: the whole file is quarantined with
reason `schema`, by the run that completes its hour.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_contracts.records import SCHEMAS, upgrade
from data_contracts.scope import (
    Partition,
    Range,
    Watermark,
    completes_hour,
    first_hour,
    is_new,
    late_rows,
    owned_completions,
    owned_feedback,
    parse_key,
    partition_prefix,
    rid_time_ms,
)
from tidal.store import ObjectStore

log = logging.getLogger("tidal.collect")
KINDS = ("completions", "feedback")


@dataclass(frozen=True)
class LogFile:
    key: str
    kind: str
    partition: Partition
    new: bool = False  # not there when the previous run listed the store: may hold late arrivals


@dataclass(frozen=True)
class Listing:
    """The log objects a run reads, and what it records of its listing for the next run."""

    files: list[LogFile]
    listed_from_ms: int  # objects modified before this were there when the listing started
    listed_recent: list[str]  # keys listed that were modified at or after listed_from_ms


@dataclass(frozen=True)
class BadFile:
    """A log object quarantined whole: not Parquet, or not in its kind's stored schema."""

    key: str
    kind: str
    rows: int  # from the Parquet footer when readable, else 0
    detail: str


@dataclass
class KindRows:
    """The rows of one kind this run owns, in the stored schema, with where each came from."""

    table: pa.Table
    source: np.ndarray  # (N,) int index into Batch.files
    joinable: np.ndarray | None = None  # feedback: (N,) bool, may be matched to this run's completions
    late: np.ndarray | None = None  # (N,) bool, arrived after an earlier run's range passed its time
    waived: np.ndarray | None = None  # (N,) object: the reason a release waives for the row (None: a log row)


@dataclass
class Batch:
    model: str
    rng: Range
    completions: KindRows
    feedback: KindRows
    files: list[str]  # log objects with owned rows
    bad_files: list[BadFile]
    future: dict[str, dict[str, int]] = field(default_factory=dict)  # kind → request id → time of future rows owned
    releases: list[str] = field(default_factory=list)  # ids of the releases appended (data_contracts/release.py)
    judged: dict[str, int] = field(default_factory=dict)  # judge id → its score rows appended (data_contracts/judgements.py)

    @property
    def partitions(self) -> list[str]:
        """Sorted partition keys (`logs/{kind}/model=M/date=D/hour=H`) the run owns rows of."""
        return sorted({partition_prefix(k) for k in self.files} | {partition_prefix(b.key) for b in self.bad_files})

    @property
    def empty(self) -> bool:
        return not (self.completions.table.num_rows or self.feedback.table.num_rows or self.bad_files)


def append_rows(batch: Batch, kind: str, key: str, table: pa.Table, waived: str | None = None) -> int:
    """Rows of another object (`key`: a release's or a judge's, `table` in the stored schema) appended to the batch's
    `kind`: not late, joinable (feedback), with the reason a release waives for them; returns the rows added."""
    rows: KindRows = getattr(batch, kind)
    n, added = rows.table.num_rows, table.num_rows
    if not added:
        return 0
    rows.table = pa.concat_tables([rows.table, table]).combine_chunks()
    rows.source = np.concatenate([rows.source, np.full(added, len(batch.files), dtype=np.int32)])
    batch.files.append(key)
    if waived is not None or rows.waived is not None:
        before = rows.waived if rows.waived is not None else np.full(n, None, dtype=object)
        rows.waived = np.concatenate([before, np.full(added, waived, dtype=object)])
    if rows.late is not None:
        rows.late = np.concatenate([rows.late, np.zeros(added, bool)])
    if kind == "feedback":
        rows.joinable = np.concatenate([rows.joinable, np.ones(added, bool)])
    return added


def find_log_files(store: ObjectStore, model: str, rng: Range, wm: Watermark, listed_from_ms: int) -> Listing:
    """Log objects of hours that may hold rows this run owns (future hours included: their rows fail the contract),
    and objects new since the previous run's listing in any hour (late arrivals). listed_from_ms: the listing's
    start less the clock skew allowed between this host and the store."""
    files, recent, seen_recent = [], [], set(wm.listed_recent)
    for kind in KINDS:
        start = first_hour(rng, kind)
        for key, modified_ms in store.list_modified(f"logs/{kind}/model={model}/").items():
            part = parse_key(key, model)
            if part is None:
                log.warning(
                    "ignoring %s: not a log part (expected logs/%s/model=%s/date=YYYY-MM-DD/hour=HH/part-*.parquet)",
                    store.uri(key),
                    kind,
                    model,
                )
                continue
            if modified_ms >= listed_from_ms:
                recent.append(key)
            new = is_new(wm, seen_recent, key, modified_ms)
            if part.hour_ms >= start or new:
                files.append(LogFile(key, kind, part, new))
    return Listing(files, listed_from_ms, recent)


def _read(path: Path, kind: str) -> tuple[pa.Table | None, str, int]:
    """(table, '', rows) for a file in the stored schema; (None, why, rows) otherwise."""
    expected = SCHEMAS[kind]
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        try:
            rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError):
            rows = 0
        return None, f"not a readable Parquet file: {e}", rows
    upgraded = upgrade(kind, table)  # a file in an earlier stored schema is read in the current one
    if upgraded is not None:
        return upgraded, "", upgraded.num_rows
    schema = table.schema.remove_metadata()
    if not schema.equals(expected):
        got, want = dict(zip(schema.names, map(str, schema.types))), dict(zip(expected.names, map(str, expected.types)))
        diff = {
            n: f"{got.get(n, 'missing')} (expected {want.get(n, 'no such column')})"
            for n in sorted(set(got) | set(want))
            if got.get(n) != want.get(n)
        }
        return None, f"schema differs from the stored {kind} schema: {diff or 'column order'}", table.num_rows
    return table, "", table.num_rows


def load_batch(store: ObjectStore, model: str, rng: Range, wm: Watermark, files: list[LogFile]) -> Batch:
    tables: dict[str, list[pa.Table]] = {k: [] for k in KINDS}
    sources: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    joinable: list[np.ndarray] = []
    used, bad, future = [], [], {k: {} for k in KINDS}
    lates: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="collect-") as tmp:
        for f in sorted(files, key=lambda f: f.key):
            local = Path(tmp) / "part.parquet"
            store.get_file(f.key, local)
            table, why, rows = _read(local, f.kind)
            done_hour = completes_hour(rng, f.partition, f.kind)
            if table is None:  # quarantined whole by the run completing its hour, or by the first to list it late
                if done_hour or (f.new and f.partition.end_ms <= (rng.c_old if f.kind == "completions" else rng.f_old)):
                    bad.append(BadFile(f.key, f.kind, rows, why))
                continue
            has_t = pc.is_valid(table["time_ms"]).to_numpy(zero_copy_only=False)
            t = pc.fill_null(table["time_ms"], 0).to_numpy()
            seen = wm.future_seen.get(f.kind, {})
            t_c = None
            if f.kind == "completions":
                owned = owned_completions(rng, t, has_t, done_hour, table["request_id"], seen)
                fb_join = None
            else:
                t_c = rid_time_ms(table["request_id"])
                owned, fb_join = owned_feedback(rng, t, has_t, t_c, done_hour, table["request_id"], seen)
            late = late_rows(rng, f.kind, f.partition, t, has_t, t_c) & ~owned if f.new else np.zeros(len(t), bool)
            take = owned | late
            if not take.any():
                continue
            kept = table.filter(pa.array(take))
            future_rows = owned & has_t & (t > rng.future_ms)
            if future_rows.any():
                ids = table["request_id"].to_pylist()
                future[f.kind].update({ids[i]: int(t[i]) for i in np.flatnonzero(future_rows) if ids[i] is not None})
            tables[f.kind].append(kept)
            sources[f.kind].append(np.full(kept.num_rows, len(used), dtype=np.int32))
            lates[f.kind].append(late[take])
            if fb_join is not None:
                joinable.append((fb_join & ~late)[take])
            used.append(f.key)

    def rows(kind: str) -> KindRows:
        table = pa.concat_tables(tables[kind]) if tables[kind] else SCHEMAS[kind].empty_table()
        source = np.concatenate(sources[kind]) if sources[kind] else np.zeros(0, np.int32)
        late = np.concatenate(lates[kind]) if lates[kind] else np.zeros(0, bool)
        return KindRows(table.combine_chunks(), source, late=late)

    batch = Batch(model, rng, rows("completions"), rows("feedback"), used, bad, future)
    batch.feedback.joinable = np.concatenate(joinable) if joinable else np.zeros(0, bool)
    return batch
