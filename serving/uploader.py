"""Uploader of the log sink: closed WAL segments → Hive-partitioned Parquet objects, then local retention.

A closed segment becomes one Parquet object per (model, UTC date, UTC hour) of its rows, at
`logs/{kind}/model={model}/date={YYYY-MM-DD}/hour={HH}/part-{segment_id}.parquet`, plus, if any row is
invalid, `quarantine/wal/{kind}/part-{segment_id}.jsonl` (`{"reason", "record"}` lines). Keys depend on
the segment id only, so uploading a segment again (after a crash between the puts and the rename to
`.uploaded`) overwrites the same objects: each record is in the store once. A segment the store keeps
refusing while later ones upload is set aside under `<wal_dir>/<kind>/poison/` with its reason, copied to
`quarantine/wal/{kind}/poison-{segment_id}.jsonl` when the store takes it, and counted
(`segments_poisoned_total`, its records in `quarantined_total`); objects it put before failing stay.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from data_contracts.log_layout import Partition, partition_key, poison_key, quarantine_key
from data_contracts.records import RECORD_TYPES, to_table
from serving.wal import CLOSED, UPLOADED, Segment, SinkStats, fsync_dir, list_segments, read_lines
from tidal.store import ObjectStore

log = logging.getLogger("tidal.logsink")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SAFE_MODEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,127}$")  # no '/', '=', '..': one key segment
_ARROW_ERRORS = (ValueError, TypeError, OverflowError)  # pa.ArrowInvalid/ArrowTypeError subclass these
POISON_AFTER = 5  # failed uploads in a row of one segment, while the next one uploads, that make it poison
# A pass lists the WAL's folders (a glob and a name match per file) and the sweep stats every uploaded segment: with
# a day's segments retained (17,280 per kind at one per 5 s) that was ~40 ms and ~320 ms of CPU per pass, every
# second, growing with uptime. Now a pass lists only while the writer's count says segments wait, the sweep runs
# at most every min(retain_s, FULL_PASS_S) or when the WAL is over its cap and stops at the first segment young
# enough to keep, and a full pass (listing whatever the counters say) runs every FULL_PASS_S.
FULL_PASS_S = 60.0


def partition_rows(kind: str, lines: list[bytes]) -> tuple[dict[Partition, list[dict]], list[dict]]:
    """Validate each line as the kind's record type and group the valid ones by partition, in segment
    order. Returns (rows by partition, quarantine entries `{"reason", "record"}`)."""
    record_type = RECORD_TYPES[kind]
    parts: dict[Partition, list[dict]] = {}
    bad: list[dict] = []
    for line in lines:
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            bad.append({"reason": f"not JSON: {e}", "record": line.decode("utf-8", "replace")})
            continue
        try:
            row = record_type.model_validate(raw).model_dump()
        except ValidationError as e:
            reason = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<record>'}: {err['msg']}" for err in e.errors())
            bad.append({"reason": f"invalid {record_type.__name__}: {reason}", "record": raw})
            continue
        if not _SAFE_MODEL.match(row["model"]):
            bad.append({"reason": f"model {row['model']!r} cannot be a partition value", "record": raw})
            continue
        try:
            t = _EPOCH + timedelta(milliseconds=row["time_ms"])
        except OverflowError:
            bad.append({"reason": f"time_ms {row['time_ms']} out of range", "record": raw})
            continue
        parts.setdefault((row["model"], f"{t:%Y-%m-%d}", f"{t:%H}"), []).append(row)
    return parts, bad


def _to_table_or_quarantine(kind: str, rows: list[dict], bad: list[dict]) -> pa.Table | None:
    """The partition's table; rows the Parquet schema refuses (e.g. a token id past int32) go to `bad`."""
    try:
        return to_table(kind, rows)
    except _ARROW_ERRORS:
        good = []
        for row in rows:  # rare path: find the culprits one by one
            try:
                to_table(kind, [row])
                good.append(row)
            except _ARROW_ERRORS as e:
                bad.append({"reason": f"does not fit the stored schema: {e}", "record": row})
        return to_table(kind, good) if good else None


