"""Token-level credit for partial verdicts: the kept characters earn their accept, the first token the
user did not keep pays for going on.

A `partial` verdict with accepted_chars = k says the suggestion's first k characters were right and what
followed was not. By default the dataset's reward R(partial) lies on the last token, so every token of the
suggestion gets the same credit: the kept ones, the one that went wrong and those the user never read. With
`train.ppo.partial_credit = "kept_prefix"` the reward is split along the suggestion (j = the served tokens
that lie wholly inside the first k characters):

    token j-1 (the last one kept)     R(accepted, kept text)                what stopping there would have earned
    token j   (the first not kept)    R(partial) - R(accepted, kept text)   the cost of going on (<= 0 for cursor-tab)
    tokens after j                    nothing                               the user stopped reading at the mismatch

The row's total reward is unchanged, so the dataset's reward statistics and the offline gate's estimate are
too. Under the non-scaled rule R(partial) also falls with the suggestion's length; that share is charged to
token j with the rest. When no served token lies wholly inside the kept characters (j = 0), the whole
reward goes on token 0. Only the user's verdict is used, never model internals; every token was drawn by
the serving engine, so the row keeps its importance weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample
from training.hindsight import HindsightRows, hindsight_samples, served_prefix
from training.ppo_config import PPOConfig


class CreditedSample(RewardSample):
    """A served partial whose reward is split: `kept_reward` on token kept_tokens - 1, the rest of `reward` on
    token kept_tokens (the whole reward on token 0 when kept_tokens is 0)."""

    kept_tokens: int
    kept_reward: float

    def token_rewards(self) -> list[float]:
        """(T,) this row's reward per completion token; sums to `reward`."""
        out = [0.0] * len(self.completion_token_ids)
        j = self.kept_tokens
        if j == 0:
            out[0] = self.reward
        else:
            out[j - 1], out[j] = self.kept_reward, self.reward - self.kept_reward
        return out


@dataclass
class CreditedRows:
    samples: list[RewardSample]  # the input rows, partials replaced by CreditedSamples
    credited: int = 0
    kept_tokens: int = 0  # served tokens inside kept characters, over the credited rows
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> partials left with their reward on the last token


def credit_partials(samples: Sequence[RewardSample], tokenizer, rule: RewardRule) -> CreditedRows:
    """`samples` with each `partial` row that kept characters replaced by a CreditedSample (order kept)."""
    out: list[RewardSample] = []
    credited = kept_total = 0
    skipped = {"no_chars_kept": 0}
    for s in samples:
        if s.event != "partial" or not s.completion_token_ids:
            out.append(s)
            continue
        k = min(s.accepted_chars or 0, len(s.completion_text))
        if k == 0:
            skipped["no_chars_kept"] += 1
            out.append(s)
            continue
        j, _ = served_prefix(tokenizer, s.completion_token_ids, s.completion_text[:k])
        j = min(j, len(s.completion_token_ids) - 1)  # a partial's last token is never wholly kept; guard anyway
        out.append(CreditedSample(**s.model_dump(), kept_tokens=j, kept_reward=rule.reward("accepted", k, s.completion_text[:k])))
        credited, kept_total = credited + 1, kept_total + j
    return CreditedRows(out, credited, kept_total, {r: n for r, n in skipped.items() if n})


@dataclass
class PartialRows:
    """The rows a run trains on, after the aids `cfg` turns on that read partial verdicts."""

    samples: list[RewardSample]  # served rows (partials credited when partial_credit='kept_prefix'), then hindsight rows
    hindsight: HindsightRows
    credit: CreditedRows | None  # None: partial_credit='last_token'


def partial_rows(served: Sequence[RewardSample], tokenizer, rule: RewardRule, cfg: PPOConfig) -> PartialRows:
    """Hindsight rows (cfg.hindsight_partials) and split credit (cfg.partial_credit) for a run's served rows."""
    hindsight = hindsight_samples(served, tokenizer, rule, cfg.hindsight_stop) if cfg.hindsight_partials else HindsightRows([])
    credit = credit_partials(served, tokenizer, rule) if cfg.partial_credit == "kept_prefix" else None
    rows = credit.samples if credit else list(served)
    return PartialRows(rows + hindsight.samples, hindsight, credit)
