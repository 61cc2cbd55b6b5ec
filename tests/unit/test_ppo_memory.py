"""The trainer's memory and precision settings (train.ppo.micro_batch_tokens, gradient_checkpointing, precision,
device) on the tiny policy: micro-batches and recomputed layers take the step the whole minibatch takes, every loss
term included (the abstain budget's penalty where it binds); bf16 autocast keeps float32 master weights and moves
them as float32 does; a device or combination that cannot work is refused with the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bench.logged_traffic import logged_traffic
from data_contracts.corpus import stdlib_root
from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample
from sim.users import SimUsersConfig
from tests.unit.ppo_helpers import trainable_weights
from training import distributed
from training.candidate import build_trainable, save_candidate
from training.distributed import LaunchEnvError
from training.job import loss_terms
from training.policy import load_policy, load_tokenizer, save_policy
from training.ppo_config import PPOConfig
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.probe import compute_probe, load_probe
from training.stop_credit import StopCredit

# every weight trained with each loss term the demo trains with, the abstain budget tight enough to bind
TERMS = dict(
    batch_size=16,
    minibatch_size=8,
    epochs=2,
    passes=1,
    max_iterations=2,
    learning_rate=1e-3,
    critic_learning_rate=1e-2,
    target_kl=None,
    seed=0,
    stop_credit_coef=2.0,
    abstain_budget=0.02,
    kept_credit_coef=4.0,
    sharpen_coef=1.0,
    sharpen_temperature=0.5,
    stop_anchor_coef=0.5,
)


@pytest.fixture(scope="module")
def rows(champion_dir, tmp_path_factory) -> list[RewardSample]:
    """32 logged requests of the tiny champion with the simulated users' verdicts (accepted, partial, rejected)."""
    code = tmp_path_factory.mktemp("code")
    for name in ("heapq.py", "bisect.py"):
        (code / name).write_text((stdlib_root() / name).read_text())
    users = SimUsersConfig(code_dir=code, min_chars=(1, 2), context_bytes=200)
    out = logged_traffic(load_policy(champion_dir), load_tokenizer(champion_dir), users, 0.0, RewardRule(), 32, seed=0)
    assert len({len(r.prompt_token_ids) for r in out}) > 4, "rows of different lengths: micro-batches pad differently"
    return out


def trained(champion_dir: Path, rows: list[RewardSample], **kw) -> tuple[PPOTrainer, list[dict]]:
    c = PPOConfig(**{"lora": False, **TERMS, **kw})
    tok = load_tokenizer(champion_dir)
    trainer = PPOTrainer(
        build_trainable(champion_dir, champion_dir, c), c, tok.pad_token_id, **loss_terms(c, tok, RewardRule(), 0.1)
    )
    plan = iteration_plan(len(rows), c)
    trainer.compute_reference(rows, rows=(r for batch in plan for r in batch))
    return trainer, trainer.train(rows, plan)


@pytest.fixture(scope="module")
def whole(champion_dir, rows) -> tuple[PPOTrainer, list[dict]]:
    return trained(champion_dir, rows)


def test_the_abstain_budget_binds_in_these_rows(champion_dir, rows) -> None:
    """Else the micro-batch test below would not check the budget's penalty, which is not linear in the rows."""
    c = PPOConfig(**TERMS, lora=False)
    tok = load_tokenizer(champion_dir)
    trainer = PPOTrainer(
        build_trainable(champion_dir, champion_dir, c), c, tok.pad_token_id, **loss_terms(c, tok, RewardRule(), 0.1)
    )
    trainer.compute_reference(rows)
    ro = trainer.rollout(rows, list(range(16)))
    share, n = trainer._abstain_share(ro, torch.arange(16).split(4))
    assert n == 16 and share > c.abstain_budget, (share, c.abstain_budget)
    assert isinstance(trainer.stop, StopCredit)


