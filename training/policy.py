"""The policy: a small Qwen2 causal LM, plus loading and saving in Hugging Face format.

Saved policies are plain ``save_pretrained`` directories (safetensors weights,
config, tokenizer), which is what vLLM serves. A directory holding a PEFT
adapter (``adapter_config.json``) loads as its base model with the adapter on top.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from training.policy_config import PolicyConfig

ADAPTER_CONFIG = "adapter_config.json"
# Any of these in a directory means a tokenizer was saved there.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_policy(cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase, seed: int | None = None) -> Qwen2ForCausalLM:
    """A freshly initialised float32 Qwen2 LM sized for ``tokenizer``.

    ``seed`` makes the initial weights reproducible without touching the global RNG.
    """
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError("num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        use_sliding_window=False,
        **special,
    )
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # Greedy by default, so that generate() and a server without sampling settings agree.
    model.generation_config = GenerationConfig(do_sample=False, **special)
    return model


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a PEFT adapter rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base_path(path: str | Path) -> str:
    """The base model an adapter directory was trained on, as recorded by PEFT."""
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    if not base:
        raise ValueError(f"{path} records no base model; pass base_path")
    return base


def load_policy(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    base_path: str | Path | None = None,
    trainable: bool = False,
) -> PreTrainedModel:
    """Load a saved policy; an adapter directory returns a ``PeftModel`` on its base.

    ``base_path`` overrides the base recorded in the adapter config (it may have
    moved since). ``trainable`` leaves the adapter weights unfrozen for further training.
    """
    if not is_adapter_dir(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    from peft import PeftModel  # only adapter users pay for the import

    base = AutoModelForCausalLM.from_pretrained(str(base_path or adapter_base_path(path)), dtype=dtype)
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def load_tokenizer(path: str | Path, base_path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a policy; for an adapter without one, its base's."""
    path = Path(path)
    if is_adapter_dir(path) and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        path = Path(base_path or adapter_base_path(path))
    return AutoTokenizer.from_pretrained(str(path))


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write model (or adapter) weights as safetensors, its config and the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
