"""Canaries configured per model: the primary metric and guardrails from `models[].canary`, outcomes read over every
feedback group through the model's own rule, and the checks that refuse a canary the model's feedback cannot judge."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from data_contracts.blend_rule import BlendRule
from data_contracts.log_layout import partition_key
from data_contracts.records import FEEDBACK_SCHEMA_V1
from data_contracts.rewards import RewardRule
from release.canary_config import CanaryConfig
from release.canary_records import ArmHealth, Outcome
from release.outcomes import LogReader, read_outcomes
from release.policy import look, tab_metrics
from tests.unit.test_contracts_data import T0, completion, feedback, partition_of, put_rows
from tidal.model_settings import CanaryMetrics, FeedbackPolicy, Guardrail, Margins, ModelSettings
from tidal.store import LocalStore

VERSIONS = {"control": 1, "canary": 3}
CHAT_FEEDBACK = FeedbackPolicy(events=["thumbs", "score"], score_range=(1, 5))
CHAT = CanaryMetrics(primary="reward", guardrails=[Guardrail(metric="thumbs_down", margin=0.02, relative=False)], watch=[])
CFG = CanaryConfig(min_samples=50, cuped=False)
HEALTH = {"control": ArmHealth(2000, 0), "canary": ArmHealth(2000, 0)}  # no errors on either arm


@pytest.fixture()
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


# --- settings -------------------------------------------------------------------------------------------------


def test_a_chat_model_declares_its_canary_and_one_its_feedback_cannot_judge_is_refused() -> None:
    chat = ModelSettings(name="chat", feedback=CHAT_FEEDBACK, canary=CHAT)
    assert chat.canary.metrics() == ["reward", "thumbs_down"] and chat.canary.guardrails[0].lower_is_better
    with pytest.raises(ValidationError, match=r"takes no Tab verdict.*set models\[\]\.canary"):
        ModelSettings(name="chat", feedback=CHAT_FEEDBACK)  # the Tab default would guard accepted chars: always 0
    with pytest.raises(ValidationError, match=r"uses 'thumbs_up', which needs the 'thumbs' event.*add 'thumbs'"):
        ModelSettings(name="tab", canary=CanaryMetrics(guardrails=[Guardrail(metric="thumbs_up")]))
    with pytest.raises(ValidationError, match="uses 'accepted_chars'"):
        ModelSettings(name="chat", feedback=CHAT_FEEDBACK, canary=CanaryMetrics())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"primary": "thumbs_down"}, "higher is better"),
        ({"guardrails": [{"metric": "reward"}]}, "lists the primary"),
        ({"guardrails": [{"metric": "shown_chars"}, {"metric": "shown_chars", "margin": 0.1}]}, "a metric twice"),
        ({"guardrails": [{"metric": "length"}]}, "Input should be"),
    ],
)
def test_a_canary_that_cannot_be_decided_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CanaryMetrics.model_validate(fields)


# --- outcomes -------------------------------------------------------------------------------------------------


def test_outcomes_take_every_feedback_group_through_the_models_rule(store) -> None:
    start = T0 + 10_000
    up = completion(start + 1, 1, arm="canary", version=3, text="a short answer")
    down = completion(start + 2, 2, text="a long answer here")
    scored = completion(start + 3, 3, text="abc")
    judged = completion(start + 4, 4, text="abc")  # only a judge's score: users said nothing
    silent = completion(start + 5, 5, text="abc")
    put_rows(store, "completions", [up, down, scored, judged, silent])
    put_rows(
        store,
        "feedback",
        [
            feedback(up, "thumbs", thumbs="up"),
            feedback(down, "thumbs", thumbs="down"),
            feedback(down, "thumbs", after_ms=3_000, thumbs="up"),  # a second thumbs: the first counts
            feedback(scored, "score", score=5.0),
            feedback(judged, "score", score=1.0, source="judge"),
        ],
    )
    rule = BlendRule()
    got = read_outcomes(LogReader(store, "tab", start), VERSIONS, rule, 30, start + 10_000, policy=CHAT_FEEDBACK)
    by = {o.time_ms - start: o for o in got}
    assert sorted(by) == [1, 2, 3]  # judged and silent wait for users until feedback_wait_s
    assert (by[1].reward, by[1].thumbs_up, by[1].thumbs_down, by[1].shown_chars) == (1.0, 1.0, 0.0, 14.0)
    assert (by[2].reward, by[2].thumbs_up, by[2].thumbs_down) == (-1.0, 0.0, 1.0)
    assert by[3].score == 1.0 and by[3].reward == 1.0 and np.isnan(by[1].score)
    late = {o.time_ms - start: o for o in read_outcomes(LogReader(store, "tab", start), VERSIONS, rule, 30, start + 60_000)}
    assert late[4].reward == rule.ignored and np.isnan(late[4].score)  # the judge's score is not the users'
    # the Tab rule reads verdicts only: a thumbs alone does not resolve a row before feedback_wait_s
    tab = read_outcomes(LogReader(store, "tab", start), VERSIONS, RewardRule(), 30, start + 10_000, policy=CHAT_FEEDBACK)
    assert tab == []


def test_feedback_stored_before_scores_and_thumbs_existed_still_reads(store, tmp_path) -> None:
    start = T0 + 10_000
    c = completion(start + 1, 1)
    put_rows(store, "completions", [c])
    old = pa.Table.from_pylist([{k: feedback(c, "accepted")[k] for k in FEEDBACK_SCHEMA_V1.names}], schema=FEEDBACK_SCHEMA_V1)
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(old, Path(tmp) / "old.parquet")
        store.put_file(Path(tmp) / "old.parquet", partition_key("feedback", partition_of(c["time_ms"]), "000000000001"))
    (got,) = read_outcomes(LogReader(store, "tab", start), VERSIONS, RewardRule(), 30, start + 10_000)
    assert got.accepted == 1.0 and got.thumbs_up == 0.0 and np.isnan(got.score)


# --- decisions ------------------------------------------------------------------------------------------------


def chat_outcomes(n: int, canary_chars: float, canary_up: float, canary_down: float, seed: int = 0) -> list[Outcome]:
    """n outcomes per arm of a chat model: control answers 400 characters, 40% thumbs up, 10% down; the canary its
    own length and rates. reward = +1 up, -1 down, 0 otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(2 * n):
        arm = "canary" if i % 2 else "control"
        chars, p_up, p_down = (canary_chars, canary_up, canary_down) if i % 2 else (400.0, 0.4, 0.1)
        u = rng.random()
        thumbs = 1 if u < p_up else -1 if u < p_up + p_down else 0
        out.append(
            Outcome(
                arm=arm,
                reward=float(thumbs),
                accepted=0.0,
                accepted_chars=0.0,
                latency_ms=50.0,
                time_ms=T0 + i,
                shown_chars=chars * rng.uniform(0.8, 1.2),
                thumbs_up=float(thumbs == 1),
                thumbs_down=float(thumbs == -1),
            )
        )
    return out


