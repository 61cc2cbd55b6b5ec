"""The trainer's view of a collected dataset: every way it can be unusable gives a clear DatasetError."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from data_contracts.dataset import write_dataset, write_watermark
from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample, samples_table
from data_contracts.scope import Watermark
from tests.manifest_helpers import collect_record
from tidal.store import LocalStore
from training.job_spec import run_key
from training.reward_data import (
    DatasetError,
    at_most,
    is_heldout,
    latest_dataset_id,
    load_dataset,
    split,
)
from training.train_settings import TrainSettings


def row(i: int, **kw) -> dict:
    base = RewardSample(
        request_id=f"r{i}",
        model="tab",
        version=1,
        arm="control",
        user_hash="u",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        behaviour_logprobs=[-0.5],
        completion_text="x",
        event="accepted",
        reward=0.75,
        reward_rule="cursor-tab@1",
        completion_time_ms=0,
    ).model_dump()
    return {**base, **kw}


@pytest.fixture()
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_a_written_dataset_loads_with_its_digest(store) -> None:
    manifest = write_dataset(store, "tab", "ds-1", samples_table([row(i) for i in range(5)]), collect_record())
    data = load_dataset(store, "tab", "ds-1")
    assert data.digest == manifest.digest and len(data.samples) == 5 and data.reward_rule == "cursor-tab@1"
    assert data.samples[0].behaviour_logprobs == [-0.5]


def test_missing_dataset_names_the_ones_that_exist(store) -> None:
    write_dataset(store, "tab", "ds-1", samples_table([row(0)]), collect_record())
    with pytest.raises(DatasetError, match=r"ds-2 of tab not found .*\['ds-1'\]"):
        load_dataset(store, "tab", "ds-2")


def test_empty_dataset_is_refused(store) -> None:
    write_dataset(store, "tab", "ds-e", samples_table([]), collect_record())
    with pytest.raises(DatasetError, match="has no rows: collect more traffic"):
        load_dataset(store, "tab", "ds-e")


def test_wrong_schema_names_the_columns(store) -> None:
    table = samples_table([row(0)]).drop_columns(["behaviour_logprobs"])
    table = table.append_column("behaviour_logprobs", pa.array([["-0.5"]], pa.list_(pa.string())))
    write_dataset(store, "tab", "ds-s", table, collect_record())
    with pytest.raises(DatasetError, match=r"\(behaviour_logprobs: expected list<float>, got list<string>\)$"):
        load_dataset(store, "tab", "ds-s")


def test_a_dataset_from_before_sampling_temperatures_says_so(store) -> None:
    write_dataset(store, "tab", "ds-old", samples_table([row(0)]).drop_columns(["temperature", "top_p"]), collect_record())
    with pytest.raises(
        DatasetError,
        match=r"temperature: expected double, got absent.*predates rows carrying their "
        r"sampling temperature.*train on a dataset collected since",
    ):
        load_dataset(store, "tab", "ds-old")


def test_withheld_completions_load_beside_the_samples_and_are_checked(store, tmp_path) -> None:
    from data_contracts.samples import WITHHELD_SCHEMA

    keys = ("request_id", "model", "version", "prompt_token_ids", "completion_token_ids", "behaviour_logprobs")
    held = pa.Table.from_pylist(
        [{k: row(9)[k] for k in keys} | {"request_id": "w1", "completion_time_ms": 5}], schema=WITHHELD_SCHEMA
    )
    manifest = write_dataset(store, "tab", "ds-w", samples_table([row(0)]), collect_record(), held)
    data = load_dataset(store, "tab", "ds-w")
    assert manifest.withheld_rows == 1 and [(w.request_id, w.behaviour_logprobs) for w in data.withheld_samples] == [
        ("w1", [-0.5])
    ]
    # nothing withheld: no file, and an empty list; a dataset from before the file, with only counts: None
    write_dataset(store, "tab", "ds-n", samples_table([row(0)]), collect_record())
    assert load_dataset(store, "tab", "ds-n").withheld_samples == []
    old = collect_record().model_copy(update={"withheld_by_version": {1: 4}})
    write_dataset(store, "tab", "ds-o", samples_table([row(0)]), old)
    assert load_dataset(store, "tab", "ds-o").withheld_samples is None
    import pyarrow.parquet as pq

    pq.write_table(held.slice(0, 0), other := tmp_path / "held.parquet")
    store.put_file(other, manifest.withheld_key)
    with pytest.raises(DatasetError, match="withheld.parquet digest .* does not match the manifest"):
        load_dataset(store, "tab", "ds-w")


def test_changed_data_file_fails_the_digest_check(store, tmp_path) -> None:
    manifest = write_dataset(store, "tab", "ds-d", samples_table([row(0), row(1)]), collect_record())
    other = tmp_path / "other.parquet"
    import pyarrow.parquet as pq

    pq.write_table(samples_table([row(0)]), other)
    store.put_file(other, manifest.data_key)
    with pytest.raises(DatasetError, match="does not match the manifest"):
        load_dataset(store, "tab", "ds-d")


def test_truncated_data_file_is_refused(store, tmp_path) -> None:
    manifest = write_dataset(store, "tab", "ds-t", samples_table([row(0)]), collect_record())
    path = store.root / manifest.data_key
    cut = tmp_path / "cut"
    cut.write_bytes(path.read_bytes()[:40])
    store.put_file(cut, manifest.data_key)
    # the manifest still names the old digest; fix it to reach the Parquet reader itself
    m = json.loads((store.root / "datasets/model=tab/ds-t/manifest.json").read_text())
    import hashlib

    m["digest"] = "sha256:" + hashlib.sha256(cut.read_bytes()).hexdigest()
    (store.root / "datasets/model=tab/ds-t/manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="unreadable Parquet"):
        load_dataset(store, "tab", "ds-t")


def test_rows_of_another_model_are_refused(store) -> None:
    write_dataset(store, "tab", "ds-m", samples_table([row(0), row(1, model="other")]), collect_record())
    with pytest.raises(DatasetError, match=r"other models \['other'\]"):
        load_dataset(store, "tab", "ds-m")


def test_latest_dataset_comes_from_the_watermark(store) -> None:
    with pytest.raises(DatasetError, match="no collected dataset yet"):
        latest_dataset_id(store, "tab")
    write_watermark(store, Watermark(model="tab", completions_through_ms=0, feedback_through_ms=0, dataset_id="ds-9"))
    assert latest_dataset_id(store, "tab") == "ds-9"


def test_split_is_stable_and_near_the_fraction() -> None:
    rows = [RewardSample.model_validate(row(i)) for i in range(2000)]
    train, heldout = split(rows, 0.2)
    assert len(train) + len(heldout) == 2000 and 0.17 < len(heldout) / 2000 < 0.23
    assert all(is_heldout(s.request_id, 0.2) for s in heldout)
    assert split(list(reversed(rows)), 0.2)[1] == list(reversed(heldout))


def test_the_gates_row_cap_takes_the_same_uniform_subset_in_any_order() -> None:
    rows = [RewardSample.model_validate(row(i)) for i in range(1000)]
    some = at_most(rows, 100)
    assert len(some) == 100 and [rows.index(s) for s in some] == sorted(rows.index(s) for s in some)  # dataset order
    assert {s.request_id for s in at_most(list(reversed(rows)), 100)} == {s.request_id for s in some}
    spread = sorted(int(s.request_id[1:]) for s in some)
    assert spread[0] < 100 and spread[-1] > 900  # across the whole dataset, not its first rows
    assert at_most(rows, None) is rows and at_most(rows[:50], 100) == rows[:50]


def test_run_key_changes_with_what_determines_the_result() -> None:
    cfg = TrainSettings()
    key = run_key("tab", "sha256:a", 1, cfg, 0.1)
    assert key == run_key("tab", "sha256:a", 1, TrainSettings(retries=9, torch_threads=1), 0.1)  # operational knobs only
    assert key != run_key("tab", "sha256:b", 1, cfg, 0.1) and key != run_key("tab", "sha256:a", 2, cfg, 0.1)
    assert key != run_key("tab", "sha256:a", 1, TrainSettings(ppo={"learning_rate": 1e-3}), 0.1)
    assert key != run_key("tab", "sha256:a", 1, cfg, 0.2)  # the code corpus's held-out share feeds the ptx loss and gate
    from tidal.model_settings import CorpusSource

    assert run_key("tab", "sha256:a", 1, cfg, 0.1, CorpusSource()) == key  # the default corpus: keys as before
    assert run_key("tab", "sha256:a", 1, cfg, 0.1, CorpusSource(source="none")) != key


def test_the_manifests_reward_rule_comes_with_the_dataset(store) -> None:
    rule = RewardRule(accept_scale_by_chars=True)
    write_dataset(
        store,
        "tab",
        "ds-r",
        samples_table([row(0)]),
        collect_record(reward_rule={"id": rule.id, "rule": rule.model_dump(mode="json")}),
    )
    assert load_dataset(store, "tab", "ds-r").rule == rule
    other = RewardRule(version=2)
    write_dataset(
        store,
        "tab",
        "ds-m",
        samples_table([row(0)]),
        collect_record(reward_rule={"id": other.id, "rule": other.model_dump(mode="json")}),
    )
    with pytest.raises(DatasetError, match=r"rewarded by \['cursor-tab@1'\], the manifest names cursor-tab@2"):
        load_dataset(store, "tab", "ds-m")
    write_dataset(
        store, "tab", "ds-b", samples_table([row(0)]), collect_record(reward_rule={"id": "x", "rule": {"accepted": "lots"}})
    )
    with pytest.raises(DatasetError, match=r"reward_rule.rule is not a RewardRule: .* at \('accepted',\)"):
        load_dataset(store, "tab", "ds-b")


def test_the_manifest_is_read_back_as_itself_and_a_damaged_one_is_named(store) -> None:
    from data_contracts.dataset import read_manifest

    written = write_dataset(store, "tab", "ds-typed", samples_table([row(0), row(1)]), collect_record())
    key = "datasets/model=tab/ds-typed/manifest.json"
    stored = json.loads((store.root / key).read_text())
    assert stored["counts"]["total"]["in"] == 0 and "schema" in stored and "schema_" not in stored  # the stored keys
    assert read_manifest(store, "tab", "ds-typed") == written and written.rows == 2
    (store.root / key).write_text(json.dumps({**stored, "digest": None}))
    with pytest.raises(DatasetError, match=r"ds-typed: .*manifest.json is not a dataset manifest .* at digest"):
        load_dataset(store, "tab", "ds-typed")


def test_a_dataset_written_before_scores_thumbs_and_edits_loads_with_them_empty(store) -> None:
    from data_contracts.samples import ADDED_SAMPLE_COLUMNS

    old = samples_table([row(0)]).drop_columns(list(ADDED_SAMPLE_COLUMNS))
    write_dataset(store, "tab", "ds-old", old, collect_record())
    [s] = load_dataset(store, "tab", "ds-old").samples
    assert (s.score, s.thumbs, s.edit_text) == (None, None, None)


def test_a_plugin_rules_dataset_loads_without_its_plugin_and_without_a_tab_rule(store) -> None:
    rule = {"plugin": "acme-nowhere", "name": "acme", "version": 2, "weight": 3}
    write_dataset(
        store,
        "tab",
        "ds-p",
        samples_table([row(0, reward_rule="acme@2")]),
        collect_record(reward_rule={"id": "acme@2", "rule": rule}),
    )
    data = load_dataset(store, "tab", "ds-p")
    assert data.rule is None and data.reward_rule == "acme@2"  # the Tab-only aids refuse it by name (training/job.py)
