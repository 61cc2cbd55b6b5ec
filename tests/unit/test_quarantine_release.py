"""`tidal quarantine release`: quarantined rows (and the verdicts their collection filtered) come back in the next
collection, once, with only the waived reason dropped, on a real local store through the collect steps."""

from __future__ import annotations

import os

import pytest

from data_contracts import dataset, pipeline, release
from data_contracts.collect_settings import CollectSettings
from data_contracts.suites import CONTRACT_VERSION
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, T0, FixedVersions, completion, feedback, put_logs
from tidal.cli import main
from tidal.store import LocalStore

KEY = "AKIAABCDEFGHIJKLMNOP"
SECRET = "secret:aws_access_key"
VERSIONS = FixedVersions([1], 1)


@pytest.fixture
def first(tmp_path):
    """One collection: a completion whose text trips the secret scanner (accepted by its user), one that also names
    an unknown version, and a clean pair."""
    store = LocalStore(tmp_path / "store")
    leaky, twice, clean = completion(T0 + 1000, text=KEY), completion(T0 + 2000, version=9, text=KEY), completion(T0 + 3000)
    put_logs(store, "completions", [leaky, twice, clean])
    put_logs(store, "feedback", [feedback(leaky, "accepted"), feedback(twice, "rejected"), feedback(clean, "rejected")])
    res = collect_once(store, VERSIONS, "tab", CollectSettings(), T0 + 2 * HOUR)
    assert res.manifest.counts.feedback.filtered_by_reason["completion_quarantined"] == 2
    return store, res, leaky, twice


def test_released_rows_and_their_verdicts_come_back_once(first):
    store, res1, leaky, twice = first
    plan = release.plan_release(store, "tab", SECRET)
    assert plan.rows["completions"].num_rows == 2 and plan.verdicts_from_logs == 2 and plan.skipped == 0
    assert plan.other_reasons == {"unknown_version": 1}
    record = release.write_release(store, "tab", SECRET, "alice", "the scanner's false positive", T0 + 2 * HOUR + 5, plan)
    assert record.rows == {"completions": 2, "feedback": 2} and record.datasets == [res1.dataset_id]
    assert [r.release_id for r in release.pending(store, "tab", dataset.read_watermark(store, "tab"))] == [record.release_id]

    res2 = collect_once(store, VERSIONS, "tab", CollectSettings(), T0 + 3 * HOUR)  # no new logs: the release alone
    assert res2.new and res2.manifest.releases == [record.release_id]
    samples = {r["request_id"]: r["event"] for r in res2.samples.to_pylist()}
    assert samples == {leaky["request_id"]: "accepted"}  # with the verdict its collection had filtered
    c = res2.manifest.counts.completions
    assert (c.in_, c.kept, c.quarantined_by_reason) == (2, 1, {"unknown_version": 1})  # the other reason still holds
    assert res2.manifest.counts.feedback.filtered_by_reason == {"completion_quarantined": 1}
    [(_, used)] = release.releases(store, "tab")
    assert used.dataset_id == res2.dataset_id and used.watermark_before.dataset_id == res1.dataset_id

    assert not collect_once(store, VERSIONS, "tab", CollectSettings(), T0 + 4 * HOUR).new  # taken once
    with pytest.raises(release.ReleaseError, match=r"no rows quarantined for 'secret:aws_access_key'.*\(2 already released\)"):
        release.plan_release(store, "tab", SECRET, dataset_id=res1.dataset_id)


def test_a_run_redone_from_the_same_watermark_takes_the_release_again(first):
    store, res1, leaky, _ = first
    plan = release.plan_release(store, "tab", SECRET, request_ids=[leaky["request_id"]])
    assert plan.rows["completions"].column("request_id").to_pylist() == [leaky["request_id"]]
    rid = release.write_release(store, "tab", SECRET, "alice", "checked by hand", T0 + 2 * HOUR + 5, plan).release_id
    # a run that wrote its dataset (and consumed the release) but died before moving the watermark
    cfg, as_of = CollectSettings(), T0 + 3 * HOUR
    p = pipeline.find_partitions(store, "tab", cfg, as_of, False)
    batch = pipeline.load_logs(store, p)
    versions, rule = pipeline.registry_versions(VERSIONS, "tab"), cfg.rule_for("tab")
    params = pipeline.contract_params("tab", versions, cfg, as_of)
    ds_id = dataset.dataset_id("tab", p.watermark, batch.partitions, rule.id, CONTRACT_VERSION)
    work, samples = pipeline.assemble_samples(pipeline.validate_logs(batch, params), rule, versions, 3, params)
    pipeline.write_version(store, p, work, samples, rule, cfg, versions, {}, ds_id, as_of)
    assert release.releases(store, "tab")[0][1].dataset_id == ds_id and release.pending(store, "tab", p.watermark)

    redo = collect_once(store, VERSIONS, "tab", cfg, as_of)
    assert redo.dataset_id == ds_id and redo.manifest.releases == [rid] and redo.samples.num_rows == 1


def test_a_release_needs_a_reason_and_a_match(first):
    store, _, _, _ = first
    plan = release.plan_release(store, "tab", SECRET)
    with pytest.raises(release.ReleaseError, match="a release needs a reason"):
        release.write_release(store, "tab", SECRET, "alice", "  ", T0, plan)
    with pytest.raises(release.ReleaseError, match="no rows quarantined for 'too_old'"):
        release.plan_release(store, "tab", "too_old")
    with pytest.raises(release.ReleaseError, match="with request ids"):
        release.plan_release(store, "tab", SECRET, request_ids=["nope"])
    assert release.releases(store, "tab") == []


def test_the_command_releases_and_lists(first, capsys, monkeypatch, tmp_path):
    store, res1, _, _ = first
    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TIDAL_STORE__URL", str(store.root))
    assert main(["quarantine", "release", "tab", SECRET, "--why", "false positive", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would release 2 completions and 2 feedback rows (2 verdicts read back" in out and "unknown_version: 1" in out
    assert release.releases(store, "tab") == []
    assert main(["quarantine", "release", "tab", SECRET, "--why", "false positive", "--by", "bob"]) == 0
    assert "the next collection takes them" in capsys.readouterr().out
    assert main(["quarantine", "list", "tab"]) == 0
    out = capsys.readouterr().out
    assert "released:" in out and "by bob: false positive" in out and "pending" in out, out
    assert main(["quarantine", "release", "tab", SECRET, "--why", "again"]) == 1
    assert "2 already released" in capsys.readouterr().err