def test_a_chat_model_is_not_rolled_back_for_shorter_answers_unless_length_is_guarded() -> None:
    shorter_and_liked = chat_outcomes(600, canary_chars=200.0, canary_up=0.6, canary_down=0.05)
    promoted = look(CFG, 2, shorter_and_liked, 600, 10.0, HEALTH, metrics=CHAT)
    assert promoted.action == "promote", promoted.reason
    assert "thumbs-down rate delta <=" in promoted.reason and set(promoted.comparisons) >= {"reward", "thumbs_down"}
    assert "shown_chars" not in promoted.comparisons and "accepted_chars" not in promoted.comparisons
    length = Guardrail(metric="shown_chars", margin=0.1)
    guarded = CHAT.model_copy(update={"guardrails": [*CHAT.guardrails, length]})
    rolled = look(CFG, 2, shorter_and_liked, 600, 10.0, HEALTH, metrics=guarded)
    assert rolled.action == "rollback" and rolled.reason.startswith("shown chars per request fell"), rolled.reason
    assert rolled.margins["shown_chars"] == pytest.approx(0.1 * rolled.comparisons["shown_chars"].control.mean)


def test_a_rise_in_a_lower_is_better_guardrail_rolls_back_at_the_first_step() -> None:
    disliked = chat_outcomes(400, canary_chars=400.0, canary_up=0.4, canary_down=0.3)
    res = look(CFG, 0, disliked, 400, 10.0, HEALTH, metrics=CHAT)
    assert res.action == "rollback" and res.reason.startswith("thumbs-down rate per request rose"), res.reason
    assert res.comparisons["thumbs_down"].low > 0.02


def test_a_step_advances_only_once_every_guardrail_clears_its_regression() -> None:
    same = chat_outcomes(4000, canary_chars=400.0, canary_up=0.4, canary_down=0.1, seed=3)
    health = {"control": ArmHealth(4000, 0), "canary": ArmHealth(4000, 0)}
    res = look(CFG, 0, same, 4000, 10.0, health, metrics=CHAT)
    assert res.action == "advance" and "reward and thumbs_down not worse" in res.reason, res.reason
    assert "thumbs_down delta <= " in res.reason


def test_a_score_compares_only_the_requests_that_were_scored() -> None:
    outs = chat_outcomes(200, 400.0, 0.4, 0.1)
    scored = [
        Outcome(**{**o.__dict__, "score": (0.8 if o.arm == "canary" else 0.6) if i % 3 == 0 else float("nan")})
        for i, o in enumerate(outs)
    ]
    metrics = CanaryMetrics(primary="score", guardrails=[], watch=[])
    res = look(CFG, 2, scored, 200, 10.0, HEALTH, metrics=metrics)
    score = res.comparisons["score"]
    assert score.control.n + score.canary.n == sum(i % 3 == 0 for i in range(len(outs)))
    assert score.delta == pytest.approx(0.2)


def test_the_guardrails_share_half_the_budget_and_the_default_is_the_tab_set() -> None:
    outs = chat_outcomes(100, 400.0, 0.4, 0.1)
    bare = look(CFG, 0, outs, 100, 1.0, {}, metrics=CanaryMetrics(guardrails=[], watch=[]))
    assert bare.comparisons["reward"].alpha == CFG.alpha / 2 and bare.comparisons["error_rate"].alpha == CFG.alpha / 4
    default = look(CFG, 0, outs, 100, 1.0, {})
    assert default.comparisons["error_rate"].alpha == pytest.approx(CFG.alpha / 6)
    assert set(default.comparisons) == {"reward", "accepted", "accepted_chars", "error_rate", "slow_share"}
    assert default.row() == look(CFG, 0, outs, 100, 1.0, {}, metrics=tab_metrics(CFG, CFG.margins)).row()
    chars_first = CanaryConfig(primary="accepted_chars")
    assert tab_metrics(chars_first, Margins()).guardrails == [] and "reward" in tab_metrics(chars_first, Margins()).watch


def test_start_up_refuses_a_global_primary_a_model_cannot_give(monkeypatch, tmp_path) -> None:
    from tests.unit.test_reward_plugins import _settings_error

    err = _settings_error(monkeypatch, tmp_path, "canary:\n  primary: thumbs_up\n")
    assert "canary.primary='thumbs_up' needs the 'thumbs' event, which model tab does not take" in err
    with pytest.raises(ValidationError, match="the primary must be a metric where higher is better"):
        CanaryConfig(primary="thumbs_down")
