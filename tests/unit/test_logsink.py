"""Log sink: group-committed WAL, Hive-partitioned Parquet uploads, recovery, local reads and retention, S3.
Invalid rows, store outages and the WAL's cap: tests/unit/test_logsink_outages.py."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import stat
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from serving.logsink import LogSink, LogSinkSettings
from tests.conftest import make_bucket
from tests.unit.logsink_fixtures import (
    HOUR_MS,
    SEGMENT_ID,
    T0,
    FlakyStore,
    append_all,
    completion,
    feedback,
    parquet_objects,
    settings,
    start,
    wal_files,
)
from tidal.store import LocalStore, S3Store

# ---- append → flush → Parquet ----------------------------------------------------------------------


def test_append_then_flush_writes_parquet_at_hive_keys(tmp_path: Path, sinks) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"))
    comps, fbs = [completion(i, T0 + i) for i in range(5)], [feedback(i, T0 + 10 + i) for i in range(3)]
    asyncio.run(append_all(sink, "completions", comps))
    asyncio.run(append_all(sink, "feedback", fbs))
    assert sink.flush_now(timeout_s=10)

    for kind, records in (("completions", comps), ("feedback", fbs)):
        objects = parquet_objects(tmp_path / "store", kind)
        assert len(objects) == 1
        [(key, rows)] = objects.items()
        assert re.fullmatch(rf"logs/{kind}/model=tab/date=2024-05-01/hour=14/part-{SEGMENT_ID}\.parquet", key)
        assert sorted(rows, key=lambda r: r["time_ms"]) == records
    m = sink.metrics()
    assert m["records_appended_total:completions"] == 5 and m["records_appended_total:feedback"] == 3
    assert m["uploads_total"] == 2 and m["segments_pending"] == 0 and m["wal_pending_bytes"] == 0
    assert m["wal_bytes"] > 0  # uploaded segments are retained locally


def test_records_in_two_hours_and_two_models_land_in_separate_partitions(tmp_path: Path, sinks) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"))
    late = T0 + HOUR_MS + 5 * 60_000  # 15:05
    records = [feedback(0, T0), feedback(1, late), feedback(2, T0 + 1), feedback(3, late, model="code")]
    asyncio.run(append_all(sink, "feedback", records))
    assert sink.flush_now(timeout_s=10)

    by_partition = {re.sub(r"/part-.*", "", k): rows for k, rows in parquet_objects(tmp_path / "store", "feedback").items()}
    assert set(by_partition) == {
        "logs/feedback/model=tab/date=2024-05-01/hour=14",
        "logs/feedback/model=tab/date=2024-05-01/hour=15",
        "logs/feedback/model=code/date=2024-05-01/hour=15",
    }
    assert by_partition["logs/feedback/model=tab/date=2024-05-01/hour=14"] == [records[0], records[2]]
    assert by_partition["logs/feedback/model=tab/date=2024-05-01/hour=15"] == [records[1]]
    assert by_partition["logs/feedback/model=code/date=2024-05-01/hour=15"] == [records[3]]


def test_group_commit_shares_fsyncs(tmp_path: Path, sinks, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"))
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd))[1])
    n = 400
    asyncio.run(append_all(sink, "feedback", [feedback(i) for i in range(n)]))
    assert sink.metrics()["records_appended_total:feedback"] == n
    assert 1 <= len(calls) <= n // 10, f"{len(calls)} fsyncs for {n} appends"
    assert len(list(sink.iter_recent("feedback"))) == n  # acknowledged means on disk already


def test_failed_fsync_fails_its_appends_and_cuts_them_off(tmp_path: Path, sinks, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"))
    asyncio.run(sink.append("feedback", feedback(0)))
    real_fsync, failing = os.fsync, [True]

    def fsync(fd: int) -> None:
        if failing and stat.S_ISREG(os.fstat(fd).st_mode):  # a segment's data, not its directory
            failing.clear()
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        asyncio.run(sink.append("feedback", feedback(1)))
    asyncio.run(sink.append("feedback", feedback(2)))  # a fresh segment
    assert [r["accepted_chars"] for r in sink.iter_recent("feedback")] == [0, 2]
    assert sink.metrics()["records_appended_total:feedback"] == 2
    assert sink.flush_now(timeout_s=10)
    rows = [r for rows in parquet_objects(tmp_path / "store", "feedback").values() for r in rows]
    assert sorted(r["accepted_chars"] for r in rows) == [0, 2]


def test_size_and_age_rotation_upload_in_the_background(tmp_path: Path, sinks) -> None:
    sink = start(
        sinks,
        tmp_path / "wal",
        LocalStore(tmp_path / "store"),
        segment_max_bytes=400,
        segment_max_age_s=0.05,
        upload_interval_s=0.05,
    )

    async def one_by_one() -> None:
        for i in range(8):
            await sink.append("feedback", feedback(i, T0 + i))

    asyncio.run(one_by_one())
    deadline = time.monotonic() + 2.5
    while sink.metrics()["records_appended_total:feedback"] != sum(
        len(r) for r in parquet_objects(tmp_path / "store", "feedback").values()
    ):
        assert time.monotonic() < deadline, "background uploader did not upload within 2.5 s"
        time.sleep(0.02)
    objects = parquet_objects(tmp_path / "store", "feedback")
    assert len(objects) >= 2  # 8 × ~186 bytes over 900-byte segments
    assert sorted(r["time_ms"] for rows in objects.values() for r in rows) == [T0 + i for i in range(8)]


# ---- crashes and re-uploads --------------------------------------------------------------------------


def test_crash_recovery_uploads_acknowledged_records_once_and_drops_torn_line(tmp_path: Path, sinks) -> None:
    wal, store = tmp_path / "wal", LocalStore(tmp_path / "store")
    crashed = LogSink(wal, store, settings(segment_max_bytes=1500))  # never stopped: the "crash"
    crashed.start()
    acked = [feedback(i, T0 + i) for i in range(27)]
    for chunk in range(0, 27, 5):  # batches of ~930 bytes → two closed segments plus an open one
        asyncio.run(append_all(crashed, "feedback", acked[chunk : chunk + 5]))
    assert wal_files(wal, "feedback", ".closed.jsonl")
    [open_segment] = wal_files(wal, "feedback", ".jsonl")
    with open(open_segment, "ab") as f:  # a write that was under way (not fsynced, never acknowledged)
        f.write(b'{"request_id": "torn-wri')

    sink = start(sinks, wal, store)
    assert sink.metrics()["torn_lines_total"] == 1
    assert not wal_files(wal, "feedback", ".jsonl")  # the open segment was closed
    assert sink.flush_now(timeout_s=10)
    rows = [r for rows in parquet_objects(tmp_path / "store", "feedback").values() for r in rows]
    assert sorted(rows, key=lambda r: r["time_ms"]) == acked
    assert sink.metrics()["quarantined_total"] == 0


def test_uploading_a_segment_again_overwrites_the_same_objects(tmp_path: Path, sinks) -> None:
    wal, store = tmp_path / "wal", LocalStore(tmp_path / "store")
    first = start(sinks, wal, store)
    asyncio.run(append_all(first, "completions", [completion(i, T0 + i * HOUR_MS) for i in range(3)]))
    assert first.flush_now(timeout_s=10)
    first.stop()
    before = parquet_objects(tmp_path / "store", "completions")
    assert len(before) == 3

    # A crash after the puts but before the rename to '.uploaded': the segment is uploaded again.
    for p in wal_files(wal, "completions", ".uploaded.jsonl"):
        p.rename(p.with_name(p.name.replace(".uploaded.", ".closed.")))
    again = start(sinks, wal, store)
    assert again.metrics()["segments_pending"] == 1
    assert again.flush_now(timeout_s=10)
    assert again.metrics()["uploads_total"] == 3
    assert parquet_objects(tmp_path / "store", "completions") == before


def test_two_gateways_of_the_same_pid_never_write_the_same_object(tmp_path: Path, sinks, monkeypatch) -> None:
    """Segment ids held the pid, which is 1 in every container: two gateway pods opening a segment in the same
    millisecond wrote the same object keys, and one pod's logs replaced the other's."""
    import types

    import serving.wal as wal_module

    frozen = types.SimpleNamespace(time_ns=lambda: T0 * 1_000_000, monotonic=time.monotonic)
    monkeypatch.setattr(wal_module, "time", frozen)  # both open their first segment in the same millisecond
    store = LocalStore(tmp_path / "store")
    pods = [start(sinks, tmp_path / f"pod{i}" / "wal", store) for i in range(2)]
    for i, pod in enumerate(pods):
        asyncio.run(append_all(pod, "completions", [completion(i)]))
    assert all(pod.flush_now(timeout_s=10) for pod in pods)
    objects = parquet_objects(tmp_path / "store", "completions")
    assert len(objects) == 2 and sorted(r["request_id"] for rows in objects.values() for r in rows) == sorted(
        completion(i)["request_id"] for i in range(2)
    )
    # the segments hold raw prompts: owner only
    wal = tmp_path / "pod0" / "wal"
    assert [oct(p.stat().st_mode & 0o777) for p in (wal, wal / "completions")] == ["0o700", "0o700"]
    assert {oct(p.stat().st_mode & 0o777) for p in (wal / "completions").iterdir()} == {"0o600"}


# ---- local reads, retention, lifecycle --------------------------------------------------------------


def test_iter_recent_reads_uploaded_closed_and_open_segments_oldest_first(tmp_path: Path, sinks) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"), segment_max_bytes=900)
    records = [feedback(i, T0 + i) for i in range(12)]
    asyncio.run(append_all(sink, "feedback", records[:4]))
    assert sink.flush_now(timeout_s=10)  # → uploaded, retained
    for r in records[4:]:
        asyncio.run(sink.append("feedback", r))  # → closed by size, and an open one
    wal = tmp_path / "wal"
    assert all(wal_files(wal, "feedback", s) for s in (".uploaded.jsonl", ".closed.jsonl", ".jsonl"))
    assert list(sink.iter_recent("feedback")) == records
    assert list(sink.iter_recent("completions")) == []


def test_uploaded_segments_are_deleted_after_retain_s(tmp_path: Path, sinks) -> None:
    sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"), retain_s=0)
    asyncio.run(append_all(sink, "completions", [completion(i) for i in range(3)]))
    assert sink.flush_now(timeout_s=10)
    assert not list((tmp_path / "wal" / "completions").iterdir())
    assert sink.metrics()["wal_bytes"] == 0
    assert len(parquet_objects(tmp_path / "store", "completions")) == 1


def test_append_refuses_unknown_kinds_and_a_stopped_sink(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "wal", LocalStore(tmp_path / "store"), settings())
    with pytest.raises(RuntimeError, match="start"):
        asyncio.run(sink.append("feedback", feedback(0)))
    sink.start()
    with pytest.raises(ValueError, match="unknown log kind"):
        asyncio.run(sink.append("clicks", {}))
    asyncio.run(sink.append("feedback", feedback(0)))
    assert sink.stop(timeout_s=5)
    assert len(parquet_objects(tmp_path / "store", "feedback")) == 1  # stop() flushed
    with pytest.raises(RuntimeError):
        asyncio.run(sink.append("feedback", feedback(1)))


def test_settings_refuse_unknown_keys() -> None:
    with pytest.raises(ValueError, match="extra"):
        LogSinkSettings(commit_interval=3)


# ---- S3 (a real moto server) -----------------------------------------------------------------------------

BUCKET = "tidal-logs"


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> str:
    make_bucket(s3_endpoint, BUCKET)
    return s3_endpoint


def test_s3_round_trip(s3_bucket: str, tmp_path: Path, sinks) -> None:
    store = S3Store(BUCKET, "prefix", s3_bucket, "us-east-1")
    sink = start(sinks, tmp_path / "wal", store)
    comps = [completion(i, T0 + i) for i in range(3)]
    asyncio.run(append_all(sink, "completions", comps))
    assert sink.flush_now(timeout_s=10)

    [key] = store.list("logs/completions/")
    assert re.fullmatch(rf"logs/completions/model=tab/date=2024-05-01/hour=14/part-{SEGMENT_ID}\.parquet", key)
    listed = store.client.list_objects_v2(Bucket=BUCKET, Prefix="prefix/logs/")
    assert [o["Key"] for o in listed["Contents"]] == [f"prefix/{key}"]
    store.get_file(key, tmp_path / "got.parquet")
    assert pq.read_table(tmp_path / "got.parquet").to_pylist() == comps


def test_wal_near_cap_warns_before_the_cap_is_reached(tmp_path: Path, sinks, caplog) -> None:
    flaky = FlakyStore(LocalStore(tmp_path / "store"), failures=10**6)
    sink = start(sinks, tmp_path / "wal", flaky, wal_cap_bytes=2000, wal_warn_fraction=0.5)
    caplog.set_level(logging.WARNING, logger="tidal.logsink")
    seen = []
    for i in range(40):
        asyncio.run(sink.append("feedback", feedback(i)))
        m = sink.metrics()
        seen.append((m["wal_pending_bytes"], m["wal_near_cap"], m["wal_over_cap"]))
        if m["wal_over_cap"]:
            break
    first_near = next(i for i, (_, near, _) in enumerate(seen) if near)
    pending, _, over = seen[first_near]
    assert 1000 < pending <= 2000 and over == 0  # the early alarm fires with room left
    assert all(not near for p, near, _ in seen if p <= 1000)
    assert seen[-1][1:] == (1, 1)  # past the cap both are raised
    assert any("nearing its 2000-byte cap" in r.getMessage() for r in caplog.records)
    flaky.failures = 0
    assert asyncio.run(sink.flush())
    assert (sink.metrics()["wal_near_cap"], sink.metrics()["wal_over_cap"]) == (0, 0)


def test_the_uploader_lists_the_wal_only_when_segments_wait_and_sweeps_stop_at_the_first_young_one(
    tmp_path: Path, sinks, monkeypatch
) -> None:
    """With a day of segments retained, listing the WAL and stat-ing every uploaded segment each second cost a core's
    third; an idle uploader now lists nothing between full passes, and a sweep stats one young segment per kind."""
    import serving.uploader as uploader

    wal = tmp_path / "wal" / "completions"
    wal.mkdir(parents=True)
    for i in range(50):  # uploaded segments retained from earlier: young, kept
        (wal / f"{1796605670623 + i * 5000}-05ef53073ee8-{i:06d}.uploaded.jsonl").write_bytes(b"{}\n")
    listed, stats = [], []
    real_list = uploader.list_segments
    monkeypatch.setattr(uploader, "list_segments", lambda *a, **k: listed.append(a[1]) or real_list(*a, **k))
    with monkeypatch.context() as m:  # the sink's start counts the retained bytes once; the passes are what is watched
        m.setattr(uploader.Uploader, "start", lambda self: None)
        sink = start(sinks, tmp_path / "wal", LocalStore(tmp_path / "store"), upload_interval_s=0.02)
    monkeypatch.setattr(Path, "stat", lambda self, *a, real=Path.stat, **k: stats.append(self.name) or real(self, *a, **k))
    listed.clear()
    sink._uploader.start()
    time.sleep(1.0)  # ~50 passes
    assert len(listed) == 4, listed  # the first pass: its listing and its sweep's, of each kind; nothing since
    assert sum(name.endswith(".uploaded.jsonl") for name in stats) == 1  # the oldest, found young: the sweep stopped
