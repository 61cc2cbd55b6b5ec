"""Reward rules as plugins: found through the `tidal.reward_rules` entry points (the built-in ones included), a
team's rule from a package of its own, clear refusals, the blend rule's arithmetic, and the start-up checks."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

from data_contracts.blend_rule import BlendRule
from data_contracts.collect_settings import CollectSettings
from data_contracts.reward_rules import RuleError, Verdicts, build_rule, installed_rules
from data_contracts.rewards import RewardRule
from tests.collect_harness import collect_once
from tests.rule_plugin import write_plugin
from tests.unit.test_contracts_data import T0, FixedVersions, completion, feedback, put_logs
from tidal.model_settings import FeedbackPolicy
from tidal.section import SettingsError
from tidal.store import LocalStore


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """The team's package on the path, as if installed; forgotten afterwards."""
    monkeypatch.syspath_prepend(str(write_plugin(tmp_path / "site")))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("acme_rules", None)


def verdicts(**columns) -> Verdicts:
    n = len(next(iter(columns.values())))
    base = Verdicts.tab(
        np.full(n, "none", dtype=object), np.full(n, np.nan), np.full(n, 10.0), np.full(n, "x" * 10, dtype=object)
    )
    for k, v in columns.items():
        setattr(base, k, np.asarray(v, dtype=object if k in ("event", "edit_text") else np.float64))
    return base


def test_the_built_in_rules_are_entry_points_and_a_spec_without_plugin_is_the_tab_rule():
    eps = installed_rules()
    assert eps["cursor-tab"].value == "data_contracts.rewards:RewardRule"
    assert eps["feedback-blend"].value == "data_contracts.blend_rule:BlendRule"
    assert build_rule({"accept_scale_by_chars": True}) == RewardRule(accept_scale_by_chars=True)
    assert isinstance(build_rule({"plugin": "feedback-blend", "score_weight": 2}), BlendRule)
    assert RewardRule().package().startswith("tidal-rl ")  # the distribution that registered it
    # a rule recorded before plugins existed (no 'plugin' key) builds as itself
    assert build_rule(RewardRule(version=3).model_dump(mode="json") | {"plugin": None}).id == "cursor-tab@3"


def test_refusals_name_the_plugin_and_what_is_installed(acme):
    with pytest.raises(RuleError, match=r"'nope' is not installed: .* offers \[.*'acme-thumbs'.*'cursor-tab'.*\]"):
        build_rule({"plugin": "nope"})
    with pytest.raises(RuleError, match=r"'feedback-blend': Input should be greater than or equal to 0 at \('score_weight',\)"):
        build_rule({"plugin": "feedback-blend", "score_weight": -1})
    with pytest.raises(RuleError, match=r"'acme-mislabelled' loads Mislabelled, whose `plugin` default is 'acme-other'"):
        build_rule({"plugin": "acme-mislabelled"})
    with pytest.raises(RuleError, match=r"'acme-missing' \(acme_rules_gone:Nothing\) failed to load"):
        build_rule({"plugin": "acme-missing"})
    with pytest.raises(RuleError, match="a mapping"):
        build_rule("cursor-tab@1")


def test_a_teams_rule_from_its_own_package_rewards_a_dataset_and_is_named_in_its_manifest(acme, tmp_path):
    cfg = CollectSettings(reward_rules={"tab": {"plugin": "acme-thumbs", "per_char": 0.01}})
    rule = cfg.rule_for("tab")
    assert type(rule).__name__ == "ThumbsAndLength" and rule.package() == "acme-rules 1.2.0"
    store = LocalStore(tmp_path / "store")
    cs = [completion(T0 + 600_000 + i * 1000, i, text="x" * 20) for i in range(3)]
    put_logs(store, "completions", cs)
    put_logs(
        store, "feedback", [feedback(cs[0], "thumbs", thumbs="up"), feedback(cs[1], "thumbs", thumbs="down"), feedback(cs[2])]
    )
    policy = FeedbackPolicy(events=["accepted", "rejected", "partial", "thumbs"])
    r = collect_once(store, FixedVersions([1], 1), "tab", cfg, T0 + 7_200_000, feedback=policy)
    assert r.samples["reward"].to_pylist() == pytest.approx([0.8, -1.2])  # cs[2]'s Tab verdict is not read: dropped
    ref = r.manifest.reward_rule
    assert (ref.id, ref.plugin, ref.package, ref.rule["per_char"]) == ("acme-thumbs@1", "acme-thumbs", "acme-rules 1.2.0", 0.01)
    assert r.manifest.counts.completions.filtered_by_reason == {"no_feedback": 1}


