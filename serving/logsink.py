"""Durable log sink of the gateway: completions and feedback → local WAL (fsynced) → Parquet in the store.

    sink = LogSink(wal_dir, store, LogSinkSettings())
    sink.start()                                   # recovers what a crashed process left
    await sink.append("completions", record.model_dump())   # returns once the line is on disk
    ...
    sink.stop()                                    # closes segments, uploads what it can, joins threads

An acknowledged append survives a crash: it is in an fsynced WAL segment, and the uploader puts every
closed segment into the store under keys derived from the segment id (exactly once, see
serving/uploader.py). A store outage only grows the WAL; `wal_over_cap` raises the alarm.
File formats and the writer: serving/wal.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from pydantic import Field

from serving.uploader import Uploader
from serving.wal import CLOSED, UPLOADED, SinkStats, WalWriter, fsync_dir, iter_records, list_segments, recover
from tidal.section import Section
from tidal.store import ObjectStore

log = logging.getLogger("tidal.logsink")

KINDS = ("completions", "feedback")


class LogSinkSettings(Section):
    commit_interval_ms: float = Field(
        2.0,
        ge=0,
        description=(
            "Longest an append waits for others to share its fsync (group commit). The writer only waits while "
            "fewer appends have come than in its last batch, so a lone appender is not delayed; 0 = never wait "
            "(appends arriving during an fsync still share the next one)."
        ),
    )
    segment_max_bytes: int = Field(8 * 2**20, ge=1, description="A WAL segment is closed (and uploaded) once this large.")
    segment_max_age_s: float = Field(5.0, gt=0, description="…or once this old: bounds the delay until records reach the store.")
    upload_interval_s: float = Field(
        1.0, gt=0, description="Seconds between upload passes; also the first retry delay after a failure."
    )
    upload_backoff_max_s: float = Field(30.0, gt=0, description="Cap of the doubling retry delay while the store fails.")
    wal_cap_bytes: int = Field(
        2**30,
        ge=1,
        description=(
            "Alarm threshold: over it, uploaded segments are deleted early, and if the not-yet-uploaded ones alone "
            "exceed it `wal_over_cap` is set and a warning logged. Appends are never refused."
        ),
    )
    wal_warn_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "Early alarm: `wal_near_cap` is set (and a warning logged) once the not-yet-uploaded bytes pass this "
            "share of wal_cap_bytes, while there is still room to act."
        ),
    )
    retain_s: float = Field(
        86400.0, ge=0, description="Uploaded segments stay on local disk this long (start-up dedup reads them), then are deleted."
    )


class LogSink:
    def __init__(self, wal_dir: Path, store: ObjectStore, cfg: LogSinkSettings):
        self.wal_dir, self.store, self.cfg = Path(wal_dir), store, cfg
        self._stats = SinkStats(KINDS, cfg.wal_cap_bytes, cfg.wal_warn_fraction)
        self._uploader = Uploader(
            self.wal_dir,
            KINDS,
            store,
            self._stats,
            cfg.upload_interval_s,
            cfg.upload_backoff_max_s,
            cfg.retain_s,
            cfg.wal_cap_bytes,
        )
        self._writer = WalWriter(
            self.wal_dir, KINDS, self._stats, cfg.commit_interval_ms / 1000, cfg.segment_max_bytes, cfg.segment_max_age_s
        )
        self._started = self._stopped = False

    def start(self) -> None:
        """Close the open segments a previous process left (dropping a torn, never-acknowledged last line),
        account for what is on disk, and start the writer and uploader threads. Closed-not-uploaded
        segments are uploaded by the first pass."""
        if self._started:
            raise RuntimeError("LogSink.start() called twice")
        for kind in KINDS:  # the segments hold raw prompts: owner only
            (self.wal_dir / kind).mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (self.wal_dir, *(self.wal_dir / k for k in KINDS)):
            d.chmod(0o700)
        fsync_dir(self.wal_dir)
        torn = sum(recover(self.wal_dir, kind) for kind in KINDS)
        pending = [s for k in KINDS for s in list_segments(self.wal_dir, k, (CLOSED,))]  # none open after recover
        retained = [s for k in KINDS for s in list_segments(self.wal_dir, k, (UPLOADED,))]
        self._stats.add(
            {
                "torn_lines_total": torn,
                "segments_pending": len(pending),
                "wal_pending_bytes": sum(s.path.stat().st_size for s in pending),
                "wal_retained_bytes": sum(s.path.stat().st_size for s in retained),
            }
        )
        if pending:
            log.info("WAL %s: %d segments from a previous run wait for upload", self.wal_dir, len(pending))
        self._writer.start()
        self._uploader.start()
        self._started = True

    async def append(self, kind: str, record: dict) -> None:
        """Log one record (a model_dump() of the kind's record type); returns once it is fsynced.
        Validation happens at upload: a bad record is quarantined, never lost. If the caller is
        cancelled meanwhile the record is still written."""
        await self.submit(kind, record)

    def submit(self, kind: str, record: dict) -> asyncio.Future:
        """append() without the coroutine: the future resolves once the record is fsynced (call from the event loop;
        cancelling the future does not stop the write)."""
        if kind not in KINDS:
            raise ValueError(f"unknown log kind {kind!r}; expected one of {KINDS}")
        line = orjson.dumps(record) + b"\n"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._writer.submit(kind, line, loop, future)
        return future

    def flush_now(self, timeout_s: float | None = None) -> bool:
        """Close the open segments and upload every pending one (blocking), retrying store failures with
        back-off. True when all is in the store; False if timeout_s passed first (the data stays in the WAL)."""
        self._writer.rotate()
        return self._uploader.drain(None if timeout_s is None else time.monotonic() + timeout_s)

    async def flush(self, timeout_s: float | None = None) -> bool:
        return await asyncio.to_thread(self.flush_now, timeout_s)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Flush (for at most timeout_s of uploading: what remains is uploaded by the next start), then
        stop the threads. Appends after stop() raise. Returns whether everything reached the store."""
        if not self._started or self._stopped:
            return True
        self._stopped = True
        self._writer.stop()  # closes the open segments after the queued appends
        done = self._uploader.drain(time.monotonic() + timeout_s)
        self._uploader.stop()
        if not done:
            log.warning(
                "log sink stopped with %d segments not yet uploaded; the next start uploads them",
                self._stats.snapshot()["segments_pending"],
            )
        return done

    def metrics(self) -> dict[str, int]:
        """Counters: records_appended_total:<kind> (acknowledged), commits_total (fsync batches),
        uploads_total / upload_errors_total (object puts that succeeded / failed), segments_uploaded_total,
        quarantined_total (records), torn_lines_total. Gauges: wal_bytes (all segment files on disk),
        wal_pending_bytes (open + closed, not yet in the store), segments_pending (closed, waiting for
        upload), wal_near_cap (0/1: wal_pending_bytes > wal_warn_fraction · wal_cap_bytes), wal_over_cap
        (0/1: wal_pending_bytes > wal_cap_bytes)."""
        m = self._stats.snapshot()
        m["wal_bytes"] = m["wal_pending_bytes"] + m.pop("wal_retained_bytes")
        m["wal_near_cap"] = int(self._stats.near_cap)
        m["wal_over_cap"] = int(self._stats.over_cap)
        return m

    def iter_recent(self, kind: str) -> Iterator[dict]:
        """Every record in the local segments (open, closed, uploaded-but-retained), oldest first."""
        if kind not in KINDS:
            raise ValueError(f"unknown log kind {kind!r}; expected one of {KINDS}")
        return iter_records(self.wal_dir, kind)
