"""The PPO trainer on a tiny Qwen2 policy and samples drawn from it (so mu is exact): learning,
exact resume, early stop, divergence, and the candidate checkpoint it writes."""

from __future__ import annotations

import pytest
import torch

from data_contracts.samples import RewardSample
from tests.unit.ppo_helpers import cfg, make_trainer, trained_uninterrupted
from training.candidate import CRITIC_FILE, build_trainable, save_candidate
from training.policy import is_adapter_dir, load_policy, load_tokenizer
from training.ppo_trainer import PPOTrainer, TrainingDiverged, iteration_plan
from training.probe import compute_probe, load_probe


@torch.no_grad()
def first_token_logp(trainer: PPOTrainer, rows: list[RewardSample]) -> torch.Tensor:
    """(N,) log pi(first completion token | prompt) under the trainer's current policy."""
    return torch.stack([lp[0] for lp in trainer.token_logprobs(rows)])


def test_plan_is_seeded_and_covers_rows_in_full_batches() -> None:
    c = cfg(batch_size=4, minibatch_size=2, passes=2)
    plan = iteration_plan(10, c)
    assert plan == iteration_plan(10, c) and len(plan) == 2 * (10 // 4)
    assert all(len(b) == 4 and len(set(b)) == 4 for b in plan)
    assert plan[:2] != plan[2:]  # each pass reshuffles
    assert (
        len(iteration_plan(3, c)) == 2 and iteration_plan(10, c.model_copy(update={"max_iterations": 1, "passes": 5})) == plan[:1]
    )


def test_ppo_raises_logprob_of_rewarded_tokens_on_heldout_rows(champion_dir, samples) -> None:
    train, heldout = samples[:120], samples[120:]
    trainer = make_trainer(champion_dir, cfg())
    good = torch.tensor([s.reward > 0 for s in heldout])
    before = first_token_logp(trainer, heldout)
    trainer.compute_reference(train)
    history = trainer.train(train, iteration_plan(len(train), trainer.cfg))
    after = first_token_logp(trainer, heldout)
    gain = after - before  # (N,)
    assert float(gain[good].mean() - gain[~good].mean()) > 0.2
    assert len(history) == 3 * (120 // 32)
    for key in (
        "ppo/policy_loss",
        "ppo/value_loss",
        "ppo/approx_kl",
        "ppo/clipfrac",
        "ppo/is_weight_mean",
        "ppo/is_truncated_frac",
        "charts/tokens_per_s",
    ):
        assert all(torch.isfinite(torch.tensor(h[key])) for h in history), key
    # mu = pi at the first rollout: weights start at exactly 1, nothing truncated
    assert history[0]["ppo/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert history[0]["ppo/is_truncated_frac"] == 0.0
    assert history[0]["ppo/kl_ref"] == pytest.approx(0.0, abs=1e-5)  # pi_old = pi_ref before the first update
    assert any(h["ppo/approx_kl"] > 0 for h in history)


def test_resume_from_state_reaches_the_same_weights(champion_dir, samples, tmp_path) -> None:
    c = cfg(passes=2, max_iterations=3)
    rows = samples[:128]
    straight, plan, used = trained_uninterrupted(champion_dir, c, rows)

    first = make_trainer(champion_dir, c)
    first.compute_reference(rows, rows=(r for batch in plan for r in batch))  # only what the plan touches
    assert set(first.ref_logprobs) == used and len(used) < len(rows)
    first.train(rows, plan[:2])  # "killed" after iteration 2
    torch.save(first.state_dict(), tmp_path / "state.pt")  # as the job stores it
    resumed = make_trainer(champion_dir, c)  # a new process: fresh model, then the saved state
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    resumed.train(rows, plan, start=2)
    a = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, a[name]), name


def test_early_stop_on_approximate_kl(champion_dir, samples) -> None:
    trainer = make_trainer(champion_dir, cfg(target_kl=1e-6, epochs=4))
    trainer.compute_reference(samples[:32])
    [m] = trainer.train(samples[:32], [list(range(32))])
    assert m["ppo/early_stopped"] == 1.0 and m["ppo/epochs_done"] == 1.0


def test_nan_producing_learning_rate_stops_with_a_clear_error(champion_dir, samples) -> None:
    trainer = make_trainer(champion_dir, cfg(learning_rate=1e30, critic_learning_rate=1e30))
    trainer.compute_reference(samples[:64])
    with pytest.raises(TrainingDiverged, match=r"iteration \d+.*not finite.*lower train.ppo.learning_rate"):
        trainer.train(samples[:64], iteration_plan(64, trainer.cfg))


def test_state_of_another_configuration_is_refused(champion_dir, samples) -> None:
    lora = make_trainer(champion_dir, cfg())
    full = make_trainer(champion_dir, cfg(lora=False))
    with pytest.raises(ValueError, match="does not match the model being trained"):
        full.load_state_dict(lora.state_dict())


@pytest.mark.parametrize("lora", [True, False])
def test_candidate_checkpoint_loads_and_matches_its_probe(champion_dir, samples, tmp_path, lora) -> None:
    c = cfg(lora=lora, passes=1, max_iterations=1)
    trainer = make_trainer(champion_dir, c)
    trainer.compute_reference(samples[:32])
    trainer.train(samples[:32], [list(range(32))])
    out = save_candidate(trainer.model, champion_dir, champion_dir, tmp_path / "cand")
    assert is_adapter_dir(out) == lora and (out / CRITIC_FILE).is_file()
    reloaded = load_policy(out, base_path=champion_dir)
    tok = load_tokenizer(champion_dir)
    probe = load_probe(out)
    again = compute_probe(reloaded, tok, [tok.decode(i.prompt_token_ids) for i in probe.items], probe.max_new_tokens)
    for x, y in zip(probe.items, again.items):
        assert x.completion_token_ids == y.completion_token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    # continuing from a lora candidate trains the same adapter further (same base)
    if lora:
        model = build_trainable(out, champion_dir, c)
        assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
        assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n and "value_head" not in n)
