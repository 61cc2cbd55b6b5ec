"""From RewardSamples to the padded tensors PPO trains on, and back to completion-aligned columns.

Layout of one batch (P = longest prompt, T = longest completion):

    input_ids   [pad pad p0 p1 p2 | c0 c1 c2 pad]    prompts left-padded, completions right-padded
    columns      0   1   2  3  4    5  6  7   8       every prompt ends at column P - 1

The logits (and value) at column P - 1 + t belong to the context that produced completion token
c_t, so ``completion_view`` slices columns [P - 1, P - 1 + T) of any (B, P + T, ...) tensor to get
(B, T, ...) aligned with ``completion_ids``, ``mask`` and ``behaviour_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from data_contracts.samples import RewardSample
from training.hindsight import HindsightSample
from training.partial_credit import CreditedSample


@dataclass
class SampleSelection:
    """Which samples a PPO batch may use, and how many were dropped for which reason."""

    kept: list[RewardSample]
    stale: int  # behaviour version more than max_stale_versions older than the trained policy
    newer: int  # behaviour version newer than the trained policy (another lineage, e.g. a canary)
    empty: int  # no completion tokens: no token to credit the reward to
    greedy: int  # sampled at temperature 0: a deterministic choice explores nothing, and has no density ratio


def select_samples(samples: Sequence[RewardSample], current_version: int, max_stale_versions: int | None) -> SampleSelection:
    """Keep samples with 0 <= current_version - version <= max_stale_versions (None: any version),
    at least one completion token and a sampling temperature above 0; count the rest by reason."""
    kept: list[RewardSample] = []
    stale = newer = empty = greedy = 0
    for s in samples:
        if not s.completion_token_ids:
            empty += 1
        elif s.temperature == 0:
            greedy += 1
        elif s.version > current_version:
            newer += 1
        elif max_stale_versions is not None and current_version - s.version > max_stale_versions:
            stale += 1
        else:
            kept.append(s)
    return SampleSelection(kept=kept, stale=stale, newer=newer, empty=empty, greedy=greedy)


@dataclass
class RolloutBatch:
    """Padded tensors of a batch of samples (see the module docstring for the layout)."""

    input_ids: torch.Tensor  # (B, P + T) long
    attention_mask: torch.Tensor  # (B, P + T) long, 1 on real prompt and completion tokens
    completion_ids: torch.Tensor  # (B, T) long, pad after each completion's end
    mask: torch.Tensor  # (B, T) float32, 1 on real completion tokens
    behaviour_logprobs: torch.Tensor  # (B, T) float32 mu, 0 on padding, NaN where mu did not draw the token
    served: torch.Tensor  # (B,) bool: every token drawn by mu (False: a hindsight row, see training/hindsight.py)
    rewards: torch.Tensor  # (B,) float32 each row's reward from the dataset
    token_rewards: torch.Tensor  # (B, T) float32 that reward per token: on the last one, or split (training/partial_credit.py)
    versions: torch.Tensor  # (B,) long behaviour versions
    temperatures: torch.Tensor  # (B,) float32 sampling temperature of each row: pi is scored at it (0 = greedy)
    top_ps: torch.Tensor  # (B,) float32 nucleus mass of each row: pi is scored on that nucleus (1 = whole vocabulary)
    prompt_width: int  # P

    def tempered_logits(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(b, P + T, V) model logits of the batch's `rows` (default: all) -> (b, T, V) float32 logits divided by
        each row's temperature, as the engine did before sampling. Greedy rows stay unscaled, as the engine
        scores them. The whole vocabulary: for measures of the policy itself (the gate's KL)."""
        t = self.temperatures if rows is None else self.temperatures[rows]
        view = self.completion_view(logits).float()
        if bool(((t == 1) | (t == 0)).all()):  # nothing to scale: no second (b, T, V) tensor on the hot path
            return view
        return view / torch.where(t > 0, t, torch.ones_like(t))[:, None, None]

    def sampled_logits(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(b, P + T, V) model logits of the batch's `rows` (default: all) -> (b, T, V) float32 logits of the
        distribution each completion token was drawn from: tempered, then cut to the row's top-p nucleus (the
        engine's logged mu is the log-prob after both). Scores pi where mu was drawn."""
        return self.cut_to_nucleus(self.tempered_logits(logits, rows), rows)

    def cut_to_nucleus(self, tempered: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(b, T, V) tempered logits of `rows` -> the same with tokens outside each row's top-p nucleus at -inf."""
        p = self.top_ps if rows is None else self.top_ps[rows]
        t = self.temperatures if rows is None else self.temperatures[rows]
        cut = (p < 1) & (t > 0)  # (b,) greedy rows: the engine takes the arg max whatever top_p says
        if not bool(cut.any()):
            return tempered
        ids = self.completion_ids if rows is None else self.completion_ids[rows]
        out = tempered.clone()
        out[cut] = nucleus(tempered[cut], p[cut], ids[cut])
        return out

    def completion_view(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P + T, ...) -> (B, T, ...): the columns whose outputs score completion tokens."""
        T = self.completion_ids.shape[1]
        return x[:, self.prompt_width - 1 : self.prompt_width - 1 + T]

    def to(self, device: torch.device) -> RolloutBatch:
        """The same batch with every tensor on `device` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return RolloutBatch(**moved)


def nucleus(logits: torch.Tensor, top_p: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """(n, T, V) tempered logits, (n,) nucleus mass, (n, T) sampled token ids -> the logits with every token
    outside its position's nucleus at -inf. The nucleus is the engine's (vLLM's top-p): the most likely tokens,
    dropping from the least likely while the mass dropped stays <= 1 - top_p, never the most likely one.

    The sampled token is always kept. The nucleus is the scoring model's own, so after some updates pi_theta's
    may no longer hold a token mu drew; that token then keeps its renormalised share rather than log-prob -inf
    (a ratio of exactly 0 would leave the row no gradient and the KL penalty infinite)."""
    with torch.no_grad():  # which tokens are in is a step function of theta: no gradient through the choice
        ordered, order = logits.sort(-1)  # (n, T, V) ascending
        dropped = ordered.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None, None]  # (n, T, V) over sorted tokens
        dropped[..., -1] = False
        drop = torch.zeros_like(dropped).scatter(-1, order, dropped)  # (n, T, V) back in vocabulary order
        drop.scatter_(-1, sampled.long().unsqueeze(-1), False)
    return logits.masked_fill(drop, float("-inf"))


def collate(samples: Sequence[RewardSample], pad_token_id: int) -> RolloutBatch:
    """Stack samples into a RolloutBatch: prompts left-padded, completions right-padded."""
    if not samples:
        raise ValueError("no samples to collate")
    if not isinstance(pad_token_id, int):  # a tokenizer without a pad token: training.tokenizer.padding_id chooses one
        raise ValueError(f"pad_token_id={pad_token_id!r}: need an int (training.tokenizer.padding_id(tokenizer))")
    for s in samples:
        if not s.prompt_token_ids:
            raise ValueError(f"sample {s.request_id} has an empty prompt: no logits predict its first token")
        if len(s.behaviour_logprobs) != len(s.completion_token_ids):
            raise ValueError(
                f"sample {s.request_id}: {len(s.behaviour_logprobs)} behaviour log-probs for "
                f"{len(s.completion_token_ids)} completion tokens"
            )
    B = len(samples)
    P = max(len(s.prompt_token_ids) for s in samples)
    T = max(len(s.completion_token_ids) for s in samples)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    behaviour = torch.zeros((B, T), dtype=torch.float32)
    token_rewards = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
        input_ids[i, P - p : P] = torch.tensor(s.prompt_token_ids)
        input_ids[i, P : P + t] = torch.tensor(s.completion_token_ids)
        attention_mask[i, P - p : P + t] = 1
        behaviour[i, :t] = torch.tensor(s.behaviour_logprobs)
        if isinstance(s, CreditedSample):
            token_rewards[i, :t] = torch.tensor(s.token_rewards())
        elif t:
            token_rewards[i, t - 1] = s.reward
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_ids=input_ids[:, P:].clone(),
        mask=attention_mask[:, P:].to(torch.float32),
        behaviour_logprobs=behaviour,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        token_rewards=token_rewards,
        versions=torch.tensor([s.version for s in samples], dtype=torch.long),
        temperatures=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        top_ps=torch.tensor([s.top_p for s in samples], dtype=torch.float32),
        served=torch.tensor([not isinstance(s, HindsightSample) for s in samples], dtype=torch.bool),
        prompt_width=P,
    )
