"""From RewardSamples to aligned PPO tensors, and a few PPO steps end to end on a tiny policy."""

from __future__ import annotations

import pytest
import torch

from data_contracts.samples import RewardSample
from tests.unit.test_ppo_value_head import tiny_qwen
from training.ppo_loss import gae, kl_penalized_rewards, ppo_losses, token_logprobs, truncated_is_weight
from training.rollout import collate, select_samples
from training.value_head import PolicyWithValue

PAD = 0


def sample(
    prompt: list[int], completion: list[int], reward: float = 0.0, version: int = 3, logprobs: list[float] | None = None
) -> RewardSample:
    return RewardSample(
        request_id=f"r{len(prompt)}-{len(completion)}-{version}",
        model="tab",
        version=version,
        arm="control",
        user_hash="u",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        behaviour_logprobs=logprobs if logprobs is not None else [-1.0] * len(completion),
        completion_text="x",
        event="accepted",
        reward=reward,
        reward_rule="test@1",
        completion_time_ms=0,
    )


def test_select_samples_drops_and_counts_by_reason() -> None:
    greedy = sample([1, 1], [2], version=5).model_copy(update={"temperature": 0.0})
    rows = [sample([1], [2], version=v) for v in (5, 4, 3, 2, 6)] + [sample([1], [], version=5), greedy]
    sel = select_samples(rows, current_version=5, max_stale_versions=2)
    assert [s.version for s in sel.kept] == [5, 4, 3]
    assert (sel.stale, sel.newer, sel.empty, sel.greedy) == (1, 1, 1, 1)
    assert len(select_samples(rows, 5, None).kept) == 4


def test_collate_layout() -> None:
    b = collate([sample([5, 6, 7], [8, 9], reward=0.75, logprobs=[-0.5, -0.25]), sample([4], [3, 2, 1])], PAD)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, PAD], [PAD, PAD, 4, 3, 2, 1]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.completion_ids.tolist() == [[8, 9, PAD], [3, 2, 1]]
    assert b.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.behaviour_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -1.0, -1.0]]
    assert b.rewards.tolist() == [0.75, 0.0] and b.versions.tolist() == [3, 3]
    # column P-1+t of the inputs is the last context token before completion token t
    assert b.completion_view(b.input_ids).tolist() == [[7, 8, 9], [4, 3, 2]]
    with pytest.raises(ValueError, match="behaviour log-probs"):
        collate([sample([1], [2, 3], logprobs=[-1.0])], PAD)
    with pytest.raises(ValueError, match="empty prompt"):
        collate([sample([], [2])], PAD)
    with pytest.raises(ValueError, match="pad_token_id=None: need an int"):  # a tokenizer without a pad token
        collate([sample([1], [2])], None)


def test_collated_logprobs_match_each_sample_scored_alone() -> None:
    model = tiny_qwen()
    rows = [sample([5, 6, 7, 11], [8, 9]), sample([4], [3, 2, 1]), sample([10, 20], [30])]
    b = collate(rows, PAD)
    with torch.no_grad():
        logits = model(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=(b.attention_mask.cumsum(-1) - 1).clamp_min(0)
        ).logits
        batched = token_logprobs(b.completion_view(logits), b.completion_ids) * b.mask
        for i, s in enumerate(rows):
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            alone = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0, -len(s.completion_token_ids) :]
            torch.testing.assert_close(batched[i, : len(alone)], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reward", [1.0, -1.0])
def test_ppo_steps_move_the_policy_with_the_reward(reward: float) -> None:
    """Two epochs of PPO on one rewarded completion raise (or lower) its log-probability."""
    torch.manual_seed(0)
    pv = PolicyWithValue(tiny_qwen())
    pv.train()
    b = collate([sample([5, 6, 7], [8, 9, 10], reward=reward), sample([4, 4], [12, 13], reward=reward)], PAD)
    opt = torch.optim.Adam(pv.param_groups(1e-3, 1e-3))

    def score() -> tuple[torch.Tensor, torch.Tensor]:
        logits, values = pv(b.input_ids, b.attention_mask)
        return token_logprobs(b.completion_view(logits), b.completion_ids), b.completion_view(values)

    with torch.no_grad():
        logp_old, values_old = score()
    # the batch was served by these very weights: mu = pi_old, and the reference is pi_old too
    w = truncated_is_weight(logp_old, logp_old, b.mask, 2.0)
    rewards = kl_penalized_rewards(b.rewards, logp_old, logp_old, b.mask, 0.05)
    adv, ret = gae(rewards, values_old, b.mask, 1.0, 0.95)
    for _ in range(4):
        logp, values = score()
        parts = ppo_losses(logp, logp_old, adv, values, values_old, ret, w, b.mask, 0.2, 0.2)
        opt.zero_grad()
        parts.total(0.5, 0.0).backward()
        torch.nn.utils.clip_grad_norm_(pv.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        logp_new, values_new = score()
    change = ((logp_new - logp_old) * b.mask).sum()
    assert change > 0 if reward > 0 else change < 0
    # the critic moved towards the (positive or negative) returns
    assert torch.sign((values_new - values_old)[b.mask.bool()]).eq(torch.sign(torch.tensor(reward))).all()
