"""The collection core over a real local store: idempotence, crash safety, and the watermark's accounting
(every stored row counted by exactly one run)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from data_contracts import dataset
from data_contracts.collect_settings import CollectSettings
from data_contracts.dataset import read_manifest, read_parquet, read_watermark
from data_contracts.scope import rid_time_ms
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, SIGNER, T0, FixedVersions, completion, feedback, put_logs
from tidal.store import LocalStore

MIN = 60_000
CFG = CollectSettings()  # feedback_timeout_s 900, upload_grace_s 60
VERSIONS = FixedVersions([1], 1)


def collect(store, as_of, **kw):
    return collect_once(store, VERSIONS, "tab", CFG, as_of, **kw)


def traffic(store, start: int, n: int, verdicts: int):
    cs = [completion(start + i * 1000, i) for i in range(n)]
    put_logs(store, "completions", cs)
    put_logs(store, "feedback", [feedback(c, "accepted" if i % 2 else "rejected") for i, c in enumerate(cs[:verdicts])])
    return cs


def dataset_ids(store) -> set[str]:
    return {k.split("/")[2] for k in store.list("datasets/model=tab/")}


def test_second_run_finds_nothing_new_and_duplicates_nothing(tmp_path):
    store = LocalStore(tmp_path)
    traffic(store, T0 + 5 * MIN, 10, 8)
    first = collect(store, T0 + 2 * HOUR)
    again = collect(store, T0 + 2 * HOUR)
    later = collect(store, T0 + 3 * HOUR)
    assert first.new and first.samples.num_rows == 8
    assert (again.dataset_id, again.new) == (first.dataset_id, False) and (later.dataset_id, later.new) == (
        first.dataset_id,
        False,
    )
    assert dataset_ids(store) == {first.dataset_id}
    wm = read_watermark(store, "tab")
    assert wm.dataset_id == first.dataset_id and wm.hour == "2026-01-01T00" and wm.completions_through_ms == T0 + HOUR


def test_crash_between_dataset_write_and_watermark_is_redone_under_the_same_id(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    traffic(store, T0 + 5 * MIN, 10, 8)
    real_write, calls = dataset.write_watermark, []

    def crash(store, wm):
        raise OSError("store went away before the watermark was written")

    monkeypatch.setattr(dataset, "write_watermark", crash)
    with pytest.raises(OSError, match="store went away"):
        collect(store, T0 + 2 * HOUR)
    [crashed_id] = dataset_ids(store)
    assert read_watermark(store, "tab") is None
    crashed = read_parquet(store, f"datasets/model=tab/{crashed_id}/part-0.parquet")

    monkeypatch.setattr(dataset, "write_watermark", lambda store, wm: calls.append(wm) or real_write(store, wm))
    redo = collect(store, T0 + 2 * HOUR + 10 * MIN)  # a little later: same partitions, same id
    assert redo.dataset_id == crashed_id and dataset_ids(store) == {crashed_id}
    assert redo.samples.equals(crashed) and redo.manifest.stored()["digest"] == read_manifest(store, "tab", crashed_id).digest
    assert collect(store, T0 + 3 * HOUR).new is False
    assert len(calls) == 1 and read_watermark(store, "tab").dataset_id == crashed_id


def test_a_scheduled_run_waits_until_the_hour_closed_and_its_verdicts_are_in(tmp_path):
    store = LocalStore(tmp_path)
    traffic(store, T0 + 10 * MIN, 4, 4)
    assert collect(store, T0 + 50 * MIN).new is False  # hour open
    assert collect(store, T0 + HOUR + 5 * MIN).new is False  # closed, verdict window (15 min) + grace not over
    res = collect(store, T0 + HOUR + 17 * MIN)
    assert res.new and res.samples.num_rows == 4


def test_a_verdict_in_the_next_hour_is_joined_and_counted_once(tmp_path):
    store = LocalStore(tmp_path)
    c = completion(T0 + HOUR - 1000)
    put_logs(store, "completions", [c])
    put_logs(store, "feedback", [feedback(c, "accepted", after_ms=3000)])  # lands in hour 1's partition
    first = collect(store, T0 + HOUR + 20 * MIN)
    assert first.samples["event"].to_pylist() == ["accepted"] and first.manifest.stored()["counts"]["feedback"]["in"] == 1
    traffic(store, T0 + HOUR + 10 * MIN, 2, 2)
    second = collect(store, T0 + 2 * HOUR + 20 * MIN)
    assert second.manifest.stored()["counts"]["feedback"]["in"] == 2  # the hour-1 verdict of hour 0 is not counted again
    assert second.samples.num_rows == 2


def test_late_verdicts_are_counted_once_and_not_used(tmp_path):
    store = LocalStore(tmp_path)
    a, b = completion(T0 + 10 * MIN), completion(T0 + 11 * MIN)
    put_logs(store, "completions", [a, b])
    put_logs(store, "feedback", [feedback(a, "accepted", after_ms=20 * MIN)])  # after the 15 min timeout
    first = collect(store, T0 + HOUR + 20 * MIN)
    assert first.manifest.stored()["counts"]["feedback"]["filtered_by_reason"] == {"late_feedback": 1}
    put_logs(store, "feedback", [feedback(b, "accepted", after_ms=HOUR + 30 * MIN)])  # stored after that run
    second = collect(store, T0 + 2 * HOUR + 20 * MIN)
    assert second.new and second.manifest.stored()["counts"]["feedback"] == {
        "in": 1,
        "kept": 0,
        "quarantined": 0,
        "quarantined_by_reason": {},
        "filtered": 1,
        "filtered_by_reason": {"late_feedback": 1},
    }
    assert collect(store, T0 + 5 * HOUR).new is False


def test_open_hour_runs_take_only_what_is_new(tmp_path):
    store = LocalStore(tmp_path)
    first_batch = traffic(store, T0 + 5 * MIN, 3, 1)
    first = collect(store, T0 + 10 * MIN, include_open_hour=True)
    assert first.new and first.manifest.stored()["counts"]["completions"]["in"] == 3
    second_batch = traffic(store, T0 + 11 * MIN, 2, 2)
    put_logs(store, "feedback", [feedback(first_batch[1], "accepted", after_ms=6 * MIN)])  # after the first run
    second = collect(store, T0 + 13 * MIN, include_open_hour=True)
    assert second.new and second.dataset_id != first.dataset_id
    assert second.manifest.stored()["counts"]["completions"]["in"] == 2
    assert second.manifest.stored()["counts"]["feedback"]["filtered_by_reason"] == {"late_feedback": 1}
    assert set(second.samples["request_id"].to_pylist()) == {c["request_id"] for c in second_batch}
    assert collect(store, T0 + 13 * MIN, include_open_hour=True).new is False
    # a record younger than upload_grace_s (60 s) may still be in a gateway's log: the next run takes it
    [young] = traffic(store, T0 + 13 * MIN + 30_000, 1, 1)
    assert collect(store, T0 + 13 * MIN + 40_000, include_open_hour=True).new is False
    third = collect(store, T0 + 15 * MIN, include_open_hour=True)
    assert set(third.samples["request_id"].to_pylist()) == {young["request_id"]}
    # the scheduled run after the hour closes has nothing left to take
    assert collect(store, T0 + 2 * HOUR).new is False


def test_future_rows_are_quarantined_once(tmp_path):
    store = LocalStore(tmp_path)
    c = completion(T0 + 3 * HOUR)  # the gateway's clock was 3 hours ahead
    put_logs(store, "completions", [c])
    traffic(store, T0 + 5 * MIN, 1, 1)
    first = collect(store, T0 + HOUR + 20 * MIN)
    assert first.manifest.stored()["counts"]["completions"]["quarantined_by_reason"] == {"future_time": 1}
    assert collect(store, T0 + 2 * HOUR + 20 * MIN).new is False  # still in the future: not counted again
    assert list(read_watermark(store, "tab").future_seen["completions"]) == [c["request_id"]]
    traffic(store, T0 + 5 * HOUR, 1, 1)
    later = collect(store, T0 + 6 * HOUR + 20 * MIN)  # the range passes it: still not counted again
    assert later.new and later.manifest.stored()["counts"]["completions"]["in"] == 1
    assert read_watermark(store, "tab").future_seen == {"completions": {}, "feedback": {}}


def test_request_id_times_are_read_without_the_secret():
    import base64

    v1 = base64.urlsafe_b64encode(bytes([1]) + bytes(12) + (T0 + 9).to_bytes(8, "big") + b"\x03tab\x01c").rstrip(b"=")
    v3 = base64.urlsafe_b64encode(bytes([3]) + bytes(12) + (T0 + 9).to_bytes(8, "big") + b"\x03tab\x01c").rstrip(b"=")
    ids = [
        SIGNER.issue("tab", "alice", T0 + 7, version=4, arm="canary"),  # format 2
        "not-an-id",
        None,
        SIGNER.issue("a-model", "some-client", 2**41),
        v1.decode() + ".sig",  # format 1, issued before an upgrade
        v3.decode() + ".sig",  # a format this code does not know
    ]
    assert rid_time_ms(pa.array(ids)).tolist() == [T0 + 7, -1, -1, 2**41, T0 + 9, -1]


def test_reports_and_data_docs(tmp_path):
    from data_contracts.report import quarantine_rows, report_markdown

    store = LocalStore(tmp_path / "store")
    cs = traffic(store, T0 + 5 * MIN, 6, 5)
    put_logs(store, "feedback", [feedback(completion(T0 + 9 * MIN), "accepted")])  # an orphan
    res = collect_once(store, FixedVersions([1, 2], 2), "tab", CFG, T0 + 2 * HOUR, docs_dir=tmp_path / "docs")
    pages = {p.relative_to(tmp_path / "docs").parts[:2] for p in (tmp_path / "docs").rglob("*.html")}
    assert {
        ("expectations", "completions.html"),
        ("expectations", "feedback.html"),
        ("validations", "completions"),
        ("validations", "feedback"),
        ("index.html",),
    } <= pages
    assert quarantine_rows(res.manifest) == [{"kind": "feedback", "reason": "orphan_feedback", "rows": 1}]
    md = report_markdown(res.manifest, "s3://bucket/reports/index.html", "run-1", store)
    assert f"collected {res.dataset_id}" in md and "| completions | 6 | 5 | 0 | 1 |" in md
    assert "| v1 | control | 5 | 5 | 0.400 |" in md and "[s3://bucket/reports/index.html]" in md
    assert "| feedback | quarantined | orphan_feedback | 1 |" in md and len(cs) == 6


def test_rows_stored_after_their_hour_was_collected_are_quarantined_as_late_arrivals(tmp_path):
    """A segment uploaded after the watermark passed its rows' time (a store outage longer than upload_grace_s, a
    gateway clock running behind) was never read by any run: its rows vanished without being counted."""
    store = LocalStore(tmp_path)
    traffic(store, T0 + 5 * MIN, 4, 4)
    first = collect(store, T0 + 2 * HOUR)  # hour 0 collected: the watermark is past it
    assert first.new and first.manifest.stored()["late_arrivals"] == {"completions": 0, "feedback": 0}
    late = completion(T0 + 20 * MIN, 99)  # stored only now
    put_logs(store, "completions", [late])
    put_logs(store, "feedback", [feedback(late, "accepted")])
    (tmp_path / "logs/feedback/model=tab/date=2026-01-01/hour=00/part-broken.parquet").write_bytes(b"not parquet")
    traffic(store, T0 + HOUR + 5 * MIN, 2, 2)  # the next hour's own traffic
    second = collect(store, T0 + 3 * HOUR)
    counts = second.manifest.stored()["counts"]
    assert second.new and second.manifest.stored()["late_arrivals"] == {"completions": 1, "feedback": 1}
    assert counts["completions"]["quarantined_by_reason"] == {"late_arrival": 1} and counts["completions"]["kept"] == 2
    assert counts["feedback"]["quarantined_by_reason"] == {"late_arrival": 1}  # (the broken file has no readable rows)
    assert [f["key"].rsplit("/", 1)[1] for f in second.manifest.stored()["schema_quarantined_files"]] == ["part-broken.parquet"]
    assert late["request_id"] not in second.samples["request_id"].to_pylist()
    quarantined = read_parquet(store, second.manifest.stored()["quarantine"]["completions"])
    assert quarantined["request_id"].to_pylist() == [late["request_id"]] and quarantined["reason"].to_pylist() == ["late_arrival"]
    assert collect(store, T0 + 4 * HOUR).new is False  # counted once: the next run does not take them again
    assert read_watermark(store, "tab").listed_from_ms is not None
