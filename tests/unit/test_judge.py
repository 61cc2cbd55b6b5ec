"""The judge stage's parts: the judge's settings, its prompt and parser, the judgements store (scored rows as
feedback with source 'judge', failures quarantined, each completion judged once), and judge scores through
collection and re-scoring beside users' scores."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from data_contracts import judgements
from data_contracts.collect_settings import CollectSettings
from data_contracts.dataset import read_parquet
from data_contracts.judge import Verdict, parse, render, rescale, summary
from data_contracts.rewards import RewardRule
from tests.collect_harness import collect_once, rescore_once
from tests.unit.test_contracts_data import T0, FixedVersions, completion, feedback, put_logs
from tidal.judge_settings import JudgeSettings
from tidal.model_settings import FeedbackPolicy, ModelSettings
from tidal.store import LocalStore

MIN = 60_000
JUDGE = JudgeSettings(name="critic", model="tab", scale=(0, 10))
CHAT = FeedbackPolicy(events=["accepted", "rejected", "partial", "score"], score_range=(1, 5))


def test_a_judges_settings_are_checked_and_its_reply_parsed() -> None:
    assert (JUDGE.id, JUDGE.client_id) == ("critic@1", "judge:critic@1")
    with pytest.raises(ValidationError, match="has no group: put the score in parentheses"):
        JudgeSettings(name="j", model="m", pattern=r"\d+")
    with pytest.raises(ValidationError, match="not a regex"):
        JudgeSettings(name="j", model="m", pattern=r"(\d")
    with pytest.raises(ValidationError, match=r"judge.template: KeyError\('answer'\)"):
        JudgeSettings(name="j", model="m", template="{answer}")
    with pytest.raises(ValidationError, match="low must be below high"):
        JudgeSettings(name="j", model="m", scale=(5, 5))
    text = render(JUDGE, "def f(", "x): pass")
    assert "def f(" in text and "x): pass" in text and "from 0 (useless) to 10 (perfect)" in text
    assert parse(JUDGE, "Reasoning... Score: 7") == (7.0, "")
    assert parse(JUDGE, "score=8.5") == (8.5, "")
    assert parse(JUDGE, "I cannot say") == (None, "no_score")
    assert parse(JUDGE, "Score: 11") == (None, "off_scale")
    assert rescale(JUDGE, 7.5, (1, 5)) == pytest.approx(4.0)
    ModelSettings(name="assistant", judge=JUDGE)  # a model declares its judge


def verdicts(cs: list[dict], scores: list[float | None]) -> list[Verdict]:
    return [
        Verdict(c["request_id"], s, "" if s is not None else "no_score", f"Score: {s}", 10.0 * (i + 1), 50, 3)
        for i, (c, s) in enumerate(zip(cs, scores))
    ]


def judge_run(store, cs: list[dict], scores: list[float | None], at_ms: int = T0 + 90 * MIN, cfg: JudgeSettings = JUDGE):
    vs = verdicts(cs, scores)
    record = {"model": "tab", "judge": cfg.id, "judge_model": "tab@v1", "started_ms": at_ms}
    record |= {"since_ms": T0, "until_ms": at_ms, "candidates": len(cs), **summary(vs, cfg)}
    return judgements.write_run(store, "tab", cfg, vs, CHAT.score_range, record, at_ms)


def test_judgements_are_stored_as_judge_feedback_and_each_completion_is_judged_once(tmp_path) -> None:
    store = LocalStore(tmp_path)
    cs = [completion(T0 + 10 * MIN + i * 1000, i) for i in range(3)]
    empty = completion(T0 + 20 * MIN, 3, text="")  # nothing shown: nothing to judge
    put_logs(store, "completions", [*cs, empty])
    todo = judgements.candidates(store, "tab", T0, T0 + 60 * MIN, set())
    assert [r["request_id"] for r in todo] == [c["request_id"] for c in cs]
    run = judge_run(store, cs, [10.0, None, 0.0])
    assert (run.asked, run.scored, run.failed, run.failed_by_reason) == (3, 2, 1, {"no_score": 1})
    assert (run.prompt_tokens, run.completion_tokens, run.cost_usd) == (150, 9, 0.0) and run.latency_ms_p50 == 20.0
    rows = read_parquet(store, run.judgements_key).to_pylist()
    assert [(r["event"], r["source"], r["client_id"], r["score"]) for r in rows] == [
        ("score", "judge", "judge:critic@1", 5.0),
        ("score", "judge", "judge:critic@1", 1.0),
    ]  # rescaled from the judge's [0, 10] into the model's score_range [1, 5]
    failed = read_parquet(store, run.quarantine_key).to_pylist()
    assert [(f["request_id"], f["reason"]) for f in failed] == [(cs[1]["request_id"], "no_score")]
    done = judgements.judged_ids(store, "tab", JUDGE.id)
    assert done == {c["request_id"] for c in cs} and judgements.candidates(store, "tab", T0, T0 + 60 * MIN, done) == []


def test_judge_scores_reach_a_dataset_beside_users_scores_and_through_re_scoring(tmp_path) -> None:
    store = LocalStore(tmp_path)
    cs = [completion(T0 + 10 * MIN + i * 1000, i, text="x" * 10) for i in range(3)]
    put_logs(store, "completions", cs)
    put_logs(store, "feedback", [feedback(cs[0]), feedback(cs[0], "score", score=5.0), feedback(cs[1], "rejected")])
    cfg = CollectSettings(reward_rule={"plugin": "cursor-tab"})
    first = collect_once(store, FixedVersions([1], 1), "tab", cfg, T0 + 2 * 3_600_000, feedback=CHAT, judge_id=JUDGE.id)
    assert first.manifest.judged == {}  # the judge has not run yet
    # a day after the collection (its scores dated then, past the source's clock): a user's and the judge's score on cs[0]
    judge_run(store, cs, [0.0, 10.0, None], at_ms=T0 + 26 * 3_600_000)
    blend = '{"plugin": "feedback-blend", "verdict_weight": 0, "score_weight": 0, "judge_weight": 1}'
    again = rescore_once(store, "tab", first.dataset_id, blend, RewardRule(), CHAT, judge_id=JUDGE.id)
    new = again.manifest
    assert new.judged == {"critic@1": 2} and new.counts.feedback.in_ == first.manifest.counts.feedback.in_ + 2
    assert new.counts.feedback.quarantined == 0  # a judge's score is no forgery, nor a duplicate of the user's
    rows = {r["request_id"]: r for r in again.samples.to_pylist()}
    assert rows[cs[0]["request_id"]]["reward"] == pytest.approx(-1.0)  # the judge's 0 of 10
    assert rows[cs[1]["request_id"]]["reward"] == pytest.approx(1.0)
    assert (rows[cs[0]["request_id"]]["score"], rows[cs[0]["request_id"]]["judge_score"]) == (5.0, 1.0)
    assert cs[2]["request_id"] not in rows  # its judgement failed and no one else said anything: no feedback
    assert np.isnan(again.work.verdicts.judge_score[2])


def test_start_up_refuses_a_fleet_judge_that_is_no_model(monkeypatch, tmp_path) -> None:
    from tests.unit.test_reward_plugins import _settings_error

    yaml = "models:\n  - name: tab\n    judge: {name: critic, model: nope}\n"
    assert "model tab's judge critic@1 is a model on the fleet, 'nope', which is no model" in _settings_error(
        monkeypatch, tmp_path, yaml
    )
