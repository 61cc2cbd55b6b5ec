"""Settings of the collection flow (the `collect` section of the Tidal settings)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny

from data_contracts.reward_rules import BaseRewardRule, build_rule
from data_contracts.rewards import RewardRule
from tidal.section import Section

# A rule in the settings: {"plugin": <entry point in tidal.reward_rules>, its fields}; no plugin = 'cursor-tab'.
# Built (its plugin loaded and its fields checked) when the settings load, so a missing plugin stops start-up.
Rule = Annotated[SerializeAsAny[BaseRewardRule], BeforeValidator(build_rule)]

PiiPolicy = Literal["quarantine", "scrub"]


class CollectSettings(Section):
    schedule_cron: str = Field(
        "20 * * * *",
        description=("When the scheduled collect deployment runs (cron, UTC): after the hour's verdicts and uploads are in."),
    )
    window_s: float = Field(
        7 * 86400.0,
        gt=0,
        description=(
            "Collection window: records older than this (at run time) fail the contract; a model's first run "
            "starts this far back."
        ),
    )
    max_stale_versions: int = Field(
        3,
        ge=0,
        description=(
            "Completions whose behaviour version is more than this many registry versions behind the champion "
            "are dropped (counted as 'stale'): their log-probs are too far off-policy."
        ),
    )
    max_model_len: int = Field(512, ge=1, description="Most prompt+completion tokens a record may hold (the engines' context).")
    feedback_timeout_s: float = Field(
        900.0,
        gt=0,
        description=(
            "A verdict counts only if it arrives within this long after the completion; later ones are counted "
            "'late_feedback'. An hour is collected once it ended this long (plus upload_grace_s) ago."
        ),
    )
    upload_grace_s: float = Field(
        60.0,
        ge=0,
        description=(
            "Time the gateway's log sink needs to get a record into the store (segment age + upload interval, "
            "with margin); an hour is not collected before it ended this long ago."
        ),
    )
    max_clock_skew_s: float = Field(
        60.0, ge=0, description="Timestamps this far past the run's clock still pass the 'not in the future' check."
    )
    pii_policy: PiiPolicy = Field(
        "quarantine",
        description=(
            "Secrets or personal data in a record: 'quarantine' the row, or 'scrub' the prompt (text replaced by "
            "[REDACTED:<kind>], prompt tokens re-encoded; counted). A completion holding one is always quarantined: "
            "its sampled tokens and log-probs cannot be rewritten."
        ),
    )
    pii_policies: dict[str, PiiPolicy] = Field(default_factory=dict, description="Per-model overrides of pii_policy.")
    reward_rule: Rule = Field(
        default_factory=RewardRule,
        description="Reward rule of models without their own: {plugin: <tidal.reward_rules entry>, its fields}.",
    )
    reward_rules: dict[str, Rule] = Field(default_factory=dict, description="Reward rule per model name.")

    def rule_for(self, model: str) -> BaseRewardRule:
        return self.reward_rules.get(model, self.reward_rule)

    def pii_policy_for(self, model: str) -> PiiPolicy:
        return self.pii_policies.get(model, self.pii_policy)
