"""One PPO iteration of the Hugging Face trainer on this machine's device, with figures: what bench/gpu_check.py
runs on a GPU (and the unit tests on a CPU). The same synthetic batch is trained four ways: every weight in float32
at once, in float32 micro-batches, and under bf16 autocast with recomputed layers; and a LoRA adapter under bf16 on
the policy stored in bf16 (its frozen base kept so). Each run's seconds and (on a GPU) peak memory; the
micro-batched step is compared with the whole one, the bf16 step with the float32 one."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from data_contracts.samples import RewardSample


def synthetic_rows(vocab: int, n: int, seed: int = 0) -> list[RewardSample]:
    """`n` rows of ragged random prompts (8-40 tokens) and completions (2-9), half accepted: padding on both sides."""
    gen, rows = torch.Generator().manual_seed(seed), []
    for i in range(n):
        p, t = 8 + (i * 7) % 33, 2 + i % 8
        rows.append(
            RewardSample(
                request_id=f"check-{i}",
                model="check",
                version=1,
                arm="control",
                user_hash="u",
                prompt_token_ids=torch.randint(3, vocab, (p,), generator=gen).tolist(),
                completion_token_ids=torch.randint(3, vocab, (t,), generator=gen).tolist(),
                behaviour_logprobs=[-5.0] * t,
                completion_text="x",
                event="accepted" if i % 2 else "rejected",
                accepted_chars=None,
                reward=0.75 if i % 2 else -0.25,
                reward_rule="check@1",
                completion_time_ms=0,
            )
        )
    return rows


def trained_tensors(model) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of every trained tensor of `model`."""
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters() if p.requires_grad}


def timed_iteration(trainer, rows: list[RewardSample], device: torch.device) -> tuple[dict, float, float | None]:
    """(metrics, seconds, peak MiB on a GPU else None) of the trainer's one iteration over all of `rows`, the GPU's
    queue drained before and after the clock."""
    from training.ppo_trainer import iteration_plan

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    [metrics] = trainer.train(rows, iteration_plan(len(rows), trainer.cfg))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return metrics, seconds, torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def train_once(policy_dir: Path, rows: list[RewardSample], device: torch.device, **settings) -> dict:
    """One iteration over `rows` under PPOConfig(**settings): its seconds, peak memory, metrics and weight step."""
    from training.candidate import build_trainable
    from training.ppo_config import PPOConfig
    from training.ppo_trainer import PPOTrainer

    cfg = PPOConfig(batch_size=len(rows), minibatch_size=len(rows) // 2, epochs=1, passes=1, target_kl=None, **settings)
    model = build_trainable(policy_dir, policy_dir, cfg).to(device)
    start = trained_tensors(model)
    trainer = PPOTrainer(model, cfg, pad_token_id=0)
    trainer.compute_reference(rows)
    metrics, seconds, peak = timed_iteration(trainer, rows, device)
    now = trained_tensors(model)
    return {
        "s": round(seconds, 3),
        "peak_mib": None if peak is None else round(peak, 1),
        "metrics": metrics,
        "step": torch.cat([(now[n] - start[n]).flatten() for n in sorted(start)]),  # the flat change of each trained tensor
        "frozen": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if not p.requires_grad}),
    }


def gpu_check_trainer(policy_dir: str | Path, n_rows: int = 16, device: str = "auto") -> dict:
    from training import distributed
    from training.policy import load_policy, load_tokenizer, save_policy

    policy_dir = Path(policy_dir)
    where = distributed.device(device)
    policy = load_policy(policy_dir)
    rows = synthetic_rows(int(policy.config.vocab_size), n_rows)
    width = max(len(r.prompt_token_ids) for r in rows) + max(len(r.completion_token_ids) for r in rows)
    full = dict(lora=False, learning_rate=1e-4)
    with tempfile.TemporaryDirectory() as tmp:  # the LoRA run's base stored in bf16, as released checkpoints ship
        bf16_dir = save_policy(policy.to(torch.bfloat16), load_tokenizer(policy_dir), Path(tmp) / "bf16")
        runs = {
            "fp32": train_once(policy_dir, rows, where, **full),
            "fp32_micro": train_once(policy_dir, rows, where, **full, micro_batch_tokens=2 * width),  # 2 rows each
            "bf16_ckpt": train_once(policy_dir, rows, where, **full, precision="bf16", gradient_checkpointing=True),
            "lora_bf16": train_once(bf16_dir, rows, where, lora=True, precision="bf16"),
        }
    whole = runs["fp32"]["step"]
    return {
        "trainer_device": where.type,
        **{f"trainer_{k}_s": r["s"] for k, r in runs.items()},
        **{f"trainer_{k}_peak_mib": r["peak_mib"] for k, r in runs.items() if r["peak_mib"] is not None},
        # the micro-batched step's distance from the whole one, relative to the step (float rounding: ~1e-6)
        "trainer_micro_vs_whole": float((runs["fp32_micro"]["step"] - whole).norm() / whole.norm()),
        "trainer_bf16_vs_fp32_cosine": float(torch.nn.functional.cosine_similarity(runs["bf16_ckpt"]["step"], whole, dim=0)),
        "trainer_lora_moved": float(runs["lora_bf16"]["step"].abs().max()),
        "trainer_lora_frozen_dtype": ",".join(runs["lora_bf16"]["frozen"]),  # 'bfloat16': the base as stored
        "trainer_finite": all(all(v == v and abs(v) != float("inf") for v in r["metrics"].values()) for r in runs.values()),
    }
