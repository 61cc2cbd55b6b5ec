"""Log sink under trouble: invalid rows quarantined with their reason, store outages retried without loss, a segment
that always fails set aside, the WAL over its cap."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import orjson
import pytest

from tests.unit.logsink_fixtures import (
    SEGMENT_ID,
    T0,
    FlakyStore,
    append_all,
    completion,
    feedback,
    parquet_objects,
    start,
    wal_files,
)
from tidal.store import LocalStore

# ---- invalid rows, outages, the cap ---------------------------------------------------------------------


class RefusingStore(FlakyStore):
    """A real LocalStore that always refuses the objects of one segment (say, a deny policy on those keys)."""

    def __init__(self, inner: LocalStore):
        super().__init__(inner, failures=0)
        self.refuse = "never"

    def put_file(self, local: Path, key: str) -> None:
        if self.refuse in key and "/poison-" not in key:
            raise PermissionError(f"AccessDenied on {key}")
        self.inner.put_file(local, key)


def test_a_segment_that_always_fails_is_set_aside_and_no_longer_blocks_the_others(tmp_path: Path, sinks) -> None:
    """One upload that always failed blocked every later segment forever."""
    from serving.uploader import POISON_AFTER

    wal, store = tmp_path / "wal", RefusingStore(LocalStore(tmp_path / "store"))
    sink = start(sinks, wal, store)
    asyncio.run(append_all(sink, "completions", [completion(0), completion(1)]))
    sink._writer.rotate()
    (first,) = wal_files(wal, "completions", ".closed.jsonl")
    store.refuse = first.name.split(".")[0]
    for n in range(1, POISON_AFTER + 1):  # traffic goes on: each pass has a later segment, which uploads
        asyncio.run(append_all(sink, "completions", [completion(1 + n)]))
        sink._writer.rotate()
        if n < POISON_AFTER:
            with pytest.raises(PermissionError):  # a strike, not yet poison: the pass ends in the error
                sink._uploader.upload_pending()
            assert first.exists()
    sink._uploader.upload_pending()  # the last strike sets it aside

    m = sink.metrics()
    assert m["segments_poisoned_total"] == 1 and m["quarantined_total"] == 2 and m["segments_pending"] == 0
    assert m["upload_errors_total"] == POISON_AFTER
    assert sorted(
        r["request_id"] for rows in parquet_objects(tmp_path / "store", "completions").values() for r in rows
    ) == sorted(completion(1 + n)["request_id"] for n in range(1, POISON_AFTER + 1))
    poison = wal / "completions" / "poison"
    assert sorted(p.name for p in poison.iterdir()) == [f"{store.refuse}.jsonl", f"{store.refuse}.reason"]
    assert f"failed on {POISON_AFTER} passes in a row" in (poison / f"{store.refuse}.reason").read_text()
    assert "AccessDenied" in (poison / f"{store.refuse}.reason").read_text()
    copied = store.inner.list("quarantine/wal/completions/")
    assert copied == [
        f"quarantine/wal/completions/poison-{store.refuse}.jsonl",
        f"quarantine/wal/completions/poison-{store.refuse}.reason",
    ]


def test_a_segment_failing_once_as_the_store_comes_back_is_retried_not_set_aside(tmp_path: Path, sinks) -> None:
    """After a long outage, the first put as the store came back failed (a stale pooled connection) while the
    next segment uploaded: the segment, past POISON_AFTER failures of the outage, was set aside as poison and its
    acknowledged records left the dataset (the chaos suite's object-store outage caught it)."""
    from serving.uploader import POISON_AFTER

    wal = tmp_path / "wal"
    # Two segments; each pass of the outage fails both (two puts); the last failure hits only the first segment.
    passes = POISON_AFTER + 1
    store = FlakyStore(LocalStore(tmp_path / "store"), failures=2 * passes - 1)
    sink = start(sinks, wal, store)
    asyncio.run(append_all(sink, "completions", [completion(0), completion(1)]))
    sink._writer.rotate()
    asyncio.run(append_all(sink, "completions", [completion(2)]))
    assert sink.flush_now(timeout_s=10)

    m = sink.metrics()
    assert m["upload_errors_total"] == 2 * passes - 1 and m["segments_poisoned_total"] == 0 and m["quarantined_total"] == 0
    assert sorted(
        r["request_id"] for rows in parquet_objects(tmp_path / "store", "completions").values() for r in rows
    ) == sorted(completion(i)["request_id"] for i in range(3))
    assert not (wal / "completions" / "poison").exists()


def test_invalid_rows_are_quarantined_with_a_reason_and_counted(tmp_path: Path, sinks) -> None:
    wal, store = tmp_path / "wal", LocalStore(tmp_path / "store")
    # A closed segment left by an earlier run, with a line that is not JSON: start() queues it.
    (wal / "feedback").mkdir(parents=True)
    old_id = "1714572000000-0000001-000001"
    (wal / "feedback" / f"{old_id}.closed.jsonl").write_bytes(orjson.dumps(feedback(100)) + b"\n" + b"{not json\n")
    sink = start(sinks, wal, store)
    asyncio.run(append_all(sink, "feedback", [feedback(0), feedback(1, event="loved"), feedback(2, model="../escape")]))
    asyncio.run(append_all(sink, "completions", [completion(0), completion(1, completion_token_ids=[1, 2**40])]))
    assert sink.flush_now(timeout_s=10)

    assert sink.metrics()["quarantined_total"] == 4
    quarantined = {
        k: [orjson.loads(line) for line in (tmp_path / "store" / k).read_bytes().splitlines()]
        for k in store.list("quarantine/wal/")
    }
    assert set(quarantined) == {f"quarantine/wal/feedback/part-{old_id}.jsonl"} | {
        k for k in quarantined if re.fullmatch(rf"quarantine/wal/(feedback|completions)/part-{SEGMENT_ID}\.jsonl", k)
    }
    assert len(quarantined) == 3
    entries = [e for es in quarantined.values() for e in es]
    reasons = " | ".join(e["reason"] for e in entries)
    assert "not JSON" in reasons and "event" in reasons and "'../escape'" in reasons and "stored schema" in reasons
    assert {e["record"]["request_id"] for e in entries if isinstance(e["record"], dict)} == {
        feedback(1)["request_id"],
        feedback(2)["request_id"],
        completion(1)["request_id"],
    }
    # The valid rows are uploaded all the same.
    assert sorted(r["request_id"] for rows in parquet_objects(tmp_path / "store", "feedback").values() for r in rows) == sorted(
        [feedback(100)["request_id"], feedback(0)["request_id"]]
    )
    assert [r["request_id"] for rows in parquet_objects(tmp_path / "store", "completions").values() for r in rows] == [
        completion(0)["request_id"]
    ]


def test_store_outage_is_retried_and_loses_nothing(tmp_path: Path, sinks) -> None:
    flaky = FlakyStore(LocalStore(tmp_path / "store"), failures=3)
    sink = start(sinks, tmp_path / "wal", flaky, upload_interval_s=0.01, segment_max_age_s=0.02)
    records = [feedback(i, T0 + i) for i in range(20)]

    async def during_outage() -> None:
        for chunk in range(0, 20, 5):  # appends keep being acknowledged while uploads fail
            await append_all(sink, "feedback", records[chunk : chunk + 5])
            await asyncio.sleep(0.03)

    asyncio.run(during_outage())
    assert sink.flush_now(timeout_s=10)
    m = sink.metrics()
    assert m["upload_errors_total"] == 3 and flaky.failures == 0
    assert m["segments_pending"] == 0 and m["wal_pending_bytes"] == 0
    rows = [r for rows in parquet_objects(tmp_path / "store", "feedback").values() for r in rows]
    assert sorted(rows, key=lambda r: r["time_ms"]) == records


def test_wal_over_cap_raises_the_alarm_but_keeps_accepting(tmp_path: Path, sinks, caplog) -> None:
    flaky = FlakyStore(LocalStore(tmp_path / "store"), failures=10**6)
    sink = start(sinks, tmp_path / "wal", flaky, wal_cap_bytes=700)  # 3 feedback records (~186 bytes each) fit, 10 do not
    caplog.set_level(logging.WARNING, logger="tidal.logsink")
    asyncio.run(append_all(sink, "feedback", [feedback(i) for i in range(3)]))
    assert sink.metrics()["wal_over_cap"] == 0
    asyncio.run(append_all(sink, "feedback", [feedback(i) for i in range(3, 10)]))
    m = sink.metrics()
    assert m["wal_over_cap"] == 1 and m["wal_bytes"] > 700
    assert any("over the 700-byte cap" in r.getMessage() for r in caplog.records)

    assert not sink.flush_now(timeout_s=0.1)  # the store is down: gives up for now, keeps the data
    asyncio.run(sink.append("feedback", feedback(10)))
    assert sink.metrics()["upload_errors_total"] >= 1 and sink.metrics()["wal_over_cap"] == 1

    flaky.failures = 0
    assert asyncio.run(sink.flush())
    m = sink.metrics()
    assert m["wal_over_cap"] == 0 and m["wal_pending_bytes"] == 0
    assert m["wal_bytes"] <= 700  # the oldest retained copies were dropped early to get under the cap
    assert sum(len(r) for r in parquet_objects(tmp_path / "store", "feedback").values()) == 11