class Uploader:
    """Background thread uploading closed segments every interval_s; after a failure it waits
    interval_s·2^n (capped at backoff_max_s) and tries again, forever: the WAL keeps the data meanwhile."""

    def __init__(
        self,
        wal_dir: Path,
        kinds: tuple[str, ...],
        store: ObjectStore,
        stats: SinkStats,
        interval_s: float,
        backoff_max_s: float,
        retain_s: float,
        cap_bytes: int,
    ):
        self.wal_dir, self.kinds, self.store, self.stats = wal_dir, kinds, store, stats
        self.interval_s, self.backoff_max_s, self.retain_s, self.cap_bytes = interval_s, backoff_max_s, retain_s, cap_bytes
        self._lock = threading.Lock()  # one pass at a time: the background thread or a flush
        self._strikes: dict[str, int] = {}  # segment id → passes in a row it failed while the next segment uploaded
        self._last_full = self._last_sweep = float("-inf")  # monotonic times of the last full pass and sweep
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="logsink-upload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def backoff(self, failures: int) -> float:
        return min(self.interval_s * 2 ** min(failures, 30), self.backoff_max_s) if failures else self.interval_s

    def _run(self) -> None:
        # Arrow imports pandas at its first conversion of Python rows: ~1 s of CPU, holding the GIL from the
        # gateway's event loop. Paid here, at start-up, rather than at the first upload, in the middle of traffic.
        for kind in self.kinds:
            to_table(kind, [])
        failures = 0
        while not self._stop.is_set():
            self._wake.wait(self.backoff(failures))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            full = now - self._last_full >= FULL_PASS_S
            figures = self.stats.snapshot()
            try:
                if full or failures or figures["segments_pending"] > 0:
                    self.upload_pending()
                failures = 0
            except Exception:  # counted and logged in upload_pending
                failures += 1
            over_cap = figures["wal_pending_bytes"] + figures["wal_retained_bytes"] > self.cap_bytes
            try:
                if full or over_cap or now - self._last_sweep >= min(self.retain_s, FULL_PASS_S):
                    self.sweep()
                    self._last_sweep = now
            except OSError as e:
                log.error("WAL retention sweep failed: %s", e)
            if full:
                self._last_full = now

    def drain(self, deadline: float | None) -> bool:
        """Upload every closed segment, retrying with back-off until done (True) or past deadline (False)."""
        failures = 0
        while True:
            try:
                self.upload_pending()
                self.sweep()
                return True
            except Exception:
                failures += 1
                delay = self.backoff(failures)
                if deadline is not None and time.monotonic() + delay > deadline:
                    return False
                time.sleep(delay)

    def upload_pending(self) -> None:
        """One pass over the closed segments, oldest first. A failure ends the pass (raised: the store is likely
        down for the rest too) unless the next segment then uploads: the failure is then the segment's own, a
        strike against it, and the pass goes on past it (raising at its end, for the back-off). A segment with
        POISON_AFTER strikes in a row is poison, not an outage: it is set aside with its reason, so that it no
        longer blocks the rest. Failures while the store is down are no strikes, so a segment that fails once
        more as the store comes back (a stale pooled connection, say) is retried, never set aside."""
        with self._lock:
            own_failure: Exception | None = None
            for kind in self.kinds:
                segs, i = list_segments(self.wal_dir, kind, (CLOSED,)), 0
                while i < len(segs):
                    try:
                        self._upload_counted(segs[i])
                        i += 1
                        continue
                    except Exception as e:
                        if i + 1 == len(segs):
                            raise
                        self._upload_counted(segs[i + 1])  # raises too during an outage: no strike
                        strikes = self._strikes[segs[i].id] = self._strikes.get(segs[i].id, 0) + 1
                        if strikes >= POISON_AFTER:
                            self._strikes.pop(segs[i].id)
                            self.set_aside(
                                segs[i],
                                f"upload failed on {strikes} passes in a row while the next "
                                f"segment uploaded: {type(e).__name__}: {e}",
                            )
                        else:
                            own_failure = e
                        i += 2
            if own_failure is not None:
                raise own_failure

    def _upload_counted(self, seg: Segment) -> None:
        try:
            self.upload_segment(seg)
        except Exception as e:
            self.stats.add({"upload_errors_total": 1})
            log.warning(
                "upload of WAL segment %s/%s to %s failed (will retry): %s: %s",
                seg.kind,
                seg.id,
                self.store.url,
                type(e).__name__,
                e,
            )
            raise
        self._strikes.pop(seg.id, None)

    def set_aside(self, seg: Segment, reason: str) -> None:
        """Move a poison segment to <wal_dir>/<kind>/poison/ beside a .reason file, count its records as
        quarantined, and copy both to the store's quarantine if it takes them; an alarm stays on in the metrics
        (segments_poisoned_total) until an operator has dealt with it."""
        lines, _ = read_lines(seg.path)
        poison = seg.path.parent / "poison"
        poison.mkdir(exist_ok=True)
        size = seg.path.stat().st_size
        target = poison / f"{seg.id}.jsonl"
        os.rename(seg.path, target)
        (poison / f"{seg.id}.reason").write_text(reason + "\n")
        fsync_dir(seg.path.parent)
        self.stats.add(
            {"segments_pending": -1, "wal_pending_bytes": -size, "segments_poisoned_total": 1, "quarantined_total": len(lines)}
        )
        log.error("WAL segment %s/%s set aside as poison (%d records) at %s: %s", seg.kind, seg.id, len(lines), target, reason)
        try:
            self.store.put_file(target, poison_key(seg.kind, seg.id))
            self.store.put_file(poison / f"{seg.id}.reason", poison_key(seg.kind, seg.id, "reason"))
        except Exception as e:  # it stays on local disk, counted; the store may refuse exactly this object
            log.error("poison segment %s/%s could not be copied to the store: %s: %s", seg.kind, seg.id, type(e).__name__, e)

    def upload_segment(self, seg: Segment) -> None:
        lines, _ = read_lines(seg.path)  # closed segments have no torn tail (recovery cut it)
        parts, bad = partition_rows(seg.kind, lines)
        with tempfile.TemporaryDirectory(prefix="logsink-") as tmp:
            for i, (part, rows) in enumerate(sorted(parts.items())):
                table = _to_table_or_quarantine(seg.kind, rows, bad)
                if table is None:
                    continue
                local = Path(tmp) / f"{i}.parquet"
                pq.write_table(table, local)
                self.store.put_file(local, partition_key(seg.kind, part, seg.id))
                self.stats.add({"uploads_total": 1})
            if bad:
                local = Path(tmp) / "quarantine.jsonl"
                local.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in bad))
                self.store.put_file(local, quarantine_key(seg.kind, seg.id))
                self.stats.add({"uploads_total": 1, "quarantined_total": len(bad)})
                log.warning(
                    "WAL segment %s/%s: %d invalid records quarantined at %s",
                    seg.kind,
                    seg.id,
                    len(bad),
                    self.store.uri(quarantine_key(seg.kind, seg.id)),
                )
        size = seg.path.stat().st_size
        done = seg.moved(UPLOADED).path
        os.rename(seg.path, done)
        os.utime(done)  # retention counts from the upload
        self.stats.add(
            {"segments_pending": -1, "segments_uploaded_total": 1, "wal_pending_bytes": -size, "wal_retained_bytes": size}
        )

    def sweep(self) -> None:
        """Delete uploaded segments older than retain_s, and the oldest ones early (completions before feedback)
        while the WAL is over its cap: they are copies of what the store holds, kept only for iter_recent()."""
        with self._lock:
            # Over the cap, completions go first: the retained feedback refills the gateway's duplicate check after
            # a restart, and its segments are small.
            now = time.time()
            total = sum(self.stats.snapshot()[k] for k in ("wal_pending_bytes", "wal_retained_bytes"))
            for kind in sorted(self.kinds, key=lambda k: k == "feedback"):
                for seg in list_segments(self.wal_dir, kind, (UPLOADED,)):  # oldest first, as they were uploaded
                    try:
                        st = seg.path.stat()
                    except FileNotFoundError:
                        continue
                    if st.st_mtime > now - self.retain_s and total <= self.cap_bytes:
                        break  # the rest of this kind is younger still
                    seg.path.unlink()
                    total -= st.st_size
                    self.stats.add({"wal_retained_bytes": -st.st_size})
