"""The `feedback-blend` rule: every kind of feedback a completion got, each read as a signal in [-1, 1], blended
into one reward by weights the rule declares. For chat assistants and agents, whose users score, vote or edit
rather than accept a suggestion.

Signals (a completion lacking one simply has no such term):
  verdict  accepted +1, rejected -1, partial 2 x (characters kept / characters shown) - 1;
  score    2 x score01 - 1 (score01: the score rescaled from the model's score_range to [0, 1]);
  thumbs   up +1, down -1;
  edit     2 x similarity(edit, completion) - 1: how much of the completion the user kept
           (difflib's ratio: 1 = kept as shown, 0 = rewritten);
  judge    2 x the judge's score01 - 1 (the model's judge, data_contracts/judge.py; weight 0 by default).
reward = scale x (sum of weight x signal over the signals present) / (sum of their weights);
a shown completion with no signal is no feedback (`no_feedback`), an empty one earns `empty`.
"""

from __future__ import annotations

import difflib
from typing import Literal

import numpy as np
from pydantic import Field

from data_contracts.reward_rules import BaseRewardRule, Verdicts
from data_contracts.rewards import kept_chars


class BlendRule(BaseRewardRule):
    plugin: Literal["feedback-blend"] = Field("feedback-blend", description="This rule's entry point.")
    name: str = Field("feedback-blend", pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Rule family name.")
    verdict_weight: float = Field(1.0, ge=0, description="Weight of a Tab verdict's signal.")
    score_weight: float = Field(1.0, ge=0, description="Weight of a score's signal.")
    thumbs_weight: float = Field(1.0, ge=0, description="Weight of a thumbs' signal.")
    edit_weight: float = Field(1.0, ge=0, description="Weight of an edit's signal.")
    judge_weight: float = Field(0.0, ge=0, description="Weight of the model's judge's score (0: judges are not read).")
    scale: float = Field(1.0, gt=0, description="Reward of a completion whose every signal is +1.")
    empty: float = Field(0.0, description="Reward of an empty completion (nothing shown), whatever the feedback says.")

    def weights(self) -> dict[str, float]:
        """feedback group → its weight."""
        return {
            "verdict": self.verdict_weight,
            "score": self.score_weight,
            "thumbs": self.thumbs_weight,
            "edit": self.edit_weight,
            "judge": self.judge_weight,
        }

    @property
    def reads(self) -> tuple[str, ...]:  # a group weighted 0 does not reward a row
        return tuple(g for g, w in self.weights().items() if w > 0)

    def bounds(self) -> tuple[float, float]:
        values = (-self.scale, self.scale, self.empty, self.ignored)
        return min(values), max(values)

    def signals(self, v: Verdicts) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """group → ((N,) signal in [-1, 1], (N,) present)."""
        shown = v.completion_chars
        kept = kept_chars(v.event, v.accepted_chars, shown)
        frac = np.divide(kept, shown, out=np.zeros_like(kept), where=shown > 0)
        verdict = np.select([v.event == "accepted", v.event == "rejected"], [1.0, -1.0], default=2 * frac - 1)
        edit = np.zeros(len(v))
        has_edit = v.present("edit")
        for i in np.flatnonzero(has_edit):
            edit[i] = 2 * difflib.SequenceMatcher(None, str(v.completion_text[i] or ""), v.edit_text[i]).ratio() - 1
        return {
            "verdict": (verdict, v.present("verdict")),
            "score": (2 * np.nan_to_num(v.score) - 1, v.present("score")),
            "thumbs": (np.sign(v.thumbs), v.present("thumbs")),
            "edit": (edit, has_edit),
            "judge": (2 * np.nan_to_num(v.judge_score) - 1, v.present("judge")),
        }

    def reward_verdicts(self, v: Verdicts) -> np.ndarray:
        weights = self.weights()
        total, weight = np.zeros(len(v)), np.zeros(len(v))
        for group, (signal, present) in self.signals(v).items():
            w = weights[group] * present
            total += w * signal
            weight += w
        out = np.where(
            weight > 0, self.scale * np.divide(total, weight, out=np.zeros_like(total), where=weight > 0), self.ignored
        )
        return np.where(v.completion_chars == 0, self.empty, out).astype(np.float64)
