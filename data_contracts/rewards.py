"""Reward rules: a user's verdict on a completion → the scalar terminal reward PPO optimises.

One rule per model, versioned (`name@version`); a dataset records the rule's id and its JSON in its
manifest, so every reward can be recomputed and a changed rule is a new version, never a silent edit.

Cursor's illustrative rule is the default: +0.75 accepted, -0.25 rejected, 0 when nothing is shown,
so a policy should suggest only where P(accept) > 0.25. A measured pilot (design notes) showed the
flaw of constant rewards: the policy learned to go silent, raising accept rate and reward while the
characters users actually kept fell by two thirds. `accept_scale_by_chars` makes the accept reward
grow with the characters kept (up to a cap), so the rule values what the user gets.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from data_contracts.records import TAB_EVENTS
from data_contracts.reward_rules import BaseRewardRule, NoFeedback, Verdicts

EVENTS = (*TAB_EVENTS, "none")  # a Tab verdict, or none arrived
__all__ = ["EVENTS", "NoFeedback", "RewardRule", "kept_chars"]


def kept_chars(event: np.ndarray, accepted_chars: np.ndarray, completion_chars: np.ndarray) -> np.ndarray:
    """(N,) characters each user kept: an 'accepted' without a count kept the whole completion, a 'partial' its
    count, any other verdict nothing; never more than was shown. event: (N,) EVENTS; accepted_chars: (N,) float,
    NaN when the feedback gave none; completion_chars: (N,) len(completion_text). The one reading of a verdict's
    characters: rewards, the canary's accepted-characters guardrail and the flywheel's figures all use it."""
    event = np.asarray(event, dtype=object)
    n_chars = np.asarray(completion_chars, dtype=np.float64)
    chars = np.asarray(accepted_chars, dtype=np.float64)
    kept = np.where(
        event == "accepted", np.where(np.isnan(chars), n_chars, chars), np.where(event == "partial", np.nan_to_num(chars), 0.0)
    )
    return np.clip(kept, 0.0, n_chars)


class RewardRule(BaseRewardRule):
    """The Tab rule (plugin `cursor-tab`): a verdict on a suggestion → its reward; scores, thumbs and edits are not
    read (a completion with only those counts as no feedback)."""

    reads: ClassVar[tuple[str, ...]] = ("verdict",)

    plugin: Literal["cursor-tab"] = Field("cursor-tab", description="This rule's entry point in `tidal.reward_rules`.")
    name: str = Field("cursor-tab", pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Rule family name.")
    accepted: float = Field(0.75, description="Reward of an accepted completion (the full completion kept).")
    rejected: float = Field(-0.25, description="Reward of a rejected completion.")
    empty: float = Field(0.0, description="Reward of an empty completion (nothing shown), whatever the feedback says.")
    accept_scale_by_chars: bool = Field(
        False,
        description=(
            "False: accepted = `accepted`, partial = `accepted` × accepted_chars/len(completion_text). True: both "
            "= `accepted` × min(chars kept, accept_chars_cap)/accept_chars_cap, so suggesting more that users keep "
            "earns more (guards against the policy learning to go silent)."
        ),
    )
    accept_chars_cap: int = Field(32, ge=1, description="Characters kept at which a scaled accept reward reaches `accepted`.")

    def bounds(self) -> tuple[float, float]:
        """Smallest and largest reward this rule can give (partial rewards lie between 0 and `accepted`)."""
        values = (self.accepted, self.rejected, self.empty, self.ignored, 0.0)
        return min(values), max(values)

    def reward_verdicts(self, v: Verdicts) -> np.ndarray:
        return self.rewards(v.event, v.accepted_chars, v.completion_chars)

    def reward(self, event: str, accepted_chars: int | None, completion_text: str) -> float:
        """One sample's reward (the scalar form of `rewards`, for readers and tests)."""
        return self.reward_of(event, accepted_chars, len(completion_text))

    def reward_of(self, event: str, accepted_chars: int | None, completion_chars: int) -> float:
        """One sample's reward from the completion's length alone (what the gateway holds at feedback time)."""
        chars = np.array([np.nan if accepted_chars is None else accepted_chars], dtype=np.float64)
        return float(self.rewards(np.array([event], dtype=object), chars, np.array([completion_chars]))[0])

    def rewards(self, event: np.ndarray, accepted_chars: np.ndarray, completion_chars: np.ndarray) -> np.ndarray:
        """Vectorised rewards. event: (N,) of EVENTS ('none' = no feedback); accepted_chars: (N,) float, NaN when
        the feedback gave none; completion_chars: (N,) len(completion_text). Returns (N,) float64.

        Callers drop no-feedback rows first when no_feedback='drop'; here 'none' earns `ignored`.
        """
        event = np.asarray(event, dtype=object)
        accepted, partial, rejected = event == "accepted", event == "partial", event == "rejected"
        known = accepted | partial | rejected | (event == "none")
        if not known.all():
            unknown = sorted({str(e) for e in event[~known]})
            raise ValueError(f"reward rule {self.id}: unknown events {unknown}; expected one of {EVENTS}")
        n_chars = np.asarray(completion_chars, dtype=np.float64)
        kept = kept_chars(event, accepted_chars, n_chars)
        if self.accept_scale_by_chars:
            scale = np.minimum(kept, self.accept_chars_cap) / self.accept_chars_cap
            accept_reward = self.accepted * scale
            partial_reward = accept_reward
        else:
            accept_reward = np.full(len(event), self.accepted)
            partial_reward = self.accepted * np.divide(kept, n_chars, out=np.zeros_like(kept), where=n_chars > 0)
        out = np.select(
            [n_chars == 0, accepted, partial, rejected],
            [self.empty, accept_reward, partial_reward, self.rejected],
            default=self.ignored,
        )
        return out.astype(np.float64)
