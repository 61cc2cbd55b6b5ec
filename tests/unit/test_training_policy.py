"""Building, saving and loading the policy, including PEFT adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from data_contracts.corpus import read_texts, stdlib_root
from training.policy import PolicyConfig, build_policy, load_policy, load_tokenizer, save_policy
from training.tokenizer import train_tokenizer

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=128)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tok():
    root = stdlib_root()
    return train_tokenizer(read_texts([root / "heapq.py", root / "bisect.py"]), vocab_size=300)


@pytest.fixture(scope="module")
def batch(tok) -> torch.Tensor:
    return torch.tensor([tok.encode("def heappush(heap, item):\n    heap.append(item)\n")])


def logits(model, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def test_build_matches_config_and_tokenizer(tok) -> None:
    model = build_policy(TINY, tok, seed=0)
    c = model.config
    assert c.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    assert c.vocab_size == len(tok) == model.get_input_embeddings().weight.shape[0]
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (0, 0, 0)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (32, 2, 4, 2)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.generation_config.do_sample is False


def test_seed_fixes_init_without_touching_global_rng(tok) -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_policy(TINY, tok, seed=7)
    assert torch.equal(torch.rand(1), before)
    b = build_policy(TINY, tok, seed=7)
    c = build_policy(TINY, tok, seed=8)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_invalid_head_layout_rejected(tok) -> None:
    with pytest.raises(ValueError):
        build_policy(TINY.model_copy(update={"num_kv_heads": 3}), tok)


def test_save_load_round_trip(tok, batch, tmp_path: Path) -> None:
    model = build_policy(TINY, tok, seed=0)
    save_policy(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    loaded = load_policy(tmp_path)
    assert torch.equal(logits(loaded, batch), logits(model, batch))
    assert next(loaded.parameters()).dtype == torch.float32
    assert load_policy(tmp_path, dtype=torch.bfloat16).dtype == torch.bfloat16
    t = load_tokenizer(tmp_path)
    assert t.encode("heap[0] = é") == tok.encode("heap[0] = é")


def test_lora_adapter_round_trip(tok, batch, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = build_policy(TINY, tok, seed=0)
    save_policy(base, tok, base_dir)
    base_logits = logits(base, batch)

    lora_cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=LORA_TARGETS)
    peft_model = get_peft_model(base, lora_cfg)  # wraps `base` in place
    adapted_logits = logits(peft_model, batch)
    peft_model.save_pretrained(adapter_dir)
    assert (adapter_dir / "adapter_model.safetensors").is_file()

    loaded = load_policy(adapter_dir, base_path=base_dir)
    assert isinstance(loaded, PeftModel)
    loaded_logits = logits(loaded, batch)
    assert torch.allclose(loaded_logits, adapted_logits, atol=1e-6, rtol=0)
    assert (loaded_logits - base_logits).abs().max() > 1e-3

    # Without an override the base recorded in adapter_config.json is used.
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base_dir)
    cfg_path.write_text(json.dumps(cfg))
    assert torch.allclose(logits(load_policy(adapter_dir), batch), adapted_logits, atol=1e-6, rtol=0)

    # The adapter directory has no tokenizer; the base's is used.
    assert not (adapter_dir / "tokenizer.json").exists()
    assert load_tokenizer(adapter_dir).encode("x = [1, 2]") == tok.encode("x = [1, 2]")


def test_tokenizer_saved_with_policy_matches_auto_tokenizer(tok, tmp_path: Path) -> None:
    save_policy(build_policy(TINY, tok), tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    s = "while lo < hi:\n\tmid = (lo+hi)//2  # 中\n"
    assert auto.encode(s) == tok.encode(s) and auto.decode(auto.encode(s)) == s
