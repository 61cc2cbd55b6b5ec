"""`tidal quarantine list|show`: the rows a real collection set aside, counted by reason and shown redacted."""

from __future__ import annotations

import json
import os

import pytest

from data_contracts import quarantine
from data_contracts.collect_settings import CollectSettings
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, T0, FixedVersions, completion, feedback, put_logs
from tidal.cli import main
from tidal.store import LocalStore

KEY = "AKIAABCDEFGHIJKLMNOP"


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """One collection (shared: the tests only read it): a completion that leaks a key in its text, an orphan verdict,
    and a clean pair."""
    store = LocalStore(tmp_path_factory.mktemp("quarantine") / "store")
    leaky, clean = completion(T0 + 1000, text=KEY), completion(T0 + 3000)
    put_logs(store, "completions", [leaky, clean])
    put_logs(store, "feedback", [feedback(c, "accepted") for c in (leaky, clean)] + [feedback(completion(T0 + 9000), "accepted")])
    res = collect_once(store, FixedVersions([1], 1), "tab", CollectSettings(), T0 + 2 * HOUR)
    return store, res, leaky


def test_the_index_counts_what_the_manifest_counted(collected):
    store, res, _ = collected
    found = quarantine.index(store, "tab")
    stored = res.manifest.stored()["counts"]
    for kind in quarantine.KINDS:
        mine = {c.reason: c.rows for c in found.counts if c.kind == kind}
        assert mine == stored[kind]["quarantined_by_reason"], kind
    assert found.by_reason()["secret:aws_access_key"] == 1 and found.by_reason()["orphan_feedback"] == 1
    assert {c.dataset_id for c in found.counts} == {res.dataset_id} and found.counts[0].created_ms == res.manifest.created_ms
    assert quarantine.QuarantineIndex.model_validate_json(found.model_dump_json()) == found
    assert quarantine.index(store, "other").counts == []


def test_rows_of_a_reason_are_redacted_unless_revealed(collected):
    store, res, leaky = collected
    shown = quarantine.rows(store, "tab", "secret:aws_access_key")
    [row] = shown["completions"].to_pylist()
    assert row["request_id"] == leaky["request_id"] and row["dataset_id"] == res.dataset_id
    assert KEY not in json.dumps(row, default=str) and "[REDACTED:aws_access_key]" in row["completion_text"]
    revealed = quarantine.rows(store, "tab", "secret:aws_access_key", reveal=True)
    assert revealed["completions"].column("completion_text").to_pylist() == [KEY]
    assert quarantine.rows(store, "tab", "no_such_reason") == {}
    assert set(quarantine.rows(store, "tab", "orphan_feedback", kind="feedback")) == {"feedback"}
    with pytest.raises(ValueError, match="no quarantine for dataset 'ds-nope' of model 'tab'; known: ds-"):
        quarantine.rows(store, "tab", "orphan_feedback", dataset_id="ds-nope")
    with pytest.raises(ValueError, match="kind 'rows': expected one of completions, feedback"):
        quarantine.rows(store, "tab", "orphan_feedback", kind="rows")


def test_the_command_lists_and_shows(collected, capsys, monkeypatch, tmp_path):
    store, res, leaky = collected
    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TIDAL_STORE__URL", str(store.root))
    assert main(["quarantine", "list", "tab"]) == 0
    out = capsys.readouterr().out
    assert "secret:aws_access_key" in out and f"{res.dataset_id}" in out and "orphan_feedback" in out, out
    assert main(["quarantine", "show", "tab", "secret:aws_access_key"]) == 0
    out = capsys.readouterr().out
    assert leaky["request_id"] in out and KEY not in out and "1 of 1 rows quarantined" in out, out
    assert main(["quarantine", "show", "tab", "orphan_feedback", "--dataset", "ds-nope"]) == 1
    assert "error: no quarantine for dataset 'ds-nope'" in capsys.readouterr().err
    assert main(["quarantine", "list", "tab", "--json"]) == 0
    assert quarantine.QuarantineIndex.model_validate_json(capsys.readouterr().out).model == "tab"
