"""Helpers of the PPO trainer tests, in a module (not fixtures) so that worker processes a test spawns can
import them too."""

from __future__ import annotations

from pathlib import Path

import torch

from data_contracts.corpus import read_texts, stdlib_root
from training.candidate import build_trainable
from training.policy import load_tokenizer
from training.ppo_config import PPOConfig
from training.ppo_trainer import PPOTrainer
from training.pretrain import token_stream
from training.ptx import PtxLoss


def cfg(**kw) -> PPOConfig:
    base = {
        "batch_size": 32,
        "minibatch_size": 8,
        "epochs": 2,
        "passes": 3,
        "learning_rate": 3e-3,
        "critic_learning_rate": 1e-2,
        "target_kl": None,
        "seed": 0,
    }
    return PPOConfig(**{**base, **kw})


def make_trainer(champion_dir: Path, c: PPOConfig) -> PPOTrainer:
    """A trainer of the tiny policy; with ptx_coef > 0 its code windows come from heapq.py (what it learned)."""
    ptx = None
    if c.ptx_coef > 0:
        code = token_stream(load_tokenizer(champion_dir), read_texts([stdlib_root() / "heapq.py"]))
        ptx = PtxLoss(code, c.ptx_batch, c.ptx_seq_len, c.seed)
    return PPOTrainer(build_trainable(champion_dir, champion_dir, c), c, pad_token_id=0, ptx=ptx)


def trainable_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    """name -> a CPU copy of every trained parameter (LoRA adapters or all weights, and the value head)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters() if p.requires_grad}


def trained_uninterrupted(champion_dir: Path, c: PPOConfig, rows: list) -> tuple[PPOTrainer, list, set[int]]:
    """(a trainer run over its whole plan without a stop, the plan, the rows the plan touches): what a resumed run
    must match bit for bit."""
    from training.ppo_trainer import iteration_plan

    plan = iteration_plan(len(rows), c)
    used = {r for batch in plan for r in batch}
    straight = make_trainer(champion_dir, c)
    straight.compute_reference(rows, rows=used)
    straight.train(rows, plan)
    return straight, plan, used
