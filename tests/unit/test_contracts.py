"""Data contracts on the stored logs: planted defects land in quarantine with their reasons, good rows pass,
counts reconcile. Real Parquet, real Great Expectations; only the registry look-up is a fixed set."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from data_contracts.collect_settings import CollectSettings
from data_contracts.dataset import read_parquet
from data_contracts.records import to_table
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import HOUR, SIGNER, T0, FixedVersions, completion, feedback, put_logs, put_rows
from tidal.store import LocalStore

AS_OF = T0 + 2 * HOUR + HOUR // 2  # hours 0 and 1 are closed and settled
CFG = CollectSettings(max_model_len=64)
VERSIONS = FixedVersions([1, 2, 3, 4, 5], champion=5)


def _c(user: str, t_off: int = 0, **changes) -> dict:
    """A good completion (version 5, the champion) marked by its user_hash, with changes applied."""
    row = completion(T0 + 60_000 + t_off, version=5)
    row["user_hash"] = user
    row.update(changes)
    return row


# marker (user_hash) → expected quarantine reasons of that completion
COMPLETION_DEFECTS: dict[str, tuple[dict, set[str]]] = {
    "null-logprobs": ({"behaviour_logprobs": None}, {"null:behaviour_logprobs"}),
    "nan-logprob": ({"behaviour_logprobs": [-0.1, math.nan, -0.2, -0.3]}, {"nonfinite_logprob"}),
    "positive-logprob": ({"behaviour_logprobs": [-0.1, 0.4, -0.2, -0.3]}, {"positive_logprob"}),
    "length-mismatch": ({"behaviour_logprobs": [-0.1, -0.2]}, {"logprob_length_mismatch"}),
    "unknown-version": ({"version": 9, "served_name": "tab@v9"}, {"unknown_version"}),
    "served-name": ({"served_name": "tab@v4"}, {"served_name_mismatch"}),
    "aws-key": ({"prompt_text": "key = 'AKIAABCDEFGHIJKLMNOP'\n"}, {"secret:aws_access_key"}),
    "email": ({"prompt_text": "# contact: jane.doe@example.com\n"}, {"pii:email"}),
    "api-key-in-completion": ({"completion_text": "sk-abcdefghijklmnopqrstuvwx"}, {"secret:api_key"}),
    "too-many-tokens": ({"prompt_token_ids": list(range(70))}, {"too_many_tokens"}),
    "bad-enums": ({"arm": "blue", "finish_reason": "bored"}, {"bad_arm", "bad_finish_reason"}),
    "negative-latency": ({"latency_ms": -3.0}, {"negative_latency"}),
    "bad-sampling": (
        {"sampling": {"temperature": 3.0, "top_p": 0.0, "max_tokens": 4, "stop": [], "seed": None}},
        {"bad_temperature", "bad_top_p"},
    ),
    "no-sampling": ({"sampling": None}, {"null:sampling.temperature", "null:sampling.top_p"}),
    "several": (
        {"behaviour_logprobs": [0.5], "prompt_text": "AKIAABCDEFGHIJKLMNOP x@y.org"},
        {"positive_logprob", "logprob_length_mismatch", "secret:aws_access_key", "pii:email"},
    ),
    "null-time": ({"time_ms": None}, {"null:time_ms"}),
    "too-old": ({"time_ms": AS_OF - int(CFG.window_s * 1000) - 60_000}, {"too_old"}),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    store = LocalStore(tmp_path_factory.mktemp("store"))
    good = [_c(f"good-{i}", t_off=i * 1000) for i in range(8)]
    defects = {user: _c(user, t_off=10_000 + i) | changes for i, (user, (changes, _)) in enumerate(COMPLETION_DEFECTS.items())}
    # duplicates: two different records under one id (conflict), and an exact replay of a good row
    conflict_a, conflict_b = _c("dup-a"), _c("dup-b")
    conflict_b["request_id"] = conflict_a["request_id"]
    replay = dict(good[0])
    stale = completion(T0 + 90_000, version=1)  # 4 versions behind the champion, K = 3
    stale["user_hash"] = "stale"
    future = completion(AS_OF + 86_400_000, version=5)
    rows = good + [r for u, r in defects.items() if u != "null-time"] + [conflict_a, conflict_b, replay, stale]
    put_logs(store, "completions", rows)
    put_rows(store, "completions", [defects["null-time"]], part_time=T0)
    put_logs(store, "completions", [future])
    # a file of the wrong schema: version stored as text
    bad = to_table("completions", [_c("schema-1"), _c("schema-2")])
    bad = bad.set_column(bad.schema.get_field_index("version"), "version", pc.cast(bad["version"], pa.string()))
    key = put_rows(store, "completions", [_c("placeholder")])
    pq.write_table(bad, store.root / key)

    # feedback: verdicts on good rows, plus defects
    fb = [
        feedback(good[i], e, chars=c)
        for i, (e, c) in enumerate(
            [("accepted", None), ("rejected", None), ("partial", 4), ("accepted", 16), ("rejected", None), ("accepted", None)]
        )
    ]
    fb.append(feedback(stale, "accepted"))
    orphan = feedback(completion(T0 + 100_000, version=5), "accepted")  # its completion was never stored
    partial_no_chars = feedback(good[6], "partial", chars=None)
    foreign = feedback(good[7], "accepted", client="bob")
    on_quarantined = feedback(defects["nan-logprob"], "accepted")
    late = feedback(
        defects["email"] | {"request_id": SIGNER.issue("tab", "alice", T0 + 20_000)},
        "accepted",
        after_ms=int(CFG.feedback_timeout_s * 1000) + 40_000,
    )
    fb += [orphan, partial_no_chars, foreign, on_quarantined, late]
    put_logs(store, "feedback", fb)
    result = collect_once(store, VERSIONS, "tab", CFG, AS_OF)
    quarantine = {
        k: read_parquet(store, v).to_pylist() for k, v in result.manifest.stored()["quarantine"].items() if k != "files"
    }
    return {
        "store": store,
        "result": result,
        "good": good,
        "defects": defects,
        "q": quarantine,
        "key": key,
        "stale": stale,
        "future": future,
        "orphan": orphan,
        "fb": {"partial_no_chars": partial_no_chars, "foreign": foreign, "on_quarantined": on_quarantined, "late": late},
    }


@pytest.mark.parametrize("user", sorted(COMPLETION_DEFECTS))
def test_each_defective_completion_is_quarantined_with_all_its_reasons(run, user):
    rows = [r for r in run["q"]["completions"] if r["user_hash"] == user]
    assert len(rows) == 1, f"{user}: {len(rows)} quarantined rows"
    assert set(rows[0]["reason"].split(",")) == COMPLETION_DEFECTS[user][1]
    assert rows[0]["source_key"].startswith("logs/completions/model=tab/")


def test_conflicting_duplicates_are_quarantined_and_replays_kept_once(run):
    dup = [r for r in run["q"]["completions"] if r["user_hash"] in ("dup-a", "dup-b")]
    assert sorted(r["user_hash"] for r in dup) == ["dup-a", "dup-b"] and {r["reason"] for r in dup} == {"duplicate_request_id"}
    ids = run["result"].samples["request_id"].to_pylist()
    assert len(ids) == len(set(ids)) and run["good"][0]["request_id"] in ids
    assert run["result"].manifest.stored()["counts"]["completions"]["filtered_by_reason"]["duplicate"] == 1


def test_future_rows_are_quarantined(run):
    rows = [r for r in run["q"]["completions"] if r["request_id"] == run["future"]["request_id"]]
    assert [r["reason"] for r in rows] == ["future_time"]


def test_a_file_in_the_wrong_schema_is_quarantined_whole(run):
    m = run["result"].manifest.stored()
    [bad] = m["schema_quarantined_files"]
    assert bad["key"] == run["key"] and bad["rows"] == 2 and "version" in bad["detail"] and "int64" in bad["detail"]
    assert m["counts"]["completions"]["quarantined_by_reason"]["schema"] == 2
    assert run["store"].exists(f"quarantine/model=tab/{run['result'].dataset_id}/files/{run['key']}")


def test_feedback_defects(run):
    by_id = {r["request_id"]: r["reason"] for r in run["q"]["feedback"]}
    fb = run["fb"]
    assert by_id[run["orphan"]["request_id"]] == "orphan_feedback"
    assert by_id[fb["partial_no_chars"]["request_id"]] == "partial_without_chars"
    assert by_id[fb["foreign"]["request_id"]] == "foreign_feedback"
    assert len(by_id) == 3
    filtered = run["result"].manifest.stored()["counts"]["feedback"]["filtered_by_reason"]
    assert filtered == {"completion_quarantined": 1, "late_feedback": 1, "stale": 1}


def test_good_rows_pass_and_only_they(run):
    res = run["result"]
    samples = {r["request_id"]: r for r in res.samples.to_pylist()}
    good = {r["request_id"] for r in run["good"]}
    # good rows 6 and 7 lost their verdicts to quarantined feedback, so no_feedback (rule default: drop)
    assert set(samples) == good - {run["good"][6]["request_id"], run["good"][7]["request_id"]}
    assert [samples[r["request_id"]]["event"] for r in run["good"][:6]] == [
        "accepted",
        "rejected",
        "partial",
        "accepted",
        "rejected",
        "accepted",
    ]
    for r in run["good"][:6]:
        s = samples[r["request_id"]]
        assert s["behaviour_logprobs"] == r["behaviour_logprobs"] and s["version"] == 5 and s["reward_rule"] == "cursor-tab@1"


def test_counts_reconcile_exactly(run):
    counts = run["result"].manifest.stored()["counts"]
    for kind in ("completions", "feedback"):
        c = counts[kind]
        assert c["in"] == c["kept"] + c["quarantined"] + c["filtered"]
        assert c["filtered"] == sum(c["filtered_by_reason"].values())
    c = counts["completions"]
    # 8 good + 17 defects + 2 conflicting + 1 replay + 1 stale + 1 future + 2 rows of the bad file
    assert c["in"] == 32 and c["kept"] == 6 and c["quarantined"] == 17 + 2 + 1 + 2
    assert c["filtered_by_reason"] == {"duplicate": 1, "no_feedback": 2, "stale": 1}
    assert counts["feedback"]["in"] == 12 and counts["feedback"]["kept"] == 6
    assert counts["total"]["in"] == 44


def test_reward_sample_type_matches_its_stored_schema():
    from data_contracts.samples import REWARD_SAMPLE_SCHEMA, RewardSample, samples_table

    assert list(RewardSample.model_fields) == REWARD_SAMPLE_SCHEMA.names
    row = RewardSample(
        request_id="r",
        model="tab",
        version=1,
        arm="control",
        user_hash="u",
        prompt_token_ids=[1],
        completion_token_ids=[2],
        behaviour_logprobs=[-0.5],
        completion_text="x",
        event="none",
        reward=0.0,
        reward_rule="cursor-tab@1",
        completion_time_ms=1,
    )
    assert RewardSample.model_validate(samples_table([row.model_dump()]).to_pylist()[0]) == row
