"""From the champion's checkpoint to a trainable policy+critic, and from the trained model to a candidate
checkpoint the fleet can serve.

    champion full  + lora=True   -> fresh adapter (seeded) on the champion; candidate = adapter on it
    champion lora  + lora=True   -> the champion's adapter, trained further; candidate = adapter on the same base
    champion full/lora + lora=False -> all weights trained (a lora champion is merged first); candidate = full

A candidate directory holds the served weights (adapter or full HF checkpoint), `probe.json` (what the
trainer's forward pass says the served weights must produce) and `critic.pt` (the value head, which is
not served: the next run starting from this version warms its critic from it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from training.policy import is_adapter_dir, load_policy, load_tokenizer, save_policy
from training.ppo_config import PPOConfig
from training.probe import compute_probe, load_probe, save_probe
from training.value_head import PolicyWithValue, ValueHead

CRITIC_FILE = "critic.pt"


def frozen_dtype(champion_dir: Path, base_dir: Path, cfg: PPOConfig) -> torch.dtype:
    """The dtype the weights load in: float32, but for a LoRA run under precision bf16 whose frozen base is stored
    in bfloat16 (how released checkpoints ship), which then stays bfloat16: half the base's memory, and the very
    values the engine loads (a base stored in float32 is not rounded: its candidates' probes are computed on it).
    The adapter is float32 either way (PEFT keeps adapter weights in float32)."""
    if not (cfg.lora and cfg.precision == "bf16"):
        return torch.float32
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(base_dir if is_adapter_dir(champion_dir) else champion_dir))
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return torch.bfloat16 if stored in (torch.bfloat16, "bfloat16") else torch.float32


def build_trainable(champion_dir: Path, base_dir: Path, cfg: PPOConfig) -> PolicyWithValue:
    """The policy to train (trainable weights per cfg.lora) with a value head on CPU, float32 but for a LoRA run's
    bf16 base (frozen_dtype); its forward under cfg.precision, its layers recomputed in the backward with
    cfg.gradient_checkpointing."""
    adapter, dtype = is_adapter_dir(champion_dir), frozen_dtype(champion_dir, base_dir, cfg)
    if cfg.lora and adapter:
        policy = load_policy(champion_dir, dtype, base_path=base_dir, trainable=True)
    else:
        policy = load_policy(champion_dir, dtype, base_path=base_dir)
        if adapter:  # full fine-tune of a lora champion: fold its adapter into the weights first
            policy = policy.merge_and_unload()
        if cfg.lora:
            from peft import get_peft_model

            with torch.random.fork_rng(devices=[]):  # seeded adapter init, no global RNG side effect
                torch.manual_seed(cfg.seed)
                policy = get_peft_model(policy, cfg.lora_config())
        else:
            policy.requires_grad_(True)
    policy.train()
    if cfg.gradient_checkpointing:  # recompute each layer in the backward (only in train mode: not the rollouts)
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    head = ValueHead(int(policy.config.hidden_size), seed=cfg.seed)
    critic = champion_dir / CRITIC_FILE
    if critic.is_file():
        head.load_state_dict(torch.load(critic, weights_only=True))
    return PolicyWithValue(policy, head, autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None)


def save_candidate(model: PolicyWithValue, champion_dir: Path, base_dir: Path, out: Path, note: str = "") -> Path:
    """Write the served weights, their probe (on the champion's probe prompts) and the critic into `out`. The probe
    is computed in float32 (a bf16 base is cast up, exactly), as the champion's was."""
    out.mkdir(parents=True, exist_ok=True)
    policy = model.policy.float()
    tokenizer = load_tokenizer(base_dir)
    if hasattr(policy, "peft_config"):
        policy.save_pretrained(str(out))  # adapter only; the fleet serves it on the base's replicas
    else:
        save_policy(policy, tokenizer, out)
    torch.save(model.value_head.state_dict(), out / CRITIC_FILE)
    prompts = [tokenizer.decode(item.prompt_token_ids) for item in load_probe(champion_dir).items]
    probe = compute_probe(policy, tokenizer, prompts, max_new_tokens=load_probe(champion_dir).max_new_tokens, version_note=note)
    save_probe(probe, out)
    return out


def candidate_kind(cfg: PPOConfig) -> str:
    return "lora" if cfg.lora else "full"