def assert_same_step(trainer: PPOTrainer, reference: PPOTrainer, start: dict[str, torch.Tensor]) -> None:
    """Every trained tensor ends where the reference's does, up to float rounding: within 1% of the way it moved
    (Adam divides each gradient by its own scale, so a rounding difference in a tiny gradient moves its weight by
    up to the learning rate; an absolute tolerance would either hide a wrong step or fail a right one)."""
    ref = trainable_weights(reference)
    for name, w in trainable_weights(trainer).items():
        step = float((ref[name] - start[name]).norm())
        assert step > 0, f"{name} did not move: equal weights prove nothing"
        assert float((w - ref[name]).norm()) < 0.01 * step, name


@pytest.fixture(scope="module")
def start(champion_dir) -> dict[str, torch.Tensor]:
    """The champion's trained tensors before any step."""
    model = build_trainable(champion_dir, champion_dir, PPOConfig(**TERMS, lora=False))
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tokens", [1, 500])
def test_micro_batches_take_the_step_of_the_whole_minibatch(champion_dir, rows, whole, start, tokens) -> None:
    """1 token: one row per micro-batch; 500: 2-3 rows, as each batch's padded length (~180 tokens) decides."""
    split, history = trained(champion_dir, rows, micro_batch_tokens=tokens)
    assert_same_step(split, whole[0], start)
    for a, b in zip(history, whole[1]):
        for k in ("ppo/policy_loss", "ppo/value_loss", "ppo/stop_credit_loss", "ppo/kept_credit_loss", "ppo/sharpen_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_recomputed_layers_take_the_same_step(champion_dir, rows, whole, start) -> None:
    ckpt, _ = trained(champion_dir, rows, gradient_checkpointing=True)
    assert ckpt.model.policy.is_activation_checkpointing
    assert_same_step(ckpt, whole[0], start)
    # an adapter run: the frozen base's layers are recomputed too, and the gradients still reach the adapters
    adapter = build_trainable(champion_dir, champion_dir, PPOConfig(**TERMS, lora=True))
    adapter_start = {n: p.detach().clone() for n, p in adapter.named_parameters() if p.requires_grad}
    plain, _ = trained(champion_dir, rows, lora=True)
    ckpt, _ = trained(champion_dir, rows, lora=True, gradient_checkpointing=True)
    assert_same_step(ckpt, plain, adapter_start)


def test_bf16_autocast_keeps_float32_master_weights_and_moves_them_like_float32(champion_dir, rows, whole, start) -> None:
    half, history = trained(champion_dir, rows, precision="bf16")
    assert all(p.dtype == torch.float32 for p in half.model.parameters())
    full_step = torch.cat([(w - start[n]).flatten() for n, w in trainable_weights(whole[0]).items()])
    half_step = torch.cat([(w - start[n]).flatten() for n, w in trainable_weights(half).items()])
    cosine = float(torch.nn.functional.cosine_similarity(full_step, half_step, dim=0))
    assert cosine > 0.9, cosine  # measured: 0.998
    assert all(torch.isfinite(torch.tensor(list(h.values()))).all() for h in history)
    # pi_old and pi_new come from the same bf16 forward, so the ratio moves as float32's does (measured: approx KL
    # 0.0314 against 0.0307 in the first iteration), and the logged float32 behaviour log-probs weigh ~1
    for h, ref in zip(history, whole[1]):
        assert h["ppo/approx_kl"] == pytest.approx(ref["ppo/approx_kl"], rel=0.2)
        assert h["ppo/is_weight_mean"] == pytest.approx(1.0, abs=0.01)


def test_bf16_logits_and_values_leave_the_model_in_float32(champion_dir, rows) -> None:
    model = build_trainable(champion_dir, champion_dir, PPOConfig(lora=False, precision="bf16"))
    ids = torch.tensor([rows[0].prompt_token_ids])
    logits, values = model(ids)
    assert logits.dtype == values.dtype == torch.float32
    plain, _ = build_trainable(champion_dir, champion_dir, PPOConfig(lora=False))(ids)
    assert not torch.equal(logits, plain), "autocast must change the computation, or the setting does nothing"
    assert torch.allclose(logits, plain, atol=0.1)


def test_a_device_that_cannot_be_had_is_refused_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.device("auto") == distributed.device("cpu") == torch.device("cpu")
    with pytest.raises(LaunchEnvError, match="no CUDA device is visible.*set device='auto'"):
        distributed.device("cuda")


def test_settings_that_cannot_work_together_are_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens=0: must be >= 1"):
        PPOConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="backend='hf' only.*set precision='fp32'"):
        PPOConfig(lora=False, backend="megatron", precision="bf16")
    with pytest.raises(ValueError, match="backend='hf' only"):
        PPOConfig(lora=False, backend="megatron", gradient_checkpointing=True)
    with pytest.raises(ValueError, match="Input should be 'auto', 'cpu' or 'cuda'"):
        PPOConfig(device="tpu")


