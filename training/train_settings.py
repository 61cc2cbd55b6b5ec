"""Settings of the training plane (the `train` section of the Tidal settings)."""

from __future__ import annotations

from pydantic import Field

from tidal.section import Section
from training.ppo_config import PPOConfig


class GateConfig(Section):
    max_kl: float = Field(0.5, gt=0, description="Largest mean per-token KL(candidate || champion), nats, on held-out logged completions.")
    ope_tolerance: float = Field(0.05, ge=0, description="The candidate's importance-weighted reward estimate may sit this far below the champion's.")
    min_ess: float = Field(10.0, ge=1, description="Below this effective sample size the reward estimate is reported as inconclusive and does not block.")
    bpb_tolerance: float = Field(0.05, ge=0, description="Allowed increase of held-out code bits/byte over the champion.")
    eval_bytes: int = Field(30_000, ge=1000, description="Held-out code bytes scored for bits/byte (both models, same bytes).")
    seq_len: int = Field(256, ge=16, description="Window length of the bits/byte evaluation.")
    min_heldout_rows: int = Field(4, ge=1, description="Fewer held-out logged rows than this fails the gate: too little evidence.")


class TrainSettings(Section):
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO hyper-parameters (logged with every run).")
    gate: GateConfig = Field(default_factory=GateConfig, description="Offline gate a candidate passes before any traffic.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description=(
        "Share of a dataset's rows (by a hash of the request id) kept out of training for the offline gate."))
    min_train_rows: int = Field(16, ge=1, description="Fewer usable training rows than this fails the run before it starts.")
    checkpoint_every: int = Field(5, ge=1, description="Save the training state to the object store every this many iterations.")
    retries: int = Field(2, ge=0, description="Times the train flow restarts a crashed trainer process (each resumes from its last checkpoint).")
    retry_delay_s: float = Field(2.0, ge=0, description="Wait before restarting a crashed trainer.")
    torch_threads: int | None = Field(None, ge=1, description=(
        "torch.set_num_threads in the trainer. None = the cores the local CPU fleet leaves free (at least 1): more "
        "threads than free cores makes every training step tens of times slower while replicas run."))
