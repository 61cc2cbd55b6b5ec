"""Record factories for the collection tests: CompletionRecord / FeedbackEvent rows written to a store
the way the gateway's uploader writes them (data_contracts.records.to_table, Parquet, partition keys).

Defective rows bypass the record types on purpose: they stand for what a buggy or foreign writer
could leave in the store, which is what the contracts are for.
"""

from __future__ import annotations

import itertools
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from data_contracts.log_layout import partition_key
from data_contracts.records import CompletionRecord, FeedbackEvent, SamplingParams, to_table
from serving.request_ids import RequestIdSigner
from tidal.store import ObjectStore

SIGNER = RequestIdSigner(b"unit-test-request-id-secret")
T0 = 1_767_225_600_000  # 2026-01-01T00:00Z
HOUR = 3_600_000
_segments = itertools.count()


class FixedVersions:
    """Test double of the registry look-up only: a fixed set of versions and a champion."""

    def __init__(self, known: list[int], champion: int | None):
        self.known, self.champion = known, champion

    def versions(self, model: str) -> list[int]:
        return list(self.known)

    def aliases(self, model: str) -> dict[str, int]:
        return {} if self.champion is None else {"champion": self.champion}


def completion(
    t: int,
    i: int = 0,
    version: int = 1,
    text: str = "    return a + b",
    prompt: str = "def add(a, b):\n",
    arm: str = "control",
    client: str = "alice",
    n_tokens: int = 4,
) -> dict:
    rid = SIGNER.issue("tab", client, t)
    return CompletionRecord(
        request_id=rid,
        time_ms=t,
        model="tab",
        version=version,
        served_name=f"tab@v{version}",
        arm=arm,
        user_hash=f"u{i % 7}",
        client_id=client,
        prompt_text=prompt,
        completion_text=text,
        prompt_token_ids=list(range(10, 10 + len(prompt))),
        completion_token_ids=list(range(1, n_tokens + 1)),
        behaviour_logprobs=[-0.5] * n_tokens,
        sampling=SamplingParams(),
        finish_reason="stop",
        latency_ms=12.5,
        replica="tab-0",
    ).model_dump()


def feedback(
    c: dict, event: str = "accepted", after_ms: int = 2_000, chars: int | None = None, client: str | None = None, **fields
) -> dict:
    """fields: score, thumbs, edit_text or source of the event."""
    return FeedbackEvent(
        request_id=c["request_id"],
        time_ms=c["time_ms"] + after_ms,
        model="tab",
        event=event,
        accepted_chars=chars,
        client_id=client or c["client_id"],
        **fields,
    ).model_dump()


def partition_of(t: int) -> tuple[str, str, str]:
    d = datetime.fromtimestamp(t / 1000, UTC)
    return "tab", f"{d:%Y-%m-%d}", f"{d:%H}"


def put_rows(store: ObjectStore, kind: str, rows: list[dict], part_time: int | None = None, segment_id: str | None = None) -> str:
    """One log object of rows (all in the partition of part_time, default the first row's time), named by
    segment_id (default: a counter)."""
    part = partition_of(part_time if part_time is not None else rows[0]["time_ms"])
    key = partition_key(kind, part, segment_id or f"{next(_segments):012d}")
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(to_table(kind, rows), Path(tmp) / "p.parquet")
        store.put_file(Path(tmp) / "p.parquet", key)
    return key


def put_logs(store: ObjectStore, kind: str, rows: list[dict]) -> list[str]:
    """Rows grouped into their hour partitions, one object each (as the uploader does per segment)."""
    by_part: dict[tuple, list[dict]] = {}
    for r in rows:
        by_part.setdefault(partition_of(r["time_ms"]), []).append(r)
    return [put_rows(store, kind, rs) for rs in by_part.values()]


def test_factories_write_the_stored_schema(tmp_path):
    from data_contracts.records import COMPLETION_SCHEMA
    from tidal.store import LocalStore

    store = LocalStore(tmp_path)
    c = completion(T0 + 5)
    keys = put_logs(store, "completions", [c]) + put_logs(store, "feedback", [feedback(c)])
    assert keys[0].startswith("logs/completions/model=tab/date=2026-01-01/hour=00/part-")
    assert pq.read_schema(tmp_path / keys[0]).remove_metadata().equals(COMPLETION_SCHEMA)
    assert FixedVersions([1, 2], 2).aliases("tab") == {"champion": 2}