def test_the_gpu_checks_trainer_step_runs_here_with_its_figures(champion_dir) -> None:
    """bench/gpu_check.py runs it on a GPU (`trainer_device` 'cuda'); here on the CPU, the same code and checks."""
    from training.trainer_check import gpu_check_trainer

    figures = gpu_check_trainer(champion_dir, device="cpu")
    assert figures["trainer_device"] == "cpu" and figures["trainer_finite"]
    assert figures["trainer_micro_vs_whole"] < 1e-3, figures  # measured: 4e-6
    assert figures["trainer_bf16_vs_fp32_cosine"] > 0.9, figures
    assert figures["trainer_lora_moved"] > 0 and figures["trainer_lora_frozen_dtype"] == "bfloat16", figures
    assert {"trainer_fp32_s", "trainer_fp32_micro_s", "trainer_bf16_ckpt_s", "trainer_lora_bf16_s"} <= set(figures)
    from bench.gpu_check import trainer_fails

    assert trainer_fails(figures) == "the trainer ran on cpu, not the GPU (train.ppo.device 'auto')"
    assert trainer_fails({**figures, "trainer_device": "cuda"}) == ""
    assert "cosine 0.500" in trainer_fails({**figures, "trainer_device": "cuda", "trainer_bf16_vs_fp32_cosine": 0.5})


@pytest.fixture(scope="module")
def bf16_champion(champion_dir, tmp_path_factory) -> Path:
    """The champion stored in bfloat16, as released checkpoints ship (its probe copied beside it)."""
    out = save_policy(
        load_policy(champion_dir).to(torch.bfloat16), load_tokenizer(champion_dir), tmp_path_factory.mktemp("bf16") / "v1"
    )
    shutil.copy(champion_dir / "probe.json", out / "probe.json")
    return out


def test_a_lora_run_under_bf16_keeps_a_bf16_base_in_bf16_and_publishes_a_float32_probe(
    champion_dir, bf16_champion, rows, tmp_path
) -> None:
    c = PPOConfig(**TERMS, lora=True, precision="bf16")
    model = build_trainable(bf16_champion, bf16_champion, c)
    frozen = [p for p in model.policy.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # half the base's memory
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # the adapter and the critic
    # a base stored in float32 is not rounded (the engine serves those values), nor is any weight of a float32 run
    assert all(p.dtype == torch.float32 for p in build_trainable(champion_dir, champion_dir, c).parameters())
    assert all(p.dtype == torch.float32 for p in build_trainable(bf16_champion, bf16_champion, PPOConfig(**TERMS)).parameters())

    tok = load_tokenizer(bf16_champion)
    trainer = PPOTrainer(model, c, tok.pad_token_id, **loss_terms(c, tok, RewardRule(), 0.1))
    trainer.compute_reference(rows[:16])
    [metrics] = trainer.train(rows[:16], [list(range(16))])
    assert all(v == v for v in metrics.values())  # finite (NaN != NaN)
    out = save_candidate(trainer.model, bf16_champion, bf16_champion, tmp_path / "cand")
    probe = load_probe(out)  # the candidate's probe: float32 on the base's bf16 values, as a fresh float32 load gives
    again = compute_probe(
        load_policy(out, base_path=bf16_champion),
        tok,
        [tok.decode(i.prompt_token_ids) for i in probe.items],
        probe.max_new_tokens,
    )
    for x, y in zip(probe.items, again.items):
        assert x.completion_token_ids == y.completion_token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