def test_the_blend_rule_weighs_the_signals_a_completion_got():
    rule = BlendRule(verdict_weight=1, score_weight=2, thumbs_weight=1, edit_weight=1)
    v = verdicts(
        event=["accepted", "none", "partial", "none", "none", "rejected"],
        accepted_chars=[np.nan, np.nan, 5, np.nan, np.nan, np.nan],
        score=[np.nan, 0.25, np.nan, np.nan, np.nan, 1.0],
        thumbs=[0, 0, 0, -1, 0, 0],
        edit_text=[None, None, None, None, "x" * 10, None],
    )
    r = rule.reward_verdicts(v)
    # accepted +1; score 0.25 → -0.5; partial 5 of 10 → 0; thumbs down -1; an edit keeping all → +1;
    # rejected (-1, weight 1) with a top score (+1, weight 2) → 1/3
    assert r == pytest.approx([1.0, -0.5, 0.0, -1.0, 1.0, 1 / 3])
    assert rule.rewarded(v).all() and rule.bounds() == (-1.0, 1.0)
    none = verdicts(event=["none", "none"], completion_chars=[10.0, 0.0])
    assert not rule.rewarded(none)[0] and rule.reward_verdicts(none).tolist() == [rule.ignored, rule.empty]
    assert BlendRule(score_weight=0).reads == ("verdict", "thumbs", "edit")  # a weight of 0 rewards nothing


def test_the_tab_rule_through_the_interface_is_the_tab_rule():
    rule = RewardRule()
    v = verdicts(
        event=["accepted", "rejected", "partial", "none"], accepted_chars=[np.nan, np.nan, 5, np.nan], thumbs=[0, 1, 0, 1]
    )
    assert rule.reward_verdicts(v).tolist() == pytest.approx([0.75, -0.25, 0.375, 0.0])
    assert rule.rewarded(v).tolist() == [True, True, True, False]  # a thumbs alone is no Tab verdict


def _settings_error(monkeypatch, tmp_path, yaml: str) -> str:
    from tidal.settings import load_settings

    for name in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tidal.yaml").write_text(yaml)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    return str(exc.value)


def test_start_up_refuses_a_rule_that_reads_nothing_the_model_takes(monkeypatch, tmp_path, acme):
    err = _settings_error(monkeypatch, tmp_path, "collect:\n  reward_rules:\n    tab:\n      plugin: acme-thumbs\n    tabx: {}\n")
    assert "model tab's reward rule acme-thumbs@1 (plugin acme-thumbs) reads ['thumbs'] feedback" in err
    assert "collect.reward_rules names 'tabx', which is no model" in err
    err = _settings_error(monkeypatch, tmp_path, "collect:\n  reward_rule:\n    plugin: nope\n")
    assert "'nope' is not installed" in err
    err = _settings_error(
        monkeypatch,
        tmp_path,
        "collect:\n  reward_rule:\n    plugin: feedback-blend\ntrain:\n  ppo:\n    stop_credit_coef: 1.0\n",
    )
    assert "is not the Tab rule (plugin feedback-blend), but train.ppo asks for hindsight rows" in err


def test_the_demo_training_aids_are_checked_when_the_demo_starts(monkeypatch, tmp_path):
    """A platform with a chat model under the blend rule starts (train.ppo asks for no Tab aids); the demo's training
    (which asks for stop credit) becomes every model's while the demo runs, so the demo refuses to start, naming the
    chat model and the settings to change; without the stop credit it starts."""
    from tidal.demo import demo_profile
    from tidal.settings import load_settings

    for name in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tidal.yaml").write_text(
        "models:\n- {name: tab}\n- name: chat\n  feedback: {events: [thumbs, score]}\n"
        "  canary: {guardrails: [{metric: thumbs_down}]}\n"
        "collect:\n  reward_rules:\n    chat: {plugin: feedback-blend}\n"
    )
    settings = load_settings()
    assert settings.demo.train.ppo.stop_credit_coef > 0  # the demo's default asks for a Tab aid
    with pytest.raises(SettingsError) as exc:
        demo_profile(settings, "tab")
    assert "the demo's training would apply to every model while it runs: model chat's reward rule feedback-blend@1" in str(
        exc.value
    )
    assert "set demo.train.ppo.hindsight_partials=false" in str(exc.value)
    monkeypatch.setenv("TIDAL_DEMO__TRAIN__PPO__STOP_CREDIT_COEF", "0")
    monkeypatch.setenv("TIDAL_DEMO__TRAIN__PPO__ABSTAIN_BUDGET", "1")  # a cap on stop credit, which is off
    assert demo_profile(load_settings(), "tab").train.ppo.stop_credit_coef == 0
