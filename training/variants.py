"""Synthetic versions of a checkpoint, each with its own served-weight probe.

Used by benchmarks and fault tests: a random LoRA adapter (changes outputs), a noisy full copy,
or an adapter deliberately registered with another version's probe (a wrong-weights candidate).
"""

from __future__ import annotations

from pathlib import Path

import torch

from training.policy import load_policy, load_tokenizer, save_policy
from training.probe import compute_probe, load_probe, save_probe

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def probe_prompts_of(base_dir: Path) -> list[str]:
    """The prompts of base_dir's probe, as text, so variants are probed on the same inputs."""
    tok = load_tokenizer(base_dir)
    return [tok.decode(item.prompt_token_ids) for item in load_probe(base_dir).items]


def random_adapter(base_dir: Path, out: Path, seed: int, rank: int = 4, probe_from: Path | None = None) -> Path:
    """A seeded random LoRA on base_dir; its probe is its own unless probe_from names another directory."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, init_lora_weights=False)
    get_peft_model(load_policy(base_dir), config).save_pretrained(str(out))
    if probe_from is not None:
        (out / "probe.json").write_bytes((probe_from / "probe.json").read_bytes())
    else:
        model = load_policy(out, base_path=base_dir)
        save_probe(compute_probe(model, load_tokenizer(base_dir), probe_prompts_of(base_dir)), out)
    return out


def noisy_copy(base_dir: Path, out: Path, seed: int, noise: float = 0.02) -> Path:
    """A full checkpoint: base weights plus seeded Gaussian noise, with its own probe."""
    torch.manual_seed(seed)
    model, tok = load_policy(base_dir), load_tokenizer(base_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    save_policy(model, tok, out)
    save_probe(compute_probe(model, tok, probe_prompts_of(base_dir)), out)
    return out
