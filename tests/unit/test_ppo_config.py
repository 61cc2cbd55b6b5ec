"""PPOConfig: the documented defaults, and helpful rejection of bad combinations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from training.ppo_config import LORA_TARGETS, PPOConfig


def test_defaults_are_valid_and_documented() -> None:
    cfg = PPOConfig()
    assert cfg.validate() is cfg
    assert (cfg.learning_rate, cfg.critic_learning_rate, cfg.clip_eps, cfg.value_clip_eps) == (1e-4, 1e-4, 0.2, 0.2)
    assert (cfg.gamma, cfg.gae_lambda, cfg.kl_coef, cfg.entropy_coef, cfg.vf_coef) == (1.0, 0.95, 0.05, 0.0, 0.5)
    assert (cfg.batch_size, cfg.minibatch_size, cfg.epochs, cfg.target_kl) == (64, 16, 2, 0.05)
    assert (cfg.is_truncation, cfg.is_level, cfg.seed, cfg.whiten_advantages) == (2.0, "token", 0, True)
    assert (cfg.lora, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (True, 8, 16, LORA_TARGETS)
    assert all(field.description for field in PPOConfig.model_fields.values())


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"minibatch_size": 128}, "lower minibatch_size or raise batch_size"),
        ({"batch_size": 60, "minibatch_size": 16}, "pick a minibatch_size that divides it, e.g. 15"),
        ({"clip_eps": 0.0}, "clip_eps=0.0: must lie in (0, 1)"),
        ({"value_clip_eps": -0.1}, "or None to disable value clipping"),
        ({"is_truncation": 0.5}, "must be a finite C >= 1"),
        ({"gae_lambda": 1.5}, "gae_lambda=1.5"),
        ({"gamma": 0.0}, "gamma=0.0"),
        ({"target_kl": 0.0}, "or None to disable early stopping"),
        ({"learning_rate": 0.0}, "learning_rate=0.0"),
        ({"epochs": 0}, "epochs=0"),
        ({"lora_targets": []}, "set lora=False"),
        ({"max_stale_versions": -1}, "max_stale_versions=-1"),
        ({"hindsight_partials": True, "hindsight_stop": ""}, "needs hindsight_stop: the text that ends a suggestion"),
        ({"ptx_coef": -0.1}, "ptx_coef=-0.1: must be a finite number >= 0"),
        ({"ptx_coef": 1.0, "ptx_seq_len": 1}, "ptx_seq_len=1: must be >= 2"),
        ({"ptx_coef": 1.0, "backend": "megatron", "lora": False}, "set ptx_coef=0 with backend='megatron'"),
    ],
)
def test_validate_rejects_bad_settings_with_a_fix(update: dict, message: str) -> None:
    with pytest.raises(ValidationError, match="invalid PPOConfig") as err:
        PPOConfig(**update)
    assert message in str(err.value)
    # model_copy skips validation; an explicit validate() still catches it
    with pytest.raises(ValueError) as err:
        PPOConfig().model_copy(update=update).validate()
    assert message in str(err.value)


def test_validate_lists_every_problem_and_typos_are_rejected() -> None:
    with pytest.raises(ValueError) as err:
        PPOConfig().model_copy(update={"clip_eps": -1.0, "kl_coef": -0.1}).validate()
    assert "clip_eps" in str(err.value) and "kl_coef" in str(err.value)
    with pytest.raises(ValidationError, match="extra"):
        PPOConfig(clip_epsilon=0.1)
    with pytest.raises(ValidationError):
        PPOConfig(is_level="batch")
    PPOConfig(lora=False, lora_targets=[], value_clip_eps=None, target_kl=None, max_stale_versions=None)


def test_lora_config_follows_the_settings() -> None:
    lc = PPOConfig(lora_rank=4, lora_alpha=8).lora_config()
    assert (lc.r, lc.lora_alpha, set(lc.target_modules), lc.lora_dropout) == (4, 8, set(LORA_TARGETS), 0.0)
    with pytest.raises(ValueError, match="lora=False"):
        PPOConfig(lora=False).lora_config()


def test_backend_and_model_parallel_combinations_are_checked() -> None:
    PPOConfig(backend="megatron", lora=False, tensor_parallel=2)
    with pytest.raises(ValueError, match="backend='megatron' trains every weight: set lora=False"):
        PPOConfig(backend="megatron", lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel=2: the Megatron PPO step runs one pipeline stage"):
        PPOConfig(backend="megatron", lora=False, pipeline_parallel=2)
    with pytest.raises(ValueError, match="model parallelism needs backend='megatron'"):
        PPOConfig(tensor_parallel=2)
