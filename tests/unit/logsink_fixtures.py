"""What the log sink's unit tests share: records, settings, starting a sink, and a store that fails (the `sinks`
fixture is in tests/unit/conftest.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pyarrow.parquet as pq

from data_contracts.records import CompletionRecord, FeedbackEvent, SamplingParams
from serving.logsink import LogSink, LogSinkSettings
from tidal.store import LocalStore

T0 = 1714572000000  # 2024-05-01T14:00:00Z
HOUR_MS = 3_600_000
SEGMENT_ID = r"\d{13}-[0-9a-f]{12}-\d{6}"


def completion(i: int, time_ms: int = T0, model: str = "tab", **over) -> dict:
    rec = CompletionRecord(
        request_id=f"{i:08x}-req.sig",
        time_ms=time_ms,
        model=model,
        version=2,
        served_name=f"{model}@v2",
        arm="control",
        user_hash="u1",
        client_id="cli",
        prompt_text=f"def f{i}(x):",
        completion_text=" return x",
        prompt_token_ids=[1, 2, i],
        completion_token_ids=[5, 6],
        behaviour_logprobs=[-0.5, -1.25],
        sampling=SamplingParams(stop=["\n"], seed=i),
        finish_reason="stop",
        latency_ms=12.5,
        replica="r0",
    ).model_dump()
    return rec | over


def feedback(i: int, time_ms: int = T0, model: str = "tab", **over) -> dict:
    rec = FeedbackEvent(
        request_id=f"{i:08x}-req.sig", time_ms=time_ms, model=model, event="partial", accepted_chars=i, client_id="cli"
    ).model_dump()
    return rec | over


def settings(**over) -> LogSinkSettings:
    # No background pass or age rotation unless a test asks: flush_now() decides when uploads happen.
    # Retries are fast (the back-off cap), so outage tests take milliseconds.
    base = {"commit_interval_ms": 1.0, "upload_interval_s": 3600, "segment_max_age_s": 3600, "upload_backoff_max_s": 0.01}
    return LogSinkSettings(**base | over)


async def append_all(sink: LogSink, kind: str, records: list[dict]) -> None:
    await asyncio.gather(*(sink.append(kind, r) for r in records))


def parquet_objects(root: Path, kind: str) -> dict[str, list[dict]]:
    """key → rows of every Parquet object under logs/<kind>/ of a LocalStore root."""
    store = LocalStore(root)
    return {k: pq.read_table(root / k).to_pylist() for k in store.list(f"logs/{kind}/")}


def wal_files(wal: Path, kind: str, suffix: str) -> list[Path]:
    return sorted(p for p in (wal / kind).iterdir() if re.fullmatch(SEGMENT_ID + re.escape(suffix), p.name))


def start(sinks: list[LogSink], wal: Path, store, **over) -> LogSink:
    sink = LogSink(wal, store, settings(**over))
    sink.start()
    sinks.append(sink)
    return sink


class FlakyStore:
    """A real LocalStore whose put_file raises for its first `failures` calls (a store outage)."""

    def __init__(self, inner: LocalStore, failures: int):
        self.inner, self.failures, self.url = inner, failures, inner.url

    def put_file(self, local: Path, key: str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("object store unavailable")
        self.inner.put_file(local, key)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
