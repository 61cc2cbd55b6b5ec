"""The duplicate-feedback ledger: one verdict per request id while a duplicate could still be accepted, with
memory bounded by one window of ids; and the WAL keeps the feedback a restarted gateway refills it from."""

from __future__ import annotations

import os

import pytest

from serving.feedback_ledger import FeedbackLedger

WINDOW = 1_000


def test_one_verdict_per_id_within_the_window_and_ids_expire_after_it():
    ledger = FeedbackLedger(WINDOW)
    assert ledger.claim("a", 0) and not ledger.claim("a", 500) and ledger.claim("b", 900)
    assert not ledger.claim("a", WINDOW)  # still inside the window of its verdict
    ledger.expire(WINDOW + 1)
    assert "a" not in ledger and "b" in ledger and len(ledger) == 1
    ledger.expire(900 + WINDOW + 1)
    assert len(ledger) == 0 and len(ledger._order) == 0


def test_a_released_claim_can_be_claimed_again_and_its_old_entry_does_not_expire_the_new_one():
    ledger = FeedbackLedger(WINDOW)
    assert ledger.claim("a", 0)
    ledger.release("a")  # the verdict could not be stored: the client may send it again
    assert ledger.claim("a", 800)
    ledger.expire(WINDOW + 1)  # drops the stale (0, "a") entry, keeps the claim made at 800
    assert "a" in ledger and not ledger.claim("a", WINDOW + 2)


def test_memory_holds_one_window_of_ids_however_many_arrive():
    ledger = FeedbackLedger(WINDOW)
    for t in range(0, 50 * WINDOW, 7):  # 50 windows of traffic, one verdict every 7 ms
        ledger.claim(f"id-{t}", t)
    assert len(ledger) <= WINDOW // 7 + 1 and len(ledger._order) == len(ledger)


def test_a_bad_window_is_refused():
    with pytest.raises(ValueError, match="window_ms"):
        FeedbackLedger(0)


def test_the_wal_keeps_feedback_over_its_cap_and_a_short_retention_is_refused(tmp_path, monkeypatch):
    """Over the WAL cap the sweep deleted the oldest uploaded segments whatever their kind, so a restarted gateway
    could forget verdicts and record a duplicate; a retention shorter than the feedback window did the same."""
    import asyncio

    from serving.logsink import LogSink, LogSinkSettings
    from tests.unit.test_logsink import completion, feedback
    from tidal.section import SettingsError
    from tidal.settings import load_settings
    from tidal.store import LocalStore

    cfg = LogSinkSettings(segment_max_age_s=0.05, upload_interval_s=0.05, wal_cap_bytes=3_000)
    sink = LogSink(tmp_path / "wal", LocalStore(tmp_path / "store"), cfg)
    sink.start()
    try:

        async def fill():
            for i in range(6):
                await sink.append("feedback", feedback(i))
                await sink.append("completions", completion(i, prompt_text="x" * 800))
                await asyncio.sleep(0.1)  # one segment per record

        asyncio.run(fill())
        assert sink.flush_now(timeout_s=10)
        sink._uploader.sweep()
        kept = {r["request_id"] for r in sink.iter_recent("feedback")}
    finally:
        sink.stop(timeout_s=2)
    assert kept == {feedback(i)["request_id"] for i in range(6)}

    for name in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError, match="retain_s=3600 is shorter than gateway.feedback_window_s=86400"):
        load_settings(gateway={"logsink": {"retain_s": 3600}})


def test_the_benchmark_measures_both_checks_side_by_side(capsys):
    import json

    from bench.feedback_ledger import main

    result = main(["--sizes", "2000", "--claims", "5", "--rounds", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["ledger_us_2000"] > 0 and result["rebuilt_dict_us_2000"] > 0 and result["ledger_bytes_per_id"] > 0
    low, high = result["ledger_us_2000_spread"]
    assert low <= result["ledger_us_2000"] <= high
