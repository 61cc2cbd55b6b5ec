"""One Megatron PPO step on a saved policy, with figures: what bench/gpu_check.py runs on a GPU (and the unit
tests on a CPU). The policy is converted to Megatron shards (tensor_parallel 1, one process), its logits are
compared with the HF model's on a left-padded batch, then one PPO iteration runs on synthetic samples."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def gpu_check_step(policy_dir: str | Path, n_samples: int = 16) -> dict:
    from training.megatron import parallel
    from training.megatron.trainable import build_megatron_trainable
    from training.policy import load_policy
    from training.ppo_config import PPOConfig
    from training.ppo_trainer import PPOTrainer
    from training.rollout import collate
    from training.trainer_check import synthetic_rows, timed_iteration
    from training.value_head import PolicyWithValue

    policy_dir = Path(policy_dir)
    cfg = PPOConfig(
        backend="megatron",
        lora=False,
        batch_size=n_samples,
        minibatch_size=n_samples // 2,
        epochs=1,
        passes=1,
        max_iterations=1,
        target_kl=None,
    )
    t0 = time.perf_counter()
    model = build_megatron_trainable(policy_dir, policy_dir, cfg)
    device = parallel.device()
    model.to(device)
    build_s = time.perf_counter() - t0
    vocab = model.shape.vocab_size
    samples = synthetic_rows(vocab, n_samples)  # ragged prompts and completions: padding on both sides
    batch = collate(samples, pad_token_id=0).to(device)
    hf = PolicyWithValue(load_policy(policy_dir).to(device), model.value_head)
    with torch.no_grad():
        want, _ = hf(batch.input_ids, batch.attention_mask)
        got, _ = model(batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    diff = float((want - got)[real].abs().max())
    trainer = PPOTrainer(model, cfg, 0, dp=parallel.data_parallel())
    trainer.compute_reference(samples)
    metrics, step_s, _ = timed_iteration(trainer, samples, device)
    return {
        "megatron_device": device.type,
        "megatron_build_s": round(build_s, 3),
        "megatron_step_s": round(step_s, 3),
        "megatron_hf_logit_max_diff": diff,
        "megatron_policy_loss": metrics["ppo/policy_loss"],
        "megatron_grad_norm": metrics["ppo/grad_norm"],
    }
