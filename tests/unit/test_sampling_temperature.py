"""Rows sampled below temperature 1 or with top-p below 1: the engines log μ after temperature scaling and the
nucleus cut, so the trainer and the gate score π at each row's own temperature, on its own nucleus; greedy rows
carry no importance weight and PPO skips them."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from data_contracts.corpus import read_texts, stdlib_root
from data_contracts.samples import RewardSample
from tests.unit.ppo_helpers import cfg, make_trainer
from training.offline_gate import kl_and_ope
from training.policy import load_policy, load_tokenizer
from training.rollout import collate, nucleus


def row(
    i: int, prompt: list[int], completion: list[int], mu: list[float], temperature: float, reward: float = 0.0, top_p: float = 1.0
) -> RewardSample:
    return RewardSample(
        request_id=f"t{i}",
        model="tab",
        version=1,
        arm="control",
        user_hash="u",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        behaviour_logprobs=mu,
        temperature=temperature,
        top_p=top_p,
        completion_text="x",
        event="rejected",
        reward=reward,
        reward_rule="r@1",
        completion_time_ms=0,
    )


def top_p_logprobs(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """(V,) log-probs -> log-probs renormalised over the nucleus: the most likely tokens, each kept while the
    mass of those more likely than it is below top_p (written apart from training.rollout.nucleus)."""
    probs, order = logp.exp().sort(descending=True)
    keep_sorted = (probs.cumsum(0) - probs) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    return torch.log_softmax(logp.masked_fill(~keep, float("-inf")), -1)


@torch.no_grad()
def tempered_rows(champion_dir, temperature: float, n: int = 24, tokens: int = 4, top_p: float = 1.0) -> list[RewardSample]:
    """Completions the champion sampled at `temperature` from the `top_p` nucleus, μ the log-prob of each token
    after the scaling and the cut (what an engine with processed log-probs logs)."""
    model, tok = load_policy(champion_dir), load_tokenizer(champion_dir)
    text = read_texts([stdlib_root() / "heapq.py"])[0]
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        start = rng.randrange(0, len(text) - 200)
        prompt = tok.encode(text[start : start + rng.randrange(40, 120)], add_special_tokens=False)
        ids, out, mu = list(prompt), [], []
        for _ in range(tokens):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature, -1)
            logp = top_p_logprobs(logp, top_p) if top_p < 1 else logp
            t = int(torch.multinomial(logp.exp(), 1, generator=gen))
            out.append(t), mu.append(float(logp[t])), ids.append(t)
        rows.append(row(i, prompt, out, mu, temperature, reward=rng.choice([0.75, -0.25]), top_p=top_p))
    return rows


def test_sampled_logits_divide_each_row_by_its_temperature() -> None:
    b = collate([row(0, [1, 2], [3, 4], [-1.0, -1.0], 0.5), row(1, [1], [3], [-1.0], 0.0)], pad_token_id=0)
    assert b.temperatures.tolist() == [0.5, 0.0]
    logits = torch.ones((2, b.input_ids.shape[1], 5))
    scaled = b.sampled_logits(logits)  # (2, T, 5)
    assert scaled.shape == (2, 2, 5)
    assert torch.equal(scaled[0], torch.full((2, 5), 2.0))  # / 0.5
    assert torch.equal(scaled[1], torch.ones((2, 5)))  # greedy: unscaled, as the engine scores it
    assert torch.equal(b.sampled_logits(logits[1:], torch.tensor([1])), scaled[1:])


def test_rows_sampled_at_half_temperature_get_unit_importance_weights(champion_dir) -> None:
    rows = tempered_rows(champion_dir, 0.5)
    trainer = make_trainer(champion_dir, cfg(batch_size=len(rows)))
    trainer.compute_reference(rows)
    ro = trainer.rollout(rows, list(range(len(rows))))
    m = ro.batch.mask.bool()
    # π_old is the policy the rows were drawn from, scored where the engine drew them: π_old/μ = 1 at every token
    assert torch.allclose(ro.logp_old[m], ro.batch.behaviour_logprobs[m], atol=1e-4)
    assert torch.allclose(ro.is_weight[m], torch.ones(int(m.sum())), atol=1e-3)
    # The same rows scored at temperature 1 (what the trainer did before rows carried their temperature) put
    # weights far from 1 on the same tokens: every update would have been mis-weighted.
    as_t1 = [r.model_copy(update={"temperature": 1.0}) for r in rows]
    wrong = trainer.rollout(as_t1, list(range(len(rows))))
    assert float((wrong.logp_old - wrong.batch.behaviour_logprobs)[m].abs().mean()) > 0.2


def test_the_gates_estimate_uses_sampled_rows_only(champion_dir) -> None:
    champion, tok = load_policy(champion_dir), load_tokenizer(champion_dir)
    rows = tempered_rows(champion_dir, 0.5, n=12)
    greedy = [r.model_copy(update={"temperature": 0.0, "request_id": r.request_id + "g", "reward": 5.0}) for r in rows[:4]]
    f = kl_and_ope(copy.deepcopy(champion), champion, rows + greedy, tok.pad_token_id)
    assert f["heldout_rows"] == 12  # the greedy rows' 5.0 rewards never enter the estimate
    assert f["ope_champion"] == pytest.approx(sum(r.reward for r in rows) / 12, abs=1e-4)
    assert f["ess_champion"] == pytest.approx(12, rel=1e-3) and f["kl_per_token"] == pytest.approx(0.0, abs=1e-6)
    only_greedy = kl_and_ope(copy.deepcopy(champion), champion, greedy, tok.pad_token_id)
    assert only_greedy["ess_candidate"] == 0.0 and only_greedy["heldout_rows"] == 0


def test_nucleus_keeps_the_engines_top_p_set_and_the_sampled_token() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().view(1, 1, 4)  # probabilities 0.5, 0.3, 0.15, 0.05
    # 1 - 0.75 = 0.25: the two least likely (mass 0.20) go, the third would take the dropped mass past 0.25
    cut = nucleus(logits, torch.tensor([0.75]), sampled=torch.tensor([[0]]))
    assert torch.isinf(cut[0, 0, 2:]).all()
    assert torch.allclose(torch.softmax(cut[0, 0], -1)[:2], torch.tensor([0.625, 0.375]))
    # a token mu drew that this model's nucleus lacks keeps its renormalised share, never log-prob -inf
    kept = nucleus(logits, torch.tensor([0.75]), sampled=torch.tensor([[3]]))
    assert torch.isfinite(kept[0, 0, 3]) and torch.isinf(kept[0, 0, 2])
    # a tiny top_p keeps the most likely token alone
    alone = nucleus(logits, torch.tensor([0.01]), torch.tensor([[0]]))[0, 0]
    assert torch.isfinite(alone).tolist() == [True, False, False, False]


def test_rows_sampled_from_a_nucleus_get_unit_importance_weights(champion_dir) -> None:
    rows = tempered_rows(champion_dir, 0.8, top_p=0.7)
    trainer = make_trainer(champion_dir, cfg(batch_size=len(rows), entropy_coef=0.01))
    trainer.compute_reference(rows)
    ro = trainer.rollout(rows, list(range(len(rows))))
    m = ro.batch.mask.bool()
    assert torch.allclose(ro.logp_old[m], ro.batch.behaviour_logprobs[m], atol=1e-4)
    assert torch.allclose(ro.is_weight[m], torch.ones(int(m.sum())), atol=1e-3)
    # scored over the whole vocabulary (top-p ignored), pi_old puts less mass on every drawn token than mu did
    whole = trainer.rollout([r.model_copy(update={"top_p": 1.0}) for r in rows], list(range(len(rows))))
    gap = (whole.batch.behaviour_logprobs - whole.logp_old)[m]
    assert (gap >= -1e-4).all() and float(gap.mean()) > 0.05
    # an update with the entropy bonus stays finite: tokens outside the nucleus have p = 0 and add nothing
    metrics = trainer.update(ro, iteration=0)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics


def test_the_gate_scores_rows_on_their_nucleus(champion_dir) -> None:
    champion, tok = load_policy(champion_dir), load_tokenizer(champion_dir)
    rows = tempered_rows(champion_dir, 0.8, n=12, top_p=0.7)
    f = kl_and_ope(copy.deepcopy(champion), champion, rows, tok.pad_token_id)
    # the champion scored where mu was drawn: every weight is 1, so the estimate is the logged mean and ESS = n
    assert f["ess_champion"] == pytest.approx(12, rel=1e-3) and f["kl_per_token"] == pytest.approx(0.0, abs=1e-6)
    assert f["ope_champion"] == pytest.approx(sum(r.reward for r in rows) / 12, abs=1e-4)
