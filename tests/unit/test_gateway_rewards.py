"""The gateway's reward counters: each verdict's reward under the model's own rule, summed apart by sign."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from data_contracts.rewards import RewardRule
from serving.gateway_metrics import GatewayMetrics


def samples(metrics: GatewayMetrics) -> dict[tuple[str, str, str, str], float]:
    """(metric, model, version, arm) → value of the reward and rewarded counters."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name in ("gateway_rewarded_total", "gateway_reward_gain_total", "gateway_reward_loss_total"):
                name = s.name.removeprefix("gateway_").removesuffix("_total")
                out[(name, s.labels["model"], s.labels["version"], s.labels["arm"])] = s.value
    return out


def test_each_verdict_is_rewarded_by_its_models_rule_and_unknown_lengths_are_not_guessed():
    rules = {"tab": RewardRule(), "chat": RewardRule(name="chat", accepted=1.0, rejected=-1.0)}
    m = GatewayMetrics(dict, rules.__getitem__)
    m.verdict("tab", 2, "canary", "accepted", None, 20)  # +0.75
    m.verdict("tab", 2, "canary", "partial", 5, 20)  # +0.75 × 5/20
    m.verdict("tab", 2, "canary", "rejected", None, 20)  # -0.25
    m.verdict("tab", 1, "control", "accepted", None, None)  # suggestion length no longer held: no reward
    m.verdict("chat", 1, "control", "rejected", None, 12)  # chat's own rule: -1
    got = samples(m)
    assert got[("rewarded", "tab", "2", "canary")] == 3
    assert abs(got[("reward_gain", "tab", "2", "canary")] - (0.75 + 0.75 * 5 / 20)) < 1e-12
    assert got[("reward_loss", "tab", "2", "canary")] == 0.25
    assert ("rewarded", "tab", "1", "control") not in got
    assert (got[("rewarded", "chat", "1", "control")], got[("reward_loss", "chat", "1", "control")]) == (1, 1.0)
    assert got[("reward_gain", "chat", "1", "control")] == 0  # both signs exist once rewarded: gain - loss is defined


def test_characters_kept_are_read_as_before():
    m = GatewayMetrics(dict)
    m.verdict("tab", 1, "control", "accepted", None, 7)
    m.verdict("tab", 1, "control", "partial", 3, None)  # counted from the verdict even without the length
    m.verdict("tab", 1, "control", "accepted", None, None)  # unknown
    text = m.render().decode()
    assert 'gateway_accepted_chars_total{arm="control",model="tab",version="1"} 10.0' in text
    assert 'gateway_accepted_chars_unknown_total{model="tab"} 1.0' in text
