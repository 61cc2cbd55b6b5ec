"""Fit a candidate's suggestion filter on a dataset's verdicts (the rule: data_contracts/suggestion_filter.py).

The candidate scores the first token of every logged completion that was shown and judged, teacher-forced on its
prompt: the same number the engine reports as that token's log-prob when the candidate samples it (raw
log-softmax, temperature 1). Against it, the characters each user kept; each row weighted by pi(first) / mu(first)
(the candidate's probability of the logged first token over the logging version's, truncated at MAX_WEIGHT), so
that the shares withheld and lost are those of the candidate's own first tokens, which the gateway will see.
The completions the logging versions' filters withheld are scored too (no verdict, so no kept characters): a
sharper candidate draws likelier first tokens on those requests as well, and would show some of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from data_contracts.rewards import kept_chars
from data_contracts.samples import RewardSample, WithheldSample
from data_contracts.suggestion_filter import SuggestionFilter, fit_filter
from training.reward_data import RewardDataset
from training.train_settings import SuggestionFilterSettings

JUDGED = ("accepted", "partial", "rejected")
MAX_WEIGHT = 10.0  # truncated importance weights (as PPO's truncated IS): a few rows cannot carry the fit


def judged_rows(samples: Sequence[RewardSample]) -> list[RewardSample]:
    """The rows a threshold can learn from: a completion was shown (text and tokens) and its user gave a verdict."""
    return [s for s in samples if s.event in JUDGED and s.completion_text and s.completion_token_ids]


@torch.no_grad()
def first_token_logprobs(
    model: PreTrainedModel, samples: Sequence[RewardSample | WithheldSample], pad_id: int, batch: int = 32
) -> np.ndarray:
    """(N,) the model's log-prob of each row's first completion token given its prompt."""
    model.eval()
    out: list[float] = []
    for i in range(0, len(samples), batch):
        rows = samples[i : i + batch]
        width = max(len(s.prompt_token_ids) for s in rows)
        # Right-padded (B, P): every real token keeps its position; each row is read at its own last prompt token.
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, s in enumerate(rows):
            ids[j, : len(s.prompt_token_ids)] = torch.tensor(s.prompt_token_ids)
            mask[j, : len(s.prompt_token_ids)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, P, V)
        last = torch.tensor([len(s.prompt_token_ids) - 1 for s in rows])
        lp = torch.log_softmax(logits[torch.arange(len(rows)), last].float(), -1)  # (B, V)
        first = torch.tensor([s.completion_token_ids[0] for s in rows])
        out += lp[torch.arange(len(rows)), first].tolist()
    return np.array(out, dtype=np.float64)


def fit_for(
    model: PreTrainedModel,
    samples: Sequence[RewardSample],
    pad_id: int,
    cfg: SuggestionFilterSettings,
    data: RewardDataset | None = None,
) -> SuggestionFilter:
    """The candidate's filter, fitted on the dataset's judged rows (every behaviour version: the verdict is about the
    text, whoever sampled it) and on the completions its versions' filters withheld (`data.withheld_samples`: no
    verdict, no kept characters; for a dataset that predates them, their count as withheld by the candidate too)."""
    rows = judged_rows(samples)
    held = [] if data is None or data.withheld_samples is None else data.withheld_samples
    uncounted = 0 if data is None or data.withheld_samples is not None else sum(data.withheld.values())
    kept = kept_chars(
        np.array([s.event for s in rows], dtype=object),
        np.array([np.nan if s.accepted_chars is None else s.accepted_chars for s in rows], dtype=np.float64),
        np.array([len(s.completion_text) for s in rows], dtype=np.float64),
    )
    scored = [*rows, *held]
    lp = first_token_logprobs(model, scored, pad_id) if scored else np.zeros(0)  # (N + W,)
    mu = np.array([s.behaviour_logprobs[0] for s in scored], dtype=np.float64)
    weights = np.exp(np.minimum(lp - mu, np.log(MAX_WEIGHT)))  # (N + W,) pi/mu of the first token, truncated
    kept = np.concatenate([kept, np.zeros(len(held))])
    return fit_filter(lp, kept, cfg.max_chars_loss, cfg.max_withheld, cfg.min_kept_rows, weights, uncounted, len(held))
