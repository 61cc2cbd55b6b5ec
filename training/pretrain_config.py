"""Settings of a pretraining run (the `bootstrap.pretrain` section), apart from torch and transformers: loading
settings must not import the training code."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PretrainConfig(BaseModel):
    """Settings of one pretraining run."""

    model_config = ConfigDict(extra="forbid")  # a typo in a setting must not pass silently

    seq_len: int = Field(256, description="Tokens per training window (context length trained on).")
    batch_size: int = Field(16, description="Windows per optimizer step.")
    learning_rate: float = Field(3e-3, description="Peak learning rate, reached at the end of warmup.")
    min_lr_ratio: float = Field(0.1, description="Final learning rate as a fraction of the peak.")
    warmup_steps: int = Field(50, description="Steps of linear warmup from ~0 to the peak rate.")
    weight_decay: float = Field(0.1, description="AdamW decoupled weight decay on matrices only.")
    max_steps: int = Field(100_000, description="Upper bound on optimizer steps.")
    max_seconds: float = Field(
        300.0,
        description="Wall-clock budget for the training steps (evaluation excluded); training "
        "stops at whichever of max_steps/max_seconds comes first.",
    )
    grad_clip: float = Field(1.0, description="Clip the global gradient norm to this (0 disables).")
    seed: int = Field(0, description="Seeds the window sampler, so runs draw the same batches.")
    eval_bytes: int = Field(200_000, description="Held-out UTF-8 bytes scored for bits per byte.")
    torch_threads: int | None = Field(None, description="If set, torch.set_num_threads(value) for the run (CPU training).")
